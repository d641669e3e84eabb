"""The one error table (service.common.errors): every error class answers, over HTTP (the real
FastAPI handlers) and over gRPC (a real grpc.aio server and channel through
``grpc_v2.abort``), the status its row says; ``wire.ErrorCode`` is the classes' codes; the engine
logs only what the table calls internal. The real round trip of ``review=always`` without a key
(UNAUTHENTICATED) is in test_grpc.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI

from service.common import errors, wire
from service.common.review_connection import ReviewStoreUnavailable
from service.engine.engine import Engine
from service.engine.model_manager import PromoteRefused
from service.frontend.error_handlers import install_error_handlers
from service.frontend.grpc_v2 import abort
from service.frontend.middleware import BodyOverLimit
from service.frontend.v2_core import RepositoryControlRefused

#: The rows, restated here on purpose: a change to a code or status is a change to the API.
#: class -> (wire code, HTTP status, gRPC status)
ROWS: dict[type[errors.ServiceError], tuple[str, int, grpc.StatusCode]] = {
    errors.BadInput: ("bad_input", 400, grpc.StatusCode.INVALID_ARGUMENT),
    errors.InvalidValue: ("invalid_value", 422, grpc.StatusCode.INVALID_ARGUMENT),
    errors.PayloadTooLarge: ("payload_too_large", 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    errors.NotFound: ("not_found", 404, grpc.StatusCode.NOT_FOUND),
    errors.Conflict: ("conflict", 409, grpc.StatusCode.FAILED_PRECONDITION),
    errors.Unauthorized: ("unauthorized", 401, grpc.StatusCode.UNAUTHENTICATED),
    errors.Forbidden: ("forbidden", 403, grpc.StatusCode.PERMISSION_DENIED),
    errors.QueueFull: ("queue_full", 503, grpc.StatusCode.UNAVAILABLE),
    errors.DeadlineExceeded: ("deadline_exceeded", 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    errors.NotReady: ("not_ready", 503, grpc.StatusCode.UNAVAILABLE),
    errors.DatabaseUnavailable: ("database_unavailable", 503, grpc.StatusCode.UNAVAILABLE),
    # subclasses defined elsewhere: their own code, their base's statuses unless overridden
    PromoteRefused: ("promote_refused", 409, grpc.StatusCode.FAILED_PRECONDITION),
    ReviewStoreUnavailable: ("review_store_unavailable", 503, grpc.StatusCode.UNAVAILABLE),
    RepositoryControlRefused: ("not_supported", 400, grpc.StatusCode.FAILED_PRECONDITION),
    BodyOverLimit: ("payload_too_large", 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
}

#: The pairing rule between the two protocols (RepositoryControlRefused's 400 is the one
#: documented exception: FAILED_PRECONDITION, as Triton answers load/unload it cannot do).
PAIRS: dict[int, set[grpc.StatusCode]] = {
    400: {grpc.StatusCode.INVALID_ARGUMENT},
    422: {grpc.StatusCode.INVALID_ARGUMENT},
    401: {grpc.StatusCode.UNAUTHENTICATED},
    403: {grpc.StatusCode.PERMISSION_DENIED},
    404: {grpc.StatusCode.NOT_FOUND},
    409: {grpc.StatusCode.FAILED_PRECONDITION},
    413: {grpc.StatusCode.RESOURCE_EXHAUSTED},
    429: {grpc.StatusCode.RESOURCE_EXHAUSTED},
    503: {grpc.StatusCode.UNAVAILABLE},
    504: {grpc.StatusCode.DEADLINE_EXCEEDED},
}


def _make(cls: type[errors.ServiceError]) -> errors.ServiceError:
    """An instance of ``cls`` (PromoteRefused takes the gate's comparison too)."""
    if cls is PromoteRefused:
        return PromoteRefused(f"{cls.__name__}!", {"deltas": {}})
    return cls(f"{cls.__name__}!")


def test_every_error_class_has_a_row() -> None:
    """The table covers every ServiceError class the service defines (those this module imports:
    each module that defines one is imported above, so the set does not depend on which other
    tests ran in this worker first), and each row keeps the HTTP↔gRPC pairing rule."""

    def subclasses(cls: type[errors.ServiceError]) -> set[type[errors.ServiceError]]:
        return {c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))}

    defined = {c for c in subclasses(errors.ServiceError) if c.__module__.startswith("service.")}
    assert defined == set(ROWS)
    for cls, (code, http, rpc) in ROWS.items():
        assert (cls.code, cls.status_code, getattr(grpc.StatusCode, cls.grpc_status)) == (
            code,
            http,
            rpc,
        ), cls
        if cls is not RepositoryControlRefused:
            assert rpc in PAIRS[http], cls


def test_error_code_is_the_classes_codes() -> None:
    """wire.ErrorCode's values are exactly the wire classes' codes plus ``internal``, and each
    code maps to its class and back."""
    assert {c.value for c in wire.ErrorCode} == {c.code for c in errors.WIRE_ERRORS} | {"internal"}
    for cls in errors.WIRE_ERRORS:
        assert wire.ErrorCode(cls.code).error_class() is cls
        assert wire.error_code(cls("x")) is wire.ErrorCode(cls.code)
    # a subclass not on the wire crosses as its nearest listed base, keeping its statuses
    reply = wire.ErrorReply.of(_make(PromoteRefused))
    assert reply.code is wire.ErrorCode.CONFLICT and reply.exception().status_code == 409


def test_every_error_class_over_http() -> None:
    """Each class raised in a route answers its row's HTTP status and code, as JSON."""
    app = FastAPI()
    install_error_handlers(app)
    by_name = {cls.__name__: cls for cls in ROWS}

    @app.get("/raise/{name}")
    async def _raise(name: str) -> None:
        raise _make(by_name[name])

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for cls, (code, status, _) in ROWS.items():
                r = await client.get(f"/raise/{cls.__name__}")
                assert (r.status_code, r.json()) == (
                    status,
                    {"error": f"{cls.__name__}!", "code": code},
                ), cls

    asyncio.run(run())


def test_every_error_class_over_grpc() -> None:
    """Each class aborted through ``grpc_v2.abort`` reaches a real gRPC client as its row's
    status with its message; any other exception is INTERNAL without detail."""
    by_name: dict[str, BaseException] = {cls.__name__: _make(cls) for cls in ROWS}
    by_name["KeyError"] = KeyError("secret detail")

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort(context, by_name[request.decode()])
        return b""  # not reached: abort raises

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "test.Errors", {"Raise": grpc.unary_unary_rpc_method_handler(handler)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call: Any = channel.unary_unary("/test.Errors/Raise")
                want = {
                    cls.__name__: (rpc, f"{cls.__name__}!") for cls, (_, _, rpc) in ROWS.items()
                }
                want["KeyError"] = (grpc.StatusCode.INTERNAL, "internal server error")
                for name, (code, message) in want.items():
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(name.encode(), timeout=10)
                    assert (err.value.code(), err.value.details()) == (code, message), name
        finally:
            await server.stop(None)

    asyncio.run(run())


class _Collect:
    """The part of an Outbox that ``Engine._error`` uses: what it was given to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def put(self, request_id: int, message: object) -> None:
        self.sent.append((request_id, message))


def test_engine_logs_only_internal_errors(caplog: pytest.LogCaptureFixture) -> None:
    """Every class in the table (engine-side subclasses too) is an answer, not logged; a
    ValueError is a client's invalid value; anything else is logged and answers internal."""
    out = _Collect()
    caplog.set_level(logging.ERROR, logger="vge")
    for i, cls in enumerate(ROWS):
        Engine._error(out, i, _make(cls))  # type: ignore[arg-type]
    Engine._error(out, 100, ValueError("k < 0"))  # type: ignore[arg-type]
    assert not caplog.records
    assert [getattr(m, "code", None) for _, m in out.sent] == [
        wire.error_code(_make(cls)) for cls in ROWS
    ] + [wire.ErrorCode.INVALID_VALUE]
    Engine._error(out, 101, KeyError("x"))  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == ["engine: request failed"]
    assert getattr(out.sent[-1][1], "code", None) is wire.ErrorCode.INTERNAL
