"""service.http_protocol on a real uvicorn (in a thread, on loopback) with a small ASGI app.

The app answers ``/early-close`` with a 413 and ``Connection: close`` without reading the body (as
the body cap does), ``/early`` with a keep-alive 400 without reading it, ``/slow`` 2.5 s after
reading the body, and anything else after reading the body. The server's open connections are read from uvicorn's own state.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from service import http_protocol
from service.http_protocol import FrontendHttpProtocol


async def _app(scope, receive, send) -> None:  # noqa: ANN001
    if scope["path"] == "/early-close":
        status, headers = 413, [(b"connection", b"close")]
    elif scope["path"] == "/early":
        status, headers = 400, []
    else:
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            await asyncio.sleep(2.5)
        status, headers = 200, []
    body = b'{"ok": false}' if status != 200 else b'{"ok": true}'
    headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Server:
    def __init__(self, protocol: type[FrontendHttpProtocol] = FrontendHttpProtocol) -> None:
        config = uvicorn.Config(_app, host="127.0.0.1", port=0, http=protocol,
                                lifespan="off", timeout_keep_alive=1, log_level="warning")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    def wait_closed(self, within: float) -> float:
        """Seconds until the server holds no connection (fails after ``within``)."""
        start = time.monotonic()
        while self.open_connections():
            assert time.monotonic() - start < within, "the server still holds the connection"
            time.sleep(0.01)
        return time.monotonic() - start


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.server.should_exit = True
    srv.thread.join(10)


def _until_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _early_413(sock: socket.socket) -> None:
    sock.sendall(b"POST /early-close HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n\r\n"
                 + b"\0" * 65536)  # fmt: skip
    answer = _until_eof(sock)  # the answer, then the server's FIN
    assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"ok": false}')


def test_linger_ends_when_the_client_closes(server: _Server) -> None:
    with server.connect() as sock:
        _early_413(sock)
        for _ in range(16):  # more of the body: read and dropped, no reset
            sock.sendall(b"\0" * 65536)
        assert server.open_connections() == 1  # still reading what the client sends
    server.wait_closed(
        within=http_protocol.LINGER_S / 2
    )  # the client's EOF ended it, not the timer


def test_linger_is_bounded(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_protocol, "LINGER_S", 0.3)
    with server.connect() as sock:
        _early_413(sock)
        server.wait_closed(within=3)  # the client stays silent and open: the timer ends it


def test_a_body_that_completes_after_a_keep_alive_answer_does_not_linger(server: _Server) -> None:
    """uvicorn leaves the request marked as still receiving when its body completes after the
    response; the keep-alive timeout's close must then close, not linger for LINGER_S."""
    with server.connect() as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"ok": false}'):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400 ") and b"connection: close" not in answer.lower()
        sock.sendall(b"0123456789")  # the body, after the answer
        # keep-alive timeout 1 s; a linger would hold the connection 5 s more
        assert server.wait_closed(within=3.5) < 3.5
        assert sock.recv(1) == b""


def test_keep_alive_requests_are_served_as_before(server: _Server) -> None:
    with server.connect() as sock:
        for _ in range(3):
            sock.sendall(b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
            answer = b""
            while not answer.endswith(b'{"ok": true}'):
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 ")
        assert server.open_connections() == 1


@pytest.fixture
def impatient() -> Iterator[_Server]:
    """The server with a 1 s client timeout."""
    srv = _Server(FrontendHttpProtocol.configured(client_timeout_s=1.0))
    yield srv
    srv.server.should_exit = True
    srv.thread.join(10)


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /read HTTP/1.1\r\nhost: x\r\ncont",  # half a request head
        b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"\0" * 40,  # a body
    ],
    ids=["head", "body"],
)
def test_a_stalled_request_gets_a_408_and_the_connection_closes(
    impatient: _Server, sent: bytes
) -> None:
    with impatient.connect() as sock:
        sock.sendall(sent)
        answer = _until_eof(sock)  # the 408, then the server's FIN
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert (
        b'"code":"request_timeout"' in answer.replace(b" ", b"") and b"connection: close" in answer
    )
    impatient.wait_closed(within=3)


def test_a_connection_that_never_sends_is_closed(impatient: _Server) -> None:
    with impatient.connect() as sock:
        assert _until_eof(sock).startswith(b"HTTP/1.1 408 ")
    impatient.wait_closed(within=3)


def test_a_slow_but_steady_client_is_served(impatient: _Server) -> None:
    """The timeout is between bytes, not for the whole request: a body that keeps coming, a
    byte every 0.25 s for 2.5 s (over twice the timeout), is read and answered."""
    with impatient.connect() as sock:
        sock.sendall(b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
        for _ in range(10):
            time.sleep(0.25)
            sock.sendall(b"x")
        answer = b""
        while not answer.endswith(b'{"ok": true}'):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")


def test_the_clock_stops_while_a_request_is_answered(impatient: _Server) -> None:
    """A complete request is the server's to answer however long that takes: ``/slow`` answers
    after 2.5 s, over twice the client timeout, with a 200 and no 408, also with bytes after
    the request that begin none (a stray CRLF, which HTTP allows between requests)."""
    with impatient.connect() as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"ok": true}'):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 ")


def test_a_url_over_64_kib_is_a_414(server: _Server) -> None:
    """httptools cannot parse a URL over 65,535 bytes; uvicorn's callback failing on it was a 400
    "User callback error"."""
    with server.connect() as sock:
        sock.sendall(b"GET /read?" + b"a" * 70_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = _until_eof(sock)
    assert answer.startswith(b"HTTP/1.1 414 "), answer[:100]
    assert b'"code": "uri_too_long"' in answer and b"exceeds the maximum of 65535 bytes" in answer
    with server.connect() as sock:  # one under the limit is served
        sock.sendall(b"GET /read?" + b"a" * 60_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
