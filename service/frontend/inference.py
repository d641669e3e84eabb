"""The request path shared by /v1/predict and /v2 infer: decode → engine (batch, forward, score).

Front ends do no math: they resolve options (:meth:`ModelInfo.options`, the single place the
default ``abstain_k`` is chosen), place the request's tensor in shared memory, and wait for the
engine's packed score columns, which routes encode as /v1 JSON or V2 tensors.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from models.prepare import Finding, PrepareMode
from models.prepare import resolve_prepare as prepare_mode
from models.serving import ScoreColumns, ScoreOptions
from service.common.decode import decode_into
from service.common.errors import BadInput, InvalidValue
from service.common.model_info import ModelInfo
from service.frontend.deps import ServiceState
from service.frontend.engine_client import Region


def resolve_options(
    state: ServiceState,
    model: ModelInfo,
    *,
    abstain_k: float | None,
    vgmu_on: str | None,
    top_k: int,
) -> ScoreOptions:
    """Request options → :class:`ScoreOptions` (422 for ``vgmu_on=q`` without a gate)."""
    return model.options(
        abstain_k=abstain_k,
        vgmu_on=vgmu_on,
        top_k=top_k,
        default_abstain_k=state.settings.abstain_k,
    )


def resolve_prepare(model: ModelInfo, asked: str | None) -> PrepareMode:
    """A request's ``prepare`` for the served model (:func:`models.prepare.resolve_prepare`;
    a misuse is a 422 that says which mode to use)."""
    try:
        return prepare_mode(asked, model.in_channels, model.input_size)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


async def predict_images(
    state: ServiceState,
    model: ModelInfo,
    blobs: list[bytes],
    options: ScoreOptions,
    timeout_s: float | None,
    prepare: PrepareMode,
) -> tuple[ScoreColumns, np.ndarray]:
    """Decode encoded images into shared memory, each prepared as ``prepare`` says, and score
    them; one row per image, and what each image's preparation found (:class:`Finding`): an
    image with no digit in it is answered with ``abstain`` set."""
    assert state.decode_pool is not None
    region = state.engine.allocate("uint8", (len(blobs), *model.input_shape))
    try:
        findings = await decode_into(
            blobs, region.array, state.settings, state.decode_pool, prepare
        )
    except BaseException:
        state.engine.release(region)
        raise
    columns = await _score(state, model, region, options, timeout_s, findings)
    state.metrics.record_predictions(model.name, columns.column("abstain").tolist())
    return columns, findings


async def predict_tensor(
    state: ServiceState,
    model: ModelInfo,
    x: torch.Tensor,
    options: ScoreOptions,
    timeout_s: float | None,
    findings: np.ndarray | None = None,
) -> ScoreColumns:
    """Score a ready tensor ``(n, Cin, H, W)``: uint8 conformed pixels or float32 model input.

    Float32 input is the model's own, unchecked beyond being finite: values far outside the
    normalised range it was trained on can overflow the forward pass, and an answer of NaN
    scores is refused (422) rather than sent (JSON has no NaN).
    """
    a = x.numpy()
    region = state.engine.allocate(str(a.dtype), a.shape)
    np.copyto(region.array, a)
    columns = await _score(state, model, region, options, timeout_s, findings)
    if a.dtype == np.float32 and not np.isfinite(columns.data).all():
        bad = int(np.flatnonzero(~np.isfinite(columns.data).all(axis=1))[0])
        raise InvalidValue(
            f"FP32 input {bad}: the model's outputs are not finite; its values (from "
            f"{float(a[bad].min()):.3g} to {float(a[bad].max()):.3g}) overflow the forward "
            "pass. FP32 input is the normalised image; send raw pixels as UINT8 instead"
        )
    state.metrics.record_predictions(model.name, columns.column("abstain").tolist())
    return columns


async def _score(
    state: ServiceState,
    model: ModelInfo,
    region: Region,
    options: ScoreOptions,
    timeout_s: float | None,
    findings: np.ndarray | None,
) -> ScoreColumns:
    """The engine's columns for the request in ``region``, ``abstain`` set on the rows whose
    image held no digit (``findings``, :class:`models.prepare.Finding`; None: not read)."""
    timeout = timeout_s if timeout_s is not None else state.settings.request_timeout_s
    columns = await state.engine.infer(model, region, options, timeout)
    return columns if findings is None else columns.abstaining(findings != Finding.ok)


def parse_json(raw: bytes, what: str) -> Any:
    """``json.loads`` with every failure a 400 (invalid, not UTF-8, or nested too deeply)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{what} is not valid JSON") from None
    except RecursionError:
        raise BadInput(f"{what} is nested too deeply to parse") from None
