"""Answer the connections still queued on the listeners with 503 at shutdown, losing none.

When the front ends have stopped accepting, connections the kernel completed since wait in the
listen queues. Closing a listener resets them, so their clients see a reset mid-request. The
supervisor hands them here instead (:func:`answer_queued`):

1. take every queued connection and close the listeners: from then on a new connection is
   refused, which a client can tell from a request that was lost;
2. for each connection (all at once, with a selector), read the request head, send a complete
   ``503`` with ``Connection: close`` and ``Retry-After``, and half-close (``SHUT_WR``);
3. keep reading, discarding, until the client closes (a lingering close, RFC 9112 §9.6).

Step 3 is what makes the answer arrive. A socket closed with unread input sends a reset, and a
reset can destroy the response in the client before it reads it. A client still writing its body
when it was answered (httpx writes the head and the body in separate writes) would see the reset,
not the 503. That happened in CI when the answer went out after the first ``recv``.

Everything is bounded by ``timeout_s``: a client that never sends its head or never closes is
closed then.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from dataclasses import dataclass, field

from service.common.errors import NotReady, raw_error_response

BUSY = raw_error_response(
    503, "the server is shutting down; retry on another replica", NotReady.code,
    [(b"retry-after", b"1")],
)  # fmt: skip

log = logging.getLogger("vge.supervisor")

#: A request head longer than this is answered without waiting for its end.
MAX_HEAD = 64 * 1024


@dataclass
class _Conn:
    sock: socket.socket
    head: bytearray = field(default_factory=bytearray)
    replied: bool = False  # the 503 was tried (sent, or the client was gone)


def take_queued(listeners: list[socket.socket]) -> list[socket.socket]:
    """Accept every connection queued on ``listeners``, then close the listeners."""
    taken: list[socket.socket] = []
    for listener in listeners:
        listener.setblocking(False)
        while True:
            try:
                conn, _ = listener.accept()
            except ConnectionAbortedError:  # reset by its client while queued
                continue
            except BlockingIOError:  # the queue is empty
                break
            except OSError as exc:  # e.g. EMFILE: what is still queued is reset by the close
                log.error("cannot accept the connections still queued (%s); they are reset", exc)
                break
            conn.setblocking(False)
            taken.append(conn)
        listener.close()
    return taken


def _answer(conn: _Conn) -> bool:
    """Send the 503 and half-close; whether it was sent (False: the client went away)."""
    conn.replied = True
    try:
        conn.sock.send(BUSY)  # ~300 bytes into an empty send buffer: one call sends it all
        conn.sock.shutdown(socket.SHUT_WR)
    except OSError:
        return False
    return True


def answer_queued(listeners: list[socket.socket], timeout_s: float = 2.0) -> int:
    """503 every connection queued on ``listeners`` and close them; returns how many were answered.

    See the module docstring for the protocol and why each step is there.
    """
    conns = [_Conn(sock) for sock in take_queued(listeners)]
    answered = 0
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for conn in conns:
            selector.register(conn.sock, selectors.EVENT_READ, conn)
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                conn = key.data
                try:
                    data = conn.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:  # reset by the client
                    data = b""
                if not data:  # the client closed: answered and read, or gone before asking
                    selector.unregister(conn.sock)
                    conn.sock.close()
                    continue
                if conn.replied:
                    continue  # the rest of a body nobody will read: discard it
                conn.head += data
                if b"\r\n\r\n" in conn.head or len(conn.head) > MAX_HEAD:
                    answered += _answer(conn)
        for key in list(selector.get_map().values()):  # out of time
            conn = key.data
            if not conn.replied and conn.head:
                answered += _answer(conn)
            conn.sock.close()
    return answered
