"""The engine process: one per device; owns the model, the batcher, the forward pass and scoring.

Front ends connect over a Unix socket (:mod:`service.common.wire`) and hand over requests whose images
already sit in their shared-memory arena (:mod:`service.common.shm`). The engine batches across *all*
front ends (:class:`service.engine.batcher.Batcher`), runs ``Predictor.run`` (normalisation on the device,
forward) and ``Predictor.score_columns`` (the served decision on the device, one copy back), and
answers each request with its rows. It also owns what must exist once per server: model swaps
(load-then-swap, broadcast to every front end) and training jobs (:class:`service.engine.jobs.JobManager`).

Lifecycle: started by :mod:`service.supervisor` (spawned, so CUDA initialises in a clean process;
forked with ``engine_start=fork`` on a CPU);
sets ``ready`` once the model is loaded and the socket listens; on SIGTERM computes what it holds
(``shutdown_grace_s`` at most), stops training jobs and exits 0. SIGINT is ignored: on Ctrl-C the
supervisor drains the front ends first and then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from service.common.errors import Conflict, InvalidValue
from service.common.job_record import JobState
from service.common.settings import Settings
from service.common.shm import DTYPES
from service.common.wire import (
    Answer,
    CancelJob,
    Command,
    ErrorCode,
    ErrorReply,
    FrameReader,
    GetJob,
    Hello,
    HistoryEntries,
    InferRequest,
    JobList,
    JobLog,
    JobLogs,
    JobRecord,
    JSONObject,
    ListJobs,
    ListModelHistory,
    ModelServed,
    ModelUpdate,
    Outbox,
    PromoteJob,
    PromoteModel,
    PromoteRefusal,
    ReloadModel,
    RollbackModel,
    SubmitJob,
    read_frame,
)

if TYPE_CHECKING:
    import threading
    from multiprocessing.synchronize import Event as ProcessEvent

    from models.serving import ScoreColumns, ScoreOptions
    from service.common.shm import Arena
    from service.engine.batcher import Unit
    from service.engine.drift import UncertaintyMonitor
    from service.engine.model_manager import LoadedModel
    from service.engine.predictor import ServedPredictor

log = logging.getLogger("vge.engine")


class Engine:
    """The engine's state and its request handlers (one asyncio loop; a compute thread per batch in
    flight, one by default)."""

    def __init__(self, settings: Settings) -> None:
        from service.common.metrics import Metrics
        from service.engine.batcher import Batcher
        from service.engine.jobs import JobManager
        from service.engine.model_manager import ModelManager
        from service.engine.repository import open_model_repository

        self.settings = settings
        self.metrics = Metrics()
        # The served model's state, history and catalogue: this replica's own, or with
        # VGE_DB_URL the fleet's (service.engine.repository).
        self.repository = open_model_repository(settings)
        self.models = ModelManager(settings, self.metrics, self.repository)
        self.batcher = Batcher(
            max_batch_size=settings.resolved_max_batch_size(),
            max_delay_s=settings.max_queue_delay_s,
            max_queue_length=settings.max_queue_length,
            metrics=self.metrics,
            wait_always=settings.batch_wait == "always",
            arriving=self._arriving,
            on_scored=self._observe,
            in_flight=settings.batches_in_flight,
        )
        self.jobs = JobManager(settings, self.metrics)
        self.reviews = None
        if settings.review_enabled:
            from service.common.review_store import open_review_store

            self.reviews = open_review_store(settings)
            self.jobs.reviews = self.reviews
        # The connected front ends: each one's outbox (answers, coalesced per loop iteration) and
        # arena (service.common.shm.Arena).
        self._clients: dict[Outbox, Arena] = {}
        self._monitors: dict[int, UncertaintyMonitor] = {}  # by model generation

    # ------------------------------------------------------------------ lifecycle
    async def run(
        self,
        socket_path: str,
        ready: ProcessEvent | threading.Event | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Load the model, listen on ``socket_path``, serve until ``stop`` is set, then drain.

        Without ``stop`` (the engine process: :func:`engine_main`) SIGTERM sets it and SIGINT is
        ignored (the supervisor stops the engine last). An engine embedded in another process's
        thread (the tests' in-process server) passes its own event, set from that thread's loop:
        signal handlers belong to a process's main thread."""
        import torch

        threads = self.settings.resolved_torch_threads()
        if threads:
            torch.set_num_threads(threads)
        loop = asyncio.get_running_loop()
        if stop is None:
            stop = asyncio.Event()
            loop.add_signal_handler(signal.SIGTERM, stop.set)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

        # The first engine start of this `vge serve` run (not a restart by the supervisor) is the
        # one where an explicit --model-dir wins over the model history: a marker in the run's
        # private directory (the supervisor's, removed when it exits) tells them apart.
        started = Path(socket_path).parent / "engine-started"
        await self.models.load_initial(first_start=not started.exists())
        started.touch()
        self.batcher.start()
        try:
            self.metrics.init_job_states()
            self._export_model_series()
            await asyncio.to_thread(self.jobs.start)
            Path(socket_path).unlink(missing_ok=True)
            server = await asyncio.start_unix_server(self._serve_client, path=socket_path)
        except BaseException:
            # A start that fails here (e.g. a socket path over AF_UNIX's 107 bytes) stops what it
            # started: in its own process the exit would, an engine embedded in another process
            # (the tests' in-process server) would leave its batch loop and job sweeper running.
            await self._stop_work()
            raise
        self.metrics.engine_ready.set(1)
        current = self.models.current
        assert current is not None
        s = self.settings
        served = current.info.description
        print(
            f"vge serve: engine: model {current.info.name} {current.info.version} on "
            f"{served['device']} (max batch {s.resolved_max_batch_size()}, "
            f"max delay {s.max_queue_delay_ms:g} ms, queue {s.max_queue_length}); "
            f"served because {served['served_because']} since {served['served_since']}",
            file=sys.stderr,
            flush=True,
        )
        # As the front ends do: what start-up allocated (torch, the model, compiled graphs) leaves
        # the cyclic GC's reach, so a full collection under load is short instead of pausing the
        # batch loop with every request queued behind it.
        gc.collect()
        gc.freeze()
        if ready is not None:
            ready.set()
        memory = loop.create_task(self._watch_device_memory())
        housekeeping = loop.create_task(self._review_housekeeping())
        fleet = loop.create_task(self._follow_fleet())
        await stop.wait()
        fleet.cancel()
        self.batcher.hurry()  # the front ends drain: compute what they send without batch waits

        # A SIGTERM sent to the whole process group (e.g. coreutils `timeout`) reaches the engine
        # while the front ends still drain: keep serving them until they have disconnected.
        deadline = loop.time() + self.settings.drain_s + self.settings.shutdown_grace_s
        while self._clients and loop.time() < deadline:
            await asyncio.sleep(0.05)
        log.info("engine: SIGTERM, computing what is queued")
        self.metrics.engine_ready.set(0)
        memory.cancel()
        housekeeping.cancel()
        server.close()
        await self._stop_work()
        for outbox in list(self._clients):
            outbox.close()

    async def _stop_work(self) -> None:
        """Compute what is queued (``shutdown_grace_s`` at most), stop the training jobs, close
        the model repository: the end of every run, and of a start that failed part-way."""
        await self.batcher.drain(self.settings.shutdown_grace_s)
        await asyncio.to_thread(self.jobs.shutdown)
        await asyncio.to_thread(self.repository.close)

    async def _review_housekeeping(self) -> None:
        """The review queue's depth gauge and store health (every 2 s), retention (at start,
        then hourly).

        The engine does this once per replica; front ends write the queue themselves. An
        unavailable store (service.common.review_connection) stops neither this loop nor the engine:
        the loop retries it (lazily, with the store's backoff), ``vge_review_store_up`` says 0
        meanwhile, and the depth gauge keeps its last reading.
        """
        if self.reviews is None:
            return
        from service.common.review_connection import WATCH_INTERVAL_S, ReviewStoreUnavailable

        store, s = self.reviews, self.settings
        gauge = self.metrics.review_queue_depth
        last_sweep = -1e9
        seen: set[str] = set()
        loop = asyncio.get_running_loop()
        while True:
            try:
                if s.review_retention_days > 0 and loop.time() - last_sweep > 3600:
                    deleted = await asyncio.to_thread(store.sweep, s.review_retention_days)
                    last_sweep = loop.time()  # once it ran: an unavailable store is swept later
                    if deleted:
                        log.info("review retention: deleted %d closed items", deleted)
                depth = await asyncio.to_thread(store.depth_by_model)
                for model in seen | depth.keys():  # a model whose queue emptied reads 0
                    gauge.labels(model=model).set(depth.get(model, 0))
                seen |= depth.keys()
            except ReviewStoreUnavailable:
                pass  # logged by the store once per outage; the gauge below says it
            except Exception:  # noqa: BLE001 - a database hiccup must not stop the engine
                log.exception("review housekeeping failed; retrying")
            self.metrics.review_store_up.labels(backend=store.backend).set(1 if store.up else 0)
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _follow_fleet(self) -> None:
        """A fleet replica (``VGE_DB_URL``): serve what the fleet serves. Woken by PostgreSQL
        ``NOTIFY`` when any replica records a model (and after the LISTEN connection
        (re)connects), and every ``FLEET_POLL_S`` seconds regardless (the fallback); each time
        :meth:`ModelManager.follow_fleet` loads the fleet's model if this replica does not serve
        it, and the front ends learn what changed. Nothing for a replica on its own."""
        from service.engine.repository import FLEET_POLL_S

        if self.models.fleet is None:
            return
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self.repository.listen(lambda: loop.call_soon_threadsafe(wake.set))
        await self.models.report_fleet()
        failing = False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), FLEET_POLL_S)
            wake.clear()
            try:
                if await self.models.follow_fleet():
                    self._broadcast_model()
                failing = False
            except Exception as exc:  # noqa: BLE001 - a database outage must not stop the engine
                if not failing:
                    log.warning("fleet: reading the fleet's model failed (%s); retrying", exc)
                failing = True

    async def _watch_device_memory(self) -> None:
        while True:
            self.metrics.update_device_memory(self.settings.resolved_device())
            await asyncio.sleep(5.0)

    # ------------------------------------------------------------------ clients
    def _arriving(self) -> int:
        """Requests the connected front ends are decoding for the engine (arena headers)."""
        return sum(arena.arriving for arena in self._clients.values())

    def _monitor(self, generation: int, predictor: ServedPredictor) -> UncertaintyMonitor:
        from service.engine.drift import UncertaintyMonitor

        monitor = self._monitors.get(generation)
        if monitor is None:
            for old in [g for g in self._monitors if g < generation - 1]:
                del self._monitors[old]
            served = predictor.options(default_abstain_k=self.settings.abstain_k)
            monitor = UncertaintyMonitor(predictor.card.name, predictor.card, self.metrics, served)
            self._monitors[generation] = monitor
            current = self.models.current
            if current is not None and generation != current.info.generation:
                # A batch of a model swapped out before its monitor existed: counted, not exported
                # as the window of a served model.
                monitor.retire(self._successor(monitor))
        return monitor

    def _successor(self, monitor: UncertaintyMonitor) -> UncertaintyMonitor | None:
        """The served model's monitor when it has ``monitor``'s model name (it owns the series it
        exports under that name), else None."""
        current = self.models.current
        if current is None:
            return None
        served = self._monitors.get(current.info.generation)
        return served if served is not None and served.model == monitor.model else None

    def _retire_monitors(self) -> None:
        """After a swap: the monitors of models no longer served stop exporting their windows
        (their gauges read NaN, but for those the served model of the same name exports)."""
        current = self.models.current
        if current is None:
            return
        for generation, monitor in self._monitors.items():
            if generation != current.info.generation and not monitor.retired:
                monitor.retire(self._successor(monitor))

    def _observe(
        self, predictor: ServedPredictor, columns: ScoreColumns, options: ScoreOptions
    ) -> None:
        """Batcher hook (event loop, once per scored group of a batch): the model's uncertainty
        monitor."""
        generation = self.models.generation_of(predictor)
        if generation is not None:
            self._monitor(generation, predictor).observe(columns, options)

    def _export_model_series(self) -> None:
        """Export the served model's series from the start (at 0), not from its first request:
        dashboards and alerts see a value, not an absent series."""
        current = self.models.current
        if current is not None:
            name = current.info.name
            self.metrics.queue_depth.labels(model=name).set(self.batcher.queued_rows_of(name))
            for abstained in ("true", "false"):
                self.metrics.predictions.labels(model=name, abstained=abstained)
            for histogram in (
                self.metrics.queue_wait,
                self.metrics.compute,
                self.metrics.batch_size,
                self.metrics.review_latency,
            ):
                histogram.labels(model=name)
            # Human review: 0 pending (the housekeeping loop keeps it current when the queue is on).
            self.metrics.review_queue_depth.labels(model=name)
            for outcome in ("agree", "disagree", "not_a_digit", "skipped"):
                self.metrics.reviews.labels(model=name, outcome=outcome)
            for status in ("queued", "already_queued", "queue_full", "unavailable", "error"):
                self.metrics.review_enqueued.labels(model=name, status=status)
            self._monitor(current.info.generation, current.predictor)

    def _broadcast_model(self) -> None:
        self._export_model_series()
        self._retire_monitors()
        current = self.models.current
        if current is not None:
            for outbox in list(self._clients):
                outbox.put(0, ModelUpdate(current.info))

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One front end's connection: its hello, then frames of requests until it goes away.

        Scoring requests are queued synchronously (no task per request) and answered through
        the connection's :class:`~service.common.wire.Outbox`; admin commands run as tasks.
        """
        from service.common.shm import Arena

        outbox = Outbox(writer)
        inflight: dict[int, Unit] = {}  # request id -> its batcher unit, until answered
        calls: set[asyncio.Task[None]] = set()
        arena: Arena | None = None
        try:
            (_, hello), *_ = await read_frame(reader)
            if not isinstance(hello, Hello):
                raise ValueError(f"expected Hello, got {type(hello).__name__}")
            arena = Arena(hello.arena, hello.size)
            self._clients[outbox] = arena
            current = self.models.current
            if current is not None:
                outbox.put(0, ModelUpdate(current.info))
            frames = FrameReader(reader)
            while True:
                for request_id, message in await frames.read():
                    if type(message) is InferRequest:  # the per-request path: checked first
                        self._infer(outbox, arena, inflight, request_id, message)
                    elif isinstance(message, Command):
                        task = asyncio.create_task(self._call(outbox, request_id, message))
                        calls.add(task)
                        task.add_done_callback(calls.discard)
                    else:  # answered, so that its sender does not wait in vain
                        log.warning("engine: unexpected message %s", type(message).__name__)
                        self._error(
                            outbox, request_id,
                            ValueError(f"the engine takes no {type(message).__name__} message"),
                        )  # fmt: skip
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front end went away (exit or crash)
        except asyncio.CancelledError:
            pass  # the engine is stopping
        except Exception:
            log.exception("engine: dropping a front-end connection")
        finally:
            self._clients.pop(outbox, None)
            for unit in inflight.values():  # a gone front end's queued requests: never computed
                self.batcher.cancel(unit)
            for task in calls:
                task.cancel()
            outbox.close()
            if arena is not None:
                arena.close()

    def _infer(
        self, outbox: Outbox, arena: Arena, inflight: dict[int, Unit], request_id: int,
        req: InferRequest,
    ) -> None:  # fmt: skip
        """Queue one scoring request; its answer goes into ``outbox`` (a 4xx/5xx as data)."""

        def answer(columns: ScoreColumns | None, error: BaseException | None) -> None:
            inflight.pop(request_id, None)
            if error is None:  # the batcher's contract: columns when there is no error
                assert columns is not None
                # Raw float64 bytes, not the array: pickling a NumPy array costs ~3.4 µs per
                # answer on the event loop, bytes ~0.1 (the front end knows the row count).
                outbox.put_result(request_id, columns.data.tobytes())
            else:
                self._error(outbox, request_id, error)

        try:
            if req.dtype not in DTYPES:
                raise ValueError(f"unsupported input dtype {req.dtype!r}")
            predictor = self.models.predictor_for(req.generation)
            x = arena.array(req.offset, req.dtype, tuple(req.shape))  # numpy: no torch op here
            inflight[request_id] = self.batcher.enqueue(
                predictor, predictor.card.name, x, req.options, req.timeout_s, answer
            )
        except Exception as exc:  # noqa: BLE001 - every request gets exactly one answer
            self._error(outbox, request_id, exc)

    @staticmethod
    def _error(outbox: Outbox, request_id: int, exc: BaseException, what: str = "request") -> None:
        """Answer ``request_id`` with ``exc``, logged only when it is a server fault: an error
        whose row of the error table (:func:`service.common.wire.error_code`, by ``isinstance``)
        is not ``internal``, or a ``ValueError`` (a client's value caught by a check), is an
        answer, not a fault."""
        reply = ErrorReply.of(exc)
        if reply.code is ErrorCode.INTERNAL:
            log.error("engine: %s failed", what, exc_info=exc)
        outbox.put(request_id, reply)

    async def _call(self, outbox: Outbox, request_id: int, command: Command[Answer]) -> None:
        try:
            outbox.put(request_id, await self._dispatch(command))
        except Exception as exc:  # noqa: BLE001
            self._error(outbox, request_id, exc, type(command).__name__)

    async def _dispatch(self, command: Command[Answer]) -> Answer:
        """Run an admin command (what exists once per server; front ends forward it here).

        One case per command type of :data:`~service.common.wire.AdminCommand`; a type with no
        case (a front end newer than its engine) is an :class:`InvalidValue` naming it.
        """
        match command:
            case ReloadModel():
                return self._served(await self.models.reload())
            case PromoteModel(name=name, force=force):
                return await self._promote(self.models.promote(name, force=force))
            case PromoteJob(job_id=job_id, force=force):
                return await self._promote(self._load_job_model(job_id, force))
            case RollbackModel(to=to):
                return self._served(await self.models.rollback(to))
            case ListModelHistory(limit=limit):
                assert self.models.history is not None
                entries = await asyncio.to_thread(self.models.history.entries, limit)
                replicas = await asyncio.to_thread(self.models.history.replicas)
                return HistoryEntries(
                    _json_list(entries), None if replicas is None else _json_list(replicas)
                )
            case SubmitJob(config=config):  # without an architecture: retrain the served model
                served = self.models.current
                job = await asyncio.to_thread(
                    self.jobs.submit, config, served.model_dir if served else None
                )
                return JobRecord(_json(job))
            case ListJobs(limit=limit):
                return JobList(_json_list(await asyncio.to_thread(self.jobs.list, limit)))
            case GetJob(job_id=job_id):
                return JobRecord(_json(await asyncio.to_thread(self.jobs.get, job_id)))
            case CancelJob(job_id=job_id):
                return JobRecord(_json(await asyncio.to_thread(self.jobs.cancel, job_id)))
            case JobLogs(job_id=job_id, tail=tail):
                return JobLog(await asyncio.to_thread(self.jobs.logs, job_id, tail))
            case _:
                raise InvalidValue(
                    f"unknown engine command {type(command).__name__}: this engine does not "
                    "run it (is the front end newer than the engine?)"
                )

    async def _load_job_model(self, job_id: str, force: bool) -> LoadedModel:
        """Load a succeeded job's model through the promote gate (a 409 for any other job)."""
        job = await asyncio.to_thread(self.jobs.get, job_id)
        model_dir = job["model_dir"]
        if job["state"] is not JobState.SUCCEEDED or not model_dir:
            raise Conflict(f"job {job_id} is {job['state']}, not succeeded; nothing to promote")
        return await self.models.load_checked(
            Path(model_dir), "promote_job", gate=True, force=force
        )

    async def _promote(self, loading: Awaitable[LoadedModel]) -> ModelServed | PromoteRefusal:
        """A gated swap's answer (model_manager.ModelManager._gate): a refusal is an answer
        carrying the comparison, which the route turns into a 409 (an ErrorReply carries a
        message only)."""
        from service.engine.model_manager import PromoteRefused

        try:
            loaded = await loading
        except PromoteRefused as exc:
            return PromoteRefusal(exc.message, _json(exc.comparison))
        return self._served(loaded)

    def _served(self, loaded: LoadedModel) -> ModelServed:
        """After a swap: every front end learns the model; the command's answer describes it."""
        self._broadcast_model()
        return ModelServed(_json(loaded.info.description))


def _json(document: Mapping[str, Any]) -> JSONObject:
    """A JSON document the engine built (a job record, a model description) as the wire's type."""
    return cast(JSONObject, document)


def _json_list(documents: Sequence[Mapping[str, Any]]) -> list[JSONObject]:
    """JSON documents the engine built, as the wire's type."""
    return cast(list[JSONObject], documents)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when installed (a dependency), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def engine_main(
    settings: Settings,
    socket_path: str,
    ready: ProcessEvent | None = None,
    inherited: tuple[int, ...] = (),
) -> None:
    """Process entry point: spawned by the supervisor, or forked (``engine_start=fork``) with
    ``inherited``, the supervisor's descriptors it must close."""
    from service.common.process import (
        ENGINE_NAME,
        die_with_parent,
        forget_parent_signals,
        name_process,
    )

    die_with_parent()
    name_process(ENGINE_NAME)
    forget_parent_signals(inherited)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
        force=True,  # forked, the supervisor's logging configuration came along
    )
    try:
        engine = Engine(settings)  # its databases: a failure here is one line too, not a traceback
        # uvloop, as the front ends: the engine's loop handles every request's messages (read,
        # queue, answer), and on plain asyncio it cost ~230 µs of CPU per request at 1,400 req/s.
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(engine.run(socket_path, ready))
    except Exception as exc:
        log.error("vge serve: engine failed: %s: %s", type(exc).__name__, exc)
        sys.exit(1)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
