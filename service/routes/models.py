"""``/v1/models``: describe the served model; reload / promote it (API key required).

Swaps run in the engine (load-then-swap; in-flight batches finish on the old model); every front
end learns the new model from the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.checkpoint import MODEL_NAME_PATTERN
from service.auth import ApiKey
from service.deps import State
from service.errors import InvalidValue
from service.routes.schemas import error_responses

router = APIRouter(
    prefix="/v1/models",
    tags=["models"],
    responses=error_responses(400, 401, 403, 404, 409, 422, 503),
)


class PromoteRequest(BaseModel):
    """Serve a model from ``models_root`` by directory name, or a finished training job's model."""

    # Exactly one of the two, each a non-empty string: the schema says so (oneOf), not only the
    # validator, so clients and contract tests see the same rule the server applies.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"oneOf": [{"required": ["model"]}, {"required": ["job_id"]}]},
    )

    model: str = Field(  # type: ignore[assignment]
        None,
        pattern=MODEL_NAME_PATTERN,
        description="A model under models_root, or a shipped model's name.",
    )
    job_id: str = Field(None, min_length=1, description="A succeeded training job.")  # type: ignore[assignment]

    @model_validator(mode="after")
    def _one(self) -> PromoteRequest:
        if (self.model is None) == (self.job_id is None):
            raise ValueError("give exactly one of `model` or `job_id`")
        return self


@router.get("")
async def list_models(state: State) -> dict[str, Any]:
    """The served model: name, version, classes, ensemble kind, M, device, abstain_k, metrics."""
    current = state.engine.model
    return {"models": [current.description] if current else []}


@router.post("/reload")
async def reload_model(_: ApiKey, state: State, request: Request) -> dict[str, Any]:
    """Reload the served model's directory; load-then-swap, no request fails. Takes no body: to
    serve another model, promote it."""
    if await request.body():  # e.g. {"model_dir": ...}: answered 200, having reloaded the same one
        raise InvalidValue(
            "reload takes no body: it reloads the served model's directory; to serve another "
            "model use POST /v1/models/promote"
        )
    return {"status": "reloaded", "model": await state.engine.call("models.reload")}


@router.post("/promote")
async def promote_model(body: PromoteRequest, _: ApiKey, state: State) -> dict[str, Any]:
    """Serve another model (load-then-swap: in-flight requests finish on the old one)."""
    if body.job_id is not None:
        described = await state.engine.call("models.promote_job", job_id=body.job_id)
    else:
        described = await state.engine.call("models.promote", name=body.model)
    return {"status": "promoted", "model": described}


class RollbackRequest(BaseModel):
    """Which earlier model to serve again: a history entry's id; none: the one before the current."""

    model_config = ConfigDict(extra="forbid")

    to: str | None = Field(None, min_length=1, max_length=64, description="A history entry id.")


@router.get("/history")
async def model_history(
    _: ApiKey, state: State, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    """Every model this replica served (start, promote, reload, rollback), newest first."""
    return {"history": await state.engine.call("models.history", limit=limit)}


@router.post("/rollback")
async def rollback_model(
    _: ApiKey, state: State, body: Annotated[RollbackRequest | None, Body()] = None
) -> dict[str, Any]:
    """Serve an earlier model again (load-then-swap): the history entry ``to``, else undo the last
    change. The shipped models and job models alike; 409 when there is nothing to roll back to."""
    to = body.to if body is not None else None
    return {"status": "rolled_back", "model": await state.engine.call("models.rollback", to=to)}


@router.get("/{name}")
async def get_model(name: str, state: State) -> dict[str, Any]:
    """One model by name (404 when it is not served)."""
    return state.model(name).description
