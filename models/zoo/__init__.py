"""Shipped models. ``default_model_dir()`` is the embedded default the service starts with:
LeNet-5 LLE-VGN, M = 10 heads, trained on the bundled MNIST split (see its README.md)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "lenet5-lle-vgn-mnist"


def zoo_dir() -> Path:
    """Directory holding the shipped models."""
    return Path(str(resources.files("models") / "zoo"))


def default_model_dir() -> Path:
    """Directory of the shipped default model (``model.safetensors`` + ``model_card.json``)."""
    return zoo_dir() / DEFAULT_MODEL
