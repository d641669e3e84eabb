"""The FastAPI application of one front-end process.

``create_app(settings, engine)`` wires settings, metrics, the engine connection and the routes; its
lifespan starts the connection to the engine and the decode thread pool. uvicorn serves
``asgi_app(app)``: :class:`ServingMiddleware` (body cap, metrics, drain, arrival count) around
:class:`DirectDispatch` (the scoring routes straight to their endpoints) around the app. The request path of
``/v1/predict`` reads in one sitting: parse (routes/predict.py) → the one scoring path of every
protocol (pipeline.py: options, decode into shared memory, the engine batches, runs and scores,
the review queue) → encode (routes/predict.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp

from service.common.metrics import Metrics
from service.common.review_connection import watch as review_watch
from service.common.review_store import open_review_store
from service.common.settings import Settings
from service.frontend.deps import ServiceState
from service.frontend.engine_client import EngineClient
from service.frontend.error_handlers import install_error_handlers, resource_table, route_template
from service.frontend.middleware import ServingMiddleware
from service.frontend.routes import health, jobs, models, predict, reviews, v2
from service.frontend.routes.direct import DirectDispatch
from service.frontend.routes.schemas import error_responses

log = logging.getLogger("vge.service")


#: How long a starting front end waits for its engine link before it accepts connections anyway.
STARTUP_ENGINE_WAIT_S = 10.0


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start-up: connect to the engine, start the decode pool. Shutdown: disconnect."""
    state: ServiceState = app.state.service
    state.decode_pool = ThreadPoolExecutor(
        state.settings.decode_workers, thread_name_prefix="vge-decode"
    )
    state.engine.start()
    watcher = None
    if state.settings.review_enabled:  # never fails start-up: an unusable store is unavailable
        state.reviews = open_review_store(state.settings)
        watcher = asyncio.get_running_loop().create_task(
            review_watch(state.reviews.connection, state.metrics.review_store_up)
        )
    _warm_up_decoding()
    # Listen only once the engine link is up (bounded; uvicorn calls listen() after this start-up):
    # the kernel would otherwise send a starting front end requests it can only answer 503. After
    # the bound (a model still loading) it serves, /readyz saying 503 meanwhile.
    await state.engine.wait_ready(STARTUP_ENGINE_WAIT_S)
    grpc_server = None
    if state.settings.grpc_port:
        from service.frontend.grpc_v2 import start_grpc

        grpc_server = await start_grpc(state)
    # Move everything allocated at start-up (torch, the app) out of the cyclic GC's reach, so
    # full collections under load stay short instead of pausing every request.
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        state.draining = True
        if grpc_server is not None:
            await grpc_server.stop(grace=state.settings.shutdown_grace_s)
        await state.engine.close()
        if watcher is not None:
            watcher.cancel()
        if state.reviews is not None:
            state.reviews.close()
        state.decode_pool.shutdown(wait=False, cancel_futures=True)


def _warm_up_decoding() -> None:
    """Decode one tiny PNG so the first request does not pay for lazy initialisation."""
    import torch
    from torchvision.io import decode_image, encode_png

    decode_image(encode_png(torch.zeros((1, 2, 2), dtype=torch.uint8)))


def create_app(settings: Settings, engine: EngineClient) -> FastAPI:
    """Build a front end's app for ``settings``, talking to the engine through ``engine``; serve
    it as :func:`asgi_app` (the app alone has no body cap, request metrics or drain marker)."""
    metrics = Metrics()
    app = FastAPI(
        title="vge-serve",
        summary="Variance-Gated Ensembles: predictions with VGMU, TU/AU/EU and abstention.",
        lifespan=lifespan,
        # ServingMiddleware refuses a body over VGE_MAX_PAYLOAD_BYTES on any route
        responses=error_responses(413),
    )
    app.state.settings = settings
    app.state.metrics = metrics
    state = ServiceState(settings, metrics, engine)
    app.state.service = state
    install_error_handlers(app)
    for module in (health, predict, models, jobs, reviews, v2):
        app.include_router(module.router)
    app.include_router(reviews.page_router)
    return app


def asgi_app(app: FastAPI) -> ASGIApp:
    """What a front end's uvicorn runs: ``app`` behind its one middleware and the scoring routes'
    fast lane (service/frontend/routes/direct.py)."""
    dispatch = DirectDispatch(app)
    table = resource_table(app)  # the one the 405s' Allow header reads too
    return ServingMiddleware(
        dispatch,
        app.state.service,
        scoring=dispatch.serves,
        template=lambda method, path: route_template(table, method, path),
    )
