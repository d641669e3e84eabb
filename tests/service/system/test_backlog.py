"""The shutdown answer to connections left in the listen queue (service.backlog), on real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from service.backlog import answer_queued


def _accept_queue(listener: socket.socket) -> int:
    """Connections waiting in ``listener``'s accept queue (rx_queue of its LISTEN row, Linux)."""
    port = listener.getsockname()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    return 0


def _listener() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def _slow_body(parts: list[bytes], pause_s: float) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(pause_s)
        yield part


def test_queued_requests_get_a_whole_503_even_while_their_body_is_still_coming() -> None:
    """The CI failure of 2026-11-27: the head arrives, the body 100 ms later. Answered after the
    first read and closed at once, the unread body reset the connection and httpx raised
    ReadError instead of returning the 503. Every queued client must read the 503."""
    listener, url = _listener()
    answered: list[int] = []

    async def main() -> list[httpx.Response | BaseException]:
        async def post(content: object, **headers: str) -> httpx.Response:
            async with httpx.AsyncClient(timeout=10) as client:
                return await client.post(url + "/v1/predict", content=content, headers=headers)

        requests = [
            post(_slow_body([b"a" * 300, b"b" * 300], 0.1), **{"content-length": "600"}),
            post(_slow_body([b"c" * 100] * 3, 0.05)),  # chunked
            post(b"x" * (2 << 20)),  # more than the socket buffers hold: discarded as it comes
            post(b"{}", **{"content-type": "application/json"}),
        ]
        tasks = [asyncio.ensure_future(r) for r in requests]
        deadline = time.monotonic() + 10
        while _accept_queue(listener) < 4:  # all four connected (queued: nobody accepts yet)
            assert time.monotonic() < deadline, _accept_queue(listener)
            await asyncio.sleep(0.01)
        answered.append(await asyncio.to_thread(answer_queued, [listener], 5.0))
        return await asyncio.gather(*tasks, return_exceptions=True)

    responses = asyncio.run(main())
    for r in responses:
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 503
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
        assert r.json()["code"] == "not_ready"
    assert answered == [4]


def test_after_the_answer_new_connections_are_refused() -> None:
    listener, url = _listener()
    assert answer_queued([listener], 1.0) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/healthz", timeout=2)


def test_silent_and_vanished_clients_do_not_hold_the_shutdown() -> None:
    """A client that never sends its head is closed at the deadline, unanswered; one that closed
    while queued is skipped; a GET beside them is answered at once."""
    listener, url = _listener()
    silent = socket.create_connection(listener.getsockname())
    gone = socket.create_connection(listener.getsockname())
    gone.close()
    asking = socket.create_connection(listener.getsockname())
    asking.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
    deadline = time.monotonic() + 10
    while _accept_queue(listener) < 3:
        assert time.monotonic() < deadline, _accept_queue(listener)
        time.sleep(0.01)
    started = time.monotonic()
    assert answer_queued([listener], 0.5) == 1
    assert time.monotonic() - started < 2.0
    head, _, body = asking.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and json.loads(body)["code"] == "not_ready"
    assert asking.recv(1) == b""  # half-closed after the answer
    silent.settimeout(1)
    assert silent.recv(1) == b""  # closed, no answer: it never asked
    for sock in (silent, asking):
        sock.close()
