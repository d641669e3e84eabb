"""Input checks shared by every uncertainty function.

All functions in :mod:`models.uncertainty` take member probabilities ``P`` of shape ``(B, M, C)``
(batch, ensemble members, classes). Bad input is a :class:`ValueError` that names the problem —
never a silent NaN further down.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Largest accepted deviation of a member's row sum from 1. Generous enough for float16/float32
#: softmax outputs written to disk, tight enough to catch logits or unnormalised scores.
SUM_TOLERANCE = 1e-3

#: Stabiliser used throughout the paper (SI "Numerical Stability"): ``s ← s + ε``, ``Γ ≥ ε``, ``Z ≥ ε``.
EPS = 1e-8


def sum_tolerance(dtype: torch.dtype, tolerance: float = SUM_TOLERANCE) -> float:
    """Row-sum tolerance for probabilities stored in ``dtype``.

    Rounding each entry of a softmax row to a float with machine epsilon ``ε`` moves the row sum by
    at most ``ε/2 · Σ p = ε/2``; a row computed in that precision carries a few such roundings. The
    tolerance is therefore ``max(tolerance, 4ε)``: 1e-3 for float32/float64, ≈ 3.9e-3 for float16
    (ε = 2⁻¹⁰) and ≈ 3.1e-2 for bfloat16 (ε = 2⁻⁷), still far below what logits or unnormalised
    scores produce.
    """
    if dtype.is_floating_point:
        return max(tolerance, 4.0 * torch.finfo(dtype).eps)
    return tolerance


def check_probs(probs: Tensor, *, tolerance: float = SUM_TOLERANCE, min_members: int = 1) -> Tensor:
    """Validate member probabilities and return them as a floating tensor of shape ``(B, M, C)``.

    Half-precision (float16/bfloat16) and integer inputs are promoted to float32; float64 stays
    float64. The row-sum tolerance scales with the input's precision (:func:`sum_tolerance`).

    Raises:
        ValueError: wrong rank, ``M < min_members``, ``C < 2``, NaN/Inf, negative entries, or a row
            whose sum differs from 1 by more than the tolerance. The message names the first
            offending index.
    """
    if not isinstance(probs, Tensor):
        probs = torch.as_tensor(probs)
    if probs.ndim != 3:
        raise ValueError(
            f"expected member probabilities of shape (B, M, C) = (batch, members, classes); "
            f"got a tensor with {probs.ndim} dimension(s), shape {tuple(probs.shape)}"
        )
    _, m, c = probs.shape
    if m < max(1, min_members):
        if min_members >= 2:
            raise ValueError(
                f"ensemble scores need at least {min_members} members (M >= {min_members}): the "
                f"spread of one member is undefined; got M = {m}"
            )
        raise ValueError("need at least one ensemble member (M >= 1); got M = 0")
    tolerance = sum_tolerance(probs.dtype, tolerance)
    if c < 2:
        raise ValueError(f"need at least two classes (C >= 2); got C = {c}")
    if probs.dtype not in (torch.float32, torch.float64):
        probs = probs.to(torch.float32)
    if probs.numel() == 0:
        return probs
    finite = torch.isfinite(probs)
    if not bool(finite.all()):
        b, mm, cc = (int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"probabilities contain NaN or Inf (first at sample {b}, member {mm}, class {cc})"
        )
    if bool((probs < 0).any()):
        b, mm, cc = (int(i) for i in (probs < 0).nonzero()[0])
        raise ValueError(
            f"probabilities must be non-negative; found {float(probs[b, mm, cc]):.4g} "
            f"at sample {b}, member {mm}, class {cc}"
        )
    sums = probs.sum(dim=-1)  # (B, M)
    bad = (sums - 1).abs() > tolerance
    if bool(bad.any()):
        b, mm = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"each member's probabilities must sum to 1 (±{tolerance:g}); sample {b}, member {mm} "
            f"sums to {float(sums[b, mm]):.6g} — pass softmax outputs, not logits"
        )
    return probs
