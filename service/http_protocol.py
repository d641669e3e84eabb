"""The front ends' HTTP/1.1 connection: uvicorn's httptools protocol with two changes.

1. **Bytes that are not HTTP** get the service's JSON error, a 400 ``bad_request`` that names the
   parser's reason, not uvicorn's plain text. uvicorn answers these itself, before any route.
2. **Answered before the body arrived: close lingering.** Two answers go out before a request's
   body is in. One is a 413 judged from its Content-Length. The other is a 413 sent once a chunked
   body passes the cap. Both close the connection. A socket closed with unread input sends a
   reset, and the reset can destroy the answer in the client before it is read. Measured with
   httpx's AsyncClient: an 8 MiB body against a 1 MiB cap got ``ReadError``, not the 413. Only a
   body small enough to fit the socket buffers got its 413.

   So when uvicorn closes a connection whose request body is still arriving, the connection
   lingers instead (RFC 9112 §9.6). It half-closes (FIN after the answer), reads and drops what
   the client still sends, and closes once the client does, at most :data:`LINGER_S` later.

   A body that completes after a keep-alive answer (a route that answered without reading it)
   is complete all the same: that connection goes back to uvicorn's keep-alive timeout, which
   its late bytes had cancelled (:meth:`FrontendHttpProtocol.on_message_complete`).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import raw_error_response

#: The longest a connection lingers after its answer (the client is sending a body nobody reads).
LINGER_S = 5.0


class _Transport:
    """The transport uvicorn is given: the real one, except that :meth:`close` while the request
    body is still arriving lingers (:meth:`FrontendHttpProtocol.linger`), and does nothing once
    lingering (the linger ends on its own: the client's EOF or the timer). ``write`` and the flow
    control calls are the real transport's bound methods; ``is_closing`` is one Python call more
    per response."""

    def __init__(self, transport: asyncio.Transport, protocol: FrontendHttpProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.write = transport.write
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def close(self) -> None:
        protocol = self._protocol
        if protocol.lingering:
            return  # e.g. uvicorn's shutdown: cutting the linger short would reset the answer
        if protocol.body_pending():
            protocol.linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:  # anything else uvicorn may call (set_protocol, …)
        return getattr(self._transport, name)


class FrontendHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol: JSON 400 for non-HTTP bytes, lingering close (module doc)."""

    lingering = False
    _real: asyncio.Transport
    _linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]

    def body_pending(self) -> bool:
        """The current request's body is still arriving (and this connection not lingering yet)."""
        cycle = self.cycle
        return not self.lingering and cycle is not None and cycle.more_body

    def linger(self) -> None:
        """Half-close after the answer, drop what still arrives, close when the client does."""
        self.lingering = True
        transport = self._real
        try:
            transport.write_eof()  # the FIN follows the answer's bytes
            transport.resume_reading()  # uvicorn may have paused reading (flow control)
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return
        self._linger_timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def on_message_complete(self) -> None:
        """A body that completes after its response (a route answered without reading it, and
        kept the connection) leaves uvicorn with no keep-alive timer (the body's bytes cancelled
        it) and the request marked as still receiving: re-arm the timer, so the idle connection
        closes as any other, and clear the mark, so that close does not linger."""
        cycle = self.cycle
        late = cycle is not None and cycle.response_complete
        super().on_message_complete()
        if cycle is None or not late:
            return
        cycle.more_body = False
        if not (self.pipeline or self.timeout_keep_alive_task or self.transport.is_closing()):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body nobody will read
        super().data_received(data)

    def eof_received(self) -> None:
        if self.lingering:
            self._real.close()  # the client is done sending: nothing unread is left

    def connection_lost(self, exc: Exception | None) -> None:
        self.lingering = True  # gone: nothing to linger for (uvicorn's close() below is a no-op)
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside its ``except httptools.HttpParserError``: the reason is there
        reason = sys.exc_info()[1]
        detail = f"malformed HTTP request: {reason}" if reason else msg
        self._real.write(
            raw_error_response(400, detail, "bad_request", self.server_state.default_headers)
        )
        self._real.close()
