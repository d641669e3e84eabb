"""Limits of the gRPC server (:func:`service.frontend.grpc_v2.start_grpc`): no client holds it.

Without them, 2 connections × 20 ``ModelInfer`` streams that each sent part of a message were
still open, unanswered, after 150 s. Now:

* ``grpc.max_concurrent_streams`` (``VGE_GRPC_MAX_CONCURRENT_STREAMS``): RPCs per HTTP/2
  connection; a client's further streams wait on its side.
* ``maximum_concurrent_rpcs`` (``VGE_GRPC_MAX_CONCURRENT_RPCS``): RPCs per front end, counted
  from their headers on (a stream still waiting for its message counts); more are answered
  RESOURCE_EXHAUSTED at once.
* ``grpc.max_connection_idle_ms``, ``grpc.max_connection_age_ms`` and ``..._grace_ms``
  (``VGE_GRPC_MAX_CONNECTION_IDLE_S``, ``_AGE_S``, ``_AGE_GRACE_S``): idle connections close, old
  ones are asked to go away (clients reconnect) and closed after the grace.
* A deadline per call on the server (:class:`CallDeadline`, ``VGE_GRPC_CALL_TIMEOUT_S``), from the
  call's headers to its answer, receiving the request message included, whatever deadline the
  client set (none, by default): DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from service.common.settings import Settings


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """The gRPC core channel arguments of a front end's server."""

    def ms(seconds: float) -> int:
        return int(seconds * 1000)

    return [
        ("grpc.so_reuseport", 1),
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ("grpc.max_connection_idle_ms", ms(settings.grpc_max_connection_idle_s)),
        ("grpc.max_connection_age_ms", ms(settings.grpc_max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", ms(settings.grpc_max_connection_age_grace_s)),
    ]


class CallDeadline(grpc.aio.ServerInterceptor):
    """A server-side deadline for every unary call, receiving its request included.

    A unary handler runs only once its message is in, so a deadline around it cannot end a call
    whose client never finishes the message. Each unary-unary handler is served here as a
    stream-unary one (the wire format is the same): the first message is awaited under the
    deadline, then the handler runs on it within what is left. Wrapped handlers are cached per
    method (one wrapping per method, not per call).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler  # unknown method (UNIMPLEMENTED) or a streaming one: as it is
        wrapped = self._wrapped[method] = grpc.stream_unary_rpc_method_handler(
            self._deadline(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        return wrapped

    def _deadline(self, behavior: Callable[[Any, Any], Awaitable[Any]]) -> Callable[..., Any]:
        timeout_s = self.timeout_s

        async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async with asyncio.timeout(timeout_s):
                    request = await anext(aiter(requests), None)  # a unary call's one message
                    if request is None:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message"
                        )
                    return await behavior(request, context)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the call took over {timeout_s:g} s on the server, receiving its request "
                    "included (VGE_GRPC_CALL_TIMEOUT_S)",
                )

        return call
