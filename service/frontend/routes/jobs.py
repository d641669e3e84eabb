"""``/v1/training-jobs``: start, list, inspect, cancel training jobs and read their logs.

All endpoints require the API key. Jobs exist once per server, in the engine process (which starts
and watches the training processes); these routes forward to it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query
from fastapi.responses import Response

from service.common.job_logs import render_text
from service.common.wire import CancelJob, GetJob, JobLogs, ListJobs, SubmitJob
from service.frontend.auth import ApiKey
from service.frontend.deps import State
from service.frontend.routes.schemas import error_responses

router = APIRouter(
    prefix="/v1/training-jobs",
    tags=["training"],
    responses=error_responses(400, 401, 403, 404, 409, 422, 503),
)


@router.post("", status_code=202)
async def create_job(
    config: Annotated[
        dict[str, Any],
        Body(
            description="Fields of a models.training.TrainConfig (dataset, epochs, lr, seed, "
            "backbone, ensemble, members, vgn, ...) over the served model's own configuration, "
            "and init: served | scratch. No architecture field: the served model is retrained "
            "(its recipe, name and, by default, weights; version <served>-<job id>). Bounded: "
            "epochs <= 1000, members <= 100, batch_size <= 4096, image_size <= 512, a few "
            'small backbone_kwargs. Example: {"dataset": "reviews+mnist-bundled", '
            '"epochs": 2}.',
        ),
    ],
    _: ApiKey,
    state: State,
) -> dict[str, Any]:
    """Validate the whole submission, then queue the job (202 + job id; it runs in its own
    process). A 422 names what is wrong or out of bounds and writes nothing; a 409 says the
    queue is full (``VGE_MAX_QUEUED_JOBS``). Reviewed images are exported only for an accepted
    job, into its own folder, removed when it ends."""
    return (await state.engine.call(SubmitJob(config))).job


@router.get("")
async def list_jobs(
    _: ApiKey, state: State, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    """Jobs, newest first."""
    return {"jobs": (await state.engine.call(ListJobs(limit))).jobs}


@router.get("/{job_id}")
async def get_job(job_id: str, _: ApiKey, state: State) -> dict[str, Any]:
    """State, progress events, metrics, error and model directory of one job."""
    return (await state.engine.call(GetJob(job_id))).job


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: str, _: ApiKey, state: State) -> dict[str, Any]:
    """Cancel a queued or running job (409 when it already finished)."""
    return (await state.engine.call(CancelJob(job_id))).job


@router.get(
    "/{job_id}/logs",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "The last tail lines of the log, each ending in a newline.",
        }
    },
)
async def job_logs(
    job_id: str,
    _: ApiKey,
    state: State,
    tail: Annotated[int, Query(ge=1, le=100_000)] = 200,
    log_format: Annotated[
        Literal["raw", "text"],
        Query(
            alias="format",
            description="raw: the log as the job wrote it (progress events are JSON lines); "
            "text: for a person, each progress event as one short line "
            "(epoch, step, losses, accuracy, time left), other lines as written.",
        ),
    ] = "raw",
) -> Response:
    """The last ``tail`` lines of the job's training log, read from its end (a log is capped at
    ``VGE_JOB_LOG_MAX_BYTES`` and deleted ``VGE_JOB_LOG_RETENTION_DAYS`` after the job ends:
    then empty). Errors are JSON, as everywhere."""
    text = (await state.engine.call(JobLogs(job_id, tail))).text
    if log_format == "text":
        text = render_text(text)
    return Response(text, media_type="text/plain; charset=utf-8")
