"""Shipped models. ``default_model_dir()`` is the embedded default the service starts with:
``cnn4-lle-vgn-doe-mnist`` (issue 33: a small BatchNorm CNN, LLE-VGN with M = 10 heads, trained
with outlier exposure whose members disagree on non-digits and split on overlaid digit pairs, so
that it defers letters, photos, noise and ambiguous digits). ``cnn4-lle-vgn-mnist``, the default
before it (trained on digits alone: it answers most non-digits with confidence), ships beside it
for comparison, as do ``cnn4-lle-vgn-oe-mnist`` (Hendrycks et al.'s uniform outlier target) and
the paper's LeNet-5 LLE-VGN (SI S3.1) as ``lenet5-lle-vgn-mnist``. Serve any of them by name
(``vge serve --model-dir lenet5-lle-vgn-mnist``) or promote one by name. See each model's README.md.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "cnn4-lle-vgn-doe-mnist"


def zoo_dir() -> Path:
    """Directory holding the shipped models."""
    return Path(str(resources.files("models") / "zoo"))


def default_model_dir() -> Path:
    """Directory of the shipped default model (``model.safetensors`` + ``model_card.json``)."""
    return zoo_dir() / DEFAULT_MODEL


def zoo_models() -> list[str]:
    """Names of the shipped models (directories with a model card)."""
    return sorted(p.name for p in zoo_dir().iterdir() if (p / "model_card.json").is_file())


def zoo_model_dir(name: str) -> Path | None:
    """The shipped model ``name``'s directory, or None when there is no such zoo entry."""
    return zoo_dir() / name if name in zoo_models() else None


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """The one resolver of a model given by name or path (``vge serve``/``VGE_MODEL_DIR``, the
    engine's start model, ``vge evaluate``, the benchmarks): ``None`` -> the shipped default; the
    bare name of a shipped model with no such directory here -> its directory in the zoo; anything
    else -> the path as given (the caller says when it is missing)."""
    if model_dir is None or str(model_dir) == "":
        return default_model_dir()
    path = Path(model_dir)
    if not path.is_dir() and len(path.parts) == 1:
        shipped = zoo_model_dir(path.name)
        if shipped is not None:
            return shipped
    return path
