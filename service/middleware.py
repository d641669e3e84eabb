"""The front end's one ASGI middleware: every HTTP request's bookkeeping in a single layer.

Four jobs, each described on :class:`ServingMiddleware`: the body size cap, the request metrics,
the drain marker and the arrival count of scoring requests (what the engine's adaptive batching
reads). They were four middlewares; each ASGI layer costs a coroutine and its own ``send`` or
``receive`` wrapper on every request, and on the 2-core box one layer cost a FastAPI app ~8 µs of
CPU per request even without contention (docs/benchmarks.md, "Reading the 2-core numbers").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, error_body

#: Paths whose requests are not timed (the scrape itself).
_UNTIMED = frozenset({"/metrics"})

#: ``scoring(method, path)``: whether a request sends images to the engine (counted on arrival).
Scoring = Callable[[str, str], bool]


def _never(method: str, path: str) -> bool:
    return False


def _no_template(method: str, path: str) -> str | None:
    return None


class ServingMiddleware:
    """One layer around every HTTP request of a front end (``state``: its
    :class:`service.deps.ServiceState`):

    * **Body cap.** A body over ``VGE_MAX_PAYLOAD_BYTES`` is refused with 413: by its
      Content-Length before anything is read, or while it streams in (chunked). Then this layer
      sends the 413 itself and raises :class:`BodyOverLimit` into the route to stop it; whatever
      the route answers after that is dropped (FastAPI's own body parsing would call it a 400).
    * **Metrics.** ``vge_inflight_requests`` and ``vge_request_duration_seconds`` by route template,
      method and status (``/metrics`` itself untimed).
    * **Drain.** While the server drains (after SIGTERM) every response says ``Connection: close``:
      keep-alive clients then open their next request on a fresh connection — which a load balancer
      that saw ``/readyz`` turn 503 sends to another replica — instead of writing it into a
      connection that is about to close.
    * **Arrival.** A scoring request counts as on its way to the engine from the moment its body is
      complete until the front end sends it (:meth:`service.engine_client.EngineClient.arrival`).
      With ``batch_wait=adaptive`` the engine holds a batch only while such requests exist, so it
      must see them while they are still parsed and decoded, not only once they are sent; a body
      still uploading is not counted (a slow client would otherwise hold every batch).
    """

    def __init__(
        self,
        app: ASGIApp,
        state: Any,
        scoring: Scoring = _never,
        template: Callable[[str, str], str | None] = _no_template,
    ) -> None:
        self.app = app
        self.state = state
        # Which requests count as arriving: the app's scoring routes, as the dispatcher in front
        # of the app decides them (service.app.asgi_app passes DirectDispatch.serves), so the
        # two never disagree about which paths score.
        self.scoring = scoring
        # ``template(method, path)``: the route template of a request refused before routing (a
        # 413 by Content-Length), so its duration is labelled by endpoint, not "unmatched".
        self.template = template
        self.metrics = state.metrics
        self.max_bytes: int = state.settings.max_payload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics, state, limit = self.metrics, self.state, self.max_bytes
        timed = scope["path"] not in _UNTIMED
        status = 500
        started = capped = False  # a response started; the body cap answered 413 for the route
        start = time.perf_counter()

        async def marked_send(message: Message) -> None:
            nonlocal status, started
            if capped:
                return  # the 413 below was this request's answer
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                if state.draining:
                    headers = [
                        (k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"
                    ]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        if timed:
            metrics.inflight.inc()
        try:
            length = _content_length(scope)
            if length > limit:
                await self._reject(
                    marked_send,
                    f"request body of {length} bytes exceeds the limit of {limit} bytes "
                    "(VGE_MAX_PAYLOAD_BYTES); send fewer or smaller images",
                )
                return
            scoring = self.scoring(scope["method"], scope["path"])
            arrival = state.engine.arrival() if scoring else None
            counting = None  # the request's place in the arrival count, once inside `arrival`
            received = 0

            async def counted_receive() -> Message:
                nonlocal received, capped
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        text = f"request body exceeds the limit of {limit} bytes (VGE_MAX_PAYLOAD_BYTES)"
                        if not started:
                            await self._reject(marked_send, text)
                            capped = True
                        raise BodyOverLimit(text)
                    if counting is not None and not message.get("more_body", False):
                        counting.start()
                return message

            if arrival is None:
                await self.app(scope, counted_receive, marked_send)
            else:
                with arrival as counting:
                    await self.app(scope, counted_receive, marked_send)
        finally:
            if timed:
                metrics.inflight.dec()
                route = scope.get("route")
                endpoint = getattr(route, "path", None) or self.template(
                    scope["method"], scope["path"]
                )
                endpoint = endpoint or "unmatched"
                metrics.request_duration.labels(
                    endpoint=endpoint, method=scope["method"], status=str(status)
                ).observe(time.perf_counter() - start)

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


class BodyOverLimit(PayloadTooLarge):
    """Raised into a route whose streamed body passed the cap; :class:`ServingMiddleware` has
    answered 413 and counted the rejection already (``reason`` None: the error handlers don't)."""

    reason = None


def _content_length(scope: Scope) -> int:
    """The request's Content-Length (0 when absent or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
