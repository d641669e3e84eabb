"""One call that scores an ensemble's members: the public entry point for the CLI and the service."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

from models.uncertainty.decomposition import Decomposition, entropy_decomposition
from models.uncertainty.divergences import epce, epjs, epkl, mutual_information
from models.uncertainty.gate import GATE_K_MAX, K_MIN
from models.uncertainty.margin import MarginScore, margin_score
from models.uncertainty.validation import check_probs
from models.uncertainty.vgn import vgn

VgmuOn = Literal["p", "q"]


@dataclass(frozen=True)
class EnsembleScores:
    """Scores for a batch; every field is a ``(B,)`` tensor."""

    prediction: Tensor  # int64 argmax of the answer's mean (q̄ for gated members, else p̄)
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


def answer_members(p: Tensor, q: Tensor | None, vgmu_on: VgmuOn | None = None) -> VgmuOn:
    """Which member set an answer is computed from: ``"q"`` (gated) or ``"p"`` (raw).

    One answer, one distribution. A VGN model is trained on the mixture of its *gated* members
    (Section 3.1, eq. for q̄), so its predictive distribution is q̄ and, by default, everything
    served about it — prediction, label, probabilities, VGMU/SNR, abstain (Section 3.2: VGMU works
    on any ensemble output) and TU/AU/EU (the gated decomposition, Section 3.3) — comes from ``q``.
    A model without a gate answers from ``p``. ``vgmu_on`` overrides the choice; ``"q"`` without
    gated members is an error (there is no q to use).
    """
    if vgmu_on is None:
        return "q" if q is not None else "p"
    if vgmu_on not in ("p", "q"):
        raise ValueError(f"vgmu_on must be 'p' or 'q'; got {vgmu_on!r}")
    if vgmu_on == "q" and q is None:
        raise ValueError(
            "vgmu_on='q' needs gated members, but this ensemble has no variance gate (VGN); "
            "use vgmu_on='p' or leave it unset"
        )
    return vgmu_on


def _checked(p: Tensor, q: Tensor | None) -> tuple[Tensor, Tensor | None]:
    p = check_probs(p, min_members=2)
    if q is not None:
        q = check_probs(q, min_members=2)
        if q.shape != p.shape:
            raise ValueError(f"gated members q {tuple(q.shape)} must match p {tuple(p.shape)}")
    return p, q


def decision_scores(
    p: Tensor,
    q: Tensor | None = None,
    *,
    abstain_k: float = 1.0,
    vgmu_on: VgmuOn | None = None,
    validate: bool = True,
) -> tuple[MarginScore, Decomposition]:
    """What a served prediction needs: the margin decision (VGMU, SNR, prediction, abstain) and TU/AU/EU.

    All of it from one member set, :func:`answer_members` (``q`` for VGN models). No divergence
    baselines: this is the serving hot path. ``validate=False`` skips :func:`check_probs` (and its
    host synchronisation) for a model's own softmax outputs, which need no checking per request.
    """
    which = answer_members(p, q, vgmu_on)
    if validate:
        p, q = _checked(p, q)
    members = q if which == "q" else p
    assert members is not None
    with torch.no_grad():
        return margin_score(members, abstain_k), entropy_decomposition(members)


def score_members(
    p: Tensor,
    q: Tensor | None = None,
    *,
    abstain_k: float = 1.0,
    vgmu_on: VgmuOn | None = None,
    validate: bool = True,
) -> EnsembleScores:
    """:func:`decision_scores` plus the divergence baselines (MI, EPKL, EPJS, EPCE) of the raw members.

    The baselines are defined on the raw members ``p`` (Section 4 compares them with VGMU and EU).
    """
    which = answer_members(p, q, vgmu_on)
    if validate:
        p, q = _checked(p, q)
    with torch.no_grad():
        margin, dec = decision_scores(p, q, abstain_k=abstain_k, vgmu_on=which, validate=False)
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
    vgmu_on: VgmuOn | None = None,
) -> EnsembleScores:
    """Score any ensemble's member probabilities ``(B, M, C)`` (what ``vge score`` and ``/v1/score`` do).

    Without ``gate_k`` the answer is that of the raw members; with ``gate_k = K`` it is that of the
    members gated by VGN with fixed ``k = K`` (:func:`answer_members`; ``vgmu_on="p"`` keeps the raw
    members). ``vgmu_on="q"`` needs ``gate_k``. Needs ``M >= 2``.
    """
    p = check_probs(probs, min_members=2)
    if gate_k is not None and not K_MIN <= gate_k <= GATE_K_MAX:  # NaN fails too
        raise ValueError(f"gate_k must be in [{K_MIN:g}, {GATE_K_MAX:g}]; got {gate_k}")
    if vgmu_on == "q" and gate_k is None:
        raise ValueError("vgmu_on='q' needs gated members: pass gate_k")
    with torch.no_grad():
        q = vgn(p, float(gate_k)) if gate_k is not None else None
    return score_members(p, q, abstain_k=abstain_k, vgmu_on=vgmu_on, validate=False)
