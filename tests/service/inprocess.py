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
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.common.settings import Settings

#: The server log's format: the engine's and the front ends' (service/engine/engine.py).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(threadName)s]: %(message)s"


class InProcessServer:
    """An engine and a front end of ``settings`` on two threads of this process; started by
    :meth:`start`, stopped by :meth:`stop` (the engine drains what it holds, as on SIGTERM)."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.url = ""
        # The supervisor's private directory of a `vge serve` run: the engine's socket and its
        # "engine-started" marker (a new directory: a new run, where an explicit model wins).
        self.rundir = Path(tempfile.mkdtemp(prefix="vge-inproc-"))
        self._log = io.StringIO()
        self._handler = logging.StreamHandler(self._log)
        self._handler.setFormatter(logging.Formatter(LOG_FORMAT))
        self._handler.setLevel(settings.log_level.upper())
        self._engine_loop: asyncio.AbstractEventLoop | None = None
        self._engine_stop: asyncio.Event | None = None
        self._engine_error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float = 90) -> InProcessServer:
        """Start the engine, then the front end; return once ``/readyz`` says 200."""
        from service.common.shm import Arena, new_arena_file
        from service.engine.engine import Engine
        from service.frontend.engine_client import EngineClient
        from service.frontend.server import frontend_server, reuseport_socket

        logging.getLogger().addHandler(self._handler)
        socket_path = str(self.rundir / "engine.sock")
        engine = Engine(self.settings)
        self.engine = engine
        ready = threading.Event()

        def run_engine() -> None:
            from service.engine.engine import _loop_factory

            try:
                with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                    self._engine_loop = runner.get_loop()
                    self._engine_stop = asyncio.Event()
                    runner.run(engine.run(socket_path, ready, stop=self._engine_stop))
            except BaseException as exc:  # reported by start() and stop()
                self._engine_error = exc
                ready.set()

        self._spawn(run_engine, "engine")
        deadline = time.monotonic() + timeout_s
        if not ready.wait(timeout_s) or self._engine_error is not None:
            self._detach()
            raise RuntimeError(f"the engine did not start: {self._engine_error!r}\n{self.log()}")

        size = self.settings.shm_mb_per_worker * 1024 * 1024
        self.arena_path = new_arena_file(size, "inproc", base=self.rundir)
        client = EngineClient(socket_path, Arena(self.arena_path, size))
        self.frontend = frontend_server(self.settings, client, configure_logging=False)
        sock = reuseport_socket(self.settings.host, 0)
        port = sock.getsockname()[1]
        self._spawn(lambda: self.frontend.run(sockets=[sock]), "frontend")
        self.url = f"http://{self.settings.host}:{port}"
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            if not all(t.is_alive() for t in self._threads):
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the in-process server was not ready:\n{self.log()}")

    def _spawn(self, target: object, role: str) -> None:
        thread = threading.Thread(target=target, name=f"vge-{role}", daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ what tests read
    def client(self, **kw: object) -> httpx.Client:
        """An HTTP client of this server (as :meth:`tests.service.conftest.Server.client`)."""
        kw.setdefault("limits", httpx.Limits(keepalive_expiry=2.0))
        return httpx.Client(base_url=self.url, timeout=30, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        """What the server logged (the engine's and the front end's records, this run only)."""
        return self._log.getvalue()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` matching ``labels`` over the front end's and the
        engine's registries: what ``/metrics`` shows for a tree, where every process writes to
        one multiprocess directory."""
        total = 0.0
        for metrics in (self.frontend.state.metrics, self.engine.metrics):
            text = metrics.render().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == name and all(
                        sample.labels.get(k) == v for k, v in labels.items()
                    ):
                        total += sample.value
        return total

    # ------------------------------------------------------------------ stop
    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Stop as ``vge serve`` does on SIGTERM: the front end drains and goes, then the engine
        computes what it holds and goes. 0 when both ended cleanly, 1 otherwise. Only SIGTERM is
        meant: a test of SIGKILL needs a real process tree."""
        if sig != signal.SIGTERM:
            raise ValueError("an in-process server stops as on SIGTERM; use a tree for signals")
        if not self._threads:
            return 0
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            frontend.should_exit = True
        for thread in self._threads[1:]:
            thread.join(timeout)
        if self._engine_loop is not None and self._engine_stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                self._engine_loop.call_soon_threadsafe(self._engine_stop.set)
        self._threads[0].join(timeout)
        clean = not any(t.is_alive() for t in self._threads) and self._engine_error is None
        self._detach()
        return 0 if clean else 1

    def _detach(self) -> None:
        """Undo what the run did to this process: the log handler, the frozen GC generation (the
        engine and the front end freeze their start-up objects, meant for a process of their
        own), the run directory."""
        logging.getLogger().removeHandler(self._handler)
        gc.unfreeze()
        self._threads = []
        shutil.rmtree(self.rundir, ignore_errors=True)
