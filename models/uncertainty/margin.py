"""Variance-Gated Margin Uncertainty (VGMU) and the abstain rule (paper Section 3.2, eq. gmu)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from models.limits import ABSTAIN_K_MAX, ABSTAIN_K_MIN
from models.uncertainty.moments import ensemble_moments
from models.uncertainty.validation import EPS


class MarginScore(NamedTuple):
    """Per-sample decision scores, each ``(B,)``."""

    prediction: Tensor  # int64 top-1 class of p̄ (ties → lowest index)
    abstain: Tensor  # bool: True when the margin rule defers to a human
    vgmu: Tensor  # 1 − (1 − e^{−SNR}) p̄1, in [0, 1]
    snr: Tensor  # (p̄1 − p̄2) / (s1 + s2 + ε) ≥ 0


def top2(mean: Tensor) -> tuple[Tensor, Tensor]:
    """Indices of the two largest entries of ``mean`` ``(B, C)``; ties break to the lowest index."""
    i1 = mean.argmax(dim=-1)  # argmax returns the first maximal index
    masked = mean.scatter(-1, i1.unsqueeze(-1), float("-inf"))
    i2 = masked.argmax(dim=-1)
    return i1, i2


def margin_score(probs: Tensor, abstain_k: float = 1.0, eps: float = EPS) -> MarginScore:
    """VGMU, SNR and the abstain decision from member probabilities ``(B, M, C)``.

    With ``p̄1, p̄2`` the top-2 entries of the ensemble mean and ``s1, s2`` their spreads:
    ``SNR = (p̄1 − p̄2) / (s1 + s2 + ε)``, ``VGMU = 1 − (1 − e^{−SNR}) · p̄1``; predict the top-1
    class iff ``p̄1 − k s1 > p̄2 + k s2`` (``k = abstain_k ≥ 0``, the deferral threshold), else abstain.
    """
    check_abstain_k(abstain_k)
    return margin_score_unchecked(probs, abstain_k, eps)


def check_abstain_k(abstain_k: float) -> None:
    """Raise ``ValueError`` unless ``ABSTAIN_K_MIN <= abstain_k <= ABSTAIN_K_MAX`` (not NaN or
    infinite)."""
    if not ABSTAIN_K_MIN <= abstain_k <= ABSTAIN_K_MAX:
        raise ValueError(
            f"abstain_k must be a number in [{ABSTAIN_K_MIN:g}, {ABSTAIN_K_MAX:g}]; got {abstain_k}"
        )


def margin_score_unchecked(
    probs: Tensor, abstain_k: float | Tensor, eps: float = EPS
) -> MarginScore:
    """:func:`margin_score` without the check of ``abstain_k``, which may be a 0-d tensor on the
    device: no host synchronisation, so ``torch.compile`` captures it whole (the served decision)."""
    mean = probs.mean(dim=1)  # (B, C)
    i1, i2 = top2(mean)
    # Spreads are only needed for the two leading classes: gather them first, O(M) instead of O(MC).
    idx = torch.stack((i1, i2), dim=-1)  # (B, 2)
    top = probs.gather(-1, idx.unsqueeze(1).expand(-1, probs.shape[1], -1))  # (B, M, 2)
    (p1, p2), (s1, s2) = (t.unbind(-1) for t in ensemble_moments(top, eps))  # (B,) each
    snr = (p1 - p2) / (s1 + s2 + eps)
    vgmu = 1 - (-torch.expm1(-snr)) * p1
    abstain = ~(p1 - abstain_k * s1 > p2 + abstain_k * s2)
    return MarginScore(prediction=i1, abstain=abstain, vgmu=vgmu, snr=snr)
