"""Errors as JSON: every client mistake becomes a 4xx ``{"error": "...", "code": "..."}``.

Routes raise :class:`ServiceError` subclasses (the engine too: they cross the wire as their code,
:class:`service.common.wire.ErrorCode`); the handlers registered by
:func:`service.frontend.error_handlers.install_error_handlers` turn them (and FastAPI's validation errors) into JSON responses and
count rejections by reason. Only a genuine server fault is a 500.

**One error table.** Each class carries its row as class attributes: ``code`` (the wire and JSON
code), ``status_code`` (HTTP), ``grpc_status`` (the name of a ``grpc.StatusCode`` member: this
module does not import grpc) and ``reason`` (the ``vge_rejections_total`` label). The HTTP
handlers, the gRPC front end (:func:`service.frontend.grpc_v2.abort`), the engine
(``Engine._error``) and :class:`service.common.wire.ErrorCode` all read these attributes, by
``isinstance``: a subclass defined elsewhere (``PromoteRefused``, ``RepositoryControlRefused``)
answers its base's row unless it overrides an attribute. :data:`WIRE_ERRORS` lists the classes
that cross the engine–front end wire, one per code.

=================== ==================== ==== ===================
class               code                 HTTP gRPC
=================== ==================== ==== ===================
BadInput            bad_input            400  INVALID_ARGUMENT
InvalidValue        invalid_value        422  INVALID_ARGUMENT
PayloadTooLarge     payload_too_large    413  RESOURCE_EXHAUSTED
NotFound            not_found            404  NOT_FOUND
Conflict            conflict             409  FAILED_PRECONDITION
Unauthorized        unauthorized         401  UNAUTHENTICATED
Forbidden           forbidden            403  PERMISSION_DENIED
QueueFull           queue_full           503  UNAVAILABLE
DeadlineExceeded    deadline_exceeded    504  DEADLINE_EXCEEDED
NotReady            not_ready            503  UNAVAILABLE
DatabaseUnavailable database_unavailable 503  UNAVAILABLE
=================== ==================== ==== ===================

A 409 is ``FAILED_PRECONDITION``, not ``ABORTED``: every conflict here is with the resource's
state (cancelling a finished job, a promote the gate refuses), which retrying does not change
until the state does; ``ABORTED`` is gRPC's code for a concurrency conflict that a retry of the
whole transaction may resolve, and nothing here raises one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

log = logging.getLogger("vge.service")

#: The status recorded for a request whose client went away before its body arrived (nginx's).
CLIENT_CLOSED_REQUEST = 499


class ServiceError(Exception):
    """An error with an HTTP status, a stable machine code and a human message naming the problem."""

    status_code: int = 400
    code: str = "bad_input"
    #: the ``grpc.StatusCode`` member name this error answers over gRPC
    grpc_status: str = "INVALID_ARGUMENT"
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
    grpc_status = "RESOURCE_EXHAUSTED"
    reason: str | None = "payload_too_large"  # None in a subclass already counted (middleware)


class NotFound(ServiceError):
    """Unknown model, job or resource (404)."""

    status_code = 404
    code = "not_found"
    grpc_status = "NOT_FOUND"
    reason = None


class Conflict(ServiceError):
    """The request conflicts with the resource's state, e.g. cancelling a finished job (409)."""

    status_code = 409
    code = "conflict"
    grpc_status = "FAILED_PRECONDITION"
    reason = None


class Unauthorized(ServiceError):
    """Missing API key (401)."""

    status_code = 401
    code = "unauthorized"
    grpc_status = "UNAUTHENTICATED"
    reason = "unauthorized"


class Forbidden(ServiceError):
    """Wrong API key, or management endpoints disabled (403)."""

    status_code = 403
    code = "forbidden"
    grpc_status = "PERMISSION_DENIED"
    reason = "unauthorized"


class QueueFull(ServiceError):
    """The batcher's queue is full or the server is draining: retry later (503 + Retry-After)."""

    status_code = 503
    code = "queue_full"
    grpc_status = "UNAVAILABLE"
    reason = "queue_full"


class DeadlineExceeded(ServiceError):
    """The request's deadline passed while it waited in the queue; it was never computed (504)."""

    status_code = 504
    code = "deadline_exceeded"
    grpc_status = "DEADLINE_EXCEEDED"
    reason = "deadline"


class NotReady(ServiceError):
    """No model is loaded yet, or the service is shutting down (503)."""

    status_code = 503
    code = "not_ready"
    grpc_status = "UNAVAILABLE"
    reason = None


class DatabaseUnavailable(NotReady):
    """The database cannot be reached or is locked too long (503 with Retry-After)."""

    code = "database_unavailable"


#: The classes that cross the engine–front end wire, one per ``code``
#: (:class:`service.common.wire.ErrorCode` is derived from them); a subclass not listed crosses
#: as the nearest one it derives from.
WIRE_ERRORS: tuple[type[ServiceError], ...] = (
    BadInput,
    InvalidValue,
    PayloadTooLarge,
    NotFound,
    Conflict,
    Unauthorized,
    Forbidden,
    QueueFull,
    DeadlineExceeded,
    NotReady,
    DatabaseUnavailable,
)


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
