"""service.frontend.http_protocol on a real uvicorn (in a thread, on loopback) with a small ASGI app.

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

from service.frontend import http_protocol
from service.frontend.http_protocol import FrontendHttpProtocol


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


# --- issue 24 item 7 and issue 28 item 2: bounded heads, whole-head and body-rate deadlines, a
# connection cap. The stalls are also measured against a real server's /healthz in test_hardening.


@pytest.fixture
def strict() -> Iterator[_Server]:
    """The server with a 1 s head deadline, a 1 KB/s body rate, 8 KiB heads, 3 connections."""
    srv = _Server(
        FrontendHttpProtocol.configured(
            client_timeout_s=30.0, head_timeout_s=1.0, body_min_rate=1000.0,
            max_head_bytes=8192, max_connections=3,
        )
    )  # fmt: skip
    yield srv
    srv.server.should_exit = True
    srv.thread.join(10)


def _json_error(answer: bytes, status: int, code: str) -> None:
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b'"code": "%s"' % code.encode() in answer and b"connection: close" in answer


def test_a_head_over_the_limit_is_a_431_without_reading_the_rest(server: _Server) -> None:
    """Default limit 64 KiB: a header block that keeps coming (it would be 50 MB) is answered 431
    once 64 KiB (plus at most a read) are in; the client's further bytes are not parsed."""
    sent = 0
    with server.connect() as sock:
        sock.sendall(b"GET /read HTTP/1.1\r\nhost: x\r\n")
        line = b"x-pad: " + b"a" * 1000 + b"\r\n"
        try:
            while sent < 50_000_000:
                sock.sendall(line * 64)
                sent += len(line) * 64
                sock.setblocking(False)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break  # the answer is there
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _until_eof(sock)
    _json_error(answer, 431, "headers_too_large")
    assert b"VGE_MAX_HEADER_BYTES" in answer
    assert sent < 16_000_000, sent  # refused early (socket buffers hold a few MB), not at 50 MB


def test_a_complete_head_is_measured_exactly(strict: _Server) -> None:
    """A head sent whole with its body in one write: its own size counts, not the body's."""
    body = b"x" * 50_000
    with strict.connect() as sock:
        head = b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
        sock.sendall(head + body)  # 50 KB in one read, the head a few dozen bytes of it
        answer = b""
        while not answer.endswith(b'{"ok": true}'):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
    with strict.connect() as sock:  # 8,300 bytes of headers and a body, in one write: a 431
        sock.sendall(b"POST /read HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 8300
                     + b"\r\ncontent-length: 5\r\n\r\nhello")  # fmt: skip
        _json_error(_until_eof(sock), 431, "headers_too_large")


def test_a_slowloris_head_gets_a_408_at_its_deadline(strict: _Server) -> None:
    """A header byte every 0.2 s keeps the gap rule (30 s here) happy for ever; the whole head
    must be in within 1 s."""
    start = time.monotonic()
    with strict.connect() as sock:
        sock.sendall(b"GET /read HTTP/1.1\r\nhost: x\r\n")
        sock.settimeout(0.2)
        answer = b""
        while time.monotonic() - start < 5:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b"x")
                continue
            if not chunk:
                break
            answer += chunk
    _json_error(answer, 408, "request_timeout")
    assert b"VGE_HEAD_TIMEOUT_S" in answer
    assert time.monotonic() - start < 2.0


def test_a_body_below_the_minimum_rate_gets_a_408(strict: _Server) -> None:
    """10 bytes every 0.2 s (50 B/s) against 1,000 B/s after a 1 s allowance."""
    start = time.monotonic()
    with strict.connect() as sock:
        sock.sendall(b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        sock.settimeout(0.2)
        answer = b""
        while time.monotonic() - start < 5:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b"y" * 10)
                continue
            if not chunk:
                break
            answer += chunk
    _json_error(answer, 408, "request_timeout")
    assert b"VGE_BODY_MIN_RATE" in answer
    assert time.monotonic() - start < 2.5


def test_a_body_at_the_minimum_rate_is_served(strict: _Server) -> None:
    """4 KB every 0.2 s (20 KB/s) for 2 s, twice the allowance: read and answered."""
    with strict.connect() as sock:
        sock.sendall(b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: 40000\r\n\r\n")
        for _ in range(10):
            time.sleep(0.2)
            sock.sendall(b"z" * 4000)
        answer = b""
        while not answer.endswith(b'{"ok": true}'):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")


def test_connections_over_the_cap_get_a_503(strict: _Server) -> None:
    held = [strict.connect() for _ in range(3)]
    try:
        deadline = time.monotonic() + 5
        while strict.open_connections() < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with strict.connect() as sock:
            start = time.monotonic()
            sock.sendall(b"GET /read HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = _until_eof(sock)
            assert time.monotonic() - start < 0.5
        _json_error(answer, 503, "too_many_connections")
        assert b"retry-after: 1" in answer.lower() and strict.open_connections() == 3
    finally:
        for sock in held:
            sock.close()
    strict.wait_closed(within=3)
    with strict.connect() as sock:  # below the cap again: served
        sock.sendall(b"GET /read HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")


class _Recorder:
    """A transport that records every ``write`` (and passes everything to the real one)."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._transport, name)


def _recording(writes: list[bytes]) -> type[FrontendHttpProtocol]:
    class Recording(FrontendHttpProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_Recorder(transport, writes))  # type: ignore[arg-type]

    return Recording


def test_a_response_head_and_body_go_out_in_one_write() -> None:
    writes: list[bytes] = []
    srv = _Server(_recording(writes))
    try:
        with srv.connect() as sock:
            for _ in range(2):  # keep-alive: each response one write
                writes.clear()
                sock.sendall(b"POST /read HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nab")
                answer = b""
                while not answer.endswith(b'{"ok": true}'):
                    answer += sock.recv(65536)
                assert answer.startswith(b"HTTP/1.1 200 ")
                assert writes == [answer]
            # HEAD: uvicorn writes no body, so the head is not held (it would never go out)
            writes.clear()
            sock.sendall(b"HEAD /read HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"\r\n\r\n"):
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 ") and writes == [answer]
            # a close answered early (the 413 path): head and body out, then the close
            writes.clear()
            sock.sendall(b"POST /early-close HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n")
            answer = _until_eof(sock)
            assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"ok": false}')
            assert writes == [answer]
    finally:
        srv.server.should_exit = True
        srv.thread.join(10)


async def _chunked_app(scope, receive, send) -> None:  # noqa: ANN001
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"one", "more_body": True})
    await asyncio.sleep(0.05)
    await send({"type": "http.response.body", "body": b"two"})


def test_a_head_without_content_length_is_not_held() -> None:
    writes: list[bytes] = []
    config = uvicorn.Config(_chunked_app, host="127.0.0.1", port=0, http=_recording(writes),
                            lifespan="off", log_level="warning")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"0\r\n\r\n"):
                answer += sock.recv(65536)
        assert b"transfer-encoding: chunked" in writes[0] and writes[0].endswith(b"\r\n\r\n")
        assert b"".join(writes) == answer and len(writes) == 3
    finally:
        server.should_exit = True
        thread.join(10)
