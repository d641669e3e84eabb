"""``/v1/models``: describe the served model; reload / promote / roll back (API key required).

Swaps run in the engine (load-then-swap; in-flight batches finish on the old model); every front
end learns the new model from the engine. Every swap is recorded in the model history before it
happens, and the engine restores the newest entry after any restart; the description says since
when and why the model is served (``served_since``, ``served_because``) and, when the recorded
model could not be restored, ``restore_failed``. Promote is gated: a candidate worse than the
served model on the gate's digits is a 409 with the comparison unless ``force`` is true. Rollback
is not gated (it is the escape hatch).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from models.checkpoint import MODEL_NAME_PATTERN
from service.common.errors import InvalidValue, error_body
from service.common.wire import (
    ListModelHistory,
    PromoteJob,
    PromoteModel,
    PromoteRefusal,
    ReloadModel,
    RollbackModel,
)
from service.frontend.auth import ApiKey
from service.frontend.deps import State
from service.frontend.routes.schemas import error_responses

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
    force: StrictBool = Field(
        False,
        description="Serve the candidate even when the promote gate finds it worse than the "
        "served model beyond the tolerances (VGE_PROMOTE_MAX_*); the comparison is still "
        "recorded, with verdict 'forced'.",
    )

    @model_validator(mode="after")
    def _one(self) -> PromoteRequest:
        if (self.model is None) == (self.job_id is None):
            raise ValueError("give exactly one of `model` or `job_id`")
        return self


@router.get("")
async def list_models(state: State) -> dict[str, Any]:
    """The served model: name, version, classes, ensemble kind, M, device, abstain_k, metrics,
    and its state: ``served_since`` (ISO 8601 UTC), ``served_because`` (start, promote,
    promote_job, reload, rollback, restored: brought back after a restart), ``history_id``,
    ``restored_from``, ``gate`` (the promote gate's comparison that let it in) and
    ``restore_failed`` (null, or why the model the history records is not the one served)."""
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
    return {"status": "reloaded", "model": (await state.engine.call(ReloadModel())).model}


@router.post("/promote")
async def promote_model(body: PromoteRequest, _: ApiKey, state: State) -> Any:
    """Serve another model (load-then-swap: in-flight requests finish on the old one), if the
    promote gate lets it: it and the served model are evaluated on the same digits (bundled
    MNIST test split + held-out digits); a candidate worse beyond the tolerances is a 409
    ``promote_refused`` with the ``comparison``, unless ``force`` is true. Models whose classes
    are not the digits 0-9 skip the gate (the reason is recorded). The answer's ``gate`` is the
    comparison, also stored in the history entry."""
    command = (
        PromoteJob(body.job_id, body.force)
        if body.job_id is not None
        else PromoteModel(body.model, body.force)
    )
    result = await state.engine.call(command)
    if isinstance(result, PromoteRefusal):
        return JSONResponse(
            error_body(result.message, "promote_refused", comparison=result.comparison),
            status_code=409,
        )
    model = result.model
    return {"status": "promoted", "model": model, "gate": model.get("gate")}


class RollbackRequest(BaseModel):
    """Which earlier model to serve again: a history entry's id; none: the one before the current."""

    model_config = ConfigDict(extra="forbid")

    to: str | None = Field(None, min_length=1, max_length=64, description="A history entry id.")


@router.get("/history")
async def model_history(
    _: ApiKey, state: State, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    """Every model this replica chose to serve (start, promote, promote_job, reload, rollback),
    newest first, with the weights' sha256, the promote gate's ``comparison`` and a ``note``.
    The newest entry is what the engine restores after a restart.

    In a fleet (``VGE_DB_URL``) the history is the fleet's: every replica's actions (``replica``
    names who acted), the newest being what every replica serves; ``replicas`` says which
    replica serves which model, whether that is the fleet's (``converged``) and why not
    (``error``), and when it last reported (``seen_at``, ``live``)."""
    answer = await state.engine.call(ListModelHistory(limit))
    if answer.replicas is None:
        return {"history": answer.entries}
    return {"history": answer.entries, "replicas": answer.replicas}


@router.post("/rollback")
async def rollback_model(
    _: ApiKey, state: State, body: Annotated[RollbackRequest | None, Body()] = None
) -> dict[str, Any]:
    """Serve an earlier model again (load-then-swap): the history entry ``to``, else undo the last
    change. The shipped models and job models alike; 409 when there is nothing to roll back to,
    422 when the entry's weights are gone or no longer hash to what was recorded. Not gated:
    rollback is the escape hatch when a promoted model disappoints."""
    to = body.to if body is not None else None
    model = (await state.engine.call(RollbackModel(to))).model
    return {"status": "rolled_back", "model": model}


@router.get("/{name}")
async def get_model(name: str, state: State) -> dict[str, Any]:
    """One model by name (404 when it is not served)."""
    return state.model(name).description
