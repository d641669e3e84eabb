"""The control channel between front ends and the engine: framed pickles over a Unix socket.

Each message is a tuple ``(kind, request_id, payload)``, pickled and prefixed with its length
(4 bytes, little endian). Tensors never travel here — only offsets into a shared arena
(:mod:`service.shm`) and the packed score block of a batch (a few hundred bytes per image).

Kinds, front end → engine: ``hello`` (arena path and size), ``infer`` (:class:`InferRequest`),
``call`` (an admin method and its keyword arguments).
Engine → front end: ``model`` (:class:`service.model_manager.ModelInfo`, sent on connect and after
every swap), ``ok`` / ``error`` (the answer to one request id).

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


def encode(kind: str, request_id: int, payload: Any) -> bytes:
    body = pickle.dumps((kind, request_id, payload), protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> tuple[str, int, Any]:
    """The next message; raises ``asyncio.IncompleteReadError`` at EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes is over the limit")
    kind, request_id, payload = pickle.loads(await reader.readexactly(n))
    return kind, request_id, payload
