"""The scoring routes' fast lane: their endpoints take the request and return a ready response, and
the front end's outermost layer calls them without going through FastAPI at all.

FastAPI's request handler resolves dependencies, reads and validates a body against the
signature and serialises the return value. The scoring routes (``POST /v1/predict``, the V2
``infer`` routes) do none of that through FastAPI: they take the :class:`Request` (and path
parameters), parse their own bodies (multipart, JSON, V2 binary), validate their options once and
return a ready :class:`Response`. :func:`add_direct_route` adds such a route to a router as a
:class:`DirectRoute`, FastAPI's documented extension point for that (a custom ``APIRoute`` whose
``get_route_handler`` is the endpoint call), so FastAPI still matches and documents it in
``/openapi.json`` from its signature, ``responses`` and ``openapi_extra``.

:class:`DirectDispatch` stands in front of the FastAPI app and calls those endpoints itself when a
request matches one's method and path, with the app's own exception handlers; every other request
goes to FastAPI unchanged. A scoring request then skips Starlette's error and exception
middlewares, FastAPI's body-limit, telemetry and exit-stack layers and the router's walk over every
route: ~25 % of a front end's CPU per single-image request on the 2-core box (py-spy,
``python -m benchmarks.profile_serve``; docs/benchmarks.md, "Reading the 2-core numbers").
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor
from starlette.exceptions import HTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

#: An endpoint of a direct route: ``await endpoint(request=request, **path_params)``.
Endpoint = Callable[..., Awaitable[Response]]


class DirectRoute(APIRoute):
    """An ``APIRoute`` whose handler is ``await endpoint(request=request, **path_params)``; the
    endpoint must return a :class:`Response`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = cast(Endpoint, self.endpoint)  # add_direct_route adds only these

        async def handler(request: Request) -> Response:
            return await endpoint(request=request, **request.path_params)

        return handler


@dataclass(frozen=True)
class DirectPath:
    """One direct route as served: its full path template, method and endpoint."""

    path: str
    method: str
    endpoint: Endpoint


#: Every route added by :func:`add_direct_route`, with its router's prefix (the app includes the
#: routers without one of its own; :class:`DirectDispatch` checks that against the app).
DIRECT_PATHS: list[DirectPath] = []


def add_direct_route(
    router: APIRouter, path: str, endpoint: Endpoint, *, paths: list[DirectPath] | None = None,
    **kwargs: Any,
) -> None:  # fmt: skip
    """Add ``POST path`` → ``endpoint`` to ``router`` as a :class:`DirectRoute` and record it in
    ``paths`` (default :data:`DIRECT_PATHS`) for :class:`DirectDispatch`; ``kwargs`` go to
    ``router.add_api_route`` (``responses``, ``openapi_extra``; the route must stay in the schema,
    which is how :class:`DirectDispatch` checks that the app serves it)."""
    router.add_api_route(
        path, endpoint, methods=["POST"], route_class_override=DirectRoute,
        response_class=Response, **kwargs,
    )  # fmt: skip
    (DIRECT_PATHS if paths is None else paths).append(
        DirectPath(router.prefix + path, "POST", endpoint)
    )


class DirectDispatch:
    """ASGI app: requests for a :data:`DIRECT_PATHS` route answered here, the rest by ``app``.

    A request goes the fast way only when it matches a direct route's method and path exactly, so
    anything FastAPI would answer differently (a 405, a redirect for a trailing slash, a 404) is
    still FastAPI's answer. Exceptions become responses through ``app.exception_handlers``, looked
    up as Starlette's ``ExceptionMiddleware`` and ``ServerErrorMiddleware`` do (a status-code
    handler for an ``HTTPException`` first, then the nearest class in the exception's MRO, the
    app's ``Exception`` handler last), so an error reads the same either way. The app may have no
    middleware of its own (``app.add_middleware``): the direct routes would silently skip it, so
    that is refused here; per-request work around every route belongs in
    :class:`service.frontend.middleware.ServingMiddleware`, which wraps this.
    ``fallback`` answers every other request (default: ``app``).
    """

    def __init__(
        self, app: FastAPI, paths: list[DirectPath] | None = None, fallback: ASGIApp | None = None
    ) -> None:
        if app.user_middleware:
            raise RuntimeError(
                "the app has middleware of its own, which the direct routes would skip: wrap "
                "DirectDispatch in it instead, or move its work into ServingMiddleware"
            )
        self.app = app
        self.fallback = app if fallback is None else fallback
        self.handlers = app.exception_handlers
        served = app.openapi()["paths"]
        self.routes: list[tuple[str, re.Pattern[str], dict[str, Convertor[Any]], DirectPath]] = []
        for direct in DIRECT_PATHS if paths is None else paths:
            if direct.method.lower() not in served.get(direct.path, {}):
                raise RuntimeError(
                    f"direct route {direct.method} {direct.path} is not served by the app: "
                    "include its router without a prefix of its own, and in the schema"
                )
            regex, _, convertors = compile_path(direct.path)
            self.routes.append((direct.method, regex, convertors, direct))

    def _match(self, method: str, path: str) -> tuple[DirectPath, dict[str, Any]] | None:
        """The direct route serving ``method path`` and its converted path parameters."""
        for route_method, regex, convertors, direct in self.routes:
            if method != route_method:
                continue
            match = regex.match(path)
            if match is not None:
                return direct, {k: convertors[k].convert(v) for k, v in match.groupdict().items()}
        return None

    def serves(self, method: str, path: str) -> bool:
        """Whether ``method path`` goes the direct way (a scoring request: it sends images to the
        engine; :class:`service.frontend.middleware.ServingMiddleware` counts it as arriving)."""
        return any(
            method == route_method and regex.match(path) is not None
            for route_method, regex, _, _ in self.routes
        )  # no path-parameter conversion: only whether, not which

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            found = self._match(scope["method"], scope["path"])
            if found is not None:
                await self._call(*found, scope, receive, send)
                return
        await self.fallback(scope, receive, send)

    async def _call(
        self, direct: DirectPath, params: dict[str, Any], scope: Scope, receive: Receive, send: Send
    ) -> None:
        # What Starlette and the router would have put in the scope: routes read the app's state
        # (request.app), ServingMiddleware labels its metrics by the route's path template.
        scope["app"] = self.app
        scope["router"] = self.app.router
        scope["route"] = direct
        scope["endpoint"] = direct.endpoint
        scope["path_params"] = params
        request = Request(scope, receive, send)
        try:
            response = await direct.endpoint(request=request, **params)
        except Exception as exc:
            handler = self._handler(exc)
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[..., Any]:
        """The app's handler for ``exc`` (re-raised when it has none, as Starlette does)."""
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        raise exc
