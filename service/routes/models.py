"""``/v1/models``: describe the served model; reload / promote it (API key required).

Swaps run in the engine (load-then-swap; in-flight batches finish on the old model); every front
end learns the new model from the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.auth import ApiKey
from service.deps import State

router = APIRouter(prefix="/v1/models", tags=["models"])


class PromoteRequest(BaseModel):
    """Serve a model from ``models_root`` by directory name, or a finished training job's model."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Directory name under models_root.")
    job_id: str | None = Field(None, description="A succeeded training job.")

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


@router.get("/{name}")
async def get_model(name: str, state: State) -> dict[str, Any]:
    """One model by name (404 when it is not served)."""
    return state.model(name).description


@router.post("/reload")
async def reload_model(_: ApiKey, state: State) -> dict[str, Any]:
    """Reload the served model's directory; load-then-swap, no request fails."""
    return {"status": "reloaded", "model": await state.engine.call("models.reload")}


@router.post("/promote")
async def promote_model(body: PromoteRequest, _: ApiKey, state: State) -> dict[str, Any]:
    """Serve another model (load-then-swap: in-flight requests finish on the old one)."""
    if body.job_id is not None:
        described = await state.engine.call("models.promote_job", job_id=body.job_id)
    else:
        described = await state.engine.call("models.promote", name=body.model)
    return {"status": "promoted", "model": described}
