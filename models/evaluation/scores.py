"""The uncertainty scores evaluated, and how each is read from an ensemble's scores.

:data:`UNCERTAINTY_SCORES` names them (the :class:`~models.uncertainty.scoring.EnsembleScores`
fields and ``max_prob``); :func:`score_arrays` turns one batch's scores into ``{score: array}``.
The package's metrics (:mod:`models.evaluation`) and the OOD suite's
(:mod:`models.evaluation.ood_suite`) both read them, and the package calls the suite: kept in
the package's ``__init__`` they closed an import circle, so they live here, below both (the
package re-exports them).
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from models.uncertainty.scoring import EnsembleScores

__all__ = ["UNCERTAINTY_SCORES", "max_prob_score", "score_arrays"]

#: Uncertainty scores evaluated (higher = more uncertain): the ``EnsembleScores`` fields and
#: ``max_prob``, 1 − max_c of the served mean (:func:`max_prob_score`), the softmax-margin
#: baseline VGMU must beat to add anything.
UNCERTAINTY_SCORES = (
    "vgmu",
    "max_prob",
    "tu",
    "au",
    "eu",
    "mutual_information",
    "epkl",
    "epjs",
    "epce",
)


def max_prob_score(p: Tensor, q: Tensor | None = None) -> Tensor:
    """``1 − max_c`` of the served mean, ``(B,)``: q̄ for VGN models (``q`` given), else p̄ (the
    distribution :func:`models.uncertainty.scoring.answer_members` serves from)."""
    members = q if q is not None else p
    return 1.0 - members.double().mean(dim=1).amax(dim=-1)


def score_arrays(
    scores: EnsembleScores,
    p: Tensor,
    q: Tensor | None,
    names: tuple[str, ...] = UNCERTAINTY_SCORES,
) -> dict[str, np.ndarray]:
    """``{score: float64 (B,)}`` for ``names``: fields of ``scores`` (what
    :func:`~models.uncertainty.scoring.score_members` gave for ``p``/``q``) and ``max_prob``."""
    return {
        name: (max_prob_score(p, q) if name == "max_prob" else getattr(scores, name))
        .double()
        .numpy()
        for name in names
    }
