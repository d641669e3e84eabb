"""Checkpoints: safetensors weights + a JSON model card, verified by sha256, never unpickled.

``model_dir/model.safetensors`` holds the state dict; ``model_dir/model_card.json`` holds a
:class:`ModelCard` with everything needed to rebuild the module through
:func:`models.ensembles.build_ensemble` and to prepare inputs (channels, size, normalisation), plus
provenance (data fingerprint, training config), the learned VGN ``k``, evaluation metrics and the
calibrated deferral threshold ``abstain_k``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from models.problems import validation_problems

__all__ = [
    "ArchitectureSpec",
    "CARD_FILE",
    "CARD_LIMITS",
    "CLASS_NAME_PATTERN",
    "WEIGHTS_FILE",
    "CheckpointError",
    "ModelCard",
    "check_class_names",
    "check_weights",
    "file_sha256",
    "learned_k",
    "load_checkpoint",
    "read_card",
    "regular_file",
    "save_card",
    "save_checkpoint",
]

WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "model_card.json"


#: Upper bounds of an architecture (:class:`ArchitectureSpec`): a training config's and a model
#: card's alike, so that neither a run nor a served model can be larger than a run may be.
#: ``models.training.LIMITS`` holds them beside the training-only bounds.
ARCHITECTURE_LIMITS: dict[str, int] = {
    "members": 100,  # M of DE/LLE, S of MCD, H of MCD-LLE (the paper: 5-10)
    "mc_samples": 100,  # S per head of MCD-LLE
    "backbone_kwargs_keys": 16,  # keyword arguments of the backbone
    "backbone_kwargs_int": 4096,  # |an integer argument| (a width, a depth, a hidden size)
    "backbone_kwargs_list": 8,  # items of a list argument (ResNet widths/blocks: 4)
    "backbone_kwargs_str": 64,  # characters of a key or of a string argument
    "parameters": 1_000_000_000,  # the whole ensemble's parameters (WRN-28-10 DE, M = 10: 365M)
}


class CheckpointError(ValueError):
    """A model directory is missing a file, is malformed, or its weights fail verification."""


class ArchitectureSpec(BaseModel):
    """An ensemble's architecture: with the data's class count and input channels, everything
    :func:`models.ensembles.build_ensemble` needs.

    One definition shared by :class:`models.training.TrainConfig` (what to train) and
    :class:`ModelCard` (what was trained), so a config and the card of the model it produced name
    and validate the architecture alike. ``k`` is the *fixed* VGN gate sensitivity (one value, or
    one per class); ``None`` learns a per-class ``k``. Cards write it as ``k_fixed`` (their name for
    it since 0.1) and read either name.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    backbone: str
    backbone_kwargs: dict[str, Any] = Field(default_factory=dict)
    ensemble: str = Field(description="de | lle | mcd | mcd-lle")
    members: int = Field(
        ge=2, description="de/lle: M; mcd: S samples; mcd-lle: H heads (>= 2: scores need a spread)"
    )
    mc_samples: int = Field(10, ge=1, description="mcd-lle: S dropout samples per head")
    vgn: bool = False
    k: float | list[float] | None = Field(
        None, description="fixed VGN k (one, or one per class); omit to learn per-class k"
    )

    @field_validator("backbone")
    @classmethod
    def _backbone(cls, v: str) -> str:
        from models.nets import available_backbones

        if v not in available_backbones():
            raise ValueError(f"unknown backbone; available: {', '.join(available_backbones())}")
        return v

    @field_validator("members", "mc_samples")
    @classmethod
    def _count_bound(cls, v: int, info: ValidationInfo) -> int:
        bound = ARCHITECTURE_LIMITS[str(info.field_name)]
        if v > bound:
            raise ValueError(f"must be at most {bound} (the training bound)")
        return v

    @field_validator("backbone_kwargs")
    @classmethod
    def _backbone_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        """A few scalar (or short list) keyword arguments of bounded size: a backbone's
        constructor takes widths, depths, dropout rates and activation names, nothing bigger."""
        limits = ARCHITECTURE_LIMITS
        if len(v) > limits["backbone_kwargs_keys"]:
            raise ValueError(f"at most {limits['backbone_kwargs_keys']} keyword arguments")
        for key, value in v.items():
            if not key.isidentifier() or len(key) > limits["backbone_kwargs_str"]:
                raise ValueError(
                    f"{key[:80]!r} is not a keyword argument name (an identifier of at most "
                    f"{limits['backbone_kwargs_str']} characters)"
                )
            items = value if isinstance(value, (list, tuple)) else [value]
            if isinstance(value, (list, tuple)) and len(value) > limits["backbone_kwargs_list"]:
                raise ValueError(f"{key}: a list of at most {limits['backbone_kwargs_list']} items")
            for item in items:
                problem = _kwarg_problem(item)
                if problem:
                    raise ValueError(f"{key}: {problem}")
        return v

    @field_validator("ensemble")
    @classmethod
    def _ensemble(cls, v: str) -> str:
        from models.ensembles.factory import normalise_kind

        return normalise_kind(v)

    @field_validator("k")
    @classmethod
    def _k(cls, v: float | list[float] | None) -> float | list[float] | None:
        values = v if isinstance(v, list) else [] if v is None else [v]
        if not all(math.isfinite(x) and x > 0 for x in values):
            raise ValueError("must be > 0 and finite")
        return v

    @model_validator(mode="after")
    def _architecture(self) -> ArchitectureSpec:
        from models.ensembles.factory import VGN_KINDS

        if self.vgn and self.ensemble not in VGN_KINDS:
            raise ValueError(
                f"vgn is only available for de and lle ensembles, not "
                f"{self.ensemble!r} (paper Table 2)"
            )
        if self.k is not None and not self.vgn:
            raise ValueError("k is only meaningful with vgn: true")
        return self

    def architecture(self) -> ArchitectureSpec:
        """The architecture alone (from a config or a card)."""
        return ArchitectureSpec(**{f: getattr(self, f) for f in ArchitectureSpec.model_fields})

    def check_buildable(self, num_classes: int, in_channels: int) -> None:
        """Build this architecture on the meta device (no memory; milliseconds) and raise
        ``ValueError`` naming what does not fit: ``backbone_kwargs`` the backbone does not take, a
        per-class ``k`` with the wrong length. A training job checks this when it is submitted,
        not minutes later in its own process."""
        import torch

        try:
            with torch.device("meta"):
                self.build(num_classes, in_channels)
        except TypeError as exc:  # the backbone's constructor: an unexpected keyword argument
            raise ValueError(f"backbone_kwargs do not fit {self.backbone}: {exc}") from None

    def build(self, num_classes: int, in_channels: int) -> nn.Module:
        """The (untrained) ensemble with this architecture."""
        from models.ensembles import build_ensemble

        return build_ensemble(
            self.ensemble,
            self.backbone,
            num_classes,
            self.members,
            self.vgn,
            in_channels,
            backbone_kwargs=self.backbone_kwargs,
            k=self.k,
            mc_samples=self.mc_samples,
        )


def _kwarg_problem(item: Any) -> str | None:
    """Why ``item`` is not an acceptable backbone argument value, or None when it is."""
    if item is None or isinstance(item, bool):
        return None
    if isinstance(item, int):
        bound = ARCHITECTURE_LIMITS["backbone_kwargs_int"]
        return None if abs(item) <= bound else f"{item} is out of range (|value| <= {bound})"
    if isinstance(item, float):
        return None if math.isfinite(item) else "must be a finite number"
    if isinstance(item, str):
        bound = ARCHITECTURE_LIMITS["backbone_kwargs_str"]
        return None if len(item) <= bound else f"a string of at most {bound} characters"
    return "values must be numbers, booleans, short strings or short lists of them"


#: A model's name as trained and served, and a model directory's name under the server's models
#: root: a URL path segment (``/v2/models/{name}``) and a file name, with no separators or
#: traversal.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: A class name as a card lists it: answers, metric labels and review labels carry it, so it is a
#: short word (letters, digits, space, ``_ . + -``), never a path: no separator, no ``..``.
CLASS_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.+-]{0,63}$"
#: A model's version (``/v2/models/{name}/versions/{version}``; a retrain appends ``-<job id>``).
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"

#: What a model card may describe. A card is input the server trusts to size its buffers and
#: label its answers, so it is bounded: its architecture by :data:`ARCHITECTURE_LIMITS` (as a
#: training config's), and the rest by:
CARD_LIMITS: dict[str, int] = {
    "classes": 1000,  # class names (ImageNet's count); at least 2: a decision between classes
    "input_side": 512,  # pixels per side of the model's input (training's image_size bound)
    "min_input_side": 8,  # (training's image_size lower bound)
    "card_bytes": 8 << 20,  # model_card.json (the shipped cards: 30-45 kB)
    "text": 4096,  # characters of a free-text field (description, dataset)
    "json_depth": 32,  # nesting of the free-form sections (metrics, training, calibration)
}

_CLASS_NAME_RE = re.compile(CLASS_NAME_PATTERN)

#: Fields a card writes before its architecture (the card's key order since 0.1).
_CARD_HEAD = ("name", "version", "description")

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Side = Annotated[int, Field(ge=CARD_LIMITS["min_input_side"], le=CARD_LIMITS["input_side"])]
Text = Annotated[str, Field(max_length=CARD_LIMITS["text"])]


def check_json_finite(value: Any, where: str = "", depth: int = 0) -> None:
    """Raise ``ValueError`` naming the first place in ``value`` (parsed JSON) that is not a
    finite number, a string, a boolean or null, or that nests deeper than
    ``CARD_LIMITS["json_depth"]``. NaN and Infinity are not JSON: a card holding one would make
    every answer that shows it (``GET /v1/models``) fail to encode."""
    at = where or "value"
    if depth > CARD_LIMITS["json_depth"]:
        raise ValueError(f"{at}: nested deeper than {CARD_LIMITS['json_depth']} levels")
    if value is None or isinstance(value, bool | str | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{at}: {value} is not a finite number")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_json_finite(item, f"{where}.{key}" if where else str(key), depth + 1)
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json_finite(item, f"{at}[{i}]", depth + 1)
        return
    raise ValueError(f"{at}: {type(value).__name__} is not a JSON value")


def check_class_names(names: list[str]) -> None:
    """Raise ``ValueError`` naming the first problem of a model's class names: a count outside
    2 … ``CARD_LIMITS["classes"]``, a name not matching :data:`CLASS_NAME_PATTERN` or holding
    ``..``, a repeated name. Training checks its data's classes with it before a run, so no run
    ends with a card that no server would load."""
    if not 2 <= len(names) <= CARD_LIMITS["classes"]:
        raise ValueError(f"{len(names)} classes; a model has 2 to {CARD_LIMITS['classes']}")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _CLASS_NAME_RE.match(name) or ".." in name:
            raise ValueError(
                f"class {i} ({repr(name)[:80]}) is not a class name: 1-64 letters, digits, "
                "spaces and '_ . + -', starting with a letter or digit, no '..'"
            )
    if len(set(names)) != len(names):
        repeated = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"class name {repeated!r} appears more than once")


def _in_order(given: dict[str, Any], validated: dict[str, Any]) -> dict[str, Any]:
    """``validated`` (a section parsed by its schema) in ``given``'s key order: a card written
    back (a retrain, a recalibration) keeps its sections as they were."""
    return {key: validated[key] for key in given if key in validated}


class _Calibration(BaseModel):
    """What the server reads of ``abstain_calibration`` (the rest is kept: finite JSON)."""

    model_config = ConfigDict(extra="allow")

    abstain_k: NonNegative | None = None
    members: Literal["p", "q"] = "p"
    by_members: dict[Literal["p", "q"], NonNegative | None] = Field(default_factory=dict)
    achieved_deferral: Fraction | None = None


class _UncertaintyReference(BaseModel):
    """What the engine's uncertainty monitor reads of ``uncertainty_reference``: per drift score
    (VGMU, EU) the validation split's fractions per bin of
    :data:`models.evaluation.drift.DRIFT_EDGES`, and the calibrated deferral rate."""

    model_config = ConfigDict(extra="allow")

    edges: list[FiniteFloat] | None = None
    fractions: dict[Literal["vgmu", "eu"], list[Fraction]] = Field(default_factory=dict)
    deferral: Fraction | None = None
    n: Annotated[int, Field(ge=0)] | None = None
    split: Annotated[str, Field(max_length=64)] | None = None

    @field_validator("fractions")
    @classmethod
    def _bins(cls, v: dict[str, list[float]]) -> dict[str, list[float]]:
        from models.evaluation.drift import DRIFT_EDGES

        for score, fractions in v.items():
            if len(fractions) != len(DRIFT_EDGES) - 1:
                raise ValueError(
                    f"{score}: {len(fractions)} fractions; the drift monitor bins into "
                    f"{len(DRIFT_EDGES) - 1} (models.evaluation.drift.DRIFT_EDGES)"
                )
        return v


class ModelCard(ArchitectureSpec):
    """Description of a trained model (its :class:`ArchitectureSpec`, data, provenance, metrics);
    JSON-serialised next to its weights.

    A card is untrusted input, validated whole whenever one is built or read: every field the
    server reads has a type and bounds (names and class names a safe pattern, ``in_channels`` 1
    or 3, input sides 8-512, 2-1000 classes, ``mean``/``std`` one finite value per channel), the
    architecture is within the training bounds, and every number anywhere in it is finite. A card
    that fails names the field (:func:`read_card`), and nothing of it is served.
    """

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    version: str = Field("1.0.0", pattern=VERSION_PATTERN)
    description: Text = ""
    class_names: list[str]
    in_channels: Literal[1, 3]
    input_size: tuple[Side, Side]  # (H, W)
    mean: list[FiniteFloat]
    std: list[Positive]
    dataset: Text = ""
    data_fingerprint: Annotated[str, Field(max_length=256)] = ""
    learned_k: list[Positive] | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    abstain_calibration: dict[str, Any] = Field(default_factory=dict)
    #: validation-split distribution of the served VGMU/EU (models.evaluation.drift)
    uncertainty_reference: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    weights_sha256: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    created_at: Annotated[str, Field(max_length=64)] = Field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds")
    )

    @field_validator("name", "version")
    @classmethod
    def _no_traversal(cls, v: str) -> str:
        if ".." in v:
            raise ValueError("must not contain '..'")
        return v

    @field_validator("class_names")
    @classmethod
    def _class_names(cls, v: list[str]) -> list[str]:
        check_class_names(v)
        return v

    @field_validator("metrics", "training")
    @classmethod
    def _finite(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_json_finite(v)
        return v

    @field_validator("abstain_calibration")
    @classmethod
    def _calibration(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        check_json_finite(v)
        return _in_order(v, _Calibration.model_validate(v).model_dump(exclude_unset=True))

    @field_validator("uncertainty_reference")
    @classmethod
    def _reference(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        check_json_finite(v)
        return _in_order(v, _UncertaintyReference.model_validate(v).model_dump(exclude_unset=True))

    @model_validator(mode="after")
    def _consistent_card(self) -> ModelCard:
        """One ``mean``/``std`` value per input channel and one ``k`` per class (the
        architecture's bounds are :class:`ArchitectureSpec`'s, a training config's too)."""
        for field in ("mean", "std"):
            n = len(getattr(self, field))
            if n != self.in_channels:
                raise ValueError(
                    f"{field}: {n} values for in_channels {self.in_channels}; one per channel"
                )
        for field, values in (("k_fixed", self.k), ("learned_k", self.learned_k)):
            if isinstance(values, list) and len(values) != self.num_classes:
                raise ValueError(f"{field}: {len(values)} values for {self.num_classes} classes")
        return self

    @model_validator(mode="before")
    @classmethod
    def _card_names(cls, data: Any) -> Any:
        """Cards name the fixed VGN k ``k_fixed``; accept it (and ``k``) as the spec's ``k``."""
        if isinstance(data, dict) and "k_fixed" in data:
            if "k" in data:
                raise ValueError("give k_fixed or k, not both")
            data = {("k" if key == "k_fixed" else key): v for key, v in data.items()}
        return data

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The card's JSON as written since 0.1: ``k`` as ``k_fixed``, name/version/description
        first, then the architecture, then the rest."""
        data = handler(self)
        head = {f: data.pop(f) for f in _CARD_HEAD if f in data}
        arch = {
            ("k_fixed" if f == "k" else f): data.pop(f)
            for f in ArchitectureSpec.model_fields
            if f in data
        }
        return {**head, **arch, **data}

    @property
    def k_fixed(self) -> float | list[float] | None:
        """The fixed VGN k (``None``: learned); the card's name for :attr:`ArchitectureSpec.k`."""
        return self.k

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def answer_members(self) -> str:
        """The member set answers come from by default: ``"q"`` for VGN models, else ``"p"``."""
        return "q" if self.vgn else "p"

    @property
    def abstain_k(self) -> float | None:
        """Calibrated deferral threshold of the served rule (default member set), if any."""
        return self.abstain_k_for(self.answer_members)

    def abstain_k_for(self, members: str) -> float | None:
        """The deferral threshold calibrated for VGMU on ``members`` (``"p"``/``"q"``), if any.

        ``abstain_calibration`` holds the calibration of the served rule (its ``members`` key;
        cards from before 0.2 calibrated on ``p`` and have none) and, under ``by_members``, the
        ``abstain_k`` of the other member set, so that ``vgmu_on`` overrides get their own k.
        """
        cal = self.abstain_calibration
        if not cal:
            return None
        if cal.get("members", "p") == members:
            v = cal.get("abstain_k")
        else:
            v = (cal.get("by_members") or {}).get(members)
        return None if v is None else float(v)


def regular_file(path: Path, what: str) -> BinaryIO:
    """``path`` opened for reading, when it is a regular file: a symbolic link is refused without
    being followed (so nothing of its target is read, hashed or reported), as are directories,
    FIFOs and devices (which would block or never end). ``CheckpointError`` names the file and
    ``what`` it should be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(
                f"{path}: the {what} is a symbolic link; a model directory's files must be "
                "regular files (a link is not followed)"
            ) from None
        raise CheckpointError(f"{path}: cannot open the {what}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: the {what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_sha256(path: Path) -> str:
    """Hex sha256 of a regular file's bytes (:func:`regular_file`: a symbolic link is refused,
    never hashed: its digest in an error would tell a caller the hash of any file)."""
    h = hashlib.sha256()
    with regular_file(Path(path), "file") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def learned_k(module: nn.Module) -> list[float] | None:
    """The VGN's per-class ``k`` (learned or fixed) as a list, or ``None`` for non-VGN models."""
    vgn = getattr(module, "vgn", None)
    if vgn is None:
        return None
    return [float(v) for v in vgn.k.detach().cpu().flatten()]


def build_from_card(card: ModelCard) -> nn.Module:
    """Rebuild the (untrained) ensemble described by ``card``."""
    return card.build(card.num_classes, card.in_channels)


def save_checkpoint(module: nn.Module, card: ModelCard, out_dir: str | Path) -> ModelCard:
    """Write ``model.safetensors`` and ``model_card.json`` (with the weights' sha256) to ``out_dir``.

    Returns the card as written (``weights_sha256`` and ``learned_k`` filled in).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}
    weights = out / WEIGHTS_FILE
    tmp = weights.with_suffix(".safetensors.tmp")
    # a single metadata key: safetensors serialises the metadata map in hash order, so several
    # keys would make the file bytes (and the sha256) differ between identical saves
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights)
    # safetensors writes 0600 whatever the umask; weights are meant to be shared/packaged, so they
    # get the mode any new file gets: 0644 under the usual umask 022, 0600 inside ``vge serve``
    # (VGE_UMASK, 0077 by default: files the server creates are private).
    mask = os.umask(0)
    os.umask(mask)
    weights.chmod(0o666 & ~mask)
    card = card.model_copy(
        update={"weights_sha256": file_sha256(weights), "learned_k": learned_k(module)}
    )
    save_card(card, out)
    return card


def save_card(card: ModelCard, model_dir: str | Path) -> None:
    """Write ``card`` as ``model_dir/model_card.json`` (the weights and their sha256 untouched).

    The card is validated whole first (``model_copy`` does not validate): a card is never written
    that :func:`read_card` would refuse."""
    ModelCard.model_validate(card.model_dump())
    path = Path(model_dir) / CARD_FILE
    path.write_text(json.dumps(card.model_dump(mode="json"), indent=2) + "\n")


def read_card(model_dir: str | Path) -> ModelCard:
    """Parse and validate ``model_card.json`` (:class:`ModelCard`: the whole card, typed and
    bounded); ``CheckpointError`` naming the file and every invalid field otherwise. The card must
    be a regular file of at most ``CARD_LIMITS["card_bytes"]``."""
    path = Path(model_dir) / CARD_FILE
    with regular_file(path, "model card") as f:
        raw = f.read(CARD_LIMITS["card_bytes"] + 1)
    if len(raw) > CARD_LIMITS["card_bytes"]:
        raise CheckpointError(
            f"{path}: invalid model card: larger than {CARD_LIMITS['card_bytes']:,} bytes"
        )
    try:
        return ModelCard.model_validate_json(raw)
    except ValidationError as e:
        # a whole-card check (mode "after") has no location: its message names the fields
        problems = "; ".join(
            validation_problems([err], max_name=200)
            if err["loc"]
            else str(err["msg"]).removeprefix("Value error, ")
            for err in e.errors()
        )
        raise CheckpointError(f"{path}: invalid model card: {problems}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid model card: {e}") from None


#: safetensors' dtype names of the tensor dtypes a state dict holds.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def check_weights(card: ModelCard, weights: Path) -> None:
    """Raise :class:`CheckpointError` unless ``weights`` is a safetensors file holding exactly the
    tensors of ``card``'s architecture: the same names, shapes and dtypes as its state dict, at
    most ``ARCHITECTURE_LIMITS["parameters"]`` values in all.

    Reads only the file's header, and builds the architecture on the meta device (no memory), so
    a card that does not match its weights is refused before anything is allocated for it.
    """
    try:
        with torch.device("meta"):
            state = build_from_card(card).state_dict()
    except (ValueError, TypeError) as e:
        raise CheckpointError(
            f"{weights.parent / CARD_FILE}: cannot build the model: {e}"
        ) from None
    expected = {k: (tuple(v.shape), _SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)))
                for k, v in state.items()}  # fmt: skip
    n = sum(math.prod(shape) for shape, _ in expected.values())
    if n > ARCHITECTURE_LIMITS["parameters"]:
        raise CheckpointError(
            f"{weights.parent / CARD_FILE}: the architecture has {n:,} values; at most "
            f"{ARCHITECTURE_LIMITS['parameters']:,} (the training bound)"
        )
    try:
        with safe_open(str(weights), framework="pt") as f:
            found = {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_slice(key)
                found[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
    except Exception as e:  # noqa: BLE001 - SafetensorError: not safetensors, truncated, bad header
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{weights}: not a readable safetensors file: {msg}") from None
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    wrong = [f"{k} is {list(found[k][0])} {found[k][1]}, the card's architecture has "
             f"{list(expected[k][0])} {expected[k][1]}"
             for k in sorted(expected.keys() & found.keys()) if found[k] != expected[k]]  # fmt: skip
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {_some(missing)}")
        if unexpected:
            parts.append(f"unexpected {_some(unexpected)}")
        if wrong:
            parts.append(_some(wrong))
        raise CheckpointError(
            f"{weights}: cannot load weights: they do not match the card's architecture "
            f"({card.backbone}, {card.ensemble}, {card.members} members, "
            f"{card.num_classes} classes, {card.in_channels} channels): {'; '.join(parts)}"
        )


def _some(items: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``items`` and how many more."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def load_checkpoint(
    model_dir: str | Path, device: str | torch.device = "cpu"
) -> tuple[nn.Module, ModelCard]:
    """Rebuild, verify and load a model: returns ``(module in eval mode on device, card)``.

    Validates the whole card (:func:`read_card`), verifies the sha256 of ``model.safetensors``
    (a regular file: a symbolic link is refused unhashed) against the card, checks the weights'
    tensors against the card's architecture (:func:`check_weights`, header only) and only then
    builds the module and loads the tensors with safetensors (no pickle). Raises
    :class:`CheckpointError` naming the offending file and field when something is missing,
    altered or inconsistent.
    """
    model_dir = Path(model_dir)
    card = read_card(model_dir)
    weights = model_dir / WEIGHTS_FILE
    with regular_file(weights, "weights file"):
        pass  # named as the weights file when missing or not a regular file
    digest = file_sha256(weights)
    if digest != card.weights_sha256:
        raise CheckpointError(
            f"{weights}: sha256 {digest[:16]}… does not match the model card "
            f"({card.weights_sha256[:16] or '<empty>'}…); the file was altered or belongs to "
            "another model"
        )
    check_weights(card, weights)
    try:
        module = build_from_card(card)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{model_dir / CARD_FILE}: cannot build the model: {e}") from None
    try:
        state = load_file(str(weights), device="cpu")
        module.load_state_dict(state, strict=True)
    except Exception as e:  # noqa: BLE001 - safetensors' errors, key/shape mismatches
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{weights}: cannot load weights: {msg}") from None
    module.to(device).eval()
    return module, card
