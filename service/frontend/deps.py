"""Shared front-end state and the ``Annotated`` dependencies routes declare."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from service.common.metrics import Metrics
from service.common.model_info import ModelInfo
from service.common.review_store import ReviewStore
from service.common.settings import Settings
from service.frontend.engine_client import EngineClient


@dataclass
class ServiceState:
    """Everything a request may touch in a front-end process; built by :func:`service.frontend.app.create_app`."""

    settings: Settings
    metrics: Metrics
    engine: EngineClient
    decode_pool: ThreadPoolExecutor | None = None
    draining: bool = False
    drain_started: float | None = None  # time.monotonic() of SIGTERM, when the server drains
    reviews: ReviewStore | None = None  # the human review queue, when VGE_REVIEW_QUEUE=on

    def review_store(self) -> ReviewStore:
        """The review queue, or a 404 saying how to turn it on."""
        from service.common.errors import NotFound

        if self.reviews is None:
            raise NotFound(
                "the review queue is off: start the server with VGE_REVIEW_QUEUE=on "
                "(or --review-queue)"
            )
        return self.reviews

    def model(self, name: str | None = None) -> ModelInfo:
        """The served model (503 while the engine starts), checking ``name`` when given (404)."""
        from service.common.errors import NotFound

        model = self.engine.current_model()
        if name is not None and name != model.name:
            raise NotFound(f"unknown model {name!r}; this server serves {model.name!r}")
        return model


def service_state(request: Request) -> ServiceState:
    """The app's :class:`ServiceState`.

    The scoring routes (``/v1/predict``, V2 ``infer``) call this directly instead of declaring the
    :data:`State` dependency: FastAPI's dependency resolution cost ~7 % of a front end's CPU per
    single-image request (py-spy, ``python -m benchmarks.profile_serve``).
    """
    state: ServiceState = request.app.state.service  # set by create_app
    return state


async def get_state(request: Request) -> ServiceState:
    """The app's :class:`ServiceState` (async: FastAPI would run a sync dependency in a thread)."""
    return service_state(request)


async def get_settings(request: Request) -> Settings:
    """The app's settings."""
    settings: Settings = request.app.state.settings  # set by create_app
    return settings


State = Annotated[ServiceState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
