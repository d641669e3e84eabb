"""Uncertainty drift: how far recent traffic's uncertainty is from the validation split's.

The model card stores the *reference*: the distribution of the served uncertainty scores (VGMU and
EU of the answer's member set, paper §3.2–3.3) on the validation split, as fractions per bin of
:data:`DRIFT_EDGES`. A server compares a sliding window of recent answers with it using the
population stability index

    PSI = Σ_b (w_b − r_b) · ln(w_b / r_b)

(``r``: reference fractions, ``w``: window fractions, both floored at ``1e-4`` so empty bins stay
finite). PSI is symmetric in its roles, 0 for identical distributions, and has a conventional
reading: < 0.1 no shift, 0.1–0.25 moderate, > 0.25 a significant shift. It was chosen over a KS
statistic because it is computed from binned counts (what a server can keep cheaply and what a
card can store) and weights shifts into rare bins — for VGMU and EU the high-uncertainty tail that
out-of-distribution traffic fills — more than KS's largest CDF gap does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

#: Bin edges on [0, 1] with resolution near 0, where most in-distribution VGMU/EU values lie.
DRIFT_EDGES: tuple[float, ...] = (
    0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0,
)  # fmt: skip
#: Scores a reference covers.
DRIFT_SCORES: tuple[str, ...] = ("vgmu", "eu")
FLOOR = 1e-4


def bin_fractions(values: ArrayLike, edges: tuple[float, ...] = DRIFT_EDGES) -> np.ndarray:
    """Fraction of ``values`` per bin of ``edges`` (values outside [0, 1] are clipped into it)."""
    v = np.clip(np.asarray(values, dtype=np.float64).ravel(), edges[0], edges[-1])
    counts, _ = np.histogram(v, bins=np.asarray(edges))
    total = counts.sum()
    return counts / total if total else np.zeros(len(edges) - 1)


def psi(reference: ArrayLike, window: ArrayLike) -> float:
    """Population stability index between two bin-fraction vectors (see the module docstring)."""
    r = np.maximum(np.asarray(reference, dtype=np.float64), FLOOR)
    w = np.maximum(np.asarray(window, dtype=np.float64), FLOOR)
    r, w = r / r.sum(), w / w.sum()
    return float(np.sum((w - r) * np.log(w / r)))


def served_reference(p: Any, q: Any, calibration: dict[str, Any]) -> dict[str, Any]:
    """:func:`uncertainty_reference` of the served rule (members and k of ``calibration``) on the
    validation members ``p``/``q``."""
    from models.uncertainty.scoring import decision_scores

    margin, dec = decision_scores(p, q, abstain_k=float(calibration["abstain_k"]),
                                  vgmu_on=calibration.get("members"))  # fmt: skip
    scores = {"vgmu": margin.vgmu.double().numpy(), "eu": dec.eu.double().numpy()}
    return uncertainty_reference(scores, calibration.get("achieved_deferral"))


def uncertainty_reference(scores: dict[str, ArrayLike], deferral: float | None) -> dict[str, Any]:
    """The card's ``uncertainty_reference``: bin edges, fractions per score, the calibrated
    deferral rate and the sample count (JSON-ready)."""
    n = len(np.asarray(scores[DRIFT_SCORES[0]]).ravel())
    return {
        "edges": list(DRIFT_EDGES),
        "fractions": {k: bin_fractions(scores[k]).tolist() for k in DRIFT_SCORES},
        "deferral": deferral,
        "n": n,
        "split": "val",
    }
