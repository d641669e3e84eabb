"""``vge serve``'s process tree: one supervisor, N front ends, one engine per device.

::

    supervisor (this module: binds the port, starts, watches, restarts, drains)
    ├── engine        spawned (forked with engine_start=fork on a CPU); model + batcher + forward
    │                 + scoring + training jobs (engine.py)
    ├── front end 0   forked; uvicorn on its own SO_REUSEPORT listener; parse, decode, respond
    ├── ...           (frontend.py)
    └── front end N-1

* The supervisor binds one listener per front end, all on the server's port with
  ``SO_REUSEPORT``; a front end listens on its own once its engine link is up, and the kernel
  spreads new connections evenly over the listeners. (One shared listening socket let whichever
  front end woke first accept a whole burst: 30/32/2/0 of 64 connections over four front ends,
  measured.) The supervisor keeps every listener open, so connections queued on one whose front
  end died wait for its replacement instead of being reset. Front ends are forked after torch,
  torchvision and the app are imported, so those pages are shared; the engine is spawned so CUDA
  starts in a clean process (``engine_start=fork``, CPU only: forked too, from what the
  supervisor has imported).
* Each front end gets a shared-memory arena (:mod:`service.common.shm`) created here, so a restarted
  front end finds its arena and the engine never maps a file that vanished.
* Faults: a front end or the engine that dies (even ``kill -9``) is restarted. Requests caught in
  flight are answered 503 by the surviving side (:mod:`service.frontend.engine_client`); ``/readyz`` is
  503 until the engine is back. An engine that cannot start (a broken model) stops the server
  with exit code 1 and its message.
* Drain (SIGTERM or SIGINT): front ends turn not-ready at once and keep answering for
  ``drain_s`` with ``Connection: close``; then they stop accepting and finish what they hold; the
  supervisor answers any connection still waiting in the listen backlogs with 503
  (:mod:`service.backlog`: it reads the request head first and closes lingering, so no reset
  destroys the answer), so every request that reached the server gets an HTTP answer; then it
  stops the engine (which computes what it holds) and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from service.backlog import answer_queued
from service.common.process import host_port
from service.common.settings import Settings

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, ForkProcess, SpawnContext, SpawnProcess
    from multiprocessing.synchronize import Event as ProcessEvent
    from types import FrameType

    from service.common.metrics import Metrics

log = logging.getLogger("vge.supervisor")

_Child = TypeVar("_Child", bound=BaseProcess)  # a spawned or forked child, started by _start

#: An engine that dies this many times in a row without becoming ready stops the server.
MAX_ENGINE_FAILURES = 3
#: A front end that fails this many times in a row, each time within FRONTEND_SETTLE_S of its
#: start and with an error status (not killed by a signal: an OOM kill caused by a request is no
#: reason to stop the server), is failing at start-up: the server stops instead of restarting it
#: twice a second for good.
MAX_FRONTEND_FAILURES = 5
FRONTEND_SETTLE_S = 10.0
ENGINE_START_TIMEOUT_S = 600.0


def _probe_bind(host: str, port: int) -> None:
    """Bind ``(host, port)`` without SO_REUSEPORT and let go: ``OSError`` (address in use) when
    anything listens there, which a SO_REUSEPORT listener of ours would silently share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


class Supervisor:
    """Starts, watches and stops the engine and the front ends."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.engine_socket = str(workdir / "engine.sock")
        self.n_workers = settings.resolved_workers()
        self.arena_size = settings.shm_mb_per_worker * 1024 * 1024
        self.arenas: list[str] = []
        self.listeners: list[socket.socket] = []
        self.port = 0
        self.engine: SpawnProcess | ForkProcess | None = None
        self.engine_ready: ProcessEvent | None = None
        self.frontends: list[ForkProcess] = []
        self._stopping = False
        self._spawn = mp.get_context("spawn")
        self._fork = mp.get_context("fork")
        self._metrics: Metrics | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None  # signal wake-up (run)

    # ------------------------------------------------------------------ start
    def bind(self) -> int:
        """Bind one listener per front end to the port (port 0 picks one); returns the port.

        Not listening yet: each front end listens on its own once it can serve
        (:func:`service.frontend.server.reuseport_socket`).
        """
        from service.frontend.server import reuseport_socket

        host, port = self.settings.host, self.settings.port
        if port:  # SO_REUSEPORT would share a port another server listens on: refuse that instead
            _probe_bind(host, port)
        first = reuseport_socket(host, port)
        self.port = int(first.getsockname()[1])
        self.listeners = [first] + [
            reuseport_socket(host, self.port) for _ in range(self.n_workers - 1)
        ]
        return self.port

    def check_grpc(self) -> str | None:
        """Why the gRPC service cannot start (``VGE_GRPC_PORT`` set), else None. Checked before any
        process starts: a front end that cannot start it fails its start-up, and restarting it
        would fail the same way, twice a second."""
        settings = self.settings
        if not settings.grpc_port:
            return None
        try:
            import grpc  # noqa: F401
            from tritonclient.grpc import service_pb2_grpc  # noqa: F401
        except ImportError:
            return "VGE_GRPC_PORT is set but gRPC support is not installed: pip install 'vge-serve[grpc]'"
        try:
            _probe_bind(settings.host, settings.grpc_port)
        except OSError as exc:
            return (
                f"cannot listen on {settings.host}:{settings.grpc_port} for gRPC "
                f"(VGE_GRPC_PORT): {exc.strerror}"
            )
        return None

    def make_arenas(self) -> None:
        from service.common.process import hold, remove_stale
        from service.common.shm import ARENA_PATTERN, new_arena_file, shm_dir

        remove_stale(shm_dir(), ARENA_PATTERN)  # left by servers killed with SIGKILL
        for i in range(self.n_workers):  # O_EXCL, 0600, random names (service.common.shm)
            path = new_arena_file(self.arena_size, f"{os.getpid()}-{i}")
            hold(path)  # locked while this server lives: no other server removes it
            self.arenas.append(str(path))

    def start_engine(self) -> None:
        """Start the engine: spawned (a fresh interpreter; CUDA needs one), or forked with
        ``engine_start=fork`` on a CPU, from what this process has imported already."""
        from service.engine.engine import engine_main

        ctx: SpawnContext | ForkContext = self._spawn
        inherited: tuple[int, ...] = ()  # a spawned child gets no descriptor it was not given
        if self.settings.engine_start == "fork":
            # What a forked engine must not keep: the listeners (a copy held open would queue
            # connections nobody answers after the drain closed them) and the wake-up socket.
            ctx = self._fork
            inherited = tuple(s.fileno() for s in [*self.listeners, *(self._wake or ())])
        self.engine_ready = ctx.Event()
        self.engine = self._start(
            ctx.Process(
                target=engine_main,
                args=(self.settings, self.engine_socket, self.engine_ready, inherited),
                name="vge-engine",
            )
        )

    def start_frontend(self, index: int) -> ForkProcess:
        from service.frontend.server import frontend_main

        return self._start(
            self._fork.Process(
                target=frontend_main,
                args=(
                    self.settings,
                    self.listeners[index],
                    self.engine_socket,
                    self.arenas[index],
                    self.arena_size,
                ),
                name=f"vge-frontend-{index}",
            )
        )

    @staticmethod
    def _start(proc: _Child) -> _Child:
        """Start ``proc`` with SIGTERM and SIGINT blocked: they wait until the child has dropped
        the handlers and wake-up socket a fork brings along (:func:`service.common.process.
        forget_parent_signals`); a signal in between would run the supervisor's handler in it."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return proc

    def wait_engine_ready(self) -> bool:
        """Block until the engine is ready (True) or died (False)."""
        engine, ready = self.engine, self.engine_ready
        assert engine is not None and ready is not None, "start_engine() first"
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping:
            if ready.wait(0.1):
                return True
            if not engine.is_alive():
                return False
        return ready.is_set()

    # ------------------------------------------------------------------ run
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # A signal also writes a byte here, which ends the wait below at once: the front ends
        # turn not-ready as soon as the supervisor is signalled, not up to a poll interval later.
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)
        # held since the start (module run()): one that came meanwhile is handled now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        if self._stopping:
            return 0
        self.start_engine()
        # Import what front ends run before forking them, so the pages stay shared (copy-on-write);
        # while the engine starts: the two imports (~2.4 s each, torch and torchvision) then run
        # side by side instead of one after the other (a ready server 10.4 -> 6.6-8.1 s on the
        # 2-core box, with the engine's other imports cut; docs/benchmarks.md, "Start-up").
        import service.frontend.server  # noqa: F401

        if not self.wait_engine_ready():
            if self._stopping:
                self._stop_engine()
                return 0
            print(  # the model, the device or the settings: a configuration error
                "vge serve: error: the engine failed to start (see the log above)", file=sys.stderr
            )
            return 2
        from service.common.metrics import Metrics

        self._metrics = Metrics()
        self.frontends = []  # filled one by one: cleanup() stops those started if one fails
        for i in range(self.n_workers):
            self.frontends.append(self.start_frontend(i))
        print(
            f"vge serve: {self.n_workers} front end(s) + 1 engine; listening on "
            f"http://{host_port(self.settings.host, self.port)}",
            file=sys.stderr,
            flush=True,
        )
        engine_failures = 0
        assert self.engine is not None  # started above (and restarted below)
        started = [time.monotonic()] * self.n_workers  # per front end: when it last started
        early_deaths = [0] * self.n_workers  # in a row, each within FRONTEND_SETTLE_S of its start
        while not self._stopping:
            sentinels = [p.sentinel for p in [self.engine, *self.frontends]]
            if self._wake[0] in wait([*sentinels, self._wake[0]], timeout=0.2):
                with contextlib.suppress(BlockingIOError):
                    self._wake[0].recv(4096)  # consumed: the flag set by the handler says what
            if self._stopping:
                break
            for i, proc in enumerate(self.frontends):
                if not proc.is_alive():
                    log.error("front end %d (pid %d) died (%s); restarting", i, proc.pid,
                              proc.exitcode)  # fmt: skip
                    self._dead(proc.pid, "frontend")
                    early = time.monotonic() - started[i] < FRONTEND_SETTLE_S
                    failed = (proc.exitcode or 0) > 0  # < 0: killed by a signal
                    early_deaths[i] = early_deaths[i] + 1 if early and failed else 0
                    if early_deaths[i] >= MAX_FRONTEND_FAILURES:
                        print(f"vge serve: error: front end {i} keeps failing at start-up (see "
                              "the log above); stopping", file=sys.stderr)  # fmt: skip
                        self._stopping = True
                        self._shutdown()
                        return 1
                    self.frontends[i] = self.start_frontend(i)
                    started[i] = time.monotonic()
            if not self.engine.is_alive():
                log.error("engine (pid %d) died (%s); restarting", self.engine.pid,
                          self.engine.exitcode)  # fmt: skip
                self._dead(self.engine.pid, "engine")
                self.start_engine()
                if self.wait_engine_ready():
                    engine_failures = 0
                else:
                    engine_failures += 1
                    if engine_failures >= MAX_ENGINE_FAILURES:
                        print("vge serve: error: the engine keeps failing; stopping",
                              file=sys.stderr)  # fmt: skip
                        self._stopping = True
                        self._shutdown()
                        return 1
        self._shutdown()
        return 0

    def _dead(self, pid: int | None, role: str) -> None:
        from prometheus_client import multiprocess

        if pid is not None:
            multiprocess.mark_process_dead(pid)
        if self._metrics is not None:
            self._metrics.worker_restarts.labels(role=role).inc()

    # ------------------------------------------------------------------ stop
    def _shutdown(self) -> None:
        s = self.settings
        for proc in self.frontends:
            if proc.pid is not None and proc.is_alive():  # a pid: started
                os.kill(proc.pid, signal.SIGTERM)
        # The engine at once too: it keeps serving the draining front ends until they disconnect,
        # but stops waiting for fuller batches, so the shutdown never waits out a batch window.
        engine = self.engine
        if engine is not None and engine.pid is not None and engine.is_alive():
            os.kill(engine.pid, signal.SIGTERM)
        deadline = time.monotonic() + s.drain_s + s.shutdown_grace_s + 5
        for proc in self.frontends:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("front end pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.join(5)
        self._answer_backlogs()
        self._stop_engine()

    def _answer_backlogs(self) -> None:
        """503 every connection still queued on the listeners, then close them (service.backlog)."""
        listeners, self.listeners = self.listeners, []
        answered = answer_queued(listeners)
        if answered:
            log.info("answered %d queued connection(s) 503 at shutdown", answered)

    def _stop_engine(self) -> None:
        engine = self.engine
        if engine is not None and engine.pid is not None and engine.is_alive():
            os.kill(engine.pid, signal.SIGTERM)
            engine.join(self.settings.shutdown_grace_s + 15)
            if engine.is_alive():
                engine.kill()
                engine.join(5)

    def cleanup(self) -> None:
        # After a normal stop every child has exited; after an error in run(), none may outlive
        # the supervisor (multiprocessing's exit hook would wait on them for good).
        for proc in [*self.frontends, *([self.engine] if self.engine is not None else [])]:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self._wake is not None:
            signal.set_wakeup_fd(-1)
            for end in self._wake:
                end.close()
        for path in self.arenas:
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.workdir, ignore_errors=True)


#: The supervisor's work directory (``vge-serve-<random>``), as
#: :func:`service.common.process.remove_stale` finds those of servers killed with SIGKILL.
WORKDIR_PATTERN = re.compile(r"vge-serve-[A-Za-z0-9_]+")


def run(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
    from service.common.process import LOCK_NAME, hold, mark_supervisor, remove_stale

    # SIGTERM/SIGINT held from here until Supervisor.run takes them (its handlers): one sent while
    # the server starts (binding imports torch and the app, seconds) ends it cleanly, exit 0 and
    # nothing left behind, instead of killing it half-made (-15, its work directory leaked).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    mark_supervisor()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # held locked while this server lives: the next one removes it if this one is killed
    remove_stale(Path(tempfile.gettempdir()), WORKDIR_PATTERN)
    workdir = Path(tempfile.mkdtemp(prefix="vge-serve-"))
    (workdir / LOCK_NAME).touch(mode=0o600)
    hold(workdir / LOCK_NAME)
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    # Before anything imports prometheus-client: every process of this server writes its
    # samples here (multiprocess mode, see service/common/metrics.py).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    if "prometheus_client" in sys.modules:  # imported early (e.g. embedding): re-resolve its values
        from prometheus_client import values

        values.ValueClass = values.get_value_class()
    supervisor = Supervisor(settings, workdir)
    problem = supervisor.check_grpc()
    if problem is not None:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"vge serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        supervisor.bind()
    except OSError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        print(
            f"vge serve: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 2
    try:
        supervisor.make_arenas()
        return supervisor.run()
    finally:
        supervisor.cleanup()
