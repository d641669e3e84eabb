"""Predictive performance and calibration of an ensemble's mean distribution (paper §4.4, SI S3.3 and S4.5).

Every function takes NumPy arrays or tensors and returns plain Python floats so results can go
straight into JSON. Notation: ``N`` samples, ``C`` classes, ``M`` ensemble members; ``probs`` is
the predictive distribution ``(N, C)`` (``p̄`` or ``q̄``), ``labels`` the true classes ``(N,)``.

* accuracy ``= (1/N) Σ_i 1[argmax_c probs_ic = y_i]``
* macro-F1 ``= (1/C') Σ_c F1_c`` over the classes present in labels or predictions (sklearn)
* ECE (15 equal-width bins, Guo et al. 2017)
  ``= Σ_b (|B_b|/N) · |acc(B_b) − conf(B_b)|`` with confidence ``conf_i = max_c probs_ic``
* NLL ``= −(1/N) Σ_i log max(probs_{i,y_i}, 1e-12)``
* Brier ``= (1/N) Σ_i Σ_c (probs_ic − 1[c = y_i])²`` (summed over classes, range [0, 2])
* diversity ``E_{i,c}[Var_M] = (1/(N·C)) Σ_{i,c} (1/(M−1)) Σ_m (P_imc − P̄_ic)²`` (SI S3.3 "diversity";
  the unbiased variance matches the ensemble std ``s`` of §3.1; 0 for a single member)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.metrics import f1_score

#: Number of equal-width confidence bins for ECE and the reliability diagram (paper: 15).
ECE_BINS = 15
#: Floor on the true-class probability in the NLL so a confidently wrong sample stays finite.
NLL_FLOOR = 1e-12


def as_numpy(x: ArrayLike) -> NDArray:
    """Convert a tensor (any device, with or without grad) or array-like to a NumPy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _check(probs: ArrayLike, labels: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    p = as_numpy(probs).astype(np.float64)
    y = as_numpy(labels).astype(np.int64)
    if p.ndim != 2:
        raise ValueError(f"probs must be (N, C); got shape {p.shape}")
    if y.shape != (p.shape[0],):
        raise ValueError(f"labels must be (N,) = ({p.shape[0]},); got shape {y.shape}")
    if p.shape[0] == 0:
        raise ValueError("need at least one sample")
    if y.min() < 0 or y.max() >= p.shape[1]:
        raise ValueError(f"labels must lie in [0, {p.shape[1] - 1}]; got [{y.min()}, {y.max()}]")
    return p, y


def accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    """Top-1 accuracy ``(1/N) Σ_i 1[argmax_c probs_ic = y_i]``."""
    p, y = _check(probs, labels)
    return float((p.argmax(axis=1) == y).mean())


def macro_f1(probs: ArrayLike, labels: ArrayLike) -> float:
    """Macro-averaged F1 of the top-1 predictions (``sklearn.metrics.f1_score(average="macro")``).

    Classes that appear in neither labels nor predictions are ignored (sklearn's behaviour);
    a class that is predicted but never correct contributes F1 = 0 (``zero_division=0``).
    """
    p, y = _check(probs, labels)
    return float(f1_score(y, p.argmax(axis=1), average="macro", zero_division=0))


@dataclass(frozen=True)
class ReliabilityBins:
    """Per-bin statistics of the reliability diagram (bins ``(lo, hi]``, the first also holds 0)."""

    edges: NDArray[np.float64]  # (n_bins + 1,)
    confidence: NDArray[np.float64]  # (n_bins,) mean max-probability in the bin, NaN if empty
    accuracy: NDArray[np.float64]  # (n_bins,) fraction correct in the bin, NaN if empty
    count: NDArray[np.int64]  # (n_bins,)


def reliability_bins(
    probs: ArrayLike, labels: ArrayLike, n_bins: int = ECE_BINS
) -> ReliabilityBins:
    """Bin samples by confidence ``conf_i = max_c probs_ic`` into ``n_bins`` equal-width bins.

    Bin ``b`` (0-based) holds ``conf ∈ (b/n, (b+1)/n]``; bin 0 also holds ``conf = 0``. The index is
    ``clip(ceil(conf·n) − 1, 0, n − 1)``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1; got {n_bins}")
    p, y = _check(probs, labels)
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    idx = np.clip(np.ceil(conf * n_bins).astype(np.int64) - 1, 0, n_bins - 1)
    count = np.bincount(idx, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(idx, weights=conf, minlength=n_bins) / count
        mean_acc = np.bincount(idx, weights=correct, minlength=n_bins) / count
    return ReliabilityBins(np.linspace(0.0, 1.0, n_bins + 1), mean_conf, mean_acc, count)


def expected_calibration_error(
    probs: ArrayLike, labels: ArrayLike, n_bins: int = ECE_BINS
) -> float:
    """ECE ``= Σ_b (|B_b|/N) · |acc(B_b) − conf(B_b)|`` over ``n_bins`` equal-width bins (default 15).

    See :func:`reliability_bins` for the binning; empty bins contribute 0.
    """
    bins = reliability_bins(probs, labels, n_bins)
    n = bins.count.sum()
    nonempty = bins.count > 0
    gap = np.abs(bins.accuracy[nonempty] - bins.confidence[nonempty])
    return float((bins.count[nonempty] / n * gap).sum())


def negative_log_likelihood(probs: ArrayLike, labels: ArrayLike) -> float:
    """NLL ``= −(1/N) Σ_i log max(probs_{i,y_i}, 1e-12)`` (natural log)."""
    p, y = _check(probs, labels)
    return float(-np.log(np.maximum(p[np.arange(len(y)), y], NLL_FLOOR)).mean())


def brier_score(probs: ArrayLike, labels: ArrayLike) -> float:
    """Multi-class Brier ``= (1/N) Σ_i Σ_c (probs_ic − 1[c = y_i])²`` (range [0, 2])."""
    p, y = _check(probs, labels)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return float(((p - onehot) ** 2).sum(axis=1).mean())


def diversity(members: ArrayLike) -> float:
    """Ensemble diversity ``E_{i,c}[Var_M]`` (paper SI S3.3): member variance averaged over samples
    and classes, ``(1/(N·C)) Σ_{i,c} (1/(M−1)) Σ_m (P_imc − P̄_ic)²``; 0 when ``M = 1``.

    Args:
        members: member probabilities ``(N, M, C)``.
    """
    P = as_numpy(members).astype(np.float64)
    if P.ndim != 3:
        raise ValueError(f"members must be (N, M, C); got shape {P.shape}")
    if P.shape[1] < 2:
        return 0.0
    return float(P.var(axis=1, ddof=1).mean())


def classification_metrics(probs: ArrayLike, labels: ArrayLike, n_bins: int = ECE_BINS) -> dict:
    """All predictive metrics of one distribution: accuracy, macro-F1, ECE, NLL, Brier."""
    return {
        "accuracy": accuracy(probs, labels),
        "macro_f1": macro_f1(probs, labels),
        "ece": expected_calibration_error(probs, labels, n_bins),
        "nll": negative_log_likelihood(probs, labels),
        "brier": brier_score(probs, labels),
    }
