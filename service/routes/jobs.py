"""``/v1/training-jobs``: start, list, inspect, cancel training jobs and read their logs.

All endpoints require the API key. Handlers are sync (FastAPI runs them in its thread pool), as
they touch SQLite and the filesystem.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from fastapi.responses import PlainTextResponse

from service.auth import ApiKey
from service.deps import State
from service.errors import NotReady
from service.jobs import JobManager

router = APIRouter(prefix="/v1/training-jobs", tags=["training"])


def _jobs(state: State) -> JobManager:
    if state.jobs is None:
        raise NotReady("the job manager is not running")
    return state.jobs


@router.post("", status_code=202)
def create_job(
    config: Annotated[
        dict[str, Any],
        Body(
            description="A models.training.TrainConfig: dataset, backbone, ensemble kind, M, "
            "VGN on/off, epochs, lr, seed, ...",
        ),
    ],
    _: ApiKey,
    state: State,
) -> dict[str, Any]:
    """Validate the config and queue the job (202 + job id); it runs in its own process."""
    return _jobs(state).submit(config)


@router.get("")
def list_jobs(
    _: ApiKey, state: State, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    """Jobs, newest first."""
    return {"jobs": _jobs(state).list(limit)}


@router.get("/{job_id}")
def get_job(job_id: str, _: ApiKey, state: State) -> dict[str, Any]:
    """State, progress events, metrics, error and model directory of one job."""
    return _jobs(state).get(job_id)


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, _: ApiKey, state: State) -> dict[str, Any]:
    """Cancel a queued or running job (409 when it already finished)."""
    return _jobs(state).cancel(job_id)


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(
    job_id: str, _: ApiKey, state: State, tail: Annotated[int, Query(ge=1, le=100_000)] = 200
) -> str:
    """The last ``tail`` lines of the job's training log."""
    return _jobs(state).logs(job_id, tail)
