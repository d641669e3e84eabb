"""Selective prediction: risk–coverage curve, AURC, E-AURC, coverage at a target risk.

Works for any uncertainty score ``u`` (lower = more confident: VGMU, EU, EPKL, …) and a 0/1 error
indicator ``e_i = 1[ŷ_i ≠ y_i]`` of the prediction that would be served. Accepting the ``k`` most
confident samples gives (Geifman & El-Yaniv 2017; Geifman et al. 2019)

    coverage c_k = k / N,     selective risk r_k = (1/k) Σ_{i ∈ top-k confident} e_i

    AURC   = (1/N) Σ_{k=1..N} r_k                      (mean risk over the N coverage levels)
    E-AURC = AURC − AURC*,   AURC* = AURC of the oracle ordering (all correct samples first):
             r*_k = max(0, k − (N − E)) / k with E = Σ_i e_i

AURC* is summed exactly (not via the ``r + (1 − r)ln(1 − r)`` approximation), so a perfect ranking has
E-AURC = 0 exactly. **Ties** in ``u`` have no defined order, so within a group of ``g`` tied samples
holding ``e_g`` errors the cumulative error count grows linearly (``e_g·j/g`` after ``j`` of them) —
the expectation over random tie-breaking. A constant score therefore has ``r_k = E/N`` for all ``k``
and AURC = the error rate. Thresholds can only be placed between distinct scores, so
:func:`coverage_at_risk` and the returned curve only use tie-group boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from models.evaluation.classification import as_numpy

#: Target selective risks reported by default (1 %, 2 %, 5 % error among accepted samples).
DEFAULT_TARGET_RISKS = (0.01, 0.02, 0.05)


def _inputs(uncertainty: ArrayLike, errors: ArrayLike) -> tuple[NDArray, NDArray]:
    u = as_numpy(uncertainty).astype(np.float64).ravel()
    e = as_numpy(errors).astype(np.float64).ravel()
    if u.shape != e.shape:
        raise ValueError(f"uncertainty and errors differ in length: {u.size} vs {e.size}")
    if u.size == 0:
        raise ValueError("selective prediction needs at least one sample")
    if not np.isfinite(u).all():
        raise ValueError("uncertainty scores must be finite")
    if not np.isin(e, (0.0, 1.0)).all():
        raise ValueError("errors must be 0/1 (or boolean)")
    return u, e


@dataclass(frozen=True)
class RiskCoverage:
    """Risk–coverage curve at every achievable threshold (one point per distinct score).

    ``coverage[j]``/``risk[j]``: accept every sample with ``u ≤ thresholds[j]``.
    """

    thresholds: NDArray[np.float64]
    coverage: NDArray[np.float64]
    risk: NDArray[np.float64]


def _tie_groups(u: NDArray, e: NDArray) -> tuple[NDArray, NDArray, NDArray]:
    """Sort ascending; return per distinct value: value, cumulative count, cumulative errors."""
    order = np.argsort(u, kind="stable")
    us, es = u[order], e[order]
    ends = np.flatnonzero(np.diff(us) != 0)
    ends = np.append(ends, us.size - 1)  # last index of each tie group
    return us[ends], (ends + 1).astype(np.float64), np.cumsum(es)[ends]


def risk_coverage_curve(uncertainty: ArrayLike, errors: ArrayLike) -> RiskCoverage:
    """Risk–coverage points at the achievable thresholds (tie-group boundaries), ascending coverage."""
    u, e = _inputs(uncertainty, errors)
    values, counts, cum_err = _tie_groups(u, e)
    return RiskCoverage(values, counts / u.size, cum_err / counts)


def _per_k_risk(u: NDArray, e: NDArray) -> NDArray[np.float64]:
    """``r_k`` for k = 1..N with ties resolved by expectation (linear within a tie group)."""
    _, counts, cum_err = _tie_groups(u, e)
    k = np.arange(1, u.size + 1, dtype=np.float64)
    # Piecewise-linear cumulative error count through (0, 0) and every group boundary.
    expected_errors = np.interp(
        k, np.concatenate([[0.0], counts]), np.concatenate([[0.0], cum_err])
    )
    return expected_errors / k


def aurc(uncertainty: ArrayLike, errors: ArrayLike) -> float:
    """AURC ``= (1/N) Σ_k r_k`` (area under the risk–coverage curve; lower is better)."""
    u, e = _inputs(uncertainty, errors)
    return float(_per_k_risk(u, e).mean())


def optimal_aurc(errors: ArrayLike) -> float:
    """AURC* of the oracle ranking: ``(1/N) Σ_k max(0, k − (N − E)) / k``."""
    e = as_numpy(errors).astype(np.float64).ravel()
    n, n_err = e.size, e.sum()
    k = np.arange(1, n + 1, dtype=np.float64)
    return float((np.maximum(0.0, k - (n - n_err)) / k).mean())


def excess_aurc(uncertainty: ArrayLike, errors: ArrayLike) -> float:
    """E-AURC ``= AURC − AURC*`` (0 for a perfect ranking)."""
    return aurc(uncertainty, errors) - optimal_aurc(errors)


def coverage_at_risk(uncertainty: ArrayLike, errors: ArrayLike, target_risk: float) -> dict:
    """Largest achievable coverage whose selective risk is ``≤ target_risk``.

    Returns ``{"target_risk", "coverage", "risk", "threshold"}``; coverage 0 (threshold ``None``)
    when even the single most confident tie group exceeds the target.
    """
    if not 0.0 <= target_risk <= 1.0:
        raise ValueError(f"target_risk must lie in [0, 1]; got {target_risk}")
    rc = risk_coverage_curve(uncertainty, errors)
    ok = np.flatnonzero(rc.risk <= target_risk + 1e-12)
    if ok.size == 0:
        return {"target_risk": target_risk, "coverage": 0.0, "risk": None, "threshold": None}
    j = ok[-1]
    return {
        "target_risk": target_risk,
        "coverage": float(rc.coverage[j]),
        "risk": float(rc.risk[j]),
        "threshold": float(rc.thresholds[j]),
    }


def error_detection_auroc(uncertainty: ArrayLike, errors: ArrayLike) -> float | None:
    """AUROC of telling the served errors (positives) from the correct answers by the score.

    ``AUROC = P(u_err > u_ok) + ½ P(u_err = u_ok)`` over pairs of one error and one correct answer
    (``sklearn.metrics.roc_auc_score``); 1 = every error is more uncertain than every correct
    answer, 0.5 = chance. ``None`` when the split has no error or no correct answer. With E errors
    its resolution is coarse: one error ranked differently moves it by up to 1/E.
    """
    from sklearn.metrics import roc_auc_score

    u, e = _inputs(uncertainty, errors)
    if e.all() or not e.any():
        return None
    return float(roc_auc_score(e, u))


def error_detection_auroc_ci(
    uncertainty: ArrayLike,
    errors: ArrayLike,
    level: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of :func:`error_detection_auroc` (stratified, seeded).

    Errors and correct answers are resampled separately (their counts stay fixed), so every
    replicate is defined. With ``H_ij = 1[u_err_i > u_ok_j] + ½ 1[u_err_i = u_ok_j]`` computed
    once, replicate ``b`` with multiplicities ``a_b`` (errors) and ``c_b`` (correct) is
    ``AUROC_b = a_bᵀ H c_b / (n_err · n_ok)``. ``None`` when the AUROC is undefined. Small error
    counts make this wide: it is the honest resolution of a target like "AUROC ≥ 0.97".
    """
    u, e = _inputs(uncertainty, errors)
    if e.all() or not e.any():
        return None
    err, ok = u[e == 1], u[e == 0]
    h = (err[:, None] > ok[None, :]) + 0.5 * (err[:, None] == ok[None, :])  # (n_err, n_ok)
    rng = np.random.default_rng(seed)
    a = rng.multinomial(err.size, np.full(err.size, 1.0 / err.size), size=n_boot)  # (B, n_err)
    c = rng.multinomial(ok.size, np.full(ok.size, 1.0 / ok.size), size=n_boot)  # (B, n_ok)
    reps = np.einsum("bi,ij,bj->b", a, h, c, optimize=True) / (err.size * ok.size)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(reps, [tail, 1.0 - tail])
    return float(lo), float(hi)


def selective_metrics(
    uncertainty: ArrayLike,
    errors: ArrayLike,
    target_risks: tuple[float, ...] = DEFAULT_TARGET_RISKS,
    with_ci: bool = False,
) -> dict:
    """AURC, E-AURC, error-detection AUROC and coverage at each target risk for one score
    (JSON-ready); ``with_ci`` adds the AUROC's 95 % bootstrap interval (``error_auroc_ci95``,
    about 0.3 s for 1,600 samples, so only for the served score)."""
    out = {
        "aurc": aurc(uncertainty, errors),
        "error_auroc": error_detection_auroc(uncertainty, errors),
        "eaurc": excess_aurc(uncertainty, errors),
        "coverage_at_risk": {
            f"{r:g}": coverage_at_risk(uncertainty, errors, r)["coverage"] for r in target_risks
        },
    }
    if with_ci:
        out["error_auroc_ci95"] = error_detection_auroc_ci(uncertainty, errors)
    return out
