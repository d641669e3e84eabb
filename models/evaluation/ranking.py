"""Rank consistency (paper §4.1, SI S3.3) and uncertainty mass concentration AUCc (§4.2, SI S4.2).

Rank consistency compares the *orderings* two uncertainty scores induce on the same samples:

* Spearman ``ρ = Pearson(rank(a), rank(b))`` (average ranks for ties; ``scipy.stats.spearmanr``)
* Kendall ``τ_b = (n_c − n_d) / sqrt((n_0 − n_1)(n_0 − n_2))`` over sample pairs
  (``scipy.stats.kendalltau``, tie-corrected τ-b)

Both are ``None`` (JSON null) when a score is constant, where they are undefined.

AUCc (paper §4.2: "sorting samples by descending uncertainty and measuring the area under the
cumulative distribution"; SI S3.3: "how rapidly scores accumulate when samples are ordered from
highest to lowest … high when a small number of top-ranked samples account for a large fraction of
the total score mass"). Exactly:

    sort u descending: u_(1) ≥ u_(2) ≥ … ≥ u_(N) ≥ 0
    x_j = j / N,   y_j = (Σ_{i≤j} u_(i)) / (Σ_i u_i),   (x_0, y_0) = (0, 0)
    AUCc = Σ_{j=1..N} (x_j − x_{j−1}) · (y_{j−1} + y_j) / 2      (trapezoidal rule)
         = (1/N) · (Σ_{j=1..N} y_j − 1/2)

Constant scores give ``y_j = j/N`` and AUCc = 0.5 exactly (the diagonal: no concentration);
all mass on one sample gives the maximum ``1 − 1/(2N)``. The curve is concave, so AUCc ∈ [0.5, 1).
Ties do not matter (tied scores add equal mass in either order). Tiny negative values from
floating-point round-off are clipped to 0; all-zero scores (no uncertainty mass at all) are defined as
0.5. AUCc measures the *shape* of the score distribution, not whether high scores fall on errors —
that is what the selective-prediction metrics in :mod:`models.evaluation.selective` measure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.stats import kendalltau, spearmanr

from models.evaluation.classification import as_numpy

#: Scores VGMU is compared against in the paper's rank-consistency analysis (§4.1).
RANK_REFERENCES = ("eu", "epkl", "epjs")


def _pair(a: ArrayLike, b: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    x = as_numpy(a).astype(np.float64).ravel()
    y = as_numpy(b).astype(np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"scores must have the same length; got {x.shape[0]} and {y.shape[0]}")
    if x.size < 2:
        raise ValueError("rank correlation needs at least two samples")
    return x, y


def _finite_or_none(v: float) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def spearman_rho(a: ArrayLike, b: ArrayLike) -> float | None:
    """Spearman ``ρ``: Pearson correlation of the (average-tie) ranks; ``None`` if undefined."""
    x, y = _pair(a, b)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return _finite_or_none(spearmanr(x, y).statistic)


def kendall_tau(a: ArrayLike, b: ArrayLike) -> float | None:
    """Kendall ``τ_b`` (pairwise ordering agreement, tie-corrected); ``None`` if undefined."""
    x, y = _pair(a, b)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return _finite_or_none(kendalltau(x, y).statistic)


def rank_consistency(
    scores: Mapping[str, ArrayLike],
    reference: str = "vgmu",
    others: Iterable[str] = RANK_REFERENCES,
) -> dict[str, dict[str, float | None]]:
    """Spearman ρ and Kendall τ between ``scores[reference]`` and each of ``scores[other]``.

    Returns ``{other: {"spearman": ρ, "kendall": τ}}`` for every ``other`` present in ``scores``.
    """
    ref = scores[reference]
    return {
        name: {
            "spearman": spearman_rho(ref, scores[name]),
            "kendall": kendall_tau(ref, scores[name]),
        }
        for name in others
        if name in scores
    }


def aucc_curve(scores: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Cumulative uncertainty-mass curve ``(x, y)`` of length ``N + 1`` starting at ``(0, 0)``.

    ``x_j = j/N``; ``y_j`` = share of the total score mass held by the ``j`` highest scores.
    See the module docstring for the exact definition.
    """
    u = as_numpy(scores).astype(np.float64).ravel()
    if u.size == 0:
        raise ValueError("AUCc needs at least one sample")
    if not np.isfinite(u).all():
        raise ValueError("AUCc scores must be finite")
    u = np.clip(u, 0.0, None)
    n = u.size
    x = np.arange(n + 1, dtype=np.float64) / n
    total = u.sum()
    if total <= 0:
        return x, x.copy()  # no mass at all: the diagonal (no concentration)
    y = np.concatenate([[0.0], np.cumsum(np.sort(u)[::-1]) / total])
    y[-1] = 1.0  # remove round-off in the final cumulative sum
    return x, y


def aucc(scores: ArrayLike) -> float:
    """AUCc ``= (1/N)(Σ_{j=1..N} y_j − 1/2)``: trapezoidal area under :func:`aucc_curve`.

    0.5 = no concentration (constant scores); → 1 as the mass concentrates on few samples.
    """
    x, y = aucc_curve(scores)
    return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2.0))
