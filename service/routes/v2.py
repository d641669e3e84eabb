"""KServe V2 / Open Inference Protocol, so existing clients (e.g. ``tritonclient.http``) work.

Input: one image-batch tensor, batch dimension first —

* ``UINT8`` ``[B, C, H, W]`` or ``[B, H, W]``: raw pixels, prepared exactly like /v1/predict images;
* ``FP32`` ``[B, Cin, H', W']``: already-prepared model input (the shape in the model metadata).

Data as a JSON list or with the binary tensor extension (``Inference-Header-Content-Length``).
Request ``parameters``: ``abstain_k``, ``vgmu_on`` (``p``/``q``), ``timeout_s``.
Outputs: ``probabilities`` FP32 [B, C], ``prediction`` INT64 [B], ``vgmu``, ``snr``, ``tu``,
``au``, ``eu`` FP32 [B], ``abstain`` BOOL [B]. Errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.decode import prepare_one
from service.deps import State
from service.errors import BadInput, InvalidValue, NotReady, PayloadTooLarge
from service.inference import effective_abstain_k, infer
from service.model_manager import LoadedModel
from service.routes.health import is_ready
from service.settings import ABSTAIN_K_MAX, ABSTAIN_K_MIN

router = APIRouter(prefix="/v2", tags=["v2"])

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
_DTYPES: dict[str, np.dtype[Any]] = {"UINT8": np.dtype(np.uint8), "FP32": np.dtype("<f4")}


@router.get("")
async def server_metadata() -> dict[str, Any]:
    """Server metadata."""
    from importlib.metadata import version

    return {
        "name": "vge-serve",
        "version": version("vge-serve"),
        "extensions": ["binary_tensor_data"],
    }


@router.get("/health/live")
async def live() -> dict[str, bool]:
    """Server liveness."""
    return {"live": True}


@router.get("/health/ready")
async def ready(state: State) -> JSONResponse:
    """Server readiness (same rule as /readyz)."""
    ok, _ = is_ready(state)
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


def _metadata(model: LoadedModel) -> dict[str, Any]:
    n_classes = len(model.class_names)
    return {
        "name": model.name,
        "versions": [model.version],
        "platform": "pytorch_vge",
        "inputs": [
            {"name": "images", "datatype": "UINT8", "shape": [-1, -1, -1, -1]},
            {"name": "images", "datatype": "FP32", "shape": [-1, *model.input_shape]},
        ],
        "outputs": [
            {"name": n, "datatype": d, "shape": [-1, n_classes] if n == "probabilities" else [-1]}
            for n, d in OUTPUTS.items()
        ],
        "parameters": {"classes": model.class_names},
    }


@router.get("/models/{name}")
async def model_metadata(name: str, state: State) -> dict[str, Any]:
    """Model metadata (inputs, outputs, versions)."""
    return _metadata(state.models.get(name))


@router.get("/models/{name}/versions/{version}")
async def model_version_metadata(name: str, version: str, state: State) -> dict[str, Any]:
    """Model metadata for an explicit version."""
    return _metadata(_versioned(state, name, version))


@router.get("/models/{name}/ready")
async def model_ready(name: str, state: State) -> JSONResponse:
    """Model readiness."""
    state.models.get(name)
    ok, _ = is_ready(state)
    return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)


def _versioned(state: State, name: str, version: str) -> LoadedModel:
    model = state.models.get(name)
    if version != model.version:
        from service.errors import NotFound

        raise NotFound(f"model {name!r} has no version {version!r}; served: {model.version!r}")
    return model


async def _parse_body(request: Request) -> tuple[dict[str, Any], bytes]:
    raw = await request.body()
    header_len = request.headers.get("inference-header-content-length")
    if header_len is not None:
        try:
            n = int(header_len)
        except ValueError:
            raise BadInput("Inference-Header-Content-Length is not an integer") from None
        if not 0 < n <= len(raw):
            raise BadInput("Inference-Header-Content-Length is outside the body")
        head, binary = raw[:n], raw[n:]
    else:
        head, binary = raw, b""
    try:
        body = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput("inference request header is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadInput("inference request must be a JSON object")
    return body, binary


def _input_tensor(body: dict[str, Any], binary: bytes, max_images: int) -> np.ndarray:
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadInput("inputs must hold exactly one tensor: the image batch")
    spec = inputs[0]
    dtype = spec.get("datatype")
    if dtype not in _DTYPES:
        raise BadInput(f"input datatype {dtype!r} is not supported; use UINT8 or FP32")
    shape = spec.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) not in (3, 4)
        or not all(isinstance(s, int) and s > 0 for s in shape)
    ):
        raise BadInput(
            f"input shape {shape!r} is invalid; use [B, C, H, W] or [B, H, W] with positive sizes"
        )
    if shape[0] > max_images:
        raise PayloadTooLarge(
            f"too many images: batch of {shape[0]}, the limit is {max_images} (VGE_MAX_IMAGES)"
        )
    count = math.prod(shape)
    size = (spec.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if size != count * _DTYPES[dtype].itemsize or size > len(binary):
            raise BadInput(f"binary_data_size {size} does not match shape {shape} of {dtype}")
        arr = np.frombuffer(binary[:size], dtype=_DTYPES[dtype])
    else:
        data = spec.get("data")
        if data is None:
            raise BadInput("input has neither data nor binary_data_size")
        try:
            arr = np.asarray(data, dtype=np.float64).reshape(-1)
        except (ValueError, TypeError):
            raise BadInput("input data must be a (flat or nested) list of numbers") from None
        if arr.size != count:
            raise BadInput(f"input data has {arr.size} elements, shape {shape} needs {count}")
        if dtype == "UINT8":
            if ((arr < 0) | (arr > 255) | (arr != np.round(arr))).any():
                raise BadInput("UINT8 input data must be integers in [0, 255]")
            arr = arr.astype(np.uint8)
        else:
            arr = arr.astype(np.float32)
    arr = arr.reshape(shape)
    if dtype == "FP32" and not np.isfinite(arr).all():
        raise BadInput("FP32 input contains NaN or infinity")
    return arr


def _parameters(body: dict[str, Any]) -> tuple[float | None, str, float | None]:
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadInput("parameters must be an object")
    k = params.get("abstain_k")
    if k is not None and (
        not isinstance(k, int | float) or not ABSTAIN_K_MIN <= k <= ABSTAIN_K_MAX
    ):
        raise InvalidValue(f"abstain_k must be a number in [{ABSTAIN_K_MIN:g}, {ABSTAIN_K_MAX:g}]")
    vgmu_on = params.get("vgmu_on", "p")
    if vgmu_on not in ("p", "q"):
        raise InvalidValue("vgmu_on must be 'p' or 'q'")
    timeout = params.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, int | float) or not 0 < timeout <= 3600):
        raise InvalidValue("timeout_s must be a number in (0, 3600]")
    return k, vgmu_on, timeout


async def _to_model_input(
    arr: np.ndarray, dtype: str, model: LoadedModel, state: State
) -> torch.Tensor:
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
        return torch.from_numpy(arr.copy())
    images = torch.from_numpy(arr.copy())
    if images.ndim == 3:
        images = images.unsqueeze(1)
    if images.shape[1] not in (1, 3, 4):
        raise BadInput(f"UINT8 input has {images.shape[1]} channels; use 1, 3 or 4 ([B, C, H, W])")
    if state.decode_pool is None:
        raise NotReady("the service is starting")
    loop = asyncio.get_running_loop()
    prepared = await asyncio.gather(
        *(
            loop.run_in_executor(state.decode_pool, prepare_one, model.predictor, img, i)
            for i, img in enumerate(images)
        )
    )
    return torch.stack(prepared)


def _outputs(
    results: list[dict[str, Any]], model: LoadedModel
) -> dict[str, tuple[list[Any], list[int]]]:
    index = {label: i for i, label in enumerate(model.class_names)}
    probs = [[0.0] * len(index) for _ in results]
    for row, r in zip(probs, results, strict=True):
        for entry in r["probabilities"]:
            row[index[entry["label"]]] = float(entry["probability"])
    b = len(results)
    out: dict[str, tuple[list[Any], list[int]]] = {
        "probabilities": ([v for row in probs for v in row], [b, len(index)]),
        "prediction": ([int(r["prediction"]) for r in results], [b]),
        "abstain": ([bool(r["abstain"]) for r in results], [b]),
    }
    for key in ("vgmu", "snr", "tu", "au", "eu"):
        out[key] = ([float(r[key]) for r in results], [b])
    return out


async def _infer(model: LoadedModel, request: Request, state: State) -> dict[str, Any]:
    body, binary = await _parse_body(request)
    wanted = body.get("outputs")
    names = list(OUTPUTS)
    if wanted:
        if not isinstance(wanted, list) or not all(isinstance(o, dict) for o in wanted):
            raise BadInput('outputs must be a list of {"name": ...} objects')
        names = [o.get("name") for o in wanted]
        unknown = [n for n in names if n not in OUTPUTS]
        if unknown:
            raise BadInput(f"unknown outputs {unknown}; available: {list(OUTPUTS)}")
    abstain_k, vgmu_on, timeout_s = _parameters(body)
    if state.batcher is None:
        raise NotReady("the service is starting")
    with state.batcher.incoming():
        arr = _input_tensor(body, binary, state.settings.max_images)
        x = await _to_model_input(arr, body["inputs"][0]["datatype"], model, state)
    results = await infer(
        state,
        model,
        x,
        abstain_k=effective_abstain_k(state, model, abstain_k),
        vgmu_on=vgmu_on,
        top_k=len(model.class_names),
        timeout_s=timeout_s,
    )
    tensors = _outputs(results, model)
    response: dict[str, Any] = {
        "model_name": model.name,
        "model_version": model.version,
        "outputs": [
            {"name": n, "datatype": OUTPUTS[n], "shape": tensors[n][1], "data": tensors[n][0]}
            for n in names
        ],
    }
    if "id" in body:
        response["id"] = body["id"]
    return response


@router.post("/models/{name}/infer")
async def model_infer(name: str, request: Request, state: State) -> dict[str, Any]:
    """Inference on an image batch."""
    return await _infer(state.models.get(name), request, state)


@router.post("/models/{name}/versions/{version}/infer")
async def model_version_infer(
    name: str, version: str, request: Request, state: State
) -> dict[str, Any]:
    """Inference on an explicit model version."""
    return await _infer(_versioned(state, name, version), request, state)
