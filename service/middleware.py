"""ASGI middleware: request metrics (duration, in-flight), the body size cap, the drain marker, and
the arrival count of scoring requests (what the engine's adaptive batching reads)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, error_body
from service.metrics import Metrics

_UNTIMED = frozenset({"/metrics"})


class RequestMetricsMiddleware:
    """Observes ``vge_request_duration_seconds`` by route template and ``vge_inflight_requests``."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNTIMED:
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.inflight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.request_duration.labels(
                endpoint=endpoint, method=scope["method"], status=str(status)
            ).observe(time.perf_counter() - start)


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413, by Content-Length or while streaming."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def _reject(self, send: Send, message: str) -> None:
        self.metrics.rejections.labels(reason="payload_too_large").inc()
        body = json.dumps(error_body(message, "payload_too_large")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = 0
                if length > self.max_bytes:
                    await self._reject(
                        send,
                        f"request body of {length} bytes exceeds the limit of {self.max_bytes} "
                        "bytes (VGE_MAX_PAYLOAD_BYTES); send fewer or smaller images",
                    )
                    return
        received = 0
        limit = self.max_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(
                        f"request body exceeds the limit of {limit} bytes (VGE_MAX_PAYLOAD_BYTES)"
                    )
            return message

        await self.app(scope, limited_receive, send)


class DrainMiddleware:
    """While the server drains (after SIGTERM), mark every response ``Connection: close``.

    Keep-alive clients then open their next request on a fresh connection — which a load balancer
    that saw ``/readyz`` turn 503 sends to another replica — instead of writing it into a connection
    that is about to close.
    """

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start" and self.state.draining:
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"
                ]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_wrapper)


#: Requests that send images to the engine: ``POST /v1/predict`` and V2 ``.../infer``.
_SCORING = re.compile(r"^/(v1/predict|v2/models/[^/]+(/versions/[^/]+)?/infer)$")


class ArrivalMiddleware:
    """Counts each scoring request as on its way to the engine from the moment its body is complete
    until the front end sends it (:meth:`service.engine_client.EngineClient.arrival`).

    With ``batch_wait=adaptive`` the engine holds a batch only while such requests exist, so it
    must see them while they are still being parsed and decoded, not only once they are sent; a
    body still uploading is not counted (a slow client would otherwise hold every batch).
    """

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not _SCORING.match(scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        with self.state.engine.arrival() as arrival:

            async def counting_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request" and not message.get("more_body", False):
                    arrival.start()
                return message

            await self.app(scope, counting_receive, send)
