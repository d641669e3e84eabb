"""Checkpoints: safetensors weights + a JSON model card, verified by sha256, never unpickled.

``model_dir/model.safetensors`` holds the state dict; ``model_dir/model_card.json`` holds a
:class:`ModelCard` with everything needed to rebuild the module through
:func:`models.ensembles.build_ensemble` and to prepare inputs (channels, size, normalisation), plus
provenance (data fingerprint, training config), the learned VGN ``k``, evaluation metrics and the
calibrated deferral threshold ``abstain_k``.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = [
    "ArchitectureSpec",
    "CARD_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "ModelCard",
    "file_sha256",
    "learned_k",
    "load_checkpoint",
    "save_card",
    "save_checkpoint",
]

WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "model_card.json"


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

    @field_validator("ensemble")
    @classmethod
    def _ensemble(cls, v: str) -> str:
        from models.ensembles.factory import normalise_kind

        return normalise_kind(v)

    @field_validator("k")
    @classmethod
    def _k(cls, v: float | list[float] | None) -> float | list[float] | None:
        values = v if isinstance(v, list) else [] if v is None else [v]
        if not all(x > 0 for x in values):  # NaN fails too
            raise ValueError("must be > 0")
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


#: A model's name as trained and served, and a model directory's name under the server's models
#: root: a URL path segment (``/v2/models/{name}``) and a file name, with no separators or
#: traversal.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

#: Fields a card writes before its architecture (the card's key order since 0.1).
_CARD_HEAD = ("name", "version", "description")


class ModelCard(ArchitectureSpec):
    """Description of a trained model (its :class:`ArchitectureSpec`, data, provenance, metrics);
    JSON-serialised next to its weights."""

    name: str
    version: str = "1.0.0"
    description: str = ""
    class_names: list[str]
    in_channels: int
    input_size: tuple[int, int]  # (H, W)
    mean: list[float]
    std: list[float]
    dataset: str = ""
    data_fingerprint: str = ""
    learned_k: list[float] | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    abstain_calibration: dict[str, Any] = Field(default_factory=dict)
    #: validation-split distribution of the served VGMU/EU (models.evaluation.drift)
    uncertainty_reference: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    weights_sha256: str = ""
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

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


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
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
    weights.chmod(0o644)  # safetensors writes 0600; weights are meant to be shared/packaged
    card = card.model_copy(
        update={"weights_sha256": file_sha256(weights), "learned_k": learned_k(module)}
    )
    save_card(card, out)
    return card


def save_card(card: ModelCard, model_dir: str | Path) -> None:
    """Write ``card`` as ``model_dir/model_card.json`` (the weights and their sha256 untouched)."""
    path = Path(model_dir) / CARD_FILE
    path.write_text(json.dumps(card.model_dump(mode="json"), indent=2) + "\n")


def read_card(model_dir: str | Path) -> ModelCard:
    """Parse ``model_card.json``; ``CheckpointError`` naming the file when missing or invalid."""
    path = Path(model_dir) / CARD_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: model card not found")
    try:
        return ModelCard.model_validate_json(path.read_text())
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise CheckpointError(f"{path}: invalid model card: {loc}: {first['msg']}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid model card: {e}") from None


def load_checkpoint(
    model_dir: str | Path, device: str | torch.device = "cpu"
) -> tuple[nn.Module, ModelCard]:
    """Rebuild, verify and load a model: returns ``(module in eval mode on device, card)``.

    Verifies the sha256 of ``model.safetensors`` against the card before reading it and loads the
    tensors with safetensors only (no pickle). Raises :class:`CheckpointError` naming the offending
    file when something is missing, altered or inconsistent with the architecture.
    """
    model_dir = Path(model_dir)
    card = read_card(model_dir)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: weights file not found")
    digest = file_sha256(weights)
    if digest != card.weights_sha256:
        raise CheckpointError(
            f"{weights}: sha256 {digest[:16]}… does not match the model card "
            f"({card.weights_sha256[:16] or '<empty>'}…); the file was altered or belongs to "
            "another model"
        )
    try:
        module = build_from_card(card)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{model_dir / CARD_FILE}: cannot build the model: {e}") from None
    try:
        state = load_file(str(weights), device="cpu")
        module.load_state_dict(state, strict=True)
    except (RuntimeError, OSError) as e:  # safetensors' errors and key/shape mismatches
        msg = str(e).splitlines()[0]
        raise CheckpointError(f"{weights}: cannot load weights: {msg}") from None
    module.to(device).eval()
    return module, card
