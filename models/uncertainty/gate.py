"""The variance gate Γ = 1 − exp(−p̄ / (k·s)) (paper Section 3.1, eq. for Γ)."""

from __future__ import annotations

import torch
from torch import Tensor

from models.uncertainty.validation import EPS

#: Lower bound on the gate sensitivity k (SI "Numerical Stability"); smaller k is clamped to it.
K_MIN = 1e-3

#: Largest gate sensitivity k a caller may ask for. Γ is floored at ε (SI "Numerical Stability"),
#: and once ``p̄ / (k s) < ε`` for every class the floor makes all Γ equal and the gate vanishes:
#: the scores snap back to the ungated ones instead of approaching their k → ∞ limit. The top
#: class has ``p̄1 ≥ 1/C`` and ``s1 ≤ 1/√2 + ε``, so below this bound that cannot happen for any
#: ``C < 14,000``; useful k are O(1) (the paper's examples use 1 and 2).
GATE_K_MAX = 1e4


def as_gate_k(k: float | Tensor, num_classes: int, like: Tensor) -> Tensor:
    """Return ``k`` as a ``(C,)`` tensor on ``like``'s device/dtype (scalar k is broadcast)."""
    k_t = torch.as_tensor(k, dtype=like.dtype, device=like.device)
    if k_t.ndim == 0:
        k_t = k_t.expand(num_classes)
    if k_t.shape != (num_classes,):
        raise ValueError(
            f"gate k must be a scalar or have one value per class ({num_classes}); got shape {tuple(k_t.shape)}"
        )
    if k_t.is_meta:  # a build on the meta device (counting parameters): no values to check
        return k_t
    if not bool(torch.isfinite(k_t).all()) or bool((k_t <= 0).any()):
        raise ValueError("gate k must be finite and > 0")
    return k_t


def variance_gate(mean: Tensor, s: Tensor, k: Tensor, eps: float = EPS) -> Tensor:
    """Variance gate ``Γ = max(1 − exp(−p̄ / (k s)), ε)``, with ``k`` clamped below by ``K_MIN``.

    Args:
        mean: ensemble mean ``p̄`` ``(B, C)``.
        s: stabilised spread ``s`` ``(B, C)`` (already ``+ ε``).
        k: per-class sensitivity ``(C,)``.
    Returns:
        Γ ``(B, C)`` in ``[ε, 1)``.
    """
    k = k.clamp(min=K_MIN)
    return (-torch.expm1(-mean / (k * s))).clamp(min=eps)
