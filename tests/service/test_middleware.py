"""service/middleware.py in process: the arrival count that adaptive batching reads.

A real :class:`~service.engine_client.EngineClient` over a real shared-memory arena, and a small
ASGI app in place of the routes, so the count can be read at each step of a request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from service.deps import ServiceState
from service.engine_client import EngineClient
from service.metrics import Metrics
from service.middleware import ArrivalMiddleware
from service.settings import Settings
from service.shm import Arena, create_arena_file


@pytest.fixture
def state(tmp_path: Path) -> ServiceState:
    path = tmp_path / "fe.arena"
    create_arena_file(path, 1 << 16)
    return ServiceState(
        Settings(), Metrics(), EngineClient(str(tmp_path / "none"), Arena(path, 1 << 16))
    )


def _call(app: Any, path: str, chunks: list[bytes]) -> None:
    """Run one POST through ``app`` with its body in ``chunks``; the inner app records the count."""
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))


def test_a_request_counts_from_its_complete_body_until_it_ends(state: ServiceState) -> None:
    arena = state.engine.arena
    seen: list[int] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        seen.append(arena.arriving)  # headers in, body not yet read
        while (await receive()).get("more_body"):
            seen.append(arena.arriving)  # part of the body
        seen.append(arena.arriving)  # the whole body: counted while parsed and decoded

    app = ArrivalMiddleware(inner, state)
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
        from service.engine_client import _ARRIVAL

        _ARRIVAL.get().sent()  # what EngineClient.infer does right before it writes the request
        seen.append(arena.arriving)

    app = ArrivalMiddleware(inner, state)
    _call(app, "/v2/models/tiny/versions/1.0.0/infer", [b"{}"])
    assert seen == [1, 0]
    seen.clear()

    async def other(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        seen.append(arena.arriving)

    _call(ArrivalMiddleware(other, state), "/v1/score", [b"{}"])
    _call(ArrivalMiddleware(other, state), "/v1/models/promote", [b"{}"])
    assert seen == [0, 0]


def test_a_failing_request_leaves_the_count_at_zero(state: ServiceState) -> None:
    async def inner(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        raise ValueError("decode failed")

    with pytest.raises(ValueError):
        _call(ArrivalMiddleware(inner, state), "/v1/predict", [b"x"])
    assert state.engine.arena.arriving == 0
