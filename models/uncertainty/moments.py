"""Ensemble moments p̄ and s (paper Section 3.1, first equation)."""

from __future__ import annotations

import torch
from torch import Tensor

from models.uncertainty.validation import EPS


def ensemble_moments(probs: Tensor, eps: float = EPS) -> tuple[Tensor, Tensor]:
    """Per-class ensemble mean and stabilised sample standard deviation.

    ``p̄ = (1/M) Σ_m p_m`` and ``s = sqrt((1/(M−1)) Σ_m (p_m − p̄)²) + ε``. With a single member
    the spread is defined as 0 (so ``s = ε``) instead of the NaN an unbiased estimator would give.

    Args:
        probs: member probabilities ``(B, M, C)`` (validated by the caller).
    Returns:
        ``(mean, s)``, both ``(B, C)``.
    """
    mean = probs.mean(dim=1)  # (B, C)
    std = probs.std(dim=1, correction=1) if probs.shape[1] > 1 else torch.zeros_like(mean)  # (B, C)
    return mean, std + eps
