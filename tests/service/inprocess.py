"""An in-process ``vge serve`` for the functional tests (issue 35, item 5).

A real server tree (:func:`tests.service.conftest.start_server`) costs a fork of the supervisor, a
forked engine and front end, each process's start-up, and ~2–6 s of a 2-core box's time. Tests of
what a request does (answers, errors, the OpenAPI contract, the review page, gRPC, Triton's
clients) need the real request path, not the real processes. Here it is, in this process:

* the :class:`~service.engine.engine.Engine` on its own thread and event loop, listening on its
  Unix socket as in ``vge serve`` (its ``stop`` event replaces SIGTERM, which belongs to a
  process's main thread);
* one front end, built as :func:`service.frontend.server.frontend_main` builds it — an
  :class:`~service.frontend.engine_client.EngineClient` over a shared-memory arena, the app
  behind :func:`~service.frontend.app.asgi_app`, the service's httptools protocol — served by
  :class:`~service.frontend.server.FrontendServer` (uvicorn) on its own thread, on a loopback
  port the kernel picks.

The tests talk to it over real HTTP (and gRPC), exactly as to a tree: :class:`InProcessServer`
has :class:`~tests.service.conftest.Server`'s ``url``, ``client``, ``log``, ``metric`` and
``stop``. What needs real processes stays on trees: signals, the drain, crash recovery, the
supervisor, ``SO_REUSEPORT`` across front ends, the fleet, the umask, the CLI's own checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import logging
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.common.settings import Settings

if TYPE_CHECKING:
    from service.frontend.server import FrontendServer

#: The server log's format: the engine's and the front ends' (service/engine/engine.py).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(threadName)s]: %(message)s"


def sample_sum(exposition: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``, in a Prometheus text
    exposition (a ``/metrics`` page)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class InProcessServer:
    """An engine and a front end of ``settings`` on two threads of this process; started by
    :meth:`start`, stopped by :meth:`stop` (the front end drains, then the engine computes what
    it holds, as on SIGTERM).

    Differences from a tree that a test must not rely on: ``/metrics`` and V2's statistics over
    HTTP show the front end's registry only (:meth:`metric` reads both); :meth:`log` holds the
    log records of the whole process while the server runs (a tree's log also has the lines its
    processes print); one front end, whatever ``workers`` says."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.url = ""
        # The supervisor's private directory of a `vge serve` run: the engine's socket and its
        # "engine-started" marker (a new directory: a new run, where an explicit model wins).
        self.rundir = Path(tempfile.mkdtemp(prefix="vge-inproc-"))
        self._log = io.StringIO()
        self._handlers = [logging.StreamHandler(self._log), logging.FileHandler(log_path)]
        for handler in self._handlers:
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            handler.setLevel(settings.log_level.upper())
        self._root_level = logging.getLogger().level
        self._engine_loop: asyncio.AbstractEventLoop | None = None
        self._engine_stop: asyncio.Event | None = None
        self._errors: dict[str, BaseException] = {}
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        self._torch_threads = 0
        self.frontend: FrontendServer | None = None
        self._stopped = False

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float = 90) -> InProcessServer:
        """Start the engine, then the front end; return once ``/readyz`` says 200. A start that
        fails part-way stops what it started before it raises."""
        import torch

        root = logging.getLogger()
        for handler in self._handlers:
            root.addHandler(handler)
        root.setLevel(min(self._root_level or logging.WARNING, self._handlers[0].level))
        self._torch_threads = torch.get_num_threads()  # the engine sets this process's
        try:
            self._start(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, deadline: float) -> None:
        from service.common.shm import Arena, new_arena_file
        from service.engine.engine import Engine, _loop_factory
        from service.frontend.engine_client import EngineClient
        from service.frontend.server import frontend_server, reuseport_socket

        socket_path = str(self.rundir / "engine.sock")
        engine = self.engine = Engine(self.settings)
        ready = threading.Event()

        def run_engine() -> None:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                self._engine_loop = runner.get_loop()
                self._engine_stop = asyncio.Event()
                runner.run(engine.run(socket_path, ready, stop=self._engine_stop))

        engine_thread = self._spawn(run_engine, "engine")
        while not ready.wait(0.05):  # ready, or the thread ended (its error kept by _spawn)
            if not engine_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start: {self._errors}\n{self.log()}")

        size = self.settings.shm_mb_per_worker * 1024 * 1024
        arena = Arena(new_arena_file(size, "inproc", base=self.rundir), size)
        frontend = self.frontend = frontend_server(
            self.settings, EngineClient(socket_path, arena), configure_logging=False
        )
        sock = self._sock = reuseport_socket(self.settings.host, 0)
        self.url = f"http://{self.settings.host}:{sock.getsockname()[1]}"

        def run_frontend() -> None:
            frontend.run(sockets=[sock])
            if not frontend.started:  # uvicorn logged why and returned (a tree's exit status 3)
                raise RuntimeError("the front end did not start")

        self._spawn(run_frontend, "frontend")
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            if self._errors or not all(t.is_alive() for t in self._threads):
                break
            time.sleep(0.05)
        raise RuntimeError(f"the in-process server was not ready: {self._errors}\n{self.log()}")

    def _spawn(self, target: Callable[[], None], role: str) -> threading.Thread:
        """Run ``target`` on a thread of its own; what it raises is kept for start and stop."""

        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self._errors[role] = exc

        thread = threading.Thread(target=run, name=f"vge-{role}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    # ------------------------------------------------------------------ what tests read
    def client(self, **kw: object) -> httpx.Client:
        """An HTTP client of this server (as :meth:`tests.service.conftest.Server.client`)."""
        kw.setdefault("limits", httpx.Limits(keepalive_expiry=2.0))
        return httpx.Client(base_url=self.url, timeout=30, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        """What was logged while the server ran (its engine's and front end's records)."""
        return self._log.getvalue()

    def metric(self, name: str, **labels: str) -> float:
        """:func:`sample_sum` over the front end's and the engine's registries, as a tree's
        ``/metrics`` sums counters, histograms and ``livesum`` gauges over its processes. A gauge
        that both processes set and a tree aggregates otherwise (``vge_review_store_up``:
        ``livemin``) reads the sum here: test it on a tree."""
        assert self.frontend is not None, "the server is not started"
        registries = (self.frontend.state.metrics.registry, self.engine.metrics.registry)
        # generate_latest, not Metrics.render: no device-memory update as a side effect
        return sum(sample_sum(generate_latest(r).decode(), name, **labels) for r in registries)

    # ------------------------------------------------------------------ stop
    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Stop as ``vge serve`` does on SIGTERM: the front end drains and goes, then the engine
        computes what it holds and goes. 0 when both started and ended cleanly, 1 otherwise
        (the errors are in :attr:`errors`). A test of SIGKILL needs a real process tree."""
        if sig != signal.SIGTERM:
            raise ValueError("an in-process server stops as on SIGTERM; use a tree for signals")
        if self._stopped:
            return 1 if self._errors else 0
        if self.frontend is not None:
            self.frontend.handle_exit(signal.SIGTERM, None)  # drains for drain_s, then exits
        for thread in self._threads[1:]:
            thread.join(timeout)
        if self._engine_loop is not None and self._engine_stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                self._engine_loop.call_soon_threadsafe(self._engine_stop.set)
        if self._threads:
            self._threads[0].join(timeout)
        clean = not any(t.is_alive() for t in self._threads) and not self._errors
        self._detach()
        return 0 if clean else 1

    @property
    def errors(self) -> dict[str, BaseException]:
        """What the engine's or the front end's thread raised, by role."""
        return dict(self._errors)

    def _detach(self) -> None:
        """Undo what the run did to this process: the log handlers and level, the engine's torch
        thread count, the frozen GC generation (the engine and the front end freeze their
        start-up objects, meant for a process of their own), the listener, the run directory."""
        import torch

        root = logging.getLogger()
        for handler in self._handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(self._root_level)
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        gc.unfreeze()
        if self._sock is not None:
            self._sock.close()
        self._stopped = True
        shutil.rmtree(self.rundir, ignore_errors=True)
