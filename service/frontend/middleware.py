"""The front end's one ASGI middleware: every HTTP request's bookkeeping in a single layer.

Five jobs, each described on :class:`ServingMiddleware`: the key check of keyed routes, the body
size caps, the request metrics, the drain marker and the arrival count of scoring requests (what
the engine's adaptive batching reads). They were four middlewares; each ASGI layer costs a coroutine and its own ``send`` or
``receive`` wrapper on every request, and on the 2-core box one layer cost a FastAPI app ~8 µs of
CPU per request even without contention (docs/benchmarks.md, "Reading the 2-core numbers").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.common.errors import PayloadTooLarge, ServiceError, error_body
from service.frontend.auth import KeyCheck, keyed_routes

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
    :class:`service.frontend.deps.ServiceState`):

    * **Keys first.** A request to a route that needs the API or reviewer key
      (:func:`service.frontend.auth.keyed_routes`, read from the app's own dependencies) without the right
      key is answered 401/403 here, before its body is read: a 30 MB JSON body to
      ``POST /v1/training-jobs`` without a key was parsed (1.96 s, the front end's loop held)
      before its 401. The route's dependency checks again (the same function).
    * **Body caps.** A body over its route's cap is refused with 413: by its Content-Length
      before anything is read, or while it streams in (chunked). Then this layer sends the 413
      itself and raises :class:`BodyOverLimit` into the route to stop it; whatever the route
      answers after that is dropped (FastAPI's own body parsing would call it a 400). The caps:
      scoring routes ``VGE_MAX_PAYLOAD_BYTES``, except a V2 infer body that is all JSON (no
      binary tensor extension) ``VGE_MAX_JSON_BYTES``; ``/v1/score`` ``VGE_MAX_SCORE_BYTES``;
      every other route of the served app (admin, jobs, reviews) ``VGE_MAX_SMALL_BODY_BYTES``.
      Wrapping an app that is not the served dispatcher (tests), every path has the first cap.
    * **Metrics.** ``vge_inflight_requests`` and ``vge_request_duration_seconds`` by route template,
      method and status (``/metrics`` itself untimed).
    * **Drain.** While the server drains (after SIGTERM) every response says ``Connection: close``:
      keep-alive clients then open their next request on a fresh connection — which a load balancer
      that saw ``/readyz`` turn 503 sends to another replica — instead of writing it into a
      connection that is about to close.
    * **Arrival.** A scoring request counts as on its way to the engine from the moment its body is
      complete until the front end sends it (:meth:`service.frontend.engine_client.EngineClient.arrival`).
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
        # of the app decides them (service.frontend.app.asgi_app passes DirectDispatch.serves), so the
        # two never disagree about which paths score.
        self.scoring = scoring
        # ``template(method, path)``: the route template of a request refused before routing (a
        # 413 by Content-Length), so its duration is labelled by endpoint, not "unmatched".
        self.template = template
        self.metrics = state.metrics
        settings = state.settings
        self.max_bytes: int = settings.max_payload_bytes
        self.settings = settings
        # The served FastAPI app behind the dispatcher (service.frontend.routes.direct.DirectDispatch):
        # its keyed routes, and per-route caps. Another inner app (tests): neither.
        served = getattr(app, "app", None)
        self.keyed: list[KeyCheck] = keyed_routes(served) if served is not None else []
        self.keyed_prefixes = tuple({k.prefix for k in self.keyed})
        self.route_caps = served is not None
        # vge_request_duration_seconds' children by (endpoint, method, status): ``labels()`` takes
        # a lock and builds its key on every call (~2 µs a request). The registry keeps every child
        # it made anyway, so this holds no more than it does.
        self._durations: dict[tuple[str, str, int], Any] = {}

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
            path = scope["path"]
            if self.keyed_prefixes and path.startswith(self.keyed_prefixes):
                refused = self._check_key(scope)
                if refused is not None:
                    await self._refuse(marked_send, refused)
                    return
            scoring = self.scoring(scope["method"], path)
            length = _content_length(scope)
            setting, hint = "VGE_MAX_PAYLOAD_BYTES", "send fewer or smaller images"
            if self.route_caps:  # a route's cap only ever lowers the payload cap
                cap = self._cap(scope, path, scoring, limit, setting, hint)
                if cap[0] < limit:
                    limit, setting, hint = cap
            if length > limit:
                too_large = PayloadTooLarge(
                    f"request body of {length} bytes exceeds the limit of {limit} bytes "
                    f"({setting}); {hint}"
                )
                await self._refuse(marked_send, too_large)
                return
            arrival = state.engine.arrival() if scoring else None
            counting = None  # the request's place in the arrival count, once inside `arrival`
            received = 0

            async def counted_receive() -> Message:
                nonlocal received, capped
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        text = (
                            f"request body exceeds the limit of {limit} bytes ({setting}); {hint}"
                        )
                        if not started:
                            await self._refuse(marked_send, PayloadTooLarge(text))
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
                key = (endpoint, scope["method"], status)
                child = self._durations.get(key)
                if child is None:
                    child = self._durations[key] = metrics.request_duration.labels(
                        endpoint=endpoint, method=scope["method"], status=str(status)
                    )
                child.observe(time.perf_counter() - start)

    def _cap(
        self, scope: Scope, path: str, scoring: bool, limit: int, setting: str, hint: str
    ) -> tuple[int, str, str]:
        """The body cap of this request's route, its setting and what to do instead."""
        settings = self.settings
        if scoring:
            if path.startswith("/v2/") and not any(
                name == b"inference-header-content-length" for name, _ in scope["headers"]
            ):
                return (settings.max_json_bytes, "VGE_MAX_JSON_BYTES",
                        "send large tensors with the binary tensor extension "
                        "(Inference-Header-Content-Length; tritonclient: binary_data=True)")  # fmt: skip
            return limit, setting, hint
        if path == "/v1/score":
            return (settings.max_score_bytes, "VGE_MAX_SCORE_BYTES",
                    "split the batch, or score a file with `vge score`")  # fmt: skip
        return (settings.max_small_body_bytes, "VGE_MAX_SMALL_BODY_BYTES",
                "this route takes small JSON bodies only")  # fmt: skip

    def _check_key(self, scope: Scope) -> ServiceError | None:
        """The 401/403 of a keyed route whose request lacks the right key, else None."""
        method, path = scope["method"], scope["path"]
        for keyed in self.keyed:
            if method in keyed.methods and keyed.regex.match(path):
                try:
                    keyed.check(self.settings, Headers(scope=scope))
                except ServiceError as exc:
                    return exc
                return None
        return None

    async def _refuse(self, send: Send, exc: ServiceError) -> None:
        """Answer ``exc`` (a 401/403, or the 413 of a body cap) without reading the body; the
        connection closes (what the client still sends is dropped by the front end's lingering
        close)."""
        if exc.reason:
            self.metrics.rejections.labels(reason=exc.reason).inc()
        body = json.dumps(error_body(exc.message, exc.code)).encode()
        headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
        await send(
            {
                "type": "http.response.start",
                "status": exc.status_code,
                "headers": [
                    *headers,
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
