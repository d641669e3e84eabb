"""The one rule for "which device": CUDA when a GPU is present, else the CPU.

Every place that resolves a device (the predictor, training, ``VGE_DEVICE=auto``) calls
:func:`resolve_device`, so a model trained, evaluated and served on the same machine lands on the
same device without each caller restating the rule.
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """``name`` as a ``torch.device``; ``None`` or ``"auto"``: ``cuda`` when available, else ``cpu``."""
    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
