"""``TrainConfig``: an :class:`~models.checkpoint.ArchitectureSpec` plus data, optimisation,
stopping and calibration fields; ``load_config`` reads it from YAML/JSON with flag overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from models.checkpoint import MODEL_NAME_PATTERN, ArchitectureSpec
from models.data import TORCHVISION_NAMES, parse_imagefolder

__all__ = [
    "DEFAULT_ARCHITECTURE",
    "DEFAULT_TARGET_DEFERRAL",
    "TrainConfig",
    "config_error_message",
    "load_config",
]

DEFAULT_TARGET_DEFERRAL = 0.05  # abstain_k calibration target when the config names none
#: The architecture trained where a config names none: LeNet-5, last-layer ensemble of M = 10.
DEFAULT_ARCHITECTURE: dict[str, Any] = {"backbone": "lenet5", "ensemble": "lle", "members": 10}


class TrainConfig(ArchitectureSpec):
    """Validated training configuration (YAML/JSON files and ``vge train`` flags map onto it).

    The architecture fields (``backbone``, ``backbone_kwargs``, ``ensemble``, ``members``,
    ``mc_samples``, ``vgn``, ``k``) and their validation are those of
    :class:`~models.checkpoint.ArchitectureSpec`, shared with the model card; the rest is how to
    train. Architecture fields a config leaves out take :data:`DEFAULT_ARCHITECTURE`.
    """

    name: str | None = Field(
        None,
        pattern=MODEL_NAME_PATTERN,
        description="model name (letters, digits, '.', '_', '-'; it names the model in URLs such "
        "as /v2/models/{name}); default <backbone>-<kind>[-vgn]-<data>",
    )
    version: str = "1.0.0"
    description: str = ""
    dataset: str = Field(
        "mnist-bundled",
        description="mnist-bundled | torchvision name | imagefolder:<path> | "
        "imagefolder:<path>+mnist-bundled (bundled MNIST, the folder's images added to train)",
    )
    data_root: str | None = None
    allow_download: bool = False
    image_size: int | None = Field(None, ge=8, description="ImageFolder resize (square)")
    max_train_samples: int | None = Field(None, ge=1)
    loss: Literal["mixture", "members"] | None = Field(
        None, description="mixture | members; default: mixture with vgn, members without"
    )
    epochs: int = Field(100, ge=1)
    lr: float = Field(1e-3, gt=0, le=1)
    lr_schedule: Literal["constant", "plateau", "cosine", "onecycle"] = Field(
        "constant",
        description="constant | plateau (ReduceLROnPlateau on the validation loss) | cosine "
        "(CosineAnnealingLR over epochs) | onecycle (OneCycleLR to lr over all steps, per step)",
    )
    lr_factor: float = Field(
        0.5, gt=0, lt=1, description="plateau: lr multiplier per reduction; cosine: final lr / lr"
    )
    lr_patience: int = Field(
        3, ge=0, description="plateau: epochs without validation-loss improvement before reducing"
    )
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(128, ge=1)
    eval_batch_size: int = Field(512, ge=1)
    seed: int = 0
    patience: int = Field(5, ge=1)
    augment: bool = Field(
        False,
        description="random small affine transforms of training images only (RandomAffine "
        "degrees 10, translate 0.1, scale 0.9-1.1; seeded)",
    )
    min_delta: float = Field(1e-4, ge=0)
    device: str | None = None
    deterministic: bool = True
    target_deferral: float | None = Field(None, gt=0, lt=1)
    target_risk: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="before")
    @classmethod
    def _default_architecture(cls, data: Any) -> Any:
        return {**DEFAULT_ARCHITECTURE, **data} if isinstance(data, dict) else data

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if v == "mnist-bundled" or v.lower() in TORCHVISION_NAMES or parse_imagefolder(v):
            return v
        raise ValueError(
            "must be 'mnist-bundled', a torchvision dataset (MNIST, FashionMNIST, "
            "SVHN, CIFAR10, CIFAR100), 'imagefolder:<path>' or 'imagefolder:<path>+mnist-bundled'"
        )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                torch.device(v)
            except RuntimeError:
                raise ValueError("must be 'cpu', 'cuda' or 'cuda:N'") from None
        return v

    @property
    def resolved_loss(self) -> str:
        """The loss trained: ``loss`` when given, else mixture with VGN and members without."""
        if self.loss is not None:
            return self.loss
        return "mixture" if self.vgn else "members"

    def check_architecture(self) -> None:
        """:meth:`check_buildable` for this config's dataset, when its classes and channels are
        known without reading it (an ImageFolder's are not: its job finds out)."""
        from models.data import dataset_shape

        shape = dataset_shape(self.dataset)
        if shape is not None:
            self.check_buildable(*shape)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.vgn and self.loss == "members":
            raise ValueError("loss 'members' ignores the VGN layer; use loss 'mixture' with vgn")
        if self.target_deferral is not None and self.target_risk is not None:
            raise ValueError("give at most one of target_deferral and target_risk")
        return self

    def model_name(self) -> str:
        if self.name:
            return self.name
        data = (
            self.dataset.split(":", 1)[0]
            if self.dataset.startswith("imagefolder:")
            else ("mnist" if self.dataset == "mnist-bundled" else self.dataset.lower())
        )
        return f"{self.backbone}-{self.ensemble}{'-vgn' if self.vgn else ''}-{data}"


def config_error_message(err: ValidationError) -> str:
    """One line describing the first problem of a config ``ValidationError``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}")
    return "invalid training config: " + "; ".join(parts)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML/JSON config file (optional), apply ``overrides`` (``None`` values ignored).

    Raises ``ValueError`` with a one-line, human-readable message on any problem.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found")
        text = p.read_text()
        try:
            if p.suffix.lower() == ".json":
                import json

                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text) or {}
        except Exception as e:  # yaml/json syntax errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"config file {p}: cannot parse: {first}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {p}: expected a mapping of fields at the top level")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(config_error_message(e)) from None
