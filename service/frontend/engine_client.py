"""The front end's side of the engine: one connection, the shared arena, request futures.

:class:`EngineClient` keeps a connection to the engine (reconnecting while the engine restarts),
knows the served model (:class:`~service.common.model_info.ModelInfo`, pushed by the engine), hands out
arena regions for request tensors, and turns the engine's answers back into results or the same
4xx/5xx errors. A request caught by an engine crash is answered 503 at once (never left hanging);
until the engine is back, :attr:`ready` is false and new requests get 503 + ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from models.serving import ScoreColumns, ScoreOptions
from service.common.errors import NotReady, QueueFull
from service.common.model_info import ModelInfo
from service.common.shm import HEADER, Allocator, Arena, nbytes_of
from service.common.wire import (
    AdminCommand,
    Command,
    ErrorReply,
    FrameReader,
    Hello,
    InferRequest,
    InferResults,
    ModelUpdate,
    check_answer,
    encode,
    encode_message,
)

log = logging.getLogger("vge.frontend")

#: The answer type of an admin command (service.common.wire.Command).
A = TypeVar("A")

#: ``str(dtype)`` of the request dtypes (``str`` of a NumPy dtype costs ~3 µs a call).
_DTYPE_NAMES: dict[np.dtype[Any], str] = {np.dtype(d): d for d in ("uint8", "float32")}

RECONNECT_S = 0.05
#: How long past its deadline a request waits for the engine before giving up (504).
ANSWER_GRACE_S = 30.0


class _Arrival:
    """One request's place in its front end's arrival count (the arena header): counted from
    :meth:`start` (its body is in) until :meth:`sent`."""

    __slots__ = ("_arena", "_counted", "_done")

    def __init__(self, arena: Arena) -> None:
        self._arena = arena
        self._counted = False
        self._done = False

    def start(self) -> None:
        """Count the request (idempotent; not after :meth:`sent`)."""
        if not self._counted and not self._done:
            self._counted = True
            self._arena.arriving += 1

    def sent(self) -> None:
        """Stop counting (idempotent)."""
        self._done = True
        if self._counted:
            self._counted = False
            self._arena.arriving -= 1


#: The arrival of the request the running task serves (set by :meth:`EngineClient.arrival`).
_ARRIVAL: contextvars.ContextVar[_Arrival | None] = contextvars.ContextVar(
    "vge_arrival", default=None
)


@dataclass
class Region:
    """An allocated arena region and a NumPy array over it (no torch call on the request path)."""

    offset: int
    array: np.ndarray


class EngineClient:
    """Connection to the engine from one front-end process."""

    def __init__(self, socket_path: str, arena: Arena) -> None:
        self.socket_path = socket_path
        self.arena = arena
        self.allocator = Allocator(arena.size, start=HEADER)
        # A replacement front end reuses its predecessor's arena: a count left there by requests
        # caught in a crash would make the engine hold every batch for max_queue_delay_ms.
        arena.arriving = 0
        self.model: ModelInfo | None = None
        self._writer: asyncio.StreamWriter | None = None
        # request id -> (its future: a scoring request's rows as bytes, else the engine's answer
        # message, checked by call(); its arena region's offset)
        self._pending: dict[int, tuple[asyncio.Future[object], int | None]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._connected = asyncio.Event()

    @property
    def ready(self) -> bool:
        """Connected to an engine that has a model loaded."""
        return self._writer is not None and self.model is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect_loop())

    async def wait_ready(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.ready

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()

    # ------------------------------------------------------------------ connection
    async def _connect_loop(self) -> None:
        while not self._closed:
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            writer.write(encode([(0, Hello(self.arena.path, self.arena.size))]))
            self._writer = writer
            try:
                await self._read_loop(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            except Exception:  # noqa: BLE001 - e.g. a frame this build cannot decode: reconnect
                log.exception("engine connection failed; reconnecting")
            finally:
                self._lost()
                writer.close()
            await asyncio.sleep(RECONNECT_S)

    def _lost(self) -> None:
        """The engine went away: every request sent to it gets a 503 now and its region is free
        again. Regions of requests not sent yet (still decoding) stay theirs: they are sent to
        the next engine, or released, by their own request (freeing every region here let a
        request that arrived after a restart be given the region of one still decoding, and
        each was answered with the other's image)."""
        if self.model is not None and not self._closed:
            log.warning("lost the engine; answering %d waiting requests 503", len(self._pending))
        self._writer = None
        self.model = None
        self._connected.clear()
        pending, self._pending = self._pending, {}
        for future, offset in pending.values():
            if offset is not None:
                self.allocator.free(offset)  # the engine that read it is gone
            if not future.done():
                future.set_exception(
                    NotReady(
                        "the inference engine restarted while this request was in flight; retry",
                        headers={"Retry-After": "1"},
                    )
                )

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        frames = FrameReader(reader)
        while True:
            for request_id, message in await frames.read():
                if type(message) is InferResults:  # scoring answers: (request id, rows' bytes)
                    pending, free = self._pending, self.allocator.free
                    for rid, rows in message.rows:
                        entry = pending.pop(rid, None)
                        if entry is not None:
                            future, offset = entry
                            if offset is not None:
                                free(offset)  # the engine is done with this region
                            if not future.done():
                                future.set_result(rows)
                    continue
                if type(message) is ModelUpdate:
                    self.model = message.info
                    self._connected.set()
                    continue
                entry = self._pending.pop(request_id, None)
                if entry is None:
                    continue
                future, offset = entry
                if offset is not None:
                    self.allocator.free(offset)  # the engine is done with this region
                if future.done():
                    continue
                if type(message) is ErrorReply:
                    future.set_exception(message.exception())
                else:  # a command's answer (checked against the command by call())
                    future.set_result(message)

    # ------------------------------------------------------------------ requests
    def current_model(self) -> ModelInfo:
        """The served model, or 503 while the engine is (re)starting."""
        model = self.model
        if model is None or self._writer is None:
            raise NotReady(
                "the inference engine is starting; retry shortly", headers={"Retry-After": "1"}
            )
        return model

    @contextlib.contextmanager
    def arrival(self) -> Iterator[_Arrival]:
        """The arrival of the request this block serves; call ``start()`` once its body is in.

        From ``start()`` until it is sent, the request counts in the arena's header, where the
        engine's batcher reads it: a batch is held (up to ``max_queue_delay_ms``) only while some
        front end holds requests it is about to send. Counting starts when the body is complete,
        not at the headers, so a slow upload holds no batch. The request stops counting when
        :meth:`infer` sends it (no ``await`` in between, so the engine never waits for a request
        already sent), or when the block ends (refused, failed, the client gone).
        """
        arrival = _Arrival(self.arena)
        token = _ARRIVAL.set(arrival)
        try:
            yield arrival
        finally:
            _ARRIVAL.reset(token)
            arrival.sent()

    def allocate(self, dtype: str, shape: tuple[int, ...]) -> Region:
        """An arena region for a request's ``dtype`` (``"uint8"``, ``"float32"``) array of ``shape``
        (503 when the arena is full)."""
        offset = self.allocator.allocate(nbytes_of(np.dtype(dtype), shape))
        if offset is None:
            raise QueueFull(
                "this front end's shared-memory arena is full (too many images in flight); "
                "retry, or raise VGE_SHM_MB_PER_WORKER",
                headers={"Retry-After": "1"},
            )
        return Region(offset, self.arena.array(offset, dtype, shape))

    def release(self, region: Region) -> None:
        """Free a region that was never handed to the engine (e.g. a decode error)."""
        self.allocator.free(region.offset)

    def _send(
        self, message: InferRequest | AdminCommand, offset: int | None
    ) -> asyncio.Future[object]:
        """Write a message to the engine at once, one frame (see :class:`service.common.wire.Outbox`
        for why front ends do not coalesce); the future gets its answer."""
        writer = self._writer
        if writer is None:
            raise NotReady(
                "the inference engine is restarting; retry", headers={"Retry-After": "1"}
            )
        request_id = next(self._ids)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, offset)
        writer.write(encode_message(request_id, message))
        return future

    async def infer(
        self, model: ModelInfo, region: Region, options: ScoreOptions, timeout_s: float
    ) -> ScoreColumns:
        """Score the images in ``region``; the region belongs to the engine until it answers."""
        a = region.array
        request = InferRequest(
            generation=model.generation,
            offset=region.offset,
            dtype=_DTYPE_NAMES.get(a.dtype) or str(a.dtype),
            shape=a.shape,
            options=options,
            timeout_s=timeout_s,
        )
        arrival = _ARRIVAL.get()
        if arrival is not None:
            arrival.sent()  # written just below, with no await in between
        try:
            future = self._send(request, region.offset)
        except NotReady:
            self.release(region)
            raise
        data = await _wait(future, timeout_s + ANSWER_GRACE_S)  # the rows' float64 bytes
        return ScoreColumns.from_bytes(cast("bytes", data), options.top_k)

    async def call(self, command: Command[A], timeout_s: float = 600.0) -> A:
        """Run an admin command in the engine (model swaps, training jobs); its answer, typed
        by the command (:class:`service.common.wire.Command`), or its error raised."""
        self.current_model()
        # Every Command subclass is one of AdminCommand's (tests/service/common/test_wire.py).
        answer = await _wait(self._send(cast("AdminCommand", command), None), timeout_s)
        return check_answer(command, answer)


async def _wait(future: asyncio.Future[object], timeout_s: float) -> object:
    """The engine's answer in ``future``, or a 504 once ``timeout_s`` has passed.

    One timer per request, no wrapper: ``asyncio.wait_for(asyncio.shield(future))`` made a task-side
    waiter and a second future per request (7 µs against 2.8 µs on the 2-core box). If the
    awaiting task is cancelled (a gRPC call cancelled by its client, a server shutting down), so
    is ``future``; the engine's later answer then only frees the request's region
    (:meth:`EngineClient._read_loop`).
    """
    timer = asyncio.get_running_loop().call_later(timeout_s, _expire, future, timeout_s)
    try:
        return await future
    finally:
        timer.cancel()


def _expire(future: asyncio.Future[object], timeout_s: float) -> None:
    from service.common.errors import DeadlineExceeded

    if not future.done():
        future.set_exception(
            DeadlineExceeded(
                f"the engine did not answer within {timeout_s:g}s; the request may still complete"
            )
        )
