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
3. **Stalled clients get a 408.** uvicorn times out only idle keep-alive connections. A
   connection that opened and sent nothing, sent half a request head, or stopped partway through
   its body stayed open for good (measured: still open after 130 s; five half-sent 30 MiB bodies
   held 85 MB). Now a connection waiting for its client's bytes gets a JSON 408
   ``request_timeout`` and a lingering close once no byte came for ``client_timeout_s``
   (``VGE_CLIENT_TIMEOUT_S``). The clock runs only while the server waits for the client: not
   while a complete request is being answered, and not while uvicorn itself paused reading.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from httptools import HttpParserInvalidURLError
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
    """uvicorn's httptools protocol: JSON 400 for non-HTTP bytes, lingering close, 408 for
    stalled clients (module doc)."""

    #: Seconds without a byte from a client the server is waiting for (module doc, 3).
    client_timeout_s = 30.0
    lingering = False
    _real: asyncio.Transport
    _linger_timer: asyncio.TimerHandle | None = None
    _client_timer: asyncio.TimerHandle | None = None
    _awaiting_client = True  # no request yet, or the current one is not complete
    _last_read = 0.0

    @classmethod
    def configured(cls, *, client_timeout_s: float) -> type[FrontendHttpProtocol]:
        """This protocol with the server's settings (uvicorn instantiates the class itself)."""
        return type(cls.__name__, (cls,), {"client_timeout_s": client_timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._last_read = self.loop.time()
        self._start_clock()

    def _start_clock(self) -> None:
        if self._client_timer is None:
            self._client_timer = self.loop.call_later(self.client_timeout_s, self._client_clock)

    def _client_clock(self) -> None:
        """The client timeout's timer. ``data_received`` only notes the time (no timer per read);
        this re-arms itself for what is left, and stops while no client bytes are awaited."""
        self._client_timer = None
        if self.lingering or self._real.is_closing() or not self._awaiting_client:
            return
        left = self._last_read + self.client_timeout_s - self.loop.time()
        cycle = self.cycle
        # A request received whole and not answered yet is the server's to answer, whatever
        # arrives meanwhile (a pipelined request's first bytes): the clock waits for the answer.
        answering = cycle is not None and not cycle.more_body and not cycle.response_complete
        # read_paused: the server stopped reading, not the client.
        if left > 0 or self.flow.read_paused or answering:
            self._client_timer = self.loop.call_later(max(left, 0.0) or self.client_timeout_s,
                                                      self._client_clock)  # fmt: skip
            return
        if cycle is None or not cycle.response_started:
            self._real.write(
                raw_error_response(
                    408,
                    f"no request bytes for {self.client_timeout_s:g} s; the request is incomplete "
                    "and the connection is closed (VGE_CLIENT_TIMEOUT_S)",
                    "request_timeout",
                    self.server_state.default_headers,
                )
            )
        self.linger()

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

    def on_message_begin(self) -> None:
        self._awaiting_client = True  # the next request has begun (not a stray CRLF between)
        self._start_clock()
        super().on_message_begin()

    def on_message_complete(self) -> None:
        """A body that completes after its response (a route answered without reading it, and
        kept the connection) leaves uvicorn with no keep-alive timer (the body's bytes cancelled
        it) and the request marked as still receiving: re-arm the timer, so the idle connection
        closes as any other, and clear the mark, so that close does not linger."""
        self._awaiting_client = False  # a whole request: answering it takes what it takes
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
        self._last_read = self.loop.time()  # the clock's only cost per read
        super().data_received(data)

    def eof_received(self) -> None:
        if self.lingering:
            self._real.close()  # the client is done sending: nothing unread is left

    def connection_lost(self, exc: Exception | None) -> None:
        self.lingering = True  # gone: nothing to linger for (uvicorn's close() below is a no-op)
        for timer in (self._linger_timer, self._client_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside its ``except httptools.HttpParserError``: the reason is there,
        # or, for an error in uvicorn's own callback, in its context (a URL over 64 KiB, which
        # httptools.parse_url refuses, is then a 414, not "User callback error").
        reason = sys.exc_info()[1]
        cause = reason.__context__ if reason is not None else None
        if isinstance(cause, HttpParserInvalidURLError) and "too long" in str(cause):
            status, code, detail = 414, "uri_too_long", f"request URL too long: {cause}"
        else:
            status, code = 400, "bad_request"
            detail = f"malformed HTTP request: {reason}" if reason else msg
        self._real.write(
            raw_error_response(status, detail, code, self.server_state.default_headers)
        )
        self._real.close()
