"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from service.common.metrics import CONTENT_TYPE
from service.frontend.deps import State

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
async def healthz_head() -> JSONResponse:
    """Liveness for probes that send HEAD (HAProxy's ``option httpchk HEAD``, some load
    balancers): the GET's response, whose body the server does not send (its headers, including
    the Content-Length, are the GET's, as RFC 9110 asks)."""
    return JSONResponse(await healthz())


@router.get("/readyz", responses={503: {"description": "loading or draining"}})  # same body
async def readyz(state: State) -> JSONResponse:
    """Readiness: 200 with the engine up and a model loaded; 503 while loading or draining."""
    ready, status = is_ready(state)
    body: dict[str, str | None] = {"status": status}
    if state.engine.model is not None:
        body["model"] = state.engine.model.name
    return JSONResponse(body, status_code=200 if ready else 503)


@router.head("/readyz", responses={503: {"description": "loading or draining"}})
async def readyz_head(state: State) -> JSONResponse:
    """Readiness for probes that send HEAD: the GET's response, whose body is not sent."""
    return await readyz(state)


@router.get("/metrics", include_in_schema=False)
async def metrics(state: State) -> Response:
    """Prometheus text exposition for the whole server (every process)."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
