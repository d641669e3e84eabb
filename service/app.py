"""The FastAPI application factory.

``create_app(settings)`` wires settings, metrics, the model manager and the routes; its lifespan
loads the model, starts the batcher and the training-job manager, and on shutdown drains the
batcher (queued and in-flight requests finish) and stops running jobs.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.batcher import Batcher
from service.deps import ServiceState
from service.errors import install_error_handlers
from service.jobs import JobManager
from service.metrics import Metrics
from service.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from service.model_manager import ModelManager
from service.routes import health, jobs, models, predict, v2
from service.settings import Settings

log = logging.getLogger("vge.service")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start-up: load model, start batcher and jobs. Shutdown: drain, stop jobs."""
    state: ServiceState = app.state.service
    settings = state.settings
    threads = settings.resolved_torch_threads()
    if threads:
        import torch

        torch.set_num_threads(threads)
    state.decode_pool = ThreadPoolExecutor(settings.decode_workers, thread_name_prefix="vge-decode")
    try:
        model = await state.models.load_initial()
    except Exception as exc:
        log.error("vge serve: cannot load the model: %s: %s", type(exc).__name__, exc)
        raise
    state.batcher = Batcher(
        max_batch_size=settings.max_batch_size,
        max_delay_s=settings.max_queue_delay_s,
        max_queue_length=settings.max_queue_length,
        metrics=state.metrics,
        wait_always=settings.batch_wait == "always",
    )
    state.batcher.start()
    state.jobs = JobManager(settings, state.metrics)
    await asyncio.to_thread(state.jobs.start)
    print(
        f"vge serve: model {model.name} {model.version} on {model.device} "
        f"(max batch {settings.max_batch_size}, max delay {settings.max_queue_delay_ms:g} ms, "
        f"queue {settings.max_queue_length}); listening on http://{settings.host}:{settings.port}",
        file=sys.stderr,
        flush=True,
    )
    # Move everything allocated at start-up (torch, the model, the app) out of the cyclic GC's
    # reach, so full collections under load stay short instead of pausing every request.
    gc.collect()
    gc.freeze()
    state.started = True
    try:
        yield
    finally:
        state.draining = True
        grace = settings.shutdown_grace_s
        if state.drain_started is not None:  # uvicorn already spent part of it on connections
            grace = max(1.0, grace - (time.monotonic() - state.drain_started))
        await state.batcher.drain(grace)
        await asyncio.to_thread(state.jobs.shutdown)
        state.decode_pool.shutdown(wait=False, cancel_futures=True)
        log.info("vge serve: shut down cleanly")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app for ``settings`` (default: from the environment)."""
    settings = settings or Settings()
    metrics = Metrics()
    app = FastAPI(
        title="vge-serve",
        summary="Variance-Gated Ensembles: predictions with VGMU, TU/AU/EU and abstention.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.service = ServiceState(settings, metrics, ModelManager(settings, metrics))
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_payload_bytes, metrics=metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    for module in (health, predict, models, jobs, v2):
        app.include_router(module.router)
    return app
