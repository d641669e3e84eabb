"""The KServe V2 protocol's core, shared by V2 over HTTP (:mod:`service.frontend.routes.v2`) and
over gRPC (:mod:`service.frontend.grpc_v2`): the tensors, declared once (:class:`Tensor`:
:data:`INPUTS`, :data:`OUTPUT_TENSORS`; the metadata, config and checks read them), model metadata, the
version check, the checks of the input spec, the request parameters and the requested outputs,
packed columns → output tensors, and the Triton extensions stock tools call (model configuration,
repository index, statistics; issue 27).

A V2 request is scored by :func:`service.frontend.pipeline.infer`, as a ``/v1`` one is: each
transport parses its wire format, checks it here (:func:`check_parameters`, :func:`check_outputs`,
:func:`check_input_spec`) into a :class:`~service.frontend.pipeline.Call`, and encodes the answer's
:func:`output_tensors`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from models.limits import ABSTAIN_K_MAX, ABSTAIN_K_MIN
from models.serving import ScoreColumns
from service.common.errors import BadInput, InvalidValue, NotFound, PayloadTooLarge
from service.common.model_info import ModelInfo
from service.common.settings import Settings
from service.frontend.deps import ServiceState
from service.frontend.pipeline import Call, Pixels, normalisation
from service.frontend.review_queue import ReviewPolicy
from service.frontend.routes.schemas import (
    TIMEOUT_S_MAX,
    TIMEOUT_S_MIN,
    VgmuOn,
)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One V2 tensor, declared once (as PyTriton's ``Tensor``): its name, datatype and per-image
    shape; the model metadata, the Triton model config, the input checks and the output encoding
    all read these declarations (:data:`INPUTS`, :data:`OUTPUT_TENSORS`)."""

    name: str
    datatype: str  # V2 datatype: UINT8, FP32, INT64, BOOL
    #: Per image (the batch dimension excluded): ``image`` the model's [C, H, W], ``classes``
    #: [n_classes], ``scalar`` [].
    per_image: Literal["image", "classes", "scalar"]

    @property
    def numpy(self) -> np.dtype[Any]:
        """Its NumPy dtype on the wire (little-endian, as V2's binary extension sends it)."""
        return _NUMPY[self.datatype]

    def dims(self, model: ModelInfo) -> list[int]:
        """Its per-image shape for ``model``."""
        if self.per_image == "image":
            return list(model.input_shape)
        return [len(model.class_names)] if self.per_image == "classes" else []


_NUMPY: dict[str, np.dtype[Any]] = {
    "UINT8": np.dtype(np.uint8), "FP32": np.dtype("<f4"), "INT64": np.dtype("<i8"),
    "BOOL": np.dtype(np.bool_),
}  # fmt: skip

#: The two inputs a request may carry, exactly one of them: raw pixels, or prepared model input.
#: ``images`` takes any size and NCHW, NHWC or [B, H, W] (pipeline.channels_first, pipeline.to_model_input); its declared
#: shape is the model's.
INPUTS: tuple[Tensor, ...] = (Tensor("images", "UINT8", "image"), Tensor("input", "FP32", "image"))

#: The outputs, in the order they are listed and sent.
OUTPUT_TENSORS: tuple[Tensor, ...] = (
    Tensor("probabilities", "FP32", "classes"),
    Tensor("prediction", "INT64", "scalar"),
    Tensor("vgmu", "FP32", "scalar"),
    Tensor("snr", "FP32", "scalar"),
    Tensor("tu", "FP32", "scalar"),
    Tensor("au", "FP32", "scalar"),
    Tensor("eu", "FP32", "scalar"),
    Tensor("abstain", "BOOL", "scalar"),
)

#: Derived from the declarations: output name -> datatype; input datatype -> NumPy dtype and
#: -> input name.
OUTPUTS: dict[str, str] = {t.name: t.datatype for t in OUTPUT_TENSORS}
DTYPES: dict[str, np.dtype[Any]] = {t.datatype: t.numpy for t in INPUTS}
INPUT_NAMES: dict[str, str] = {t.datatype: t.name for t in INPUTS}
_IMAGES = INPUTS[0]


#: The protocol extensions server metadata lists. The statistics routes answer, but
#: "statistics" is not listed: perf_analyzer reads server statistics only when it is, and then
#: looks them up under the version as an integer (``std::stoll("1.0.0")`` -> "1", Triton's
#: versions are integers), finds none for this server's "1.0.0" and stops with "missing
#: statistics for requested model". Unlisted, it reports client-side numbers and completes.
SERVER_EXTENSIONS: list[str] = ["binary_tensor_data", "model_configuration"]


#: The layout of the ``images`` input this server documents; NHWC is accepted where unambiguous
#: (:func:`to_model_input`).
IMAGE_LAYOUT = "NCHW"


def _input_parameters(model: ModelInfo) -> dict[str, Any]:
    """What a client needs to build either input, as V2 ``parameters`` (flat strings and numbers
    where the protocol's parameter types allow; lists as JSON text)."""
    mean, std = normalisation(model)
    c, h, w = model.input_shape
    return {
        "images_layout": IMAGE_LAYOUT,
        "images_shape": f"[{c}, {h}, {w}]",
        "images_note": (
            f"UINT8 pixels [B, C, H, W] (or [B, H, W], or unambiguous NHWC [B, H, W, C]); C 1, 3 "
            f"or 4 and any size are converted to the model's [{c}, {h}, {w}] as /v1/predict does"
        ),
        "input_datatype": "FP32",
        "input_shape": f"[{c}, {h}, {w}]",
        "input_layout": "NCHW",
        "input_mean": json.dumps(mean),
        "input_std": json.dumps(std),
        "input_note": (
            "FP32 prepared input [B, C, H, W] = (pixels / 255 - input_mean) / input_std per "
            "channel; pixels merely scaled to [0, 1] are refused (422)"
        ),
    }


def model_metadata_dict(model: ModelInfo) -> dict[str, Any]:
    """V2 model metadata: the ``images`` input with its per-image shape (batch first, ``-1``),
    its layout and the FP32 alternative with its normalisation in ``parameters``.

    ``inputs`` lists ``images`` alone, though a request may carry the FP32 ``input`` instead: a
    request holds exactly one of the two, and stock tools (perf_analyzer, model_analyzer) send
    every listed input at once, which no request can be (issue 27). The FP32 input is described
    in ``parameters`` (``input_datatype``, ``input_shape``, ``input_mean``, ``input_std``)."""
    return {
        "name": model.name,
        "versions": [model.version],
        "platform": PLATFORM,
        "inputs": [
            {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims(model)]}
            for t in (_IMAGES,)
        ],
        "outputs": [
            {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims(model)]}
            for t in OUTPUT_TENSORS
        ],
        "parameters": {"classes": list(model.class_names), **_input_parameters(model)},
    }


#: The platform / backend a Triton client sees.
PLATFORM = "pytorch_vge"


def model_config_dict(model: ModelInfo, settings: Settings) -> dict[str, Any]:
    """Triton's model configuration (``model_config.proto`` field names, as Triton's HTTP
    ``/config`` answers): what perf_analyzer and model_analyzer read before they send a request.

    ``max_batch_size`` is the per-request image limit (``VGE_MAX_IMAGES``: the largest batch
    dimension a client may send); ``dims`` exclude the batch dimension.
    ``input`` lists ``images`` alone, as the metadata does (:func:`model_metadata_dict`: tools
    send every listed input); the FP32 ``input`` and its normalisation are in ``parameters``.
    ``dynamic_batching`` is this server's batcher: its delay and the forward-pass size it fills
    batches towards; ``instance_group`` its device and batches computed at once."""
    device = str(model.description.get("device", "cpu"))  # the engine's, as it reports it
    return {
        "name": model.name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        # one version served: "latest 1" (Triton's "specific" takes integer versions; this
        # server's are strings such as "1.0.0", in the metadata's "versions")
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": settings.max_images,
        "input": [
            {
                "name": t.name,
                "data_type": f"TYPE_{t.datatype}",
                "format": f"FORMAT_{IMAGE_LAYOUT}",
                "dims": t.dims(model),
                "optional": False,
            }
            for t in (_IMAGES,)
        ],
        "output": [
            {"name": t.name, "data_type": f"TYPE_{t.datatype}", "dims": t.dims(model)}
            if t.dims(model)
            # a scalar per image: dims [1] reshaped to [] (Triton's way to say [B])
            else {
                "name": t.name,
                "data_type": f"TYPE_{t.datatype}",
                "dims": [1],
                "reshape": {"shape": []},
            }
            for t in OUTPUT_TENSORS
        ],  # fmt: skip
        "dynamic_batching": {
            "preferred_batch_size": [settings.resolved_max_batch_size(device)],
            "max_queue_delay_microseconds": int(round(settings.max_queue_delay_ms * 1000)),
        },
        "instance_group": [
            {
                "name": model.name,
                "kind": "KIND_GPU" if device.startswith("cuda") else "KIND_CPU",
                "count": settings.batches_in_flight,
            }
        ],
        "parameters": {
            key: {"string_value": str(value)}
            for key, value in {
                **_input_parameters(model),
                "classes": json.dumps(list(model.class_names)),
                "batch_wait": settings.batch_wait,
            }.items()
        },
    }


#: What load/unload answer: this server swaps its one model through /v1/models (gated).
REPOSITORY_CONTROL = (
    "model {action} through the V2 repository API is not supported: this server serves one model "
    "and swaps it through the promote gate; use POST /v1/models/promote with "
    '{{"model": "<directory under models_root, or a shipped model>"}} (an API key is required)'
)


class RepositoryControlRefused(BadInput):
    """A V2 repository load/unload: a 400 naming the route to use instead (gRPC:
    FAILED_PRECONDITION), never a 404 or UNIMPLEMENTED."""

    code = "not_supported"
    grpc_status = "FAILED_PRECONDITION"


def repository_control(action: str) -> RepositoryControlRefused:
    """The refusal of a repository ``load`` or ``unload``."""
    return RepositoryControlRefused(REPOSITORY_CONTROL.format(action=action))


def repository_index(state: ServiceState, ready_only: bool = False) -> list[dict[str, str]]:
    """Triton's repository index: the served model (``READY``, or ``UNAVAILABLE`` while the engine
    is not ready), then the models the operator exposes as promotable: the shipped models and
    the directories under ``models_root`` named in ``VGE_REPOSITORY_INDEX_MODELS`` that hold a
    model card (``UNAVAILABLE``, the reason saying how to serve one). Not every directory under
    ``models_root``: the route is anonymous, and job ids and directory names are the operator's
    to show. Loadable entries are named as promote takes them (the directory name); their
    ``version`` is their card's, read once per card file change (:func:`_card_version`).
    ``ready_only``: the served model alone (Triton's ``ready`` flag)."""
    from service.common.catalogue import loadable_models
    from service.frontend.routes.health import is_ready

    out: list[dict[str, str]] = []
    model = state.engine.model
    if model is not None:
        ready, why = is_ready(state)
        out.append({"name": model.name, "version": model.version,
                    "state": "READY" if ready else "UNAVAILABLE", "reason": "" if ready else str(why)})  # fmt: skip
    if ready_only:
        return [m for m in out if m["state"] == "READY"]
    # Which models exist is the engine's repository's to say (service.engine.repository).
    loadable = loadable_models(state.settings)
    served = (model.name, model.version) if model is not None else None
    for name, d in loadable.items():
        version = _card_version(d / "model_card.json")
        if (name, version) == served:  # the served model's own directory: listed once, READY
            continue
        out.append({
            "name": name, "version": version, "state": "UNAVAILABLE",
            "reason": f'not loaded; serve it with POST /v1/models/promote {{"model": "{name}"}}',
        })  # fmt: skip
    return out


#: Card file -> ((mtime_ns, size), version): the repository index reads a card again only when
#: it changed (an anonymous route must not read every card on every request).
_CARD_VERSIONS: dict[Path, tuple[tuple[int, int], str]] = {}
_CARD_VERSIONS_MAX = 1024


def _card_version(path: Path) -> str:
    """The ``version`` of the model card at ``path`` ("" when it cannot be read), cached by the
    file's modification time and size."""
    try:
        st = path.stat()
    except OSError:
        return ""
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _CARD_VERSIONS.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        version = str(json.loads(path.read_text()).get("version", ""))
    except (OSError, ValueError, AttributeError):
        version = ""
    if len(_CARD_VERSIONS) >= _CARD_VERSIONS_MAX:
        _CARD_VERSIONS.clear()
    _CARD_VERSIONS[path] = (stamp, version)
    return version


def _samples(state: ServiceState) -> dict[tuple[str, str], float]:
    """The server's Prometheus samples of the batcher's families, summed over all processes (as
    /metrics aggregates them), by (sample name, model label)."""
    from prometheus_client import CollectorRegistry, multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:  # one process (a library user): this process's own registry
        registry = state.metrics.registry
    wanted = ("vge_queue_wait_seconds", "vge_compute_seconds", "vge_batch_size", "vge_rejections")
    out: dict[tuple[str, str], float] = {}
    for family in registry.collect():
        if family.name not in wanted:
            continue
        for sample in family.samples:
            key = (sample.name, sample.labels.get("model", sample.labels.get("reason", "")))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(round(seconds * 1e9))}


def model_statistics(state: ServiceState, model: ModelInfo) -> dict[str, Any]:
    """Triton's statistics of the served model, from the counts the engine's batcher keeps for
    Prometheus (service/common/metrics.py; every process's, aggregated as /metrics does), since
    the server started, over every protocol (/v1/predict, V2 HTTP and gRPC):

    * ``inference_count``: images computed (``vge_batch_size`` sum); ``execution_count``: batches
      (forward passes, ``vge_compute_seconds`` count);
    * ``queue``: requests taken into a batch and their total wait (``vge_queue_wait_seconds``);
    * ``compute_infer``: that request count, and the batches' total forward + scoring time, each
      batch counted once (Triton charges each request its batch's whole time, which this server
      does not record: ns / count here is the compute per request amortised over its batch);
    * ``success``: the same requests, ns = queue + compute_infer (server-side; front-end decoding
      and transport excluded);
    * ``fail``: requests the engine refused (queue full, deadline; ``vge_rejections``), ns 0;
    * not recorded, so zero: ``last_inference``, ``compute_input``/``compute_output`` (inside
      compute_infer), cache hits/misses (no cache), ``batch_stats``.
    """
    s = _samples(state)
    m = model.name
    requests = s.get(("vge_queue_wait_seconds_count", m), 0.0)
    queue_s = s.get(("vge_queue_wait_seconds_sum", m), 0.0)
    compute_s = s.get(("vge_compute_seconds_sum", m), 0.0)
    failed = sum(s.get(("vge_rejections_total", r), 0.0) for r in ("queue_full", "deadline"))
    zero = _duration(0, 0.0)
    queue, compute = _duration(requests, queue_s), _duration(requests, compute_s)
    # success's ns is the sum of the two rounded ns, as documented: rounding the sum of the
    # seconds instead can differ from it by 1 ns
    success = {"count": queue["count"], "ns": queue["ns"] + compute["ns"]}
    return {
        "name": m,
        "version": model.version,
        "last_inference": 0,
        "inference_count": int(s.get(("vge_batch_size_sum", m), 0.0)),
        "execution_count": int(s.get(("vge_compute_seconds_count", m), 0.0)),
        "inference_stats": {
            "success": success,
            "fail": _duration(failed, 0.0),
            "queue": queue,
            "compute_input": zero,
            "compute_infer": compute,
            "compute_output": zero,
            "cache_hit": zero,
            "cache_miss": zero,
        },
        "batch_stats": [],
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
        raise BadInput(f"input datatype {dtype!r} is not supported; use {' or '.join(DTYPES)}")
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
    "abstain_k", "vgmu_on", "timeout_s", "review", "prepare", "binary_data_output",
)  # fmt: skip


#: Parameters Triton reserves that stock clients send and that mean nothing to this server:
#: accepted and ignored. perf_analyzer's gRPC client sends ``triton_enable_empty_final_response``
#: with every request (it matters only for decoupled models, which Triton ignores it for too).
TRITON_IGNORED_PARAMETERS: tuple[str, ...] = ("triton_enable_empty_final_response",)


@dataclass(frozen=True, slots=True)
class Parameters:
    """A V2 request's parameters, checked for HTTP and gRPC alike (:func:`check_parameters`)."""

    abstain_k: float | None
    vgmu_on: str | None
    timeout_s: float | None
    prepare: str | None
    review: ReviewPolicy | None

    def call(self, model: ModelInfo, pixels: Pixels, headers: Mapping[str, str]) -> Call:
        """The pipeline's :class:`~service.frontend.pipeline.Call` for ``pixels`` (every class's
        probability: V2 answers whole vectors)."""
        return Call(
            model, pixels, headers, abstain_k=self.abstain_k, vgmu_on=self.vgmu_on,
            prepare=self.prepare, review=self.review, timeout_s=self.timeout_s,
        )  # fmt: skip


def check_parameters(params: dict[str, Any]) -> Parameters:
    """A request's ``abstain_k``, ``vgmu_on``, ``timeout_s``, ``prepare`` (``mnist``/``none``) and
    ``review`` (``auto``/``always``/``never``), as on /v1/predict; and that it sends no parameter
    this server does not read. What they mean for the model and the queue is the pipeline's."""
    unknown = [
        str(key)
        for key in params
        if key not in REQUEST_PARAMETERS and key not in TRITON_IGNORED_PARAMETERS
    ]
    if unknown:
        raise BadInput(
            f"unknown request parameter {unknown[0][:64]!r}; this server reads "
            f"{', '.join(REQUEST_PARAMETERS)}"
        )
    flag = params.get("binary_data_output")  # HTTP's own; gRPC answers raw tensors anyway
    if flag is not None and not isinstance(flag, bool):  # the string "false" is not false
        raise BadInput("binary_data_output must be true or false")
    k = params.get("abstain_k")
    if k is not None and (not is_number(k) or not ABSTAIN_K_MIN <= k <= ABSTAIN_K_MAX):
        raise InvalidValue(f"abstain_k must be a number in [{ABSTAIN_K_MIN:g}, {ABSTAIN_K_MAX:g}]")
    vgmu_on = params.get("vgmu_on")
    if vgmu_on is not None and vgmu_on not in get_args(VgmuOn):
        raise InvalidValue(f"vgmu_on must be one of {', '.join(map(repr, get_args(VgmuOn)))}")
    timeout = params.get("timeout_s")
    if timeout is not None and (
        not is_number(timeout) or not TIMEOUT_S_MIN <= timeout <= TIMEOUT_S_MAX
    ):
        raise InvalidValue(
            f"timeout_s must be a number in [{TIMEOUT_S_MIN:g}, {TIMEOUT_S_MAX:g}] (seconds)"
        )
    review = params.get("review")
    if review is not None and review not in get_args(ReviewPolicy):
        raise InvalidValue(f"review must be one of {', '.join(map(repr, get_args(ReviewPolicy)))}")
    prepare = params.get("prepare")
    if prepare is not None and not isinstance(prepare, str):
        raise InvalidValue("prepare must be a string: 'mnist' or 'none'")
    return Parameters(k, vgmu_on, timeout, prepare, review)


def check_outputs(names: list[Any]) -> list[str]:
    """The requested output names (all of them when none is named), each one this model has."""
    unknown = [n for n in names if not isinstance(n, str) or n not in OUTPUTS]
    if unknown:
        raise BadInput(f"unknown outputs {unknown}; available: {list(OUTPUTS)}")
    if len(set(names)) != len(names):  # the answer would carry a tensor twice
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BadInput(f"outputs {twice} requested more than once: name each once")
    return list(names) or list(OUTPUTS)


def output_tensors(columns: ScoreColumns, n_classes: int) -> dict[str, np.ndarray]:
    """The V2 output tensors (:data:`OUTPUT_TENSORS`) from the packed columns: the probabilities
    scattered back from the top-k over all classes, each per-image score its column."""
    probs = np.zeros((len(columns), n_classes), dtype=np.float64)
    np.put_along_axis(probs, columns.top_indices, columns.top_probabilities, axis=1)
    return {
        t.name: (probs if t.per_image == "classes" else columns.column(t.name)).astype(t.numpy)
        for t in OUTPUT_TENSORS
    }
