"""The front ends' FastAPI error handlers: :class:`~service.common.errors.ServiceError` (and
FastAPI's validation errors) as JSON responses, rejections counted by reason; the documented
resource table that tells a 404 from a 405."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route, compile_path

from models.problems import validation_problems
from service.common.errors import CLIENT_CLOSED_REQUEST, ServiceError, error_body

log = logging.getLogger("vge.service")


def _count(request: Request, reason: str | None) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if reason and metrics is not None:
        metrics.rejections.labels(reason=reason).inc()


def _format_validation(exc: RequestValidationError) -> str:
    return validation_problems(exc.errors(), skip=("body", "query", "path"), max_name=64)


#: The operations an OpenAPI path item may hold (its other keys are parameters, summary, ...).
_OPERATIONS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


#: A documented resource: its path regex, the number of its path parameters, its template and
#: the methods it serves.
Resource = tuple[re.Pattern[str], int, str, set[str]]


def resource_table(app: FastAPI) -> list[Resource]:
    """What the app documents, as :data:`Resource` rows: its OpenAPI path items (exactly the
    methods of FastAPI's routes, which serve no HEAD), plus the app's own top-level routes
    (Starlette's, which add HEAD to GET). FastAPI includes routers lazily (``app.routes`` holds the
    routers, not their routes, since 0.16x), so this, not the router, is where the paths are.
    Built once per app (kept on ``app.state``)."""
    table: list[Resource] | None = getattr(app.state, "resource_table", None)
    if table is not None:
        return table
    table = app.state.resource_table = []
    for template, item in app.openapi()["paths"].items():
        methods = {op.upper() for op in item if op in _OPERATIONS}
        table.append((compile_path(template)[0], template.count("{"), template, methods))
    for route in app.routes:
        # APIRoute is a Route; mounts and websocket routes have no methods
        if isinstance(route, Route) and route.methods:
            table.append((route.path_regex, route.path.count("{"), route.path, set(route.methods)))
    return table


def _matching(table: list[Resource], path: str) -> list[Resource]:
    """The resources at ``path``, the most concrete (fewest path parameters) first, as OpenAPI
    matches paths (``/v1/models/promote`` is the promote resource, not ``/v1/models/{name}``)."""
    return sorted((row for row in table if row[0].match(path)), key=lambda row: row[1])


def route_template(table: list[Resource], method: str, path: str) -> str | None:
    """The path template that serves ``method path`` (``/v2/models/{name}/infer``), or None: the
    label of a request refused before routing (a 413 by its Content-Length)."""
    for _, _, template, methods in _matching(table, path):  # the most concrete that serves it
        if method in methods:
            return template
    return None


def _allowed_methods(request: Request, fallback: str) -> str:
    """The methods of the documented resource at this path (:func:`resource_table`).

    Starlette's 405 names only the first route whose path matches (e.g. GET of
    ``/v1/reviews/{id}``, not the POST that is a separate route). Where several templates match,
    the most concrete one names the resource (``OPTIONS /v1/models/promote`` is a 405 of the
    promote resource, ``POST``, although a GET there is routed to ``/v1/models/{name}``). A path
    documented nowhere (``/metrics``) keeps ``fallback``, the router's own ``Allow``.
    """
    matches = _matching(resource_table(request.app), request.url.path)
    if not matches:
        return fallback
    fewest = matches[0][1]
    return ", ".join(sorted(set().union(*(row[3] for row in matches if row[1] == fewest))))


def install_error_handlers(app: FastAPI) -> None:
    """Register the JSON error handlers on ``app``."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        _count(request, exc.reason)
        return JSONResponse(
            error_body(exc.message, exc.code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count(request, "bad_input")
        details = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
            for e in exc.errors()
        ]
        return JSONResponse(
            error_body(_format_validation(exc), "invalid_value", details=details), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request, headers.get("Allow", ""))
        return JSONResponse(
            error_body(str(exc.detail), code), status_code=exc.status_code, headers=headers
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection before its body was complete: nobody reads an answer,
        # and it is not a server fault. 499 (nginx's "client closed request") is what the request
        # metrics record; uvicorn sends nothing on a closed connection.
        log.debug("client disconnected during %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "internal"), status_code=500)
