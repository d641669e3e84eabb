"""Starting a run from a trained model's weights (``TrainConfig.init_from``): fine-tuning.

A served model is retrained on its own data plus what people labelled; starting from its weights
keeps what it learned and needs a few epochs, not a full schedule. The weights only fit a run
that builds the same module and feeds it the same inputs, so :func:`check_init` refuses (before
the run, from the config alone) another architecture or a dataset prepared differently, and
:func:`load_init` checks the data itself (classes, channels, input size, normalisation) before it
copies the weights in.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from models.checkpoint import ArchitectureSpec, CheckpointError, ModelCard, read_card
from models.data import TORCHVISION_NAMES, DataBundle, parse_imagefolder

if TYPE_CHECKING:  # annotations only: config imports this module (no circle at run time)
    from .config import TrainConfig

__all__ = ["architecture_differences", "check_init", "input_family", "load_init"]


def input_family(dataset: str) -> str | None:
    """Which inputs a dataset name gives a model, when the name alone says so: the bundled MNIST
    and ``imagefolder:<path>+mnist-bundled`` both give the bundled digits' 28x28 gray inputs with
    the bundled normalisation (``"mnist-bundled"``), a torchvision dataset its fixed statistics
    (its name); a plain ImageFolder's size and normalisation come from its images (None)."""
    if dataset == "mnist-bundled":
        return "mnist-bundled"
    folder = parse_imagefolder(dataset)
    if folder is not None:
        return "mnist-bundled" if folder[1] else None
    return TORCHVISION_NAMES.get(dataset.lower())


def architecture_differences(a: ArchitectureSpec, b: ArchitectureSpec) -> list[str]:
    """The architecture fields in which ``a`` and ``b`` differ, as ``"field a != b"``."""
    return [
        f"{f} {getattr(a, f)!r} != {getattr(b, f)!r}"
        for f in ArchitectureSpec.model_fields
        if getattr(a, f) != getattr(b, f)
    ]


def _card(config: TrainConfig) -> ModelCard:
    assert config.init_from is not None
    try:
        return read_card(Path(config.init_from))
    except CheckpointError as exc:
        raise ValueError(f"init_from: {exc}") from None


def check_init(config: TrainConfig, card: ModelCard | None = None) -> None:
    """Raise ``ValueError`` when ``config.init_from``'s weights cannot start this run: another
    architecture (the fields named), or a dataset whose inputs differ from the ones the model was
    trained on (a plain ImageFolder's normalisation is its own, so it never qualifies)."""
    card = card if card is not None else _card(config)
    diff = architecture_differences(config, card)
    if diff:
        raise ValueError(
            f"init_from: the weights of {card.name} {card.version} do not fit this "
            f"architecture ({'; '.join(diff)}); train from scratch or keep its architecture"
        )
    ours, theirs = input_family(config.dataset), input_family(card.dataset)
    if ours is None or ours != theirs:
        raise ValueError(
            f"init_from: {card.name} {card.version} was trained on {card.dataset!r}, whose "
            f"inputs (size, normalisation) are not those of dataset {config.dataset!r}; "
            "fine-tune on the same data family (e.g. reviews+mnist-bundled for a model trained "
            "on mnist-bundled) or train from scratch"
        )


def load_init(config: TrainConfig, model: nn.Module, bundle: DataBundle) -> dict[str, Any]:
    """Copy ``config.init_from``'s verified weights (sha256 against its card) into ``model``,
    after checking that ``bundle`` prepares inputs as that model was trained on. Returns what the
    new card records of its start: the model's name, version, weights hash and directory."""
    from models.checkpoint import load_checkpoint

    assert config.init_from is not None
    check_init(config)
    # rebuilding the old module draws initial weights from the global RNG: keep the run's draws
    with torch.random.fork_rng(devices=[]):
        try:
            source, card = load_checkpoint(config.init_from, device="cpu")
        except CheckpointError as exc:
            raise ValueError(f"init_from: {exc}") from None
    mismatch = [
        f"{name} {mine!r} != {theirs!r}"
        for name, mine, theirs in (
            ("class_names", list(bundle.class_names), list(card.class_names)),
            ("in_channels", bundle.in_channels, card.in_channels),
            ("input_size", tuple(bundle.input_size), tuple(card.input_size)),
        )
        if mine != theirs
    ]
    for name, mine, theirs in (("mean", bundle.mean, card.mean), ("std", bundle.std, card.std)):
        if len(mine) != len(theirs) or not all(
            math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
            for a, b in zip(mine, theirs, strict=False)
        ):
            mismatch.append(f"{name} {list(mine)} != {list(theirs)}")
    if mismatch:
        raise ValueError(
            f"init_from: the data of this run ({bundle.name}) is not prepared like "
            f"{card.name} {card.version}'s ({'; '.join(mismatch)}); train from scratch"
        )
    model.load_state_dict(source.state_dict(), strict=True)
    return {
        "name": card.name,
        "version": card.version,
        "weights_sha256": card.weights_sha256,
        "model_dir": str(config.init_from),
    }
