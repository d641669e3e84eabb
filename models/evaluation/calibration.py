"""Deferral threshold calibration: choose the abstain ``k`` on a validation split (paper §3.2).

The paper's rule (§3.2, eq. for ŷ) predicts the top-1 class ``i`` iff ``p̄1 − k·s1 > p̄2 + k·s2`` and
abstains (defers to a human) otherwise, and notes that "threshold k can be set to reflect the fraction
of samples that require abstentions … by sorting the margin-based SNR in increasing values". Each
sample has a *critical* value

    κ_i = (p̄1 − p̄2) / (s1 + s2)          (s already includes the paper's ε, so s1 + s2 > 0)

and abstains exactly when ``k ≥ κ_i``. Hence ``deferral(k) = #{i : κ_i ≤ k} / N`` is a step function
that only changes at the κ's, and the only distinct operating points are ``k`` between consecutive
distinct κ's. :func:`calibrate_abstain_k` evaluates those candidates (midpoints between consecutive
distinct κ's, half the smallest κ, and just above the largest κ) — or a user-supplied grid — and

* ``target_deferral=d``: picks the candidate whose deferral is closest to ``d`` (ties → smaller ``k``);
  with distinct κ's the achieved rate is within ``1/(2N)`` of ``d``;
* ``target_risk=r``: picks the smallest deferral whose selective risk
  ``risk(k) = #{accepted errors} / #{accepted}`` is ``≤ r``. Deferring everything is always allowed
  (nothing accepted, no errors), so the search never fails; ``achieved_risk`` is then ``None``.

Achieved deferral and risk are re-measured with :func:`models.uncertainty.margin.margin_score` (the
rule the service applies), in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import Tensor

from models.evaluation.classification import as_numpy
from models.uncertainty.margin import margin_score, top2
from models.uncertainty.moments import ensemble_moments
from models.uncertainty.validation import check_probs

#: Most points kept in the returned curve (evenly spaced over the candidates, chosen point included).
MAX_CURVE_POINTS = 50


def critical_k(p: Tensor) -> Tensor:
    """Per-sample critical value ``κ_i = (p̄1 − p̄2)/(s1 + s2)`` ``(B,)``: abstain iff ``k ≥ κ_i``."""
    mean, s = ensemble_moments(p)
    i1, i2 = top2(mean)
    p1, p2 = mean.gather(-1, i1[:, None])[:, 0], mean.gather(-1, i2[:, None])[:, 0]
    s1, s2 = s.gather(-1, i1[:, None])[:, 0], s.gather(-1, i2[:, None])[:, 0]
    return (p1 - p2) / (s1 + s2)


def _measure(p: Tensor, labels: Tensor, k: float) -> dict:
    """Deferral and accepted-error rate of the margin rule at ``k`` (risk ``None`` if none accepted)."""
    ms = margin_score(p, abstain_k=k)
    accepted = ~ms.abstain
    n_acc = int(accepted.sum())
    errors = int(((ms.prediction != labels) & accepted).sum())
    return {
        "abstain_k": float(k),
        "deferral": float(ms.abstain.double().mean()),
        "risk": errors / n_acc if n_acc else None,
    }


def _candidates(kappa: np.ndarray) -> np.ndarray:
    """One ``k`` inside every distinct operating region of ``deferral(k)``, ascending, all ≥ 0."""
    vals = np.unique(kappa)
    inner = (vals[:-1] + vals[1:]) / 2.0
    top = vals[-1] * (1.0 + 1e-6) + 1e-12
    return np.concatenate([[vals[0] / 2.0], inner, [top]])


def calibrate_abstain_k(
    p: ArrayLike | Tensor,
    labels: ArrayLike | Tensor,
    target_deferral: float | None = None,
    target_risk: float | None = None,
    grid: Sequence[float] | None = None,
) -> dict:
    """Choose the abstain ``k`` for a target deferral rate or a target selective risk.

    Args:
        p: member probabilities ``(N, M, C)`` of the validation split: the members the served
            rule uses (the gated ``q`` for VGN models, see :func:`calibrate_served`).
        labels: true classes ``(N,)``.
        target_deferral: desired fraction of abstentions in ``[0, 1]``; or
        target_risk: largest allowed error rate among accepted predictions in ``[0, 1]``
            (exactly one of the two).
        grid: candidate ``k`` values (≥ 0); default: every distinct operating point (see module doc).

    Returns:
        ``{"abstain_k", "mode" ("deferral"|"risk"), "target", "achieved_deferral", "achieved_risk",
        "n_samples", "curve": [{"abstain_k", "deferral", "risk"}, …]}`` with at most
        :data:`MAX_CURVE_POINTS` curve points in increasing ``k`` (JSON-ready).
    """
    if (target_deferral is None) == (target_risk is None):
        raise ValueError("give exactly one of target_deferral or target_risk")
    mode, target = (
        ("deferral", float(target_deferral))
        if target_deferral is not None
        else ("risk", float(target_risk))
    )
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target_{mode} must lie in [0, 1]; got {target}")
    P = check_probs(torch.as_tensor(p)).to(torch.float64)
    y = torch.as_tensor(as_numpy(labels)).to(torch.int64).reshape(-1)
    n = P.shape[0]
    if n == 0:
        raise ValueError("calibration needs at least one validation sample")
    if y.shape[0] != n:
        raise ValueError(f"labels must have {n} entries; got {y.shape[0]}")

    kappa = critical_k(P).numpy()
    if grid is None:
        ks = _candidates(kappa)
    else:
        ks = np.unique(np.asarray(list(grid), dtype=np.float64))
        if ks.size == 0 or not np.isfinite(ks).all() or (ks < 0).any():
            raise ValueError("grid must be a non-empty list of finite values >= 0")

    # Deferral and risk at every candidate, from the sorted critical values (O(N log N)).
    order = np.argsort(kappa, kind="stable")
    wrong = (P.mean(dim=1).argmax(dim=-1) != y).numpy()[order]
    cum_wrong = np.concatenate([[0], np.cumsum(wrong)])
    n_deferred = np.searchsorted(kappa[order], ks, side="right")  # κ ≤ k → abstain
    n_accepted = n - n_deferred
    accepted_wrong = cum_wrong[-1] - cum_wrong[n_deferred]
    deferral = n_deferred / n
    with np.errstate(invalid="ignore", divide="ignore"):
        risk = np.where(n_accepted > 0, accepted_wrong / np.maximum(n_accepted, 1), 0.0)

    if mode == "deferral":
        best = int(np.argmin(np.abs(deferral - target)))  # first minimum = smallest k
    else:
        best = (
            int(np.flatnonzero(risk <= target + 1e-12)[0]) if (risk <= target + 1e-12).any() else -1
        )
        if best < 0:  # only possible with a user grid that cannot defer everything
            best = int(np.argmin(risk))

    chosen = _measure(P, y, float(ks[best]))
    keep = np.unique(np.round(np.linspace(0, ks.size - 1, min(MAX_CURVE_POINTS - 1, ks.size))))
    keep = np.union1d(keep.astype(np.int64), [best])
    curve = [
        {
            "abstain_k": float(ks[j]),
            "deferral": float(deferral[j]),
            "risk": float(risk[j]) if n_accepted[j] > 0 else None,
        }
        for j in keep
    ]
    return {
        "abstain_k": chosen["abstain_k"],
        "mode": mode,
        "target": target,
        "achieved_deferral": chosen["deferral"],
        "achieved_risk": chosen["risk"],
        "n_samples": n,
        "curve": curve,
    }


def calibrate_served(
    p: ArrayLike | Tensor,
    q: ArrayLike | Tensor | None,
    labels: ArrayLike | Tensor,
    target_deferral: float | None = None,
    target_risk: float | None = None,
) -> dict:
    """Calibrate ``abstain_k`` on exactly the served rule, plus the other member set's ``k``.

    The served rule is VGMU on the answer's members (``q`` for VGN models, else ``p``; see
    :func:`models.uncertainty.scoring.answer_members`). Returns :func:`calibrate_abstain_k`'s dict
    for those members with ``"members"`` (``"q"``/``"p"``) and, for VGN models,
    ``"by_members": {"p": k_p}`` so that a ``vgmu_on="p"`` request gets a threshold calibrated for
    the same target on ``p`` instead of ``q``'s.
    """
    served = q if q is not None else p
    calib = calibrate_abstain_k(served, labels, target_deferral, target_risk)
    calib["members"] = "q" if q is not None else "p"
    if q is not None:
        other = calibrate_abstain_k(p, labels, target_deferral, target_risk)
        calib["by_members"] = {"p": other["abstain_k"]}
    return calib
