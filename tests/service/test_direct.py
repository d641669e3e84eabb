"""service/routes/direct.py in process: the scoring routes' fast lane answers exactly as FastAPI
would, and only for the method and path it serves.

A real FastAPI app with the service's own error handlers and one direct route, called through
httpx's ASGI transport, once through :class:`DirectDispatch` and once through FastAPI alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from service.errors import BadInput, install_error_handlers
from service.routes.direct import DirectDispatch, DirectPath, DirectRoute


async def echo(name: str, request: Request) -> Response:
    body = await request.body()
    if body == b"bad":
        raise BadInput("the body says bad")
    if body == b"boom":
        raise RuntimeError("a bug")
    route = request.scope["route"]
    return JSONResponse({"name": name, "route": route.path, "same_app": request.app is APP})


def _app() -> tuple[FastAPI, list[str]]:
    """The app, and the paths of the requests that reached FastAPI's middleware stack."""
    app = FastAPI()
    install_error_handlers(app)
    reached: list[str] = []

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        reached.append(request.url.path)
        return await call_next(request)

    router = APIRouter(prefix="/v9")
    router.add_api_route(
        "/things/{name}/echo", echo, methods=["POST"], route_class_override=DirectRoute,
        response_class=Response,
    )  # fmt: skip
    app.include_router(router)
    return app, reached


APP, REACHED = _app()
PATHS = [DirectPath("/v9/things/{name}/echo", "POST", echo)]


def _request(app: Any, method: str, path: str, body: bytes = b"") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, content=body)

    return asyncio.run(go())


def test_a_direct_request_skips_fastapi_and_gets_its_path_parameters() -> None:
    REACHED.clear()
    r = _request(DirectDispatch(APP, PATHS), "POST", "/v9/things/a%20b/echo", b"hi")
    assert r.status_code == 200, r.text
    # the route's template labels the metrics; routes find the app's state through request.app
    assert r.json() == {"name": "a b", "route": "/v9/things/{name}/echo", "same_app": True}
    assert REACHED == []


@pytest.mark.parametrize("body", [b"hi", b"bad", b"boom"])
def test_direct_answers_equal_fastapis(body: bytes) -> None:
    """Same status, body and content type either way: success, a 4xx from the service's
    handlers, and the logged 500 of an unexpected error."""
    fast = _request(DirectDispatch(APP, PATHS), "POST", "/v9/things/x/echo", body)
    slow = _request(APP, "POST", "/v9/things/x/echo", body)
    assert (fast.status_code, fast.json()) == (slow.status_code, slow.json())
    assert fast.headers["content-type"] == slow.headers["content-type"]
    assert fast.status_code == {b"hi": 200, b"bad": 400, b"boom": 500}[body]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v9/things/x/echo", 405), ("POST", "/v9/things/x/echo/", 307),
     ("POST", "/v9/things/x/y/echo", 404), ("POST", "/v9/things//echo", 404)],
)  # fmt: skip
def test_anything_else_is_fastapis_answer(method: str, path: str, status: int) -> None:
    REACHED.clear()
    r = _request(DirectDispatch(APP, PATHS), method, path)
    assert r.status_code == status, r.text
    assert [path] == REACHED


def test_a_direct_path_the_app_does_not_serve_is_refused_at_start() -> None:
    with pytest.raises(RuntimeError, match="not served by the app"):
        DirectDispatch(APP, [DirectPath("/v1/things/{name}/echo", "POST", echo)])
