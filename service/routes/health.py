"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from service.deps import State
from service.metrics import CONTENT_TYPE

router = APIRouter(tags=["health"])


def is_ready(state: State) -> tuple[bool, str]:
    """Ready with the engine connected and a model loaded, and not draining."""
    if state.draining:
        return False, "draining"
    if not state.engine.ready:
        return False, "loading"
    return True, "ready"


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.head("/healthz")
async def healthz_head() -> Response:
    """Liveness for probes that send HEAD (HAProxy's ``option httpchk HEAD``, some load
    balancers): the status and content type of ``GET /healthz``, no body."""
    return Response(media_type="application/json")


@router.get("/readyz", responses={503: {"description": "loading or draining"}})  # same body
async def readyz(state: State) -> JSONResponse:
    """Readiness: 200 with the engine up and a model loaded; 503 while loading or draining."""
    ready, status = is_ready(state)
    body: dict[str, str | None] = {"status": status}
    if state.engine.model is not None:
        body["model"] = state.engine.model.name
    return JSONResponse(body, status_code=200 if ready else 503)


@router.head("/readyz", responses={503: {"description": "loading or draining"}})
async def readyz_head(state: State) -> Response:
    """Readiness for probes that send HEAD: the status and content type of ``GET /readyz``, no
    body."""
    ready, _ = is_ready(state)
    return Response(status_code=200 if ready else 503, media_type="application/json")


@router.get("/metrics", include_in_schema=False)
async def metrics(state: State) -> Response:
    """Prometheus text exposition for the whole server (every process)."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
