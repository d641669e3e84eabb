"""One call that scores an ensemble's members: the public entry point for the CLI and the service."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

from models.uncertainty.decomposition import Decomposition, entropy_decomposition
from models.uncertainty.divergences import epce, epjs, epkl, mutual_information
from models.uncertainty.margin import MarginScore, margin_score
from models.uncertainty.validation import check_probs
from models.uncertainty.vgn import vgn

VgmuOn = Literal["p", "q"]


@dataclass(frozen=True)
class EnsembleScores:
    """Scores for a batch; every field is a ``(B,)`` tensor."""

    prediction: Tensor
    abstain: Tensor
    vgmu: Tensor
    snr: Tensor
    tu: Tensor
    au: Tensor
    eu: Tensor
    mutual_information: Tensor
    epkl: Tensor
    epjs: Tensor
    epce: Tensor

    def to_records(self) -> list[dict[str, int | bool | float]]:
        """One JSON-ready dict per sample, keys in field order."""
        cols = {f.name: getattr(self, f.name).detach().cpu().tolist() for f in fields(self)}
        n = len(cols["prediction"])
        return [
            {
                name: (
                    int(v[i])
                    if name == "prediction"
                    else bool(v[i])
                    if name == "abstain"
                    else float(v[i])
                )
                for name, v in cols.items()
            }
            for i in range(n)
        ]


def _checked(p: Tensor, q: Tensor | None, vgmu_on: str) -> tuple[Tensor, Tensor | None]:
    if vgmu_on not in ("p", "q"):
        raise ValueError(f"vgmu_on must be 'p' or 'q'; got {vgmu_on!r}")
    p = check_probs(p)
    if q is not None:
        q = check_probs(q)
        if q.shape != p.shape:
            raise ValueError(f"gated members q {tuple(q.shape)} must match p {tuple(p.shape)}")
    return p, q


def _decide(
    p: Tensor, q: Tensor | None, abstain_k: float, vgmu_on: str
) -> tuple[MarginScore, Decomposition]:
    gated = q if q is not None else p
    return margin_score(gated if vgmu_on == "q" else p, abstain_k), entropy_decomposition(gated)


def decision_scores(
    p: Tensor,
    q: Tensor | None = None,
    *,
    abstain_k: float = 1.0,
    vgmu_on: VgmuOn = "p",
) -> tuple[MarginScore, Decomposition]:
    """What a served prediction needs: the margin decision (VGMU, SNR, prediction, abstain) and TU/AU/EU.

    TU/AU/EU come from ``q`` when given (the gated decomposition, Section 3.3), else from ``p``.
    VGMU, SNR, prediction and abstain come from ``p`` unless ``vgmu_on == "q"`` (Section 3.2: VGMU
    works on any ensemble output). No divergence baselines: this is the serving hot path.
    """
    p, q = _checked(p, q, vgmu_on)
    with torch.no_grad():
        return _decide(p, q, abstain_k, vgmu_on)


def score_members(
    p: Tensor,
    q: Tensor | None = None,
    *,
    abstain_k: float = 1.0,
    vgmu_on: VgmuOn = "p",
) -> EnsembleScores:
    """:func:`decision_scores` plus the divergence baselines (MI, EPKL, EPJS, EPCE) of the raw members."""
    p, q = _checked(p, q, vgmu_on)
    with torch.no_grad():
        margin, dec = _decide(p, q, abstain_k, vgmu_on)
        return EnsembleScores(
            prediction=margin.prediction,
            abstain=margin.abstain,
            vgmu=margin.vgmu,
            snr=margin.snr,
            tu=dec.tu,
            au=dec.au,
            eu=dec.eu,
            mutual_information=mutual_information(p),
            epkl=epkl(p),
            epjs=epjs(p),
            epce=epce(p),
        )


def score_ensemble(
    probs: Tensor,
    *,
    gate_k: float | None = None,
    abstain_k: float = 1.0,
    vgmu_on: VgmuOn = "p",
) -> EnsembleScores:
    """Score any ensemble's member probabilities ``(B, M, C)`` (what ``vge score`` and ``/v1/score`` do).

    Without ``gate_k`` TU/AU/EU are those of the raw members; with ``gate_k = K`` they are those of the
    members gated by VGN with fixed ``k = K``. ``vgmu_on="q"`` needs ``gate_k``.
    """
    p = check_probs(probs)
    if gate_k is not None and (not gate_k == gate_k or gate_k <= 0):
        raise ValueError(f"gate_k must be > 0; got {gate_k}")
    if vgmu_on == "q" and gate_k is None:
        raise ValueError("vgmu_on='q' needs gated members: pass gate_k")
    with torch.no_grad():
        q = vgn(p, float(gate_k)) if gate_k is not None else None
    return score_members(p, q, abstain_k=abstain_k, vgmu_on=vgmu_on)
