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
4. **Slow clients get a 408 too.** The gap rule alone let a client keep a connection by sending
   one header byte every 20 s (measured: 101 s for one request head). The whole request head
   must now arrive within ``head_timeout_s`` (``VGE_HEAD_TIMEOUT_S``; from the connection's
   opening for its first request, from a request's first byte for the next), and a body must
   keep up ``body_min_rate`` bytes/s once ``head_timeout_s`` has passed since its head (Apache's
   ``mod_reqtimeout`` rule ``body=T,MinRate=R``: the body's allowance is ``T + received / R``
   seconds; ``VGE_BODY_MIN_RATE``, 0: off). The same clock checks both; while uvicorn paused
   reading (the app has not taken the body yet) the body's window starts over.
5. **Request heads are bounded.** A request line plus headers over ``max_head_bytes``
   (``VGE_MAX_HEADER_BYTES``, 64 KiB) is a JSON 431 ``headers_too_large`` and a lingering close,
   without parsing the rest (a 50 MB header block was read whole and answered 200, holding a
   front end 2.9 s). A head still arriving is measured by the bytes read since it began, so it
   is refused within one read (at most 256 KiB) of the limit; a complete head is measured
   exactly (URL and headers). A URL alone over httptools' 65,535 bytes stays a 414.
6. **Connections per front end are capped.** A connection beyond ``max_connections``
   (``VGE_MAX_CONNECTIONS``) gets a JSON 503 ``too_many_connections`` at once and a lingering
   close; it never reaches the parser nor counts against the cap.
7. **A response's head and body go out in one write.** uvicorn writes a response's status line
   and headers, then its body, each with its own ``transport.write``: two ``send`` calls and two
   TCP segments (the socket has ``TCP_NODELAY``) per answer, and a client that may wake for each.
   The head of a response with a ``Content-Length`` and a body to come is held and written with
   the body's first bytes (:class:`_Transport`); anything else the connection does (close,
   half-close, the end of the response) writes a held head first, so bytes are never reordered
   nor dropped, only joined.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from httptools import HttpParserInvalidURLError
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.common.errors import raw_error_response

#: The longest a connection lingers after its answer (the client is sending a body nobody reads).
LINGER_S = 5.0
#: The longest URL httptools parses (longer ones are a 414, not a 431).
MAX_URL_BYTES = 65_535


class _HeadTooLarge(Exception):
    """Raised in the parser's headers-complete callback for a head over the limit: httptools
    turns it into a parser error, and :meth:`FrontendHttpProtocol.send_400_response` into a 431."""


class _Transport:
    """The transport uvicorn is given: the real one, except that :meth:`close` while the request
    body is still arriving lingers (:meth:`FrontendHttpProtocol.linger`), and does nothing once
    lingering (the linger ends on its own: the client's EOF or the timer), and that a response's
    head is written together with its body (module doc, 7: :meth:`write`). The flow control
    calls are the real transport's bound methods; ``is_closing`` is one Python call more per
    response."""

    __slots__ = ("_transport", "_protocol", "_write", "_held", "_seen", "get_extra_info",
                 "pause_reading", "resume_reading")  # fmt: skip

    def __init__(self, transport: asyncio.Transport, protocol: FrontendHttpProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._write = transport.write
        self._held: bytes | None = None  # a response head waiting for its body
        self._seen: object = None  # the last response (uvicorn's cycle) that wrote anything
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data``, after a held head; hold it instead when it is the head of a response
        whose body is still to come: the first write of a started, incomplete response that
        has a Content-Length over 0 and is not an answer to HEAD (uvicorn writes no body then).
        uvicorn writes the head as soon as the app starts the response, so a held head always
        has a write, a close or the response's end after it (each writes it)."""
        held = self._held
        if held is not None:
            self._held = None
            self._write(held + data)
            return
        cycle = self._protocol.cycle
        if cycle is not None and cycle.response_started and cycle is not self._seen:
            self._seen = cycle
            if (
                cycle.chunked_encoding is False
                and cycle.expected_content_length > 0
                and not cycle.response_complete
                and cycle.scope["method"] != "HEAD"
            ):
                self._held = bytes(data)
                return
        self._write(data)

    def flush(self) -> None:
        """Write a held head now (the response ends, or the connection closes or half-closes)."""
        held = self._held
        if held is not None:
            self._held = None
            self._write(held)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def close(self) -> None:
        self.flush()
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
    stalled and slow clients, 431 for oversized heads, 503 past the connection cap (module doc)."""

    #: Seconds without a byte from a client the server is waiting for (module doc, 3).
    client_timeout_s = 30.0
    #: Seconds a whole request head may take, and a body's allowance before its rate counts (4).
    head_timeout_s = 20.0
    #: Bytes/s a body must average after its allowance (4); 0: no rate rule.
    body_min_rate = 500.0
    #: Bytes of request line plus headers at most (5).
    max_head_bytes = 64 * 1024
    #: Open connections this server serves at once; more get a 503 (6).
    max_connections = 1024
    lingering = False
    _real: asyncio.Transport
    _linger_timer: asyncio.TimerHandle | None = None
    _client_timer: asyncio.TimerHandle | None = None
    _awaiting_client = True  # no request yet, or the current one is not complete
    _last_read = 0.0
    _refused = False  # over the connection cap: answered 503, never parsed
    _in_head = True  # the next bytes belong to a request head (or precede one)
    _head_bytes = 0  # bytes read since the head began (module doc, 5)
    _head_deadline: float | None = None  # when the current head must be complete
    _received = 0  # bytes read on this connection
    _body_start = 0.0  # when the current body's window began, and the bytes read by then
    _body_base = 0

    @classmethod
    def configured(
        cls, *, client_timeout_s: float, head_timeout_s: float = head_timeout_s,
        body_min_rate: float = body_min_rate, max_head_bytes: int = max_head_bytes,
        max_connections: int = max_connections,
    ) -> type[FrontendHttpProtocol]:  # fmt: skip
        """This protocol with the server's settings (uvicorn instantiates the class itself)."""
        return type(
            cls.__name__,
            (cls,),
            {
                "client_timeout_s": client_timeout_s,
                "head_timeout_s": head_timeout_s,
                "body_min_rate": body_min_rate,
                "max_head_bytes": max_head_bytes,
                "max_connections": max_connections,
            },
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real = transport
        if len(self.connections) >= self.max_connections:
            self._refuse_connection()
            return
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        now = self._last_read = self.loop.time()
        self._head_deadline = now + self.head_timeout_s
        self._start_clock()

    def _refuse_connection(self) -> None:
        """Over the cap: a JSON 503 and a lingering close, without uvicorn's per-connection state
        (the connection is not in ``connections``; ``connection_lost`` knows it by ``_refused``)."""
        self._refused = self.lingering = True
        transport = self._real
        transport.write(
            raw_error_response(
                503,
                f"this front end serves {self.max_connections} connections at most "
                "(VGE_MAX_CONNECTIONS); retry shortly",
                "too_many_connections",
                [*self.server_state.default_headers, (b"retry-after", b"1")],
            )
        )
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def _start_clock(self) -> None:
        if self._client_timer is None:
            self._client_timer = self.loop.call_later(
                min(self.client_timeout_s, self.head_timeout_s), self._client_clock
            )

    def _overdue(self, now: float) -> tuple[float, str | None]:
        """Seconds until the earliest client deadline (module doc, 3 and 4) and, when one has
        passed, the 408's message."""
        left = self._last_read + self.client_timeout_s - now
        if left <= 0:
            return left, (
                f"no request bytes for {self.client_timeout_s:g} s; the request is incomplete "
                "and the connection is closed (VGE_CLIENT_TIMEOUT_S)"
            )
        if self._head_deadline is not None:
            head_left = self._head_deadline - now
            if head_left <= 0:
                return head_left, (
                    f"the request head did not arrive within {self.head_timeout_s:g} s; the "
                    "connection is closed (VGE_HEAD_TIMEOUT_S)"
                )
            left = min(left, head_left)
        cycle = self.cycle
        if self.body_min_rate > 0 and cycle is not None and cycle.more_body:
            got = self._received - self._body_base
            body_left = self._body_start + self.head_timeout_s + got / self.body_min_rate - now
            if body_left <= 0:
                return body_left, (
                    f"the request body arrives slower than {self.body_min_rate:g} bytes/s "
                    f"({got} bytes in {now - self._body_start:.1f} s); the connection is closed "
                    "(VGE_BODY_MIN_RATE)"
                )
            left = min(left, body_left)
        return left, None

    def _client_clock(self) -> None:
        """The client deadlines' timer. ``data_received`` only notes the time and bytes (no timer
        per read); this re-arms itself for what is left, and stops while no client bytes are
        awaited."""
        self._client_timer = None
        if self.lingering or self._real.is_closing() or not self._awaiting_client:
            return
        now = self.loop.time()
        cycle = self.cycle
        # A request received whole and not answered yet is the server's to answer, whatever
        # arrives meanwhile (a pipelined request's first bytes): the clock waits for the answer.
        answering = cycle is not None and not cycle.more_body and not cycle.response_complete
        # read_paused: the server stopped reading, not the client; the body's window restarts.
        if self.flow.read_paused or answering:
            self._body_start, self._body_base = now, self._received
            self._client_timer = self.loop.call_later(
                min(self.client_timeout_s, self.head_timeout_s), self._client_clock
            )
            return
        left, message = self._overdue(now)
        if message is None:
            self._client_timer = self.loop.call_later(left, self._client_clock)
            return
        self._flush()
        if cycle is None or not cycle.response_started:
            self._real.write(
                raw_error_response(
                    408, message, "request_timeout", self.server_state.default_headers
                )
            )
        self.linger()

    def body_pending(self) -> bool:
        """The current request's body is still arriving (and this connection not lingering yet)."""
        cycle = self.cycle
        return not self.lingering and cycle is not None and cycle.more_body

    def _flush(self) -> None:
        """Write a response head :class:`_Transport` holds, before writing past it."""
        transport = self.transport
        if isinstance(transport, _Transport):
            transport.flush()

    def on_response_complete(self) -> None:
        self._flush()  # (a complete response has written its head already: a safety net)
        super().on_response_complete()

    def linger(self) -> None:
        """Half-close after the answer, drop what still arrives, close when the client does."""
        self._flush()
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
        if self._head_deadline is None:  # a later request: its head's clock starts now
            self._head_deadline = self.loop.time() + self.head_timeout_s
        self._start_clock()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        """The head is in: measured exactly when the bytes read since it began exceed the limit
        (they may hold body bytes too), then uvicorn starts the request; the body's window
        begins."""
        if self._head_bytes > self.max_head_bytes:
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if size > self.max_head_bytes:
                raise _HeadTooLarge(size)
        self._in_head = False
        self._head_deadline = None
        self._body_start, self._body_base = self.loop.time(), self._received
        super().on_headers_complete()

    def _refuse_head(self, size: int | None) -> None:
        """A 431 (a 414 for a URL alone over httptools' limit) and a lingering close."""
        self._flush()
        if len(getattr(self, "url", b"") or b"") > MAX_URL_BYTES:
            status, code = 414, "uri_too_long"
            detail = f"request URL too long: it exceeds the maximum of {MAX_URL_BYTES} bytes"
        else:
            status, code = 431, "headers_too_large"
            got = "more than" if size is None else f"{size} bytes,"
            detail = (
                f"request line and headers of {got} over the limit of {self.max_head_bytes} "
                "bytes (VGE_MAX_HEADER_BYTES)"
            )
        self._real.write(
            raw_error_response(status, detail, code, self.server_state.default_headers)
        )
        self.linger()

    def on_message_complete(self) -> None:
        """A body that completes after its response (a route answered without reading it, and
        kept the connection) leaves uvicorn with no keep-alive timer (the body's bytes cancelled
        it) and the request marked as still receiving: re-arm the timer, so the idle connection
        closes as any other, and clear the mark, so that close does not linger."""
        self._awaiting_client = False  # a whole request: answering it takes what it takes
        self._in_head, self._head_bytes = True, 0  # what follows is the next request's head
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

    @property
    def request_on_its_way(self) -> bool:
        """Whether the client may be sending a request this server has not parsed yet: the
        connection is new (not a byte yet) or a request head is part-way in. uvicorn's shutdown
        closes such a connection as idle, and a request written to it meanwhile is reset, not
        answered (:meth:`service.frontend.server.FrontendServer.shutdown` waits for these)."""
        if self.lingering or self._refused:
            return False
        return self._received == 0 or (self._in_head and self._head_bytes > 0)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body nobody will read
        self._last_read = self.loop.time()  # the clocks' only cost per read
        self._received += len(data)
        if self._in_head:  # this read begins inside a head (or between requests)
            self._head_bytes += len(data)
        super().data_received(data)
        # (not once lingering or closed: a 431 or 414 raised in the parser, a 400)
        if (
            self._in_head
            and self._head_bytes > self.max_head_bytes
            and not self.lingering
            and not self._real.is_closing()
        ):
            self._refuse_head(None)

    def eof_received(self) -> None:
        if self.lingering:
            self._real.close()  # the client is done sending: nothing unread is left

    def connection_lost(self, exc: Exception | None) -> None:
        self.lingering = True  # gone: nothing to linger for (uvicorn's close() below is a no-op)
        for timer in (self._linger_timer, self._client_timer):
            if timer is not None:
                timer.cancel()
        if self._refused:
            return  # never one of uvicorn's connections
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside its ``except httptools.HttpParserError``: the reason is there,
        # or, for an error in uvicorn's own callback, in its context (a URL over 64 KiB, which
        # httptools.parse_url refuses, is then a 414, not "User callback error").
        reason = sys.exc_info()[1]
        self._flush()
        cause = reason.__context__ if reason is not None else None
        if isinstance(cause, _HeadTooLarge):
            self._refuse_head(cause.args[0])
            return
        if isinstance(cause, HttpParserInvalidURLError) and "too long" in str(cause):
            status, code, detail = 414, "uri_too_long", f"request URL too long: {cause}"
        else:
            status, code = 400, "bad_request"
            detail = f"malformed HTTP request: {reason}" if reason else msg
        self._real.write(
            raw_error_response(status, detail, code, self.server_state.default_headers)
        )
        self._real.close()
