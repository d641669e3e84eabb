"""Errors as JSON: every client mistake becomes a 4xx ``{"error": "...", "code": "..."}``.

Routes raise :class:`ServiceError` subclasses; the handlers registered by
:func:`install_error_handlers` turn them (and FastAPI's validation errors) into JSON responses and
count rejections by reason. Only a genuine server fault is a 500.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import compile_path

log = logging.getLogger("vge.service")

#: The status recorded for a request whose client went away before its body arrived (nginx's).
CLIENT_CLOSED_REQUEST = 499


class ServiceError(Exception):
    """An error with an HTTP status, a stable machine code and a human message naming the problem."""

    status_code: int = 400
    code: str = "bad_input"
    #: the ``vge_rejections_total`` reason, or None when this error is not counted as a rejection
    reason: str | None = "bad_input"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadInput(ServiceError):
    """A malformed request: not an image, truncated data, wrong tensor shape, ..."""


class InvalidValue(ServiceError):
    """A well-formed request with a value out of range (422)."""

    status_code = 422
    code = "invalid_value"


class PayloadTooLarge(ServiceError):
    """Body, image or image count over a configured limit (413)."""

    status_code = 413
    code = "payload_too_large"
    reason = "payload_too_large"


class NotFound(ServiceError):
    """Unknown model, job or resource (404)."""

    status_code = 404
    code = "not_found"
    reason = None


class Conflict(ServiceError):
    """The request conflicts with the resource's state, e.g. cancelling a finished job (409)."""

    status_code = 409
    code = "conflict"
    reason = None


class Unauthorized(ServiceError):
    """Missing API key (401)."""

    status_code = 401
    code = "unauthorized"
    reason = "unauthorized"


class Forbidden(ServiceError):
    """Wrong API key, or management endpoints disabled (403)."""

    status_code = 403
    code = "forbidden"
    reason = "unauthorized"


class QueueFull(ServiceError):
    """The batcher's queue is full or the server is draining: retry later (503 + Retry-After)."""

    status_code = 503
    code = "queue_full"
    reason = "queue_full"


class DeadlineExceeded(ServiceError):
    """The request's deadline passed while it waited in the queue; it was never computed (504)."""

    status_code = 504
    code = "deadline_exceeded"
    reason = "deadline"


class NotReady(ServiceError):
    """No model is loaded yet, or the service is shutting down (503)."""

    status_code = 503
    code = "not_ready"
    reason = None


def error_body(message: str, code: str, **extra: Any) -> dict[str, Any]:
    """The JSON error shape shared by /v1 and /v2 (``error`` is the V2 protocol's field)."""
    return {"error": message, "code": code, **extra}


def raw_error_response(
    status: int, message: str, code: str, headers: Iterable[tuple[bytes, bytes]] = ()
) -> bytes:
    """A whole HTTP/1.1 response carrying :func:`error_body`, with ``Connection: close``, as the
    bytes to write to a socket: for answers no ASGI app sends (the supervisor's 503 to connections
    left queued at shutdown, the front ends' 400 to bytes that are not HTTP)."""
    body = json.dumps(error_body(message, code)).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in headers]
    lines += [b"content-type: application/json", b"content-length: %d" % len(body),
              b"connection: close"]  # fmt: skip
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _count(request: Request, reason: str | None) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if reason and metrics is not None:
        metrics.rejections.labels(reason=reason).inc()


def _format_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        parts.append(f"{loc or 'request'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


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
        regex, methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and methods:
            table.append((regex, route.path.count("{"), route.path, set(methods)))
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
