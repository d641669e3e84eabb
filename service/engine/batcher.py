"""Dynamic batcher (in the engine): gathers concurrent requests from every front end into one pass.

Requests (each one or more images, already in shared memory) wait in one bounded queue. The batch
loop takes the oldest request and the ones behind it for the same model generation, up to
``max_batch_size`` images, runs the forward pass and the scoring in a compute thread, and answers
each request with its rows of the packed score columns. While one batch computes, the next one
fills — that is where batching comes from under load. ``batch_wait="adaptive"`` (the default)
also holds a batch that is not full for up to ``max_delay_s`` while a front end reports requests
on their way (``arriving``: decoded now, sent in a moment; :mod:`service.common.shm`'s arena header), and
never otherwise: a lone request runs at once, and under load the forward pass gets the larger
batches it runs most efficiently (on a CPU shared with the front ends, a batch of one costs twice
the CPU per image of a batch of eight). With ``batch_wait="always"`` the loop waits up to
``max_delay_s`` for a fuller batch whatever is arriving (Triton's ``max_queue_delay``).
``in_flight`` batches compute at once (default 1: the next batch is taken when one finishes). With
more, a further batch starts beside a computing one only when it is full (``max_batch_size``
images): large requests and deep queues use a second compute thread, light load keeps its fuller
batches.

Guarantees (each tested in tests/service/engine/test_batcher.py):

* bounded queue: a request that does not fit is refused at once with 503 + ``Retry-After``;
* deadlines: a request whose deadline passes while queued is dropped before compute (504);
  one already computing is answered when its batch finishes;
* a batch holds requests for one predictor only, so after a hot swap, requests admitted for the
  old model finish on it;
* requests with equal :class:`~models.serving.ScoreOptions` are scored in one call;
* every accepted request gets exactly one answer, including on shutdown (:meth:`drain`), unless
  its sender went away (:meth:`cancel`: never computed if still queued).

The engine queues with :meth:`enqueue` and a callback (no task or future per request);
:meth:`submit` is the same as a coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from models.serving import ScoreColumns, ScoreOptions
from service.common.errors import DeadlineExceeded, QueueFull
from service.common.metrics import Metrics, observe_many
from service.engine.predictor import ServedPredictor

log = logging.getLogger("vge.batcher")


class _State(enum.Enum):
    QUEUED = "queued"
    TAKEN = "taken"  # in a batch that computes
    DROPPED = "dropped"  # removed unanswered (its front end went away)
    ANSWERED = "answered"


#: How a queued request is answered: ``answer(columns, None)`` or ``answer(None, error)``, exactly
#: once, on the event loop.
Answer = Callable[[ScoreColumns | None, BaseException | None], None]


@dataclasses.dataclass(eq=False)
class Unit:
    """One request in the queue (the engine holds each until it is answered)."""

    predictor: ServedPredictor
    model: str
    x: torch.Tensor | np.ndarray  # (n, Cin, H, W) uint8 pixels or float32 prepared input
    options: ScoreOptions
    timeout_s: float
    enqueued: float
    answer: Answer
    timer: asyncio.TimerHandle | None = None  # fires at the deadline while queued
    state: _State = _State.QUEUED

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    def reply(self, columns: ScoreColumns | None, error: BaseException | None) -> None:
        """Answer once; a failing answer callback is logged, never raised into the batch loop."""
        if self.state is _State.ANSWERED:
            return
        self.state = _State.ANSWERED
        if self.timer is not None:
            self.timer.cancel()
        try:
            self.answer(columns, error)
        except Exception:  # noqa: BLE001
            log.exception("answering a request failed")


def _ignore(columns: ScoreColumns | None, error: BaseException | None) -> None:
    """The answer of a cancelled request: nobody waits for it."""


class Batcher:
    """The dynamic batcher; create inside a running event loop, then :meth:`start`."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_delay_s: float,
        max_queue_length: int,
        metrics: Metrics,
        wait_always: bool = False,
        arriving: Callable[[], int] | None = None,
        on_scored: Callable[[ServedPredictor, ScoreColumns, ScoreOptions], None] | None = None,
        in_flight: int = 1,
    ) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self.max_batch_size = max_batch_size
        # Requests the front ends are about to send (adaptive waiting); none known: never wait.
        self.arriving = arriving or (lambda: 0)
        # Called on the event loop with every scored option group (predictor, its columns), after
        # the batch's answers are out: monitoring per batch, not per request, and off the compute
        # thread (the forward pass of the next batch runs meanwhile).
        self.on_scored = on_scored
        self.max_delay_s = max_delay_s
        self.max_queue_length = max_queue_length
        self.wait_always = wait_always
        self.metrics = metrics
        self._pending: deque[Unit] = deque()
        self._rows = 0
        # predictor -> rows queued for it (O(1) fullness)
        self._rows_by: dict[ServedPredictor, int] = {}
        self._model_rows: dict[str, int] = {}  # model name -> rows queued (its queue-depth gauge)
        # Arrivals wake the batch loop only once this many rows are queued: 0 (every arrival)
        # except while a batch computes and the next may start only when full (in_flight > 1).
        self._wake_rows = 0
        self._wakeup = asyncio.Event()
        self._admitting = True
        self._closing = False
        self._hurry = False  # shutting down: stop waiting for fuller batches
        self._task: asyncio.Task[None] | None = None
        # One compute thread per batch in flight; a batch is taken only when a slot is free, so
        # with one slot the next batch fills while this one computes.
        self._slots = asyncio.Semaphore(in_flight)
        self._running: dict[asyncio.Task[None], list[Unit]] = {}  # batches computing
        self._executor = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="vge-compute")
        self._batch_s = 0.01  # running estimate of one batch's compute time (for Retry-After)
        self._gauges: dict[str, Any] = {}
        self._event_loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._stale_depth: set[str] = set()  # models whose queue-depth gauge awaits an update

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the batch loop on the running event loop."""
        self._event_loop = loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="vge-batcher")

    @property
    def admitting(self) -> bool:
        """False once shutdown began."""
        return self._admitting

    @property
    def queued_rows(self) -> int:
        """Images waiting in the queue."""
        return self._rows

    def queued_rows_of(self, model: str) -> int:
        """Images of ``model`` waiting in the queue (what its ``vge_queue_depth`` reads)."""
        return self._model_rows.get(model, 0)

    def hurry(self) -> None:
        """Shutdown has begun: run each batch as soon as it is taken, never wait to fill it.

        Requests still arrive while the front ends drain; this keeps ``batch_wait=always`` (up to
        ``max_queue_delay_ms``) from holding the whole shutdown for one batch window.
        """
        self._hurry = True
        self._wakeup.set()

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting, compute what is queued without waiting for more, stop the loop.

        Requests still queued or computing after ``timeout_s`` are answered 503, so none is left
        unanswered (a batch that finishes later answers nobody twice: :meth:`Unit.reply`).
        """
        self._admitting = False
        self._closing = True
        self.hurry()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                log.error(
                    "drain timed out after %.1fs; refusing %d queued and %d computing images",
                    timeout_s, self._rows, sum(u.rows for b in self._running.values() for u in b),
                )  # fmt: skip
                self._task.cancel()
        gone = [u for u in self._pending if u.state is _State.QUEUED]
        gone += [u for batch in self._running.values() for u in batch]
        self._pending.clear()
        self._rows_by.clear()
        self._model_rows.clear()
        for unit in gone:
            unit.reply(
                None,
                QueueFull(
                    "the server shut down before this request was answered; retry",
                    headers={"Retry-After": "1"},
                ),
            )
        self._rows = 0
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ admission
    def _retry_after(self) -> str:
        batches_ahead = math.ceil((self._rows + 1) / self.max_batch_size)
        return str(max(1, math.ceil(batches_ahead * self._batch_s)))

    def enqueue(
        self,
        predictor: ServedPredictor,
        model: str,
        x: torch.Tensor | np.ndarray,
        options: ScoreOptions,
        timeout_s: float,
        answer: Answer,
    ) -> Unit:
        """Queue ``x`` (n, Cin, H, W), a tensor or a numpy array, for ``predictor``; ``answer``
        gets its rows' packed score columns, or :class:`DeadlineExceeded` (504) if its deadline
        passes while it is queued.

        Raises :class:`QueueFull` (503) at once when the request does not fit. No task or future
        per request: the engine's event loop handles every request's bookkeeping, and at
        thousands of requests a second that is its main cost.
        """
        if not self._admitting:
            raise QueueFull(
                "the server is shutting down and admits no new requests; retry on another replica",
                headers={"Retry-After": "1"},
            )
        n = int(x.shape[0])
        if self._rows + n > self.max_queue_length:
            raise QueueFull(
                f"the queue is full ({self._rows} of {self.max_queue_length} images waiting); "
                "retry after the Retry-After seconds",
                headers={"Retry-After": self._retry_after()},
            )
        loop = self._event_loop or asyncio.get_running_loop()
        unit = Unit(predictor, model, x, options, timeout_s, time.monotonic(), answer)
        unit.timer = loop.call_later(timeout_s, self._expire, unit)
        self._pending.append(unit)
        self._rows += n
        self._rows_by[predictor] = self._rows_by.get(predictor, 0) + n
        self._model_rows[model] = self._model_rows.get(model, 0) + n
        if not self._stale_depth:
            loop.call_soon(self._publish_depth)
        self._stale_depth.add(model)
        if self._rows >= self._wake_rows:
            self._wakeup.set()
        return unit

    async def submit(
        self,
        predictor: ServedPredictor,
        model: str,
        x: torch.Tensor,
        options: ScoreOptions,
        timeout_s: float,
    ) -> ScoreColumns:
        """:meth:`enqueue` as a coroutine: the request's columns, or its error raised.

        Cancelling the caller drops the request if it is still queued (:meth:`cancel`).
        """
        future: asyncio.Future[ScoreColumns] = asyncio.get_running_loop().create_future()

        def answer(columns: ScoreColumns | None, error: BaseException | None) -> None:
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:  # the callback's contract: columns when there is no error
                    assert columns is not None
                    future.set_result(columns)

        unit = self.enqueue(predictor, model, x, options, timeout_s, answer)
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel(unit)
            raise

    def cancel(self, unit: Unit) -> None:
        """Drop a request whose sender went away: never computed if still queued, never answered."""
        self._remove(unit)  # when still queued
        if unit.timer is not None:
            unit.timer.cancel()
        unit.answer = _ignore  # a batch already computing it answers nobody

    def _expire(self, unit: Unit) -> None:
        """The deadline timer: a request still queued is dropped and answered 504; one already
        computing is answered when its batch finishes."""
        if unit.state is _State.QUEUED:
            self._remove(unit)
            unit.reply(
                None,
                DeadlineExceeded(
                    f"the request's deadline of {unit.timeout_s:g}s passed while it was queued; "
                    "it was not computed (raise timeout_s or retry)"
                ),
            )

    def _publish_depth(self) -> None:
        """Set the queue-depth gauges that arrivals made stale, once per event-loop iteration:
        a burst of arrivals is one write, not one each (a locked write to a mapped file in
        multiprocess mode, ~1 µs on the engine's loop per request)."""
        stale, self._stale_depth = self._stale_depth, set()
        for model in stale:
            self._queue_depth(model).set(self._model_rows.get(model, 0))

    def _queue_depth(self, model: str) -> Any:
        """The queue-depth gauge of ``model`` (prometheus-client's labelled child, cached)."""
        gauge = self._gauges.get(model)
        if gauge is None:
            gauge = self._gauges[model] = self.metrics.queue_depth.labels(model=model)
        return gauge

    def _remove(self, unit: Unit) -> None:
        """Take a queued request out of the queue (unanswered)."""
        if unit.state is _State.QUEUED:
            unit.state = _State.DROPPED
            with contextlib.suppress(ValueError):
                self._pending.remove(unit)
            self._rows -= unit.rows
            self._untrack(unit.predictor, unit.model, unit.rows)
            self._wakeup.set()

    # ------------------------------------------------------------------ batch loop
    def _rows_for(self, predictor: ServedPredictor) -> int:
        """Rows queued for ``predictor`` (kept as a count: the batch loop asks on every wake-up)."""
        return self._rows_by.get(predictor, 0)

    def _untrack(self, predictor: ServedPredictor, model: str, rows: int) -> None:
        """Rows of ``predictor`` (serving ``model``) left the queue; its gauge follows."""
        left = self._rows_by.get(predictor, 0) - rows
        if left > 0:
            self._rows_by[predictor] = left
        else:  # a swapped-out model's predictor is not kept alive by the count
            self._rows_by.pop(predictor, None)
        left = self._model_rows.pop(model, 0) - rows
        if left > 0:
            self._model_rows[model] = left
        self._queue_depth(model).set(max(left, 0))

    def _take(self, predictor: ServedPredictor) -> list[Unit]:
        """Remove and return up to ``max_batch_size`` rows of ``predictor``'s requests, in order.

        Other models' requests met on the way (during a swap) keep their places at the front.
        """
        now = time.monotonic()
        batch: list[Unit] = []
        rows = 0
        others: list[Unit] = []
        pending = self._pending
        while pending and rows < self.max_batch_size:
            unit = pending.popleft()
            if unit.predictor is not predictor:
                others.append(unit)
                continue
            if batch and rows + unit.rows > self.max_batch_size:
                pending.appendleft(unit)
                break
            unit.state = _State.TAKEN
            batch.append(unit)
            rows += unit.rows
        pending.extendleft(reversed(others))
        self._rows -= rows
        if batch:
            model = batch[0].model
            self._untrack(predictor, model, rows)
            waits = now - np.fromiter((u.enqueued for u in batch), float, len(batch))
            observe_many(self.metrics.queue_wait.labels(model=model), waits)
        return batch

    async def _loop(self) -> None:
        try:
            await self._batches()
        finally:
            if self._running:  # drained: batches still computing answer first
                # asyncio.wait, not gather: a cancelled drain must not cancel them (drain answers
                # their requests 503 and a batch finishing later answers nobody twice).
                await asyncio.wait(self._running)

    async def _batches(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._slots.locked():  # every slot computes: wait for one (the queue fills)
                async with self._slots:
                    pass
                continue
            first = self._pending[0]
            if (
                self._running
                and not self._hurry
                and self._rows_for(first.predictor) < self.max_batch_size
            ):
                # A batch computes: another starts beside it only when it is full. Half-full
                # batches side by side cost more per image than one fuller batch after the other
                # (on the 2-core box, single images: 1,075 -> 850 req/s at c=16 without this rule).
                # Arrivals wake the loop only once a full batch could be queued, not one by one.
                self._wake_rows = self.max_batch_size
                self._wakeup.clear()  # set by such an arrival and by a batch finishing
                try:
                    await self._wakeup.wait()
                finally:
                    self._wake_rows = 0
                continue
            flush_at = first.enqueued + self.max_delay_s
            while (
                not self._hurry
                and first.state is _State.QUEUED
                and self._rows_for(first.predictor) < self.max_batch_size
                and (self.wait_always or self.arriving() > 0)
            ):
                remaining = flush_at - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            if first.state is not _State.QUEUED:
                continue
            batch = self._take(first.predictor)
            if batch:
                await self._slots.acquire()
                task = asyncio.get_running_loop().create_task(self._run(batch))
                self._running[task] = batch
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        batch = self._running.pop(task, [])
        self._slots.release()
        self._wakeup.set()  # a batch waiting to fill may start now
        if not task.cancelled() and task.exception() is not None:  # never raised: answer here
            log.error("a batch of %d requests failed", len(batch), exc_info=task.exception())
            for unit in batch:
                unit.reply(None, task.exception())

    @staticmethod
    def _compute(
        batch: list[Unit],
    ) -> tuple[list[tuple[bool, Any]], list[tuple[ScoreColumns, ScoreOptions]]]:
        """Worker thread: one forward pass, then one scoring call per distinct option set.

        The predictor's output goes to scoring as it is when the batch has one option set (the
        common case); a group of a mixed batch is scored on its rows (``EnsembleOutput.rows``).
        Returns each unit's ``(ok, rows or error)`` and every option group's scored columns.
        """
        predictor = batch[0].predictor
        # The engine queues numpy views of shared memory (no torch call on its event loop);
        # Predictor.run gathers them with one np.concatenate, not a torch call per request.
        out = predictor.run([u.x for u in batch])  # EnsembleOutput (B, M, C) on the device
        groups: dict[ScoreOptions, list[tuple[int, int, int]]] = {}
        start = 0
        for n, unit in enumerate(batch):
            groups.setdefault(unit.options, []).append((n, start, start + unit.rows))
            start += unit.rows
        results: list[tuple[bool, Any]] = [(False, None)] * len(batch)
        scored: list[tuple[ScoreColumns, ScoreOptions]] = []
        for options, spans in groups.items():
            if len(spans) == len(batch):
                part = out
            else:
                index = torch.as_tensor(
                    np.concatenate([np.arange(i, j) for _, i, j in spans]), device=out.p.device
                )
                part = out.rows(index)
            try:
                columns = predictor.score_columns(part, options)
            except Exception as exc:  # noqa: BLE001 - delivered to these requests only
                for n, _, _ in spans:
                    results[n] = (False, exc)
                continue
            offset = 0
            for n, i, j in spans:
                results[n] = (True, columns.rows(offset, offset + j - i))
                offset += j - i
            scored.append((columns, options))
        return results, scored

    async def _run(self, batch: list[Unit]) -> None:
        model = batch[0].model
        rows = sum(u.rows for u in batch)
        t0 = time.perf_counter()
        try:
            results, scored = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._compute, batch
            )
        except Exception as exc:  # forward failed: a server fault, every unit gets it
            log.exception("forward pass failed for a batch of %d", rows)
            results, scored = [(False, exc)] * len(batch), []
        elapsed = time.perf_counter() - t0
        self._batch_s = 0.8 * self._batch_s + 0.2 * elapsed
        self.metrics.compute.labels(model=model).observe(elapsed)
        self.metrics.batch_size.labels(model=model).observe(rows)
        for unit, (ok, value) in zip(batch, results, strict=True):
            if ok:
                unit.reply(value, None)
            else:
                unit.reply(None, value)
        if self.on_scored is not None:
            predictor = batch[0].predictor
            for columns, options in scored:
                try:
                    self.on_scored(predictor, columns, options)
                except Exception:  # monitoring never fails the answers
                    log.exception("on_scored failed for a batch of %d", len(columns))
