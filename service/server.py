"""Run the app on uvicorn with a graceful SIGTERM drain.

On SIGTERM/SIGINT: readiness turns false and the batcher admits nothing new (503 + Retry-After),
uvicorn stops accepting connections and waits up to ``shutdown_grace_s`` for in-flight requests;
then the lifespan drains whatever is still queued and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from service.app import create_app
from service.deps import ServiceState
from service.settings import Settings


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that marks the app draining before shutting down; exits 0 on SIGTERM."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: begin draining (not ready, admit nothing), then let uvicorn shut down."""
        self.state.draining = True
        if self.state.drain_started is None:
            self.state.drain_started = time.monotonic()
        if self.state.batcher is not None:
            self.state.batcher.stop_admitting()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def run(settings: Settings) -> None:
    """Serve until SIGTERM/SIGINT."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
        access_log=False,
        lifespan="on",
    )
    GracefulServer(config, app.state.service).run()
