"""KServe V2 / Open Inference Protocol, so existing clients (e.g. ``tritonclient.http``) work.

Input: one image-batch tensor, batch dimension first —

* ``images``, ``UINT8`` ``[B, C, H, W]`` (NCHW, the metadata's shape), ``[B, H, W]`` or
  unambiguous NHWC ``[B, H, W, C]``: raw pixels, prepared exactly like /v1/predict images;
* ``input``, ``FP32`` ``[B, Cin, H', W']``: already-prepared model input, ``(pixels / 255 - mean)
  / std`` with the mean and std in the metadata's ``parameters`` (pixels only scaled to [0, 1]
  are a 422 giving them).

Triton's extensions its tools call: ``/config`` (model configuration), ``/stats`` (statistics),
``POST /v2/repository/index``; repository load/unload answer 400 naming /v1/models/promote
(:mod:`service.frontend.v2_core` has the logic, shared with gRPC).

Data as a JSON list or with the binary tensor extension (``Inference-Header-Content-Length``), in
both directions: outputs requested with ``"parameters": {"binary_data": true}`` (or the request
parameter ``binary_data_output``) come back as raw little-endian tensors after the JSON header.
Request ``parameters``: ``abstain_k``, ``vgmu_on`` (``p``/``q``; default: the model's answer set),
``timeout_s``, ``review`` (``auto``/``always``/``never``, with the review queue on, as on
/v1/predict; ``always`` needs a key); any other is a 400 naming it. What the review queue did is
in the response's ``parameters``: ``review_status`` and ``review_id``, comma-separated per image
(``UINT8`` pixels are stored as PNG; ``FP32`` input, already normalised, is not an image a person
can label: ``unsupported_input``).
Outputs: ``probabilities`` FP32 [B, C], ``prediction`` INT64 [B], ``vgmu``, ``snr``, ``tu``,
``au``, ``eu`` FP32 [B], ``abstain`` BOOL [B]. Errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from service.common.errors import BadInput, PayloadTooLarge
from service.common.model_info import ModelInfo
from service.frontend.deps import ServiceState, State, service_state
from service.frontend.multipart import INLINE_PARSE_BYTES
from service.frontend.pipeline import Pixels, infer, parse_json
from service.frontend.routes.direct import add_direct_route
from service.frontend.routes.health import is_ready
from service.frontend.routes.schemas import error_responses
from service.frontend.v2_core import (
    DTYPES,
    OUTPUTS,
    SERVER_EXTENSIONS,
    check_input_spec,
    check_outputs,
    check_parameters,
    is_number,
    model_config_dict,
    model_metadata_dict,
    model_statistics,
    output_tensors,
    repository_control,
    repository_index,
    versioned_model,
)

router = APIRouter(
    prefix="/v2", tags=["v2"], responses=error_responses(400, 404, 413, 422, 503, 504)
)


@router.get("")
async def server_metadata() -> dict[str, Any]:
    """Server metadata."""
    from importlib.metadata import version

    return {
        "name": "vge-serve",
        "version": version("vge-serve"),
        "extensions": SERVER_EXTENSIONS,
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


# Triton's extensions that stock tools call (perf_analyzer, model_analyzer, tritonclient):
# statistics, model configuration, repository. /models/stats before /models/{name}.
async def _statistics(state: ServiceState, model: ModelInfo) -> dict[str, Any]:
    """Triton's statistics answer for ``model`` (read off the metrics files: off the loop)."""
    return {"model_stats": [await asyncio.to_thread(model_statistics, state, model)]}


@router.get("/models/stats")
async def all_model_statistics(state: State) -> dict[str, Any]:
    """Statistics of every served model (this server serves one), in Triton's shape:
    inference/execution counts and cumulative queue/compute times since start (see
    ``v2_core.model_statistics`` for what each field counts)."""
    return await _statistics(state, state.model())


@router.get("/models/{name}/stats")
async def model_stats(name: str, state: State) -> dict[str, Any]:
    """Statistics of the model (Triton's shape)."""
    return await _statistics(state, state.model(name))


@router.get("/models/{name}/versions/{version}/stats")
async def model_version_stats(name: str, version: str, state: State) -> dict[str, Any]:
    """Statistics of an explicit model version (404 for a version this server does not serve)."""
    return await _statistics(state, versioned_model(state, name, version))


@router.get("/models/{name}/config")
async def model_config(name: str, state: State) -> dict[str, Any]:
    """The model's configuration in Triton's schema (``model_config.proto`` field names):
    ``max_batch_size`` (images per request), inputs with data type, NCHW format and dims without
    the batch dimension, outputs, ``dynamic_batching`` (the batcher's delay and batch size),
    version policy, and the FP32 input's normalisation in ``parameters``."""
    return model_config_dict(state.model(name), state.settings)


@router.get("/models/{name}/versions/{version}/config")
async def model_version_config(name: str, version: str, state: State) -> dict[str, Any]:
    """The configuration of an explicit model version."""
    return model_config_dict(versioned_model(state, name, version), state.settings)


class RepositoryIndexRequest(BaseModel):
    """Triton's repository index request: ``ready`` true lists only the models ready to serve."""

    model_config = ConfigDict(extra="forbid")
    ready: StrictBool = False


@router.post("/repository/index")
async def repository_index_route(
    state: State, body: Annotated[RepositoryIndexRequest | None, Body()] = None
) -> list[dict[str, str]]:
    """The served model (``READY``) and the models it can promote (directories under
    models_root, shipped models; ``UNAVAILABLE``, the reason says how), as Triton's index."""
    ready_only = body.ready if body is not None else False
    return await asyncio.to_thread(repository_index, state, ready_only)


# Load and unload exist so a stock client gets a clear 400 naming the route to use (not a 404);
# they are not offered in the OpenAPI document, since no request to them can succeed.
@router.post("/repository/models/{name}/load", include_in_schema=False)
async def repository_load(name: str) -> None:
    """Refused: swap models with POST /v1/models/promote."""
    raise repository_control("load")


@router.post("/repository/models/{name}/unload", include_in_schema=False)
async def repository_unload(name: str) -> None:
    """Refused: this server always serves one model."""
    raise repository_control("unload")


@router.get("/models/{name}")
async def model_metadata(name: str, state: State) -> dict[str, Any]:
    """Model metadata (inputs, outputs, versions)."""
    return model_metadata_dict(state.model(name))


@router.get("/models/{name}/versions/{version}")
async def model_version_metadata(name: str, version: str, state: State) -> dict[str, Any]:
    """Model metadata for an explicit version."""
    return model_metadata_dict(versioned_model(state, name, version))


@router.get("/models/{name}/ready")
async def model_ready(name: str, state: State) -> JSONResponse:
    """Model readiness."""
    state.model(name)
    ok, _ = is_ready(state)
    return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)


@router.get("/models/{name}/versions/{version}/ready")
async def model_version_ready(name: str, version: str, state: State) -> JSONResponse:
    """Readiness of an explicit model version (404 for a version this server does not serve)."""
    versioned_model(state, name, version)
    ok, _ = is_ready(state)
    return JSONResponse(
        {"name": name, "version": version, "ready": ok}, status_code=200 if ok else 503
    )


async def _parse_body(request: Request, max_json: int) -> tuple[dict[str, Any], bytes, int]:
    """The request's JSON (capped at ``max_json`` bytes; parsed in a worker thread when over
    INLINE_PARSE_BYTES: json.loads holds the interpreter), its binary tensor data and the JSON's
    size in bytes."""
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
    if len(head) > max_json:  # (a whole-JSON body is capped by the middleware already)
        raise PayloadTooLarge(
            f"inference request JSON of {len(head)} bytes exceeds the limit of {max_json} bytes "
            "(VGE_MAX_JSON_BYTES); send large tensors with the binary tensor extension"
        )
    if len(head) > INLINE_PARSE_BYTES:
        body = await asyncio.to_thread(parse_json, head, "inference request header")
    else:
        body = parse_json(head, "inference request header")
    if not isinstance(body, dict):
        raise BadInput("inference request must be a JSON object")
    return body, binary, len(head)


def _input_tensor(body: dict[str, Any], binary: bytes, max_images: int) -> np.ndarray:
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadInput("inputs must hold exactly one tensor: the image batch")
    spec = inputs[0]
    dtype, shape = spec.get("datatype"), spec.get("shape")
    count = check_input_spec(spec.get("name"), dtype, shape, max_images)
    if not isinstance(dtype, str):  # check_input_spec refused any other; this narrows for DTYPES
        raise BadInput(f"unsupported datatype {dtype!r}")
    size = _object(spec.get("parameters"), "input parameters").get("binary_data_size")
    if size is not None:
        if not is_number(size) or size != count * DTYPES[dtype].itemsize:
            raise BadInput(f"binary_data_size {size!r} does not match shape {shape} of {dtype}")
        if size != len(binary):  # one input: its bytes are all the binary data there is
            raise BadInput(
                f"binary_data_size {size} but the request carries {len(binary)} bytes of "
                "binary tensor data"
            )
        arr = np.frombuffer(binary, dtype=DTYPES[dtype])  # size == len(binary): whole items
    else:
        data = spec.get("data")
        if data is None:
            raise BadInput("input has neither data nor binary_data_size")
        try:
            raw = np.asarray(data)
        except (ValueError, TypeError):  # ragged nesting
            raw = np.asarray(None)
        # Not strings, booleans (also mixed with numbers: numpy would make them 0 and 1), nulls
        # or ragged lists.
        if raw.dtype.kind not in "iuf" or (
            raw.dtype.kind in "iu" and any(v is True or v is False for v in _flat(data))
        ):
            raise BadInput("input data must be a (flat or nested) list of numbers")
        arr = raw.astype(np.float64).reshape(-1)
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


def _object(value: Any, what: str) -> dict[str, Any]:
    """``value`` when it is a JSON object, ``{}`` when absent, else a 400 naming ``what``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{what} must be an object; got {type(value).__name__}")
    return value


def _flag(params: dict[str, Any], key: str, what: str) -> bool | None:
    """A boolean parameter (JSON ``true``/``false``), None when absent, else a 400: the string
    ``"false"`` must not switch a flag on."""
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadInput(f"{what} {key} must be true or false; got {value!r}")
    return value


def _flat(data: Any) -> Any:
    """The leaves of a nested list."""
    for v in data if isinstance(data, list) else (data,):
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


def _binary_wanted(body: dict[str, Any], wanted: list[dict[str, Any]] | None) -> dict[str, bool]:
    """Per output: send it with the binary tensor extension (request- or output-level flag)."""
    params = _object(body.get("parameters"), "parameters")
    default = bool(_flag(params, "binary_data_output", "parameters"))
    flags = {name: default for name in OUTPUTS}
    for o in wanted or []:
        flag = _flag(_object(o.get("parameters"), f"output {o['name']!r} parameters"),
                     "binary_data", f"output {o['name']!r} parameter")  # fmt: skip
        if flag is not None:
            flags[o["name"]] = flag
    return flags


def _encode(response: dict[str, Any], tensors: dict[str, np.ndarray], binary: dict[str, bool],
            names: list[str]) -> Response:  # fmt: skip
    """JSON, or the binary tensor extension: JSON header + raw little-endian tensors in order."""
    chunks: list[bytes] = []
    outputs = []
    for n in names:
        t = tensors[n]
        entry: dict[str, Any] = {"name": n, "datatype": OUTPUTS[n], "shape": list(t.shape)}
        if binary[n]:
            raw = np.ascontiguousarray(t).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = t.reshape(-1).tolist()
        outputs.append(entry)
    head = json.dumps({**response, "outputs": outputs}, separators=(",", ":")).encode()
    if not chunks:
        return Response(head, media_type="application/json")
    return Response(
        head + b"".join(chunks),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


async def _infer(model: ModelInfo, request: Request, state: State) -> Response:
    """V2 HTTP's adapter over the one scoring path (:func:`service.frontend.pipeline.infer`):
    parse the JSON or binary-extension body into a call, encode the answer's tensors."""
    body, binary, json_size = await _parse_body(request, state.settings.max_json_bytes)
    wanted = body.get("outputs")
    if wanted is not None and (
        not isinstance(wanted, list) or not all(isinstance(o, dict) for o in wanted)
    ):  # "" or {} asked for nothing nameable: not "every output"
        raise BadInput('outputs must be a list of {"name": ...} objects')
    names = check_outputs([o.get("name") for o in wanted or []])
    binary_wanted = _binary_wanted(body, wanted)  # checked before the batch is computed
    params = check_parameters(_object(body.get("parameters"), "parameters"))
    if json_size <= INLINE_PARSE_BYTES:
        arr = _input_tensor(body, binary, state.settings.max_images)
    else:  # a long JSON list: numpy's conversion and the checks hold the interpreter
        arr = await asyncio.to_thread(_input_tensor, body, binary, state.settings.max_images)
    pixels = Pixels(arr, body["inputs"][0]["datatype"])
    answer = await infer(state, params.call(model, pixels, request.headers))
    response: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if "id" in body:
        response["id"] = body["id"]
    if answer.review:  # what the review queue did (review_status, review_id)
        response["parameters"] = answer.review
    tensors = output_tensors(answer.columns, len(model.class_names))
    return _encode(response, tensors, binary_wanted, names)


async def model_infer(name: str, request: Request) -> Response:
    """Inference on an image batch."""
    state = service_state(request)  # not the State dependency: see service_state
    return await _infer(state.model(name), request, state)


# The request in, the Response out, past FastAPI (routes/direct.py): _infer parses and encodes.
add_direct_route(router, "/models/{name}/infer", model_infer)


async def model_version_infer(name: str, version: str, request: Request) -> Response:
    """Inference on an explicit model version."""
    state = service_state(request)
    return await _infer(versioned_model(state, name, version), request, state)


add_direct_route(router, "/models/{name}/versions/{version}/infer", model_version_infer)
