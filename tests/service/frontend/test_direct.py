"""service/frontend/routes/direct.py in process: the scoring routes' fast lane answers exactly as FastAPI
would, and only for the method and path it serves.

A real FastAPI app with the service's own error handlers and one direct route, called through
httpx's ASGI transport, once through :class:`DirectDispatch` and once through FastAPI alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from service.common.errors import BadInput, QueueFull
from service.frontend.error_handlers import install_error_handlers
from service.frontend.routes.direct import DirectDispatch, DirectPath, add_direct_route


async def echo(name: str, request: Request) -> Response:
    body = await request.body()
    if body == b"bad":
        raise BadInput("the body says bad")
    if body == b"full":
        raise QueueFull("the queue is full; retry", headers={"Retry-After": "1"})
    if body == b"teapot":
        raise HTTPException(418, "short and stout")
    if body == b"boom":
        raise RuntimeError("a bug")
    route = request.scope["route"]
    return JSONResponse({"name": name, "route": route.path, "same_app": request.app is APP})


def _teapot(request: Request, exc: Exception) -> Response:
    """A synchronous handler keyed by status code (Starlette runs those in a thread)."""
    return PlainTextResponse("I'm a teapot", status_code=418)


def _app() -> tuple[FastAPI, list[DirectPath]]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_exception_handler(418, _teapot)
    router = APIRouter(prefix="/v9")
    paths: list[DirectPath] = []
    add_direct_route(router, "/things/{name}/echo", echo, paths=paths)
    app.include_router(router)
    return app, paths


APP, PATHS = _app()


class Recording:
    """FastAPI behind a recorder: the paths of the requests that reached it."""

    def __init__(self, app: FastAPI) -> None:
        self.app, self.reached = app, []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.reached.append(scope["path"])
        await self.app(scope, receive, send)


def _request(app: Any, method: str, path: str, body: bytes = b"") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, content=body)

    return asyncio.run(go())


def test_a_direct_request_skips_fastapi_and_gets_its_path_parameters() -> None:
    fastapi = Recording(APP)
    r = _request(DirectDispatch(APP, PATHS, fallback=fastapi), "POST", "/v9/things/a%20b/echo")
    assert r.status_code == 200, r.text
    # the route's template labels the metrics; routes find the app's state through request.app
    assert r.json() == {"name": "a b", "route": "/v9/things/{name}/echo", "same_app": True}
    assert fastapi.reached == []


@pytest.mark.parametrize("body", [b"hi", b"bad", b"full", b"teapot", b"boom"])
def test_direct_answers_equal_fastapis(body: bytes) -> None:
    """Same status, body and headers either way: success, a 4xx from the service's handlers (one
    with Retry-After), a status-code handler that is synchronous, and the logged 500."""
    fast = _request(DirectDispatch(APP, PATHS), "POST", "/v9/things/x/echo", body)
    slow = _request(APP, "POST", "/v9/things/x/echo", body)
    assert (fast.status_code, fast.content) == (slow.status_code, slow.content)
    assert dict(fast.headers) == dict(slow.headers)
    expected = {b"hi": 200, b"bad": 400, b"full": 503, b"teapot": 418, b"boom": 500}[body]
    assert fast.status_code == expected
    if body == b"full":
        assert fast.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v9/things/x/echo", 405), ("POST", "/v9/things/x/echo/", 307),
     ("POST", "/v9/things/x/y/echo", 404), ("POST", "/v9/things//echo", 404)],
)  # fmt: skip
def test_anything_else_is_fastapis_answer(method: str, path: str, status: int) -> None:
    fastapi = Recording(APP)
    r = _request(DirectDispatch(APP, PATHS, fallback=fastapi), method, path)
    assert r.status_code == status, r.text
    assert fastapi.reached == [path]


def test_a_direct_path_the_app_does_not_serve_is_refused_at_start() -> None:
    with pytest.raises(RuntimeError, match="not served by the app"):
        DirectDispatch(APP, [DirectPath("/v1/things/{name}/echo", "POST", echo)])


def test_an_app_with_middleware_of_its_own_is_refused() -> None:
    """The direct routes would skip it silently."""
    app, paths = _app()

    @app.middleware("http")
    async def stamp(request: Request, call_next: Any) -> Response:
        return await call_next(request)

    with pytest.raises(RuntimeError, match="middleware of its own"):
        DirectDispatch(app, paths)
