"""Shared application state and the ``Annotated`` dependencies routes declare."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from service.batcher import Batcher
from service.jobs import JobManager
from service.metrics import Metrics
from service.model_manager import ModelManager
from service.settings import Settings


@dataclass
class ServiceState:
    """Everything a request may touch; built by :func:`service.app.create_app`."""

    settings: Settings
    metrics: Metrics
    models: ModelManager
    batcher: Batcher | None = None
    jobs: JobManager | None = None
    decode_pool: ThreadPoolExecutor | None = None
    draining: bool = False
    drain_started: float | None = None  # time.monotonic() of SIGTERM, when the server drains
    started: bool = field(default=False)


async def get_state(request: Request) -> ServiceState:
    """The app's :class:`ServiceState` (async: FastAPI would run a sync dependency in a thread)."""
    return request.app.state.service


async def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return request.app.state.settings


State = Annotated[ServiceState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
