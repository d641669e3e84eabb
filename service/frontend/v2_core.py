"""The KServe V2 protocol's core, shared by V2 over HTTP (:mod:`service.frontend.routes.v2`) and
over gRPC (:mod:`service.frontend.grpc_v2`): the outputs and input datatypes, model metadata, the
version check, the checks of the input spec and request parameters, the review parameter,
input → model input and packed columns → output tensors.

Both transports call these, so a rule changes in one place (issue 26: the start of the single V2
core; parsing and encoding still live with each transport).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from models.serving import ScoreColumns
from models.uncertainty.margin import ABSTAIN_K_MAX, ABSTAIN_K_MIN
from service.common.decode import conform_one
from service.common.errors import BadInput, InvalidValue, NotFound, PayloadTooLarge
from service.common.model_info import ModelInfo
from service.frontend.deps import ServiceState
from service.frontend.review_queue import ReviewPolicy, review_policy

OUTPUTS: dict[str, str] = {
    "probabilities": "FP32",
    "prediction": "INT64",
    "vgmu": "FP32",
    "snr": "FP32",
    "tu": "FP32",
    "au": "FP32",
    "eu": "FP32",
    "abstain": "BOOL",
}


DTYPES: dict[str, np.dtype[Any]] = {"UINT8": np.dtype(np.uint8), "FP32": np.dtype("<f4")}


#: The two inputs, by name: raw pixels or prepared model input.
INPUT_NAMES: dict[str, str] = {"UINT8": "images", "FP32": "input"}


def model_metadata_dict(model: ModelInfo) -> dict[str, Any]:
    n_classes = len(model.class_names)
    return {
        "name": model.name,
        "versions": [model.version],
        "platform": "pytorch_vge",
        "inputs": [
            {"name": INPUT_NAMES["UINT8"], "datatype": "UINT8", "shape": [-1, -1, -1, -1]},
            {"name": INPUT_NAMES["FP32"], "datatype": "FP32", "shape": [-1, *model.input_shape]},
        ],
        "outputs": [
            {"name": n, "datatype": d, "shape": [-1, n_classes] if n == "probabilities" else [-1]}
            for n, d in OUTPUTS.items()
        ],
        "parameters": {"classes": list(model.class_names)},
    }


def versioned_model(state: ServiceState, name: str, version: str) -> ModelInfo:
    model = state.model(name)
    if version != model.version:
        raise NotFound(f"model {name!r} has no version {version!r}; served: {model.version!r}")
    return model


def check_input_spec(name: Any, dtype: Any, shape: Any, max_images: int) -> int:
    """The one input tensor's name, datatype and shape, checked for HTTP and gRPC alike; returns
    its element count."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadInput(f"input datatype {dtype!r} is not supported; use UINT8 or FP32")
    if name != INPUT_NAMES[dtype]:  # required by the protocol; the name says what the data is
        raise BadInput(
            f"input {name!r} with datatype {dtype}: send raw pixels as "
            f"{INPUT_NAMES['UINT8']!r} (UINT8) or prepared input as {INPUT_NAMES['FP32']!r} (FP32)"
        )
    if (
        not isinstance(shape, list)
        or len(shape) not in (3, 4)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)
    ):
        raise BadInput(
            f"input shape {shape!r} is invalid; use [B, C, H, W] or [B, H, W] with positive sizes"
        )
    if shape[0] > max_images:
        raise PayloadTooLarge(
            f"too many images: batch of {shape[0]}, the limit is {max_images} (VGE_MAX_IMAGES)"
        )
    return math.prod(shape)


def is_number(value: Any) -> bool:
    """A JSON number; ``true``/``false`` are not numbers here, though Python's bools are ints."""
    return isinstance(value, int | float) and not isinstance(value, bool)


#: The request parameters this server reads; any other is a 400 naming it (a typo, or ``review``
#: sent to a server that did not know it, was silently ignored).
REQUEST_PARAMETERS: tuple[str, ...] = (
    "abstain_k", "vgmu_on", "timeout_s", "review", "binary_data_output",
)  # fmt: skip


def check_parameters(params: dict[str, Any]) -> tuple[float | None, str | None, float | None]:
    """A request's ``abstain_k``, ``vgmu_on`` and ``timeout_s``, checked for HTTP and gRPC alike
    (and that it sends no parameter this server does not read; ``review``: :func:`review_param`)."""
    unknown = [str(key) for key in params if key not in REQUEST_PARAMETERS]
    if unknown:
        raise BadInput(
            f"unknown request parameter {unknown[0][:64]!r}; this server reads "
            f"{', '.join(REQUEST_PARAMETERS)}"
        )
    k = params.get("abstain_k")
    if k is not None and (not is_number(k) or not ABSTAIN_K_MIN <= k <= ABSTAIN_K_MAX):
        raise InvalidValue(f"abstain_k must be a number in [{ABSTAIN_K_MIN:g}, {ABSTAIN_K_MAX:g}]")
    vgmu_on = params.get("vgmu_on")
    if vgmu_on not in (None, "p", "q"):
        raise InvalidValue("vgmu_on must be 'p' or 'q'")
    timeout = params.get("timeout_s")
    if timeout is not None and (not is_number(timeout) or not 0.05 <= timeout <= 3600):
        raise InvalidValue("timeout_s must be a number in [0.05, 3600] (seconds)")
    return k, vgmu_on, timeout


def review_param(state: ServiceState, params: dict[str, Any], headers: Any) -> ReviewPolicy:
    """The request's ``review`` parameter (``auto``/``always``/``never``, as on /v1/predict:
    ``auto`` by default with the queue on; ``always`` needs a key), for HTTP and gRPC alike."""
    asked = params.get("review")
    if asked not in (None, "auto", "always", "never"):
        raise InvalidValue("review must be 'auto', 'always' or 'never'")
    return review_policy(state, asked, headers)


def to_model_input(
    arr: np.ndarray, dtype: str, model: ModelInfo, state: ServiceState
) -> torch.Tensor:
    """uint8 pixels conformed to the model's channels and size, or the FP32 input as given."""
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
        return torch.from_numpy(np.ascontiguousarray(arr))
    images = torch.from_numpy(np.ascontiguousarray(arr))
    if images.ndim == 3:
        images = images.unsqueeze(1)
    if images.shape[1] not in (1, 3, 4):
        raise BadInput(f"UINT8 input has {images.shape[1]} channels; use 1, 3 or 4 ([B, C, H, W])")
    if tuple(images.shape[1:]) == model.input_shape:
        return images
    return torch.stack(
        [conform_one(img, i, model.in_channels, model.input_size) for i, img in enumerate(images)]
    )


NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "FP32": np.dtype("<f4"),
    "INT64": np.dtype("<i8"),
    "BOOL": np.dtype(np.bool_),
}


def output_tensors(columns: ScoreColumns, n_classes: int) -> dict[str, np.ndarray]:
    """V2 output tensors from the packed columns (top-k over all classes, scattered back)."""
    b = len(columns)
    probs = np.zeros((b, n_classes), dtype=np.float64)
    np.put_along_axis(probs, columns.top_indices, columns.top_probabilities, axis=1)
    out: dict[str, np.ndarray] = {
        "probabilities": probs,
        "prediction": columns.column("prediction"),
        "abstain": columns.column("abstain"),
    }
    for key in ("vgmu", "snr", "tu", "au", "eu"):
        out[key] = columns.column(key)
    return {k: v.astype(NUMPY_DTYPES[OUTPUTS[k]]) for k, v in out.items()}
