"""A front-end process: FastAPI on uvicorn (uvloop + httptools) on its own ``SO_REUSEPORT`` listener.

Front ends parse HTTP, decode images into their shared-memory arena and encode responses; the
engine does the rest. The supervisor forks them after importing torch, torchvision and the app,
so their code pages are shared (see docs/architecture.md for the measured per-worker memory).

Drain on SIGTERM/SIGINT (:class:`FrontendServer`): readiness turns false at once; for ``drain_s``
the front end keeps answering, marking every response ``Connection: close``; then it stops
accepting, finishes the requests it holds (``shutdown_grace_s`` at most) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from service.common.settings import Settings
from service.common.shm import Arena
from service.frontend.app import asgi_app, create_app
from service.frontend.deps import ServiceState
from service.frontend.engine_client import EngineClient


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


#: uvicorn's fast paths when installed (they are dependencies; h11/asyncio are the fallback).
LOOP = "uvloop" if _has("uvloop") else "asyncio"
HTTP = "httptools" if _has("httptools") else "h11"


def http_protocol(settings: Settings) -> type[asyncio.Protocol] | str:
    """The HTTP protocol a front end's uvicorn runs: httptools with the service's changes
    (:mod:`service.frontend.http_protocol`: JSON 400 for non-HTTP bytes, lingering close, a 408 for
    stalled or slow clients, a 431 for heads over ``max_header_bytes``, a 503 past
    ``max_connections``), else h11 (uvicorn's own limits only: the images install httptools)."""
    if HTTP != "httptools":
        return HTTP
    from service.frontend.http_protocol import FrontendHttpProtocol

    return FrontendHttpProtocol.configured(
        client_timeout_s=settings.client_timeout_s,
        head_timeout_s=settings.head_timeout_s,
        body_min_rate=settings.body_min_rate,
        max_head_bytes=settings.max_header_bytes,
        max_connections=settings.max_connections,
    )


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` with ``SO_REUSEPORT``, not listening yet.

    The supervisor binds one per front end to the server's port; the kernel spreads new
    connections evenly over those that listen (Linux). The front end's uvicorn calls ``listen()``
    after the app's start-up, i.e. once the engine link is up, so a starting front end is sent no
    connection it cannot serve.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


#: How long a stopping front end waits, at most, for the requests of connections it accepted and
#: has not had a request head from yet (FrontendServer.shutdown): new connections, part-way heads.
REQUEST_WAIT_S = 2.0


class FrontendServer(uvicorn.Server):
    """uvicorn.Server that drains for ``drain_s`` before shutting down; exits 0 on SIGTERM."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: start draining (not ready, Connection: close); a 2nd SIGINT forces."""
        if self.state.drain_started is not None and sig == signal.SIGINT:
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        if self.state.drain_started is None:
            self.state.drain_started = time.monotonic()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting first; wait until every accepted connection whose request may still be
        on its way has delivered its head (at most :data:`REQUEST_WAIT_S`), so that request is
        answered, not cut; then uvicorn's own graceful shutdown, which closes idle connections and
        finishes the requests in hand. The listener stays open in the supervisor, which answers
        what is still queued on it 503.

        A fixed 0.2 s wait lost requests on a loaded box: a client that connected just before
        the listener closed but wrote its request later than that (its process starved of CPU:
        3 pytest workers on 2 cores) had its connection closed as idle under the request, a
        reset where an answer was due (tests/service/system/test_processes.py, 5 of 16 clients).
        """
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + REQUEST_WAIT_S
        while True:
            await asyncio.sleep(0.02)
            if time.monotonic() >= deadline or not any(
                getattr(c, "request_on_its_way", False) for c in self.server_state.connections
            ):
                break
        await super().shutdown(sockets)

    async def on_tick(self, counter: int) -> bool:
        started = self.state.drain_started
        if started is not None and time.monotonic() - started >= self.state.settings.drain_s:
            self.should_exit = True
        return await super().on_tick(counter)


def frontend_server(
    settings: Settings, engine: EngineClient, *, configure_logging: bool = True
) -> FrontendServer:
    """A front end's server: the app of ``settings`` talking to ``engine``, behind
    :func:`asgi_app`, on uvicorn with the service's protocol; ``run(sockets=[...])`` serves it.
    ``configure_logging=False`` leaves the process's logging configuration alone (a front end
    embedded in another process: the tests' in-process server)."""
    app = create_app(settings, engine)
    config = uvicorn.Config(
        asgi_app(app),
        loop=LOOP,
        http=http_protocol(settings),
        log_level=settings.log_level,
        log_config=uvicorn.config.LOGGING_CONFIG if configure_logging else None,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
        access_log=False,
        lifespan="on",
    )
    return FrontendServer(config, app.state.service)


def frontend_main(
    settings: Settings, sock: socket.socket, engine_socket: str, arena_path: str, arena_size: int
) -> None:
    """Process entry point (forked by the supervisor)."""
    from service.common.process import (
        FRONTEND_NAME,
        die_with_parent,
        forget_parent_signals,
        name_process,
    )

    die_with_parent()
    name_process(FRONTEND_NAME)
    forget_parent_signals()  # the supervisor's handlers and wake-up socket came with the fork
    import torch

    torch.set_num_threads(1)  # decoding parallelism comes from processes, not intra-op threads
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[frontend]: %(message)s",
    )
    server = frontend_server(settings, EngineClient(engine_socket, Arena(arena_path, arena_size)))
    server.run(sockets=[sock])
    if not server.started:  # start-up failed (uvicorn logged why): an error status, so the
        raise SystemExit(3)  # supervisor tells a failing front end from a killed one
