"""The control channel between front ends and the engine: framed pickles over a Unix socket.

Each message is a tuple ``(kind, request_id, payload)``. Messages travel in frames: a pickled list
of messages prefixed with its length (4 bytes, little endian). The engine's :class:`Outbox` puts
the answers of one batch to one front end into one frame, so its event loop pickles and writes
once per batch and front end, not once per request. Tensors never
travel here — only offsets into a shared arena (:mod:`service.shm`) and the packed score rows of
each request (a few hundred bytes per image).

Kinds, front end → engine: ``hello`` (arena path and size), ``infer`` (:class:`InferRequest`),
``call`` (an admin method and its keyword arguments).
Engine → front end: ``model`` (:class:`service.model_manager.ModelInfo`, sent on connect and after
every swap), ``ok`` / ``error`` (the answer to one request id: for ``infer``, the request's packed
score rows as raw float64 bytes, :class:`models.serving.ScoreColumns` without the array's pickle).

Errors cross as :class:`RemoteError` (the :class:`service.errors.ServiceError` subclass name,
message and headers) and are re-raised as that class in the front end, so a 503 from the engine's
queue is a 503 with the same ``Retry-After`` at the HTTP edge.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from service import errors

_LEN = struct.Struct("<I")
MAX_FRAME = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class InferRequest:
    """One request's rows in the sender's arena, what to compute, and by when."""

    generation: int  # the model generation the inputs were conformed for
    offset: int
    dtype: str  # "uint8" (pixels, normalised on the engine) or "float32" (prepared input)
    shape: tuple[int, ...]  # (n, Cin, H, W)
    options: Any  # models.serving.ScoreOptions
    timeout_s: float

    def __reduce__(self) -> tuple[type[InferRequest], tuple[Any, ...]]:
        # A constructor call instead of the frozen dataclass's state restore: one message per
        # request crosses here, and this halves its pickling both ways (5.3 -> 3.2 µs to
        # unpickle, 5.3 -> 2.7 µs to pickle, with its ScoreOptions; measured in process).
        return InferRequest, (
            self.generation, self.offset, self.dtype, self.shape, self.options, self.timeout_s
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RemoteError:
    """A :class:`service.errors.ServiceError` (or a server fault) as data."""

    kind: str
    message: str
    headers: dict[str, str]

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        if isinstance(exc, errors.ServiceError):
            return cls(type(exc).__name__, exc.message, dict(exc.headers))
        if isinstance(exc, ValueError):
            return cls("InvalidValue", str(exc), {})
        return cls("Internal", f"{type(exc).__name__}: {exc}", {})

    def exception(self) -> Exception:
        cls = getattr(errors, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.ServiceError):
            return cls(self.message, headers=self.headers)
        return RuntimeError(self.message)


Message = tuple[str, int, Any]  # (kind, request_id, payload)


def encode(messages: list[Message]) -> bytes:
    """One frame holding ``messages``, in order."""
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> list[Message]:
    """The messages of the next frame, in order; raises ``asyncio.IncompleteReadError`` at EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes is over the limit")
    messages: list[Message] = pickle.loads(await reader.readexactly(n))
    return messages


class FrameReader:
    """Frames from one stream, every complete one per wake-up.

    :func:`read_frame` awaits twice per frame (length, then body). Under load a front end's
    requests arrive faster than the engine's event loop turns, so one socket read holds several
    frames: this reads what has arrived in one call and unpickles each complete frame, keeping a
    partial one for the next call.
    """

    __slots__ = ("_reader", "_buf")

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buf = bytearray()

    async def read(self) -> list[Message]:
        """The messages of every frame received so far, in order (at least one frame's worth);
        raises ``asyncio.IncompleteReadError`` at EOF and ``ValueError`` for an oversized frame."""
        buf = self._buf
        while True:
            messages: list[Message] = []
            pos, end = 0, len(buf)
            while end - pos >= _LEN.size:
                (n,) = _LEN.unpack_from(buf, pos)
                if n > MAX_FRAME:
                    raise ValueError(f"control frame of {n} bytes is over the limit")
                start = pos + _LEN.size
                if end - start < n:
                    break
                messages += pickle.loads(buf[start : start + n])
                pos = start + n
            if pos:
                del buf[:pos]
            if messages:
                return messages
            chunk = await self._reader.read(1 << 16)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(buf), None)
            buf += chunk


class Outbox:
    """The engine's messages to one front end, sent as one frame per event-loop iteration.

    :meth:`put` only appends; the first put of an iteration schedules :meth:`flush` with
    ``call_soon``, which runs after the callbacks already ready — e.g. every answer of the batch
    that just finished. Front ends do not coalesce their requests: a front end decodes one request
    after another within one iteration, and holding the first until the last of a burst was
    decoded kept the engine idle meanwhile (877 → 653 req/s at 16 connections on the 2-core box).
    """

    __slots__ = ("_writer", "_messages", "_scheduled")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._messages: list[Message] = []
        self._scheduled = False

    def put(self, message: Message) -> None:
        self._messages.append(message)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Write what is waiting as one frame (dropped once the connection is closing)."""
        self._scheduled = False
        messages, self._messages = self._messages, []
        if messages and not self._writer.is_closing():
            self._writer.write(encode(messages))

    def close(self) -> None:
        """Write what is waiting, then close the connection."""
        self.flush()
        self._writer.close()
