"""service/frontend/middleware.py in process: the arrival count that adaptive batching reads, the body cap
and the drain marker.

A real :class:`~service.frontend.engine_client.EngineClient` over a real shared-memory arena, and a small
ASGI app in place of the routes, so the count can be read at each step of a request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from service.common.errors import PayloadTooLarge
from service.common.metrics import Metrics
from service.common.settings import Settings
from service.common.shm import Arena, create_arena_file
from service.frontend.deps import ServiceState
from service.frontend.engine_client import EngineClient
from service.frontend.middleware import ServingMiddleware


def _scoring(method: str, path: str) -> bool:
    """The served app's scoring routes (test_the_served_app_counts_exactly_its_scoring_routes
    checks the real predicate); here a stand-in for a test app."""
    return method == "POST" and path in {"/v1/predict", "/v2/models/tiny/versions/1.0.0/infer"}


@pytest.fixture
def state(tmp_path: Path) -> ServiceState:
    path = tmp_path / "fe.arena"
    create_arena_file(path, 1 << 16)
    return ServiceState(
        Settings(), Metrics(), EngineClient(str(tmp_path / "none"), Arena(path, 1 << 16))
    )


def _call(
    app: Any, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None
) -> list[dict]:
    """Run one POST through ``app`` with its body in ``chunks``; returns what it sent."""
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict:
        return messages.pop(0)

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers or []}
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_request_counts_from_its_complete_body_until_it_ends(state: ServiceState) -> None:
    arena = state.engine.arena
    seen: list[int] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        seen.append(arena.arriving)  # headers in, body not yet read
        while (await receive()).get("more_body"):
            seen.append(arena.arriving)  # part of the body
        seen.append(arena.arriving)  # the whole body: counted while parsed and decoded

    app = ServingMiddleware(inner, state, scoring=_scoring)
    _call(app, "/v1/predict", [b"a", b"b", b"c"])
    assert seen == [0, 0, 0, 1]
    assert arena.arriving == 0  # the request ended: no longer counted


def test_sending_to_the_engine_ends_the_count_and_other_paths_never_count(
    state: ServiceState,
) -> None:
    arena = state.engine.arena
    seen: list[int] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        seen.append(arena.arriving)
        from service.frontend.engine_client import _ARRIVAL

        _ARRIVAL.get().sent()  # what EngineClient.infer does right before it writes the request
        seen.append(arena.arriving)

    app = ServingMiddleware(inner, state, scoring=_scoring)
    _call(app, "/v2/models/tiny/versions/1.0.0/infer", [b"{}"])
    assert seen == [1, 0]
    seen.clear()

    async def other(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        seen.append(arena.arriving)

    _call(ServingMiddleware(other, state, scoring=_scoring), "/v1/score", [b"{}"])
    _call(ServingMiddleware(other, state, scoring=_scoring), "/v1/models/promote", [b"{}"])
    assert seen == [0, 0]


def test_a_failing_request_leaves_the_count_at_zero(state: ServiceState) -> None:
    async def inner(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        raise ValueError("decode failed")

    with pytest.raises(ValueError):
        _call(ServingMiddleware(inner, state, scoring=_scoring), "/v1/predict", [b"x"])
    assert state.engine.arena.arriving == 0


async def _answer(scope: dict, receive: Any, send: Any) -> None:
    """An inner app that reads the whole body and answers 200 with a keep-alive header."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"connection", b"keep-alive"), (b"x-a", b"1")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b"ok"})


def test_while_draining_every_response_says_connection_close(state: ServiceState) -> None:
    app = ServingMiddleware(_answer, state)
    start = _call(app, "/v1/score", [b"{}"])[0]
    assert start["headers"] == [(b"connection", b"keep-alive"), (b"x-a", b"1")]
    state.draining = True
    start = _call(app, "/v1/score", [b"{}"])[0]
    assert start["status"] == 200
    assert start["headers"] == [(b"x-a", b"1"), (b"connection", b"close")]  # replaced, not doubled


def test_bodies_over_the_cap_are_refused_by_length_or_while_streaming(
    state: ServiceState,
) -> None:
    cap = state.settings.max_payload_bytes
    reached: list[bool] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        reached.append(True)
        await _answer(scope, receive, send)

    app = ServingMiddleware(inner, state)
    declared = [(b"content-length", str(cap + 1).encode())]
    start, body = _call(app, "/v1/predict", [b"x"], declared)
    assert (start["status"], reached) == (413, [])  # refused before the app saw it
    assert (b"connection", b"close") in start["headers"]
    assert "exceeds the limit" in body["body"].decode()
    assert state.engine.arena.arriving == 0
    assert state.metrics.rejections.labels(reason="payload_too_large")._value.get() == 1

    async def parses_like_fastapi(scope: dict, receive: Any, send: Any) -> None:
        """FastAPI's body parsing turns any error while reading into a 400."""
        try:
            await _answer(scope, receive, send)
        except PayloadTooLarge:
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"error parsing the body"})

    chunked = [b"x" * (cap // 2), b"x" * (cap // 2 + 1)]  # no Content-Length: capped while read
    for route in (ServingMiddleware(parses_like_fastapi, state), app):
        if route is app:  # a route that lets the error through: the client still got its 413
            with pytest.raises(PayloadTooLarge, match="exceeds the limit"):
                _call(route, "/v1/score", chunked)
            continue
        sent = _call(route, "/v1/score", chunked)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[0]["status"] == 413 and b"exceeds the limit" in sent[1]["body"]
    # counted once each, by this layer (the error handlers do not count BodyOverLimit again)
    assert state.metrics.rejections.labels(reason="payload_too_large")._value.get() == 3
    assert state.engine.arena.arriving == 0
    assert _call(app, "/v1/predict", [b"x" * (cap // 2), b"x" * (cap // 2)])[0]["status"] == 200


def test_the_served_app_counts_exactly_its_scoring_routes(state: ServiceState) -> None:
    """asgi_app hands the middleware the dispatcher's own route table: the requests that send
    images to the engine, and nothing else (no second list of paths to keep in step)."""
    from service.frontend.app import asgi_app, create_app

    served = asgi_app(create_app(state.settings, state.engine))
    assert isinstance(served, ServingMiddleware)
    scoring = served.scoring
    for path in ("/v1/predict", "/v2/models/m/infer", "/v2/models/m/versions/2/infer"):
        assert scoring("POST", path), path
        assert not scoring("GET", path), path
    for path in ("/v1/score", "/v1/models/promote", "/v2/models/m", "/v2/models/m/ready",
                 "/v1/predict/", "/v2/models/m/versions/2/infer/x", "/metrics"):  # fmt: skip
        assert not scoring("POST", path), path
