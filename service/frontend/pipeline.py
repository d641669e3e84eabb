"""One scoring request under any protocol: ``/v1/predict``, V2 HTTP and V2 gRPC (issue 35, item 1).

A protocol's adapter parses its wire format into a :class:`Call` and encodes the :class:`Answer`;
everything between happens here, once, in this order::

    adapter: parse ──▶ Call ──▶ infer():  options resolved once (ModelInfo.options)
                                          the input placed in the shared-memory arena: encoded
                                            images decoded there (service.common.decode), a V2
                                            tensor checked, prepared and copied there
                                          one engine round trip (batch, forward, score)
                                          metrics (answers and abstentions per model)
                                          the review queue (the request's policy)
    adapter: encode ◀── Answer ◀──┘

The adapters are ``routes/predict.py`` (/v1: multipart or JSON in, JSON out), ``routes/v2.py``
(V2 JSON and the binary tensor extension) and ``grpc_v2.py`` (V2 protobuf); the V2 parameters both
V2 adapters read are checked in ``v2_core.py``. Front ends do no math: the engine scores and
:mod:`models.prepare` reads images. What lives here are the request rules that hold whatever the
protocol: which ``prepare`` applies, what a tensor may look like, when FP32 input is refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.prepare import Finding, PrepareMode
from models.prepare import resolve_prepare as prepare_mode
from models.serving import ScoreColumns, ScoreOptions
from service.common.decode import decode_into, prepare_one
from service.common.errors import BadInput, InvalidValue, PayloadTooLarge
from service.common.model_info import ModelInfo
from service.frontend.deps import ServiceState
from service.frontend.engine_client import Region
from service.frontend.review_queue import (
    ReviewPolicy,
    chosen_for_review,
    has_review_key,
    queue_answers,
    queue_tensor_answers,
    review_policy,
)


@dataclass(frozen=True, slots=True)
class Encoded:
    """Encoded image files (``/v1/predict``): decoded straight into the arena, each prepared."""

    blobs: list[bytes]


@dataclass(frozen=True, slots=True)
class Pixels:
    """A V2 input tensor: ``UINT8`` pixels (``[B, C, H, W]``, ``[B, H, W, C]`` or ``[B, H, W]``),
    or ``FP32`` model input (``[B, *model.input_shape]``, already normalised)."""

    array: np.ndarray
    datatype: str  # "UINT8" or "FP32" (v2_core.check_input_spec)


@dataclass(frozen=True, slots=True)
class Call:
    """One scoring request, as every protocol states it. None: not given (the server's default)."""

    model: ModelInfo
    images: Encoded | Pixels
    headers: Mapping[str, str]  # HTTP headers or gRPC metadata: the keys ``review`` may need
    abstain_k: float | None = None
    vgmu_on: str | None = None
    top_k: int | None = None  # None: every class (V2 answers whole probability vectors)
    prepare: str | None = None
    review: ReviewPolicy | None = None
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """What the engine answered, one row per image, and what the review queue did with it."""

    model: ModelInfo
    options: ScoreOptions
    columns: ScoreColumns
    #: Per image: what reading it found (:class:`models.prepare.Finding`); None for FP32 input.
    findings: np.ndarray | None
    #: ``/v1``'s result objects (always built for encoded images: they are its response), with
    #: ``review_id``/``review_status`` on the queued ones; None for a tensor.
    records: list[dict[str, Any]] | None
    #: A tensor's review outcome as V2 response parameters (``review_status``, ``review_id``,
    #: comma-separated per image); empty when nothing was chosen.
    review: dict[str, str]


async def infer(state: ServiceState, call: Call) -> Answer:
    """Score ``call`` (module docstring): the one path of every scoring request."""
    model = call.model
    options = model.options(
        abstain_k=call.abstain_k,
        vgmu_on=call.vgmu_on,
        top_k=len(model.class_names) if call.top_k is None else call.top_k,
        default_abstain_k=state.settings.abstain_k,
    )
    images = call.images
    if isinstance(images, Encoded):
        prepare = resolve_prepare(model, call.prepare)
        review = review_policy(state, call.review, call.headers)
        columns, findings = await _decode_and_score(state, model, images.blobs, options,
                                                    call.timeout_s, prepare)  # fmt: skip
        records = columns.records(list(model.class_names), options.abstain_k, findings)
        await _queue_encoded(state, model, review, images.blobs, records, call.headers)
        return Answer(model, options, columns, findings, records, {})
    tensor_prepare = _tensor_prepare(model, call.prepare, images.datatype)
    review = review_policy(state, call.review, call.headers)
    array = channels_first(images.array, images.datatype)
    x, tensor_findings = to_model_input(array, images.datatype, model, state,
                                        tensor_prepare)  # fmt: skip
    columns = await _score_tensor(state, model, x, options, call.timeout_s, tensor_findings)
    said: dict[str, str] = {}
    if review != "never":  # the queue is on
        pixels = array if images.datatype == "UINT8" else None  # channels first, as the model's
        said = await queue_tensor_answers(state, model, review, columns, pixels,
                                          options.abstain_k, call.headers)  # fmt: skip
    return Answer(model, options, columns, tensor_findings, None, said)


# ---------------------------------------------------------------------- steps
async def _decode_and_score(
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


async def _score_tensor(
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


async def _queue_encoded(
    state: ServiceState,
    model: ModelInfo,
    review: ReviewPolicy,
    blobs: list[bytes],
    records: list[dict[str, Any]],
    headers: Mapping[str, str],
) -> None:
    """Queue what ``review`` chooses of encoded images (the files as sent), marking their records
    (:func:`service.frontend.review_queue.queue_answers`; off the loop: file and database writes)."""
    queue = state.reviews if review != "never" else None
    if queue is None or not chosen_for_review(review, records):
        return
    reveal = review == "always" or has_review_key(state.settings, headers)
    await asyncio.to_thread(
        queue_answers, queue, state.metrics, model=model.name, model_version=model.version,
        classes=model.class_names, policy=review, blobs=blobs, records=records, reveal=reveal,
    )  # fmt: skip


# ---------------------------------------------------------------------- request rules
def resolve_prepare(model: ModelInfo, asked: str | None) -> PrepareMode:
    """A request's ``prepare`` for the served model (:func:`models.prepare.resolve_prepare`;
    a misuse is a 422 that says which mode to use)."""
    try:
        return prepare_mode(asked, model.in_channels, model.input_size)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


def _tensor_prepare(model: ModelInfo, asked: str | None, datatype: str) -> PrepareMode | None:
    """``prepare`` for a tensor's images: as for encoded images when they are ``UINT8`` pixels;
    None for ``FP32`` input, the model's own input, never prepared (any ``prepare`` but ``none``
    with it is a 422)."""
    if datatype == "FP32":
        if asked not in (None, "none"):
            raise InvalidValue(
                "prepare applies to UINT8 images; FP32 input is the model's normalised input "
                "and is used as sent: leave prepare out or send the pixels as UINT8"
            )
        return None
    return resolve_prepare(model, asked)


def normalisation(model: ModelInfo) -> tuple[list[float], list[float]]:
    """The card's per-channel mean and std: FP32 ``input`` = (pixels / 255 − mean) / std.

    From the engine's description of the model (``/v1/models`` shows the same); an older engine
    without them (during a rolling upgrade) gives empty lists."""
    desc = model.description
    return list(desc.get("input_mean", [])), list(desc.get("input_std", []))


def _check_normalised(x: np.ndarray, model: ModelInfo) -> None:
    """Refuse (422) FP32 input that is pixels scaled to [0, 1] rather than normalised.

    A normalised image's black pixels are (0 − mean) / std < 0 (−0.42 for the default model), so
    an image whose values all lie in [0, 1] and vary is, in practice, ``pixels / 255`` sent without
    the normalisation: the model answered such an image confidently wrong ("8", probability 1.0,
    no abstain; issue 27), which an uncertainty server must not do silently. A constant image
    (e.g. all zeros, perf_analyzer's ``--input-data zero``) says nothing either way and is
    answered."""
    mean, std = normalisation(model)
    if not mean:
        return
    flat = x.reshape(len(x), -1)
    lo, hi = flat.min(axis=1), flat.max(axis=1)
    bad = np.flatnonzero((lo >= 0.0) & (hi <= 1.0) & (hi > lo))
    if bad.size:
        i = int(bad[0])
        black = [round((0.0 - m) / s, 4) for m, s in zip(mean, std, strict=True)]
        raise InvalidValue(
            f"FP32 input {i} looks like pixels scaled to [0, 1] (min {float(lo[i]):.3g}, max "
            f"{float(hi[i]):.3g}, mean {float(flat[i].mean()):.3g}), not the model's normalised "
            f"input: send (pixels / 255 - mean) / std per channel with mean {mean} and std {std} "
            f"(black pixels become {black}), or send the raw pixels as UINT8 'images'"
        )


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """``arr`` as a tensor over one writable C-ordered array, copied only when it is neither: a
    transposed (NHWC) array, or a request's read-only bytes (V2 binary, gRPC), which torch wraps
    only with a warning that writing them is undefined. Called after the checks, so a refused
    payload is never copied."""
    return torch.from_numpy(
        np.ascontiguousarray(arr) if arr.flags.writeable else np.array(arr, order="C")
    )


def channels_first(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A V2 input tensor with its channels first: ``UINT8`` ``[B, H, W, C]`` (NHWC, as numpy/PIL
    images stack) becomes ``[B, C, H, W]`` (a view) when dim 1 cannot be a channel count (1, 3
    or 4) and the last dim is one; anything else is returned as sent (NCHW, the documented
    layout; ``[B, H, W]`` grayscale; FP32 model input). The model input and the review queue's
    PNGs read the same layout."""
    if (
        dtype == "UINT8"
        and arr.ndim == 4
        and arr.shape[1] not in (1, 3, 4)
        and arr.shape[3] in (1, 3, 4)
    ):
        return arr.transpose(0, 3, 1, 2)  # NHWC, unambiguous: dim 1 cannot be channels
    return arr


def to_model_input(
    arr: np.ndarray,
    dtype: str,
    model: ModelInfo,
    state: ServiceState,
    prepare: PrepareMode | None = None,
) -> tuple[torch.Tensor, np.ndarray | None]:
    """uint8 pixels prepared for the model (``prepare``: :func:`models.prepare.prepare_image`)
    with what each preparation found, or the FP32 input as given (and None).

    UINT8 layout: ``arr`` as :func:`channels_first` gives it (:func:`infer` lays it out once, for
    the model and the review queue alike): ``[B, C, H, W]`` with C 1, 3 or 4, or ``[B, H, W]``
    grayscale; anything else is a 400 naming the expected layouts."""
    settings = state.settings
    if arr.shape[-1] * arr.shape[-2] > settings.max_image_pixels:
        raise PayloadTooLarge(
            f"images of {arr.shape[-1]}x{arr.shape[-2]} pixels exceed the limit of "
            f"{settings.max_image_pixels} (VGE_MAX_IMAGE_PIXELS)"
        )
    if dtype == "FP32":
        if tuple(arr.shape[1:]) != model.input_shape:
            raise BadInput(
                f"FP32 input shape {list(arr.shape)} does not match the model input "
                f"[B, {', '.join(map(str, model.input_shape))}]; send raw pixels as UINT8 instead"
            )
        _check_normalised(arr, model)
        return _tensor(arr), None
    shape = arr.shape if arr.ndim == 4 else (arr.shape[0], 1, *arr.shape[1:])  # [B, H, W]: gray
    if shape[1] not in (1, 3, 4):
        raise BadInput(
            f"UINT8 input of shape {list(arr.shape)} has {shape[1]} channels in NCHW and "
            f"{shape[3]} in NHWC: send [B, C, H, W] (NCHW; the model's is "
            f"[B, {', '.join(map(str, model.input_shape))}]) or [B, H, W, C] with C 1, 3 or 4"
        )
    images = _tensor(arr).reshape(shape)
    findings = np.zeros(len(images), np.uint8)
    if prepare in (None, "none") and tuple(images.shape[1:]) == model.input_shape:
        return images, findings
    mode: PrepareMode = prepare or "none"
    prepared = []
    for i, img in enumerate(images):
        image, finding = prepare_one(img, i, mode, model.in_channels, model.input_size)
        prepared.append(image)
        findings[i] = finding
    return torch.stack(prepared), findings


def parse_json(raw: bytes, what: str) -> Any:
    """``json.loads`` with every failure a 400 (invalid, not UTF-8, or nested too deeply)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{what} is not valid JSON") from None
    except RecursionError:
        raise BadInput(f"{what} is nested too deeply to parse") from None
