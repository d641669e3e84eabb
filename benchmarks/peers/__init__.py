"""Peer servers for side-by-side benchmarks (never runtime dependencies of vge-serve)."""

from __future__ import annotations

import os
from pathlib import Path


def model_dir() -> Path:
    """The model a peer serves: ``VGE_MODEL_DIR`` (a zoo name or a directory) as for ``vge serve``,
    else the shipped default, so a benchmark target can put any model behind every server."""
    from models.zoo import default_model_dir, zoo_model_dir

    name = os.environ.get("VGE_MODEL_DIR")
    if not name:
        return default_model_dir()
    return zoo_model_dir(name) or Path(name)
