"""``TrainConfig``: an :class:`~models.checkpoint.ArchitectureSpec` plus data, optimisation,
stopping and calibration fields; ``load_config`` reads it from YAML/JSON with flag overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError, field_validator, model_validator
from torch.overrides import TorchFunctionMode

from models.checkpoint import (
    ARCHITECTURE_LIMITS,
    CARD_LIMITS,
    MODEL_NAME_PATTERN,
    VERSION_PATTERN,
    ArchitectureSpec,
    ModelCard,
)
from models.data import TORCHVISION_NAMES, parse_imagefolder

from .warmstart import check_init

__all__ = [
    "DEFAULT_ARCHITECTURE",
    "DEFAULT_TARGET_DEFERRAL",
    "LIMITS",
    "NOT_INHERITED",
    "TrainConfig",
    "config_error_message",
    "load_config",
    "served_config",
]

DEFAULT_TARGET_DEFERRAL = 0.05  # abstain_k calibration target when the config names none
#: The architecture trained where a config names none: LeNet-5, last-layer ensemble of M = 10.
DEFAULT_ARCHITECTURE: dict[str, Any] = {"backbone": "lenet5", "ensemble": "lle", "members": 10}

#: Upper bounds of a training config: a run must end, fit in memory and be built in
#: milliseconds when it is checked. The same bounds hold for ``vge train`` and for the training
#: jobs the server accepts (where anyone with the API key could otherwise queue a run that never
#: ends or a model that fills the host's memory). A 422 / the CLI's one line names the bound.
LIMITS: dict[str, int] = {
    "epochs": 1000,  # the shipped models train 30-100
    "batch_size": 4096,
    "eval_batch_size": 8192,
    "image_size": 512,  # ImageFolder resize (square); the shipped models see 28x28
    "build_ops": 100_000,  # torch calls to build it (WRN-28-10 DE, M = 100: 78,000); bounds the check
    # members, mc_samples, backbone_kwargs_*, parameters: the architecture's own bounds, which a
    # model card meets too (ArchitectureSpec validates them)
    **ARCHITECTURE_LIMITS,
}
#: Fields of a served model's training config that a retraining job does not inherit
#: (:func:`served_config`): the job's own data, size, device, identity and starting weights.
NOT_INHERITED = frozenset(
    {
        "name",
        "version",
        "description",
        "dataset",
        "data_root",
        "allow_download",
        "max_train_samples",
        "device",
        "init_from",
    }
)


#: The largest run seed: 2**32 − 1, as NumPy's and most tools' seeds; the derived streams
#: (``seed * 1_000_003 + tag``) stay far inside torch's 64-bit seeds (a seed of 2**64 was accepted,
#: and the run failed at its first generator).
SEED_MAX = 2**32 - 1


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
    # as the model card takes them (checked here, not after training, when the card is written)
    version: str = Field(
        "1.0.0", pattern=VERSION_PATTERN,
        description="model version: a letter or digit, then letters, digits, '.', '_', '+', '-' "
        "(at most 64 characters)",
    )  # fmt: skip
    description: str = Field("", max_length=CARD_LIMITS["text"])
    dataset: str = Field(
        "mnist-bundled",
        description="mnist-bundled | torchvision name | imagefolder:<path> | "
        "imagefolder:<path>+mnist-bundled (bundled MNIST, the folder's images added to train)",
    )
    data_root: str | None = None
    allow_download: bool = False
    image_size: int | None = Field(
        None, ge=8, le=LIMITS["image_size"], description="ImageFolder resize (square)"
    )
    max_train_samples: int | None = Field(None, ge=1)
    loss: Literal["mixture", "members"] | None = Field(
        None, description="mixture | members; default: mixture with vgn, members without"
    )
    epochs: int = Field(100, ge=1, le=LIMITS["epochs"])
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
    weight_decay: float = Field(0.0, ge=0, le=1)
    batch_size: int = Field(128, ge=1, le=LIMITS["batch_size"])
    eval_batch_size: int = Field(512, ge=1, le=LIMITS["eval_batch_size"])
    seed: int = Field(
        0, ge=0, le=SEED_MAX,
        description="seeds every generator of the run (0 to 2**32 - 1; streams of their own are "
        "derived from it as seed * 1,000,003 + a tag, within torch's 64-bit seeds)",
    )  # fmt: skip
    patience: int = Field(5, ge=1)
    augment: bool = Field(
        False,
        description="random small affine transforms of training images only (RandomAffine "
        "degrees 10, translate 0.1, scale 0.9-1.1; seeded)",
    )
    augment_read: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of every training batch drawn as a photo or scan (stroke width, "
        "chalk, a larger page, ink on paper, uneven light, blur, noise) and read back as the "
        "server reads an upload (models/training/step.py); needs augment; 0 = none",
    )
    augment_elastic: float = Field(
        0.0,
        ge=0,
        le=100,
        description="elastic distortion of training images, torchvision ElasticTransform's "
        "alpha (sigma 4, Simard et al. 2003), in the same resampling as the affine transform; "
        "needs augment; 0 = none",
    )
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="exponential moving average of the weights and BatchNorm statistics "
        "(Polyak averaging, torch.optim.swa_utils.AveragedModel), updated after every optimiser "
        "step; validation, early stopping and the saved model use the average; 0 = none",
    )
    min_delta: float = Field(1e-4, ge=0, le=10)
    device: str | None = None
    deterministic: bool = True
    target_deferral: float | None = Field(None, gt=0, lt=1)
    target_risk: float | None = Field(None, gt=0, lt=1)
    member_repulsion: float = Field(
        0.0,
        ge=0,
        le=100,
        description="negative correlation learning (Liu & Yao 1999) on the digits: the loss "
        "subtracts this weight x the members' variance of p (unbiased over the members, summed "
        "over classes, mean over the batch: the paper's diversity E[Var_M], SI S3.3, before its "
        "mean over classes; models/training/loss.py), so members are pushed apart where the "
        "likelihood leaves them free; the reported train_loss includes the term and can fall "
        "below 0; 0 = none",
    )
    member_bootstrap: Literal["none", "poisson", "half"] = Field(
        "none",
        description="bagging of the members on the digits (Breiman 1996; the per-member "
        "bootstrap weights of issue 33's options): every training digit i gets a fixed weight "
        "w_im per member m, drawn once per run, and the mixture NLL weights member m's share "
        "of digit i by it (models/training/loss.py: each digit's mixture is over the members "
        "that drew it, weighted by their counts), so members should differ where the data is "
        "thin: none | poisson (w ~ Poisson(1); 37 % of digits unseen by a member) | half (w in "
        "{0, 2}: each member draws each digit with probability 1/2); not for ensemble mcd",
    )
    outlier_exposure: float = Field(
        0.0,
        ge=0,
        le=10,
        description="weight of the outlier-exposure loss (models/training/outliers.py: generated "
        "non-digits pushed to a uniform answer; 1-channel 28x28 data only); 0 = off",
    )
    outlier_batch_size: int = Field(64, ge=1, le=LIMITS["batch_size"])
    outlier_pool: int = Field(12000, ge=1, le=100_000)
    outlier_set: Literal[1, 2, 3] = Field(
        1,
        description="version of the generated outlier set (models/data_ood/outliers.py): 1; "
        "2 with Latin letters in the Computer Modern faces added; 3 with Latin letters in "
        "Pillow's built-in sans-serif (Aileron) added as well",
    )
    outlier_targets: Literal["uniform", "disagree"] = Field(
        "uniform",
        description="what outlier exposure asks of the members on an outlier: uniform (the "
        "served mean flat, Hendrycks et al.) | disagree (each member confident on its own "
        "class, the classes spread so that the mean is flat: the ensemble's disagreement, EU, "
        "carries the signal; models/training/outliers.py)",
    )
    outlier_overlays: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="share of every outlier batch made of two training digits of different "
        "classes overlaid (near OOD: the answer is split between their two classes); 0 = none",
    )
    outlier_prepare: bool = Field(
        False,
        description="read the outlier pool and the overlays as the server reads an upload "
        "(models/prepare.py, prepare=mnist), so training sees the pixels serving will",
    )
    calibration_split: float = Field(
        0.0,
        ge=0,
        le=0.5,
        description="share of the training digits carved out before training (stratified, "
        "seed 0), never trained on, and used with the validation split to calibrate abstain_k; "
        "0 = calibrate on the validation split alone",
    )
    ood_suite_per_group: int = Field(
        500,
        ge=0,
        le=5000,
        description="images per group of the OOD suite (docs/ood-suite.md) the model card is "
        "evaluated on after training, read as the server reads an upload (~1 ms of CPU an "
        "image: ~5 s at 500 for its 9 groups); 0 = no suite in the card",
    )
    init_from: str | None = Field(
        None,
        description="a model directory whose weights start the run (fine-tuning): its "
        "architecture, classes, input size and normalisation must be this run's; default: "
        "freshly initialised weights",
    )

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
                kind = torch.device(v).type
            except RuntimeError:
                kind = ""
            # torch knows more device types (xpu, hpu, meta, …): this build trains on these only
            # (others were accepted and failed at run time, a traceback in the CLI)
            if kind not in ("cpu", "cuda", "mps"):
                raise ValueError(f"must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {v!r}")
        return v

    @property
    def resolved_loss(self) -> str:
        """The loss trained: ``loss`` when given, else mixture with VGN and members without."""
        if self.loss is not None:
            return self.loss
        return "mixture" if self.vgn else "members"

    def check_architecture(self, init_card: ModelCard | None = None) -> None:
        """What can be checked before a run without reading its data, in milliseconds: the
        architecture builds for this config's dataset (:meth:`check_buildable`, when its classes
        and channels are known without reading it; an ImageFolder's are not: its job finds out),
        the ensemble has at most ``LIMITS["parameters"]`` parameters (built on the meta device,
        no memory), and ``init_from``'s weights fit this run (:func:`.warmstart.check_init`;
        ``init_card``: its card, when the caller has read it already). Raises ``ValueError``
        naming the problem."""
        from models.data import dataset_shape

        shape = dataset_shape(self.dataset)
        # an ImageFolder of unknown classes: counted with 10 classes (or k's) and 3 channels
        classes, channels = shape or (len(self.k) if isinstance(self.k, list) else 10, 3)
        with torch.device("meta"), _BoundedBuild():
            try:
                n = sum(p.numel() for p in self.build(classes, channels).parameters())
            except ValueError:
                raise
            except TypeError as exc:  # the backbone's constructor: an unexpected keyword
                raise ValueError(f"backbone_kwargs do not fit {self.backbone}: {exc}") from None
            except (RuntimeError, ArithmeticError) as exc:
                # a size it cannot build (a zero or negative width: RuntimeError, a division)
                raise ValueError(
                    f"backbone_kwargs {self.backbone_kwargs} do not fit {self.backbone}: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
        if n > LIMITS["parameters"]:
            raise ValueError(
                f"the ensemble would have {n:,} parameters; at most {LIMITS['parameters']:,} "
                "(the training bound): fewer members or a smaller backbone"
            )
        if self.init_from is not None:
            check_init(self, init_card)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.vgn and self.loss == "members":
            raise ValueError("loss 'members' ignores the VGN layer; use loss 'mixture' with vgn")
        if self.member_bootstrap != "none" and self.ensemble == "mcd":
            raise ValueError(
                "member_bootstrap weights members, and an mcd model trains one network (its "
                "members are dropout samples at inference): use lle, mcd-lle or de, or none"
            )
        if self.augment_read and not self.augment:
            raise ValueError("augment_read is part of the training augmentation: set augment")
        if self.augment_elastic and not self.augment:
            raise ValueError("augment_elastic is part of the training augmentation: set augment")
        if self.target_deferral is not None and self.target_risk is not None:
            raise ValueError("give at most one of target_deferral and target_risk")
        if self.image_size is not None and not resizes_images(self.dataset):
            raise ValueError(
                f"image_size resizes the images of a plain 'imagefolder:<path>' dataset; "
                f"{self.dataset!r} is read at its own size: leave image_size out"
            )
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


def resizes_images(dataset: str) -> bool:
    """Whether ``image_size`` applies to ``dataset``: a plain ``imagefolder:<path>`` (bundled
    MNIST, torchvision datasets and the mixed ``…+mnist-bundled`` are read at their own size)."""
    folder = parse_imagefolder(dataset)
    return folder is not None and not folder[1]


class _BoundedBuild(TorchFunctionMode):
    """Stop a build (on this thread) once it has made ``LIMITS["build_ops"]`` torch calls.

    Even on the meta device, building is Python work per module: bounded kwargs such as ResNet
    ``blocks: [4096, 4096, 4096, 4096]`` with 100 DE members would take minutes and gigabytes
    before the parameter count could refuse them. Every parameter a module makes, and its
    initialisation, is a torch call, so counting them bounds the work. Torch-function modes are
    per thread: a model the server loads meanwhile on another thread is neither counted nor
    slowed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        if self.calls > LIMITS["build_ops"]:
            raise ValueError(
                f"building the ensemble takes more than {LIMITS['build_ops']:,} tensor "
                "operations (the training bound): fewer members, blocks or layers"
            )
        return func(*args, **(kwargs or {}))


def served_config(card: ModelCard) -> dict[str, Any]:
    """The training configuration a served model was trained with, as the fields a retraining
    job starts from: the card's architecture (authoritative) and the training fields recorded
    in ``card.training["config"]`` (loss, epochs, learning rate and schedule, batch size,
    augmentation, stopping, calibration target, ...) less :data:`NOT_INHERITED`. A card without
    a recorded config (not trained by :func:`models.training.train`) gives its architecture and
    the :class:`TrainConfig` defaults for the rest."""
    recorded = card.training.get("config") if isinstance(card.training, dict) else None
    fields = {
        k: v
        for k, v in (recorded if isinstance(recorded, dict) else {}).items()
        if k in TrainConfig.model_fields and k not in NOT_INHERITED
    }
    return {**fields, **card.architecture().model_dump()}


def config_error_message(err: ValidationError) -> str:
    """One line naming every problem of a config ``ValidationError``."""
    from models.problems import validation_problems

    return "invalid training config: " + validation_problems(err.errors(), what="config")


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
