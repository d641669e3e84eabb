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

import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.routing import APIRoute
from starlette.convertors import Convertor
from starlette.routing import compile_path
from starlette.types import Receive, Scope, Send

#: An endpoint of a direct route: ``await endpoint(request=request, **path_params)``.
Endpoint = Callable[..., Awaitable[Response]]


class DirectRoute(APIRoute):
    """An ``APIRoute`` whose handler is ``await endpoint(request=request, **path_params)``; the
    endpoint must return a :class:`Response`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

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


def add_direct_route(router: APIRouter, path: str, endpoint: Endpoint, **kwargs: Any) -> None:
    """Add ``POST path`` → ``endpoint`` to ``router`` as a :class:`DirectRoute` and record it for
    :class:`DirectDispatch`; ``kwargs`` go to ``router.add_api_route`` (``responses``, ...)."""
    router.add_api_route(
        path, endpoint, methods=["POST"], route_class_override=DirectRoute,
        response_class=Response, **kwargs,
    )  # fmt: skip
    DIRECT_PATHS.append(DirectPath(router.prefix + path, "POST", endpoint))


class DirectDispatch:
    """ASGI app: requests for a :data:`DIRECT_PATHS` route answered here, the rest by ``app``.

    A request goes the fast way only when it matches a direct route's method and path exactly, so
    anything FastAPI would answer differently (a 405, a redirect for a trailing slash, a 404) is
    still FastAPI's answer. Exceptions become responses through ``app.exception_handlers``, the
    handlers FastAPI uses, so an error reads the same either way.
    """

    def __init__(self, app: FastAPI, paths: list[DirectPath] | None = None) -> None:
        self.app = app
        self.handlers = app.exception_handlers
        served = app.openapi()["paths"]
        self.routes: list[tuple[str, re.Pattern[str], dict[str, Convertor[Any]], DirectPath]] = []
        for direct in DIRECT_PATHS if paths is None else paths:
            if direct.method.lower() not in served.get(direct.path, {}):
                raise RuntimeError(
                    f"direct route {direct.method} {direct.path} is not served by the app: "
                    "include its router without a prefix of its own"
                )
            regex, _, convertors = compile_path(direct.path)
            self.routes.append((direct.method, regex, convertors, direct))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            for route_method, regex, convertors, direct in self.routes:
                if method != route_method:
                    continue
                match = regex.match(path)
                if match is not None:
                    params = {k: convertors[k].convert(v) for k, v in match.groupdict().items()}
                    await self._call(direct, params, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _call(
        self, direct: DirectPath, params: dict[str, Any], scope: Scope, receive: Receive, send: Send
    ) -> None:
        # What Starlette and the router would have put in the scope: routes read the app's state
        # (request.app), ServingMiddleware labels its metrics by the route's path template.
        scope["app"] = self.app
        scope["route"] = direct
        scope["endpoint"] = direct.endpoint
        scope["path_params"] = params
        request = Request(scope, receive, send)
        try:
            response = await direct.endpoint(request=request, **params)
        except Exception as exc:
            response = await self._handler(exc)(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[..., Awaitable[Response]]:
        """The app's handler for ``exc``: the nearest class in its MRO that has one (the app's
        ``Exception`` handler, the logged 500, takes the rest)."""
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        raise exc
