"""Additive uncertainty decomposition TU = AU + EU (paper Section 3.3), normalised by log C."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class Decomposition(NamedTuple):
    """Per-sample uncertainties, each ``(B,)`` in ``[0, 1]`` (units of log C)."""

    tu: Tensor
    au: Tensor
    eu: Tensor


def entropy(probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in nats, ``H(p) = −Σ p log p`` with ``0 log 0 = 0``."""
    return torch.special.entr(probs).sum(dim=dim)


def entropy_decomposition(probs: Tensor) -> Decomposition:
    """Decompose the uncertainty of a member set (raw ``p`` or gated ``q``), ``(B, M, C)``.

    ``TU = H(mean_m p_m) / log C``, ``AU = mean_m H(p_m) / log C``, ``EU = TU − AU``
    (= mean_m KL(p_m ‖ p̄) / log C ≥ 0; clamped at 0 against round-off). Normalising by log C puts
    every value in [0, 1], the units of the paper's SI examples (three one-hot members over three
    classes give EU = 1).
    """
    log_c = math.log(probs.shape[-1])
    tu = entropy(probs.mean(dim=1)) / log_c  # (B,)
    au = entropy(probs).mean(dim=1) / log_c  # (B,)
    tu = tu.clamp(0.0, 1.0)
    au = torch.minimum(au.clamp(0.0, 1.0), tu)
    return Decomposition(tu=tu, au=au, eu=tu - au)
