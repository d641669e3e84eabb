"""Peer servers for side-by-side benchmarks (never runtime dependencies of vge-serve)."""

from __future__ import annotations

import os
from pathlib import Path


def model_dir(name: str | None = None) -> Path:
    """A benchmark's model: ``name`` (a zoo name or a directory), else ``VGE_MODEL_DIR`` as for
    ``vge serve`` (how a peer learns it), else the shipped default, so a benchmark can put any
    model behind every server."""
    from models.zoo import resolve_model_dir

    return resolve_model_dir(name or os.environ.get("VGE_MODEL_DIR") or None)
