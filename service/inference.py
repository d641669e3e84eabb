"""The request path shared by /v1/predict and /v2 infer: batch → forward → score → respond."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from service.deps import ServiceState
from service.errors import NotReady
from service.model_manager import LoadedModel


def effective_abstain_k(state: ServiceState, model: LoadedModel, requested: float | None) -> float:
    """The request's ``abstain_k``, else the server default, else the card's calibration, else 1."""
    if requested is not None:
        return float(requested)
    if state.settings.abstain_k is not None:
        return float(state.settings.abstain_k)
    calibrated = model.calibrated_abstain_k
    return calibrated if calibrated is not None else 1.0


async def infer(
    state: ServiceState,
    model: LoadedModel,
    x: torch.Tensor,
    *,
    abstain_k: float,
    vgmu_on: str,
    top_k: int,
    timeout_s: float | None,
) -> list[dict[str, Any]]:
    """Queue prepared inputs ``x`` (N, Cin, H, W) on the batcher; return one result per row.

    Scoring (``Predictor.score``) runs in the compute thread right after the batch's forward pass,
    on the predictor that computed it (a hot swap never mixes models), once for all requests of
    the batch that share the same options.
    """
    if state.batcher is None:
        raise NotReady("the service is starting; no batcher yet")
    post = partial(model.predictor.score, abstain_k=abstain_k, vgmu_on=vgmu_on, top_k=top_k)
    results: list[dict[str, Any]] = await state.batcher.submit(
        model.predictor,
        model.name,
        x,
        post,
        timeout_s if timeout_s is not None else state.settings.request_timeout_s,
        post_key=(abstain_k, vgmu_on, top_k),
    )
    state.metrics.record_predictions(model.name, [bool(r["abstain"]) for r in results])
    return results
