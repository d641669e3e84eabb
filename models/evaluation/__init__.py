"""Evaluation of variance-gated ensembles (paper §4 and SI S3.3/S4): metrics, plots, report.

One concept per module: :mod:`.evaluate` (:func:`evaluate_predictions`, every metric from member
probabilities; :func:`run_evaluation`, what ``vge evaluate`` runs), :mod:`.classification`
(accuracy, macro-F1, ECE, NLL, Brier, diversity), :mod:`.ranking` (Spearman/Kendall, AUCc),
:mod:`.selective` (risk–coverage, AURC, E-AURC), :mod:`.ood` (AUROC, FPR@95, natural-image OOD
set), :mod:`.calibration` (``abstain_k``), :mod:`.plots`, :mod:`.report`, :mod:`.scores`
(``UNCERTAINTY_SCORES`` and ``score_arrays``, shared with :mod:`.ood_suite`), :mod:`.drift` (PSI),
:mod:`.promote_gate` (whether a candidate model may replace the served one: the engine asks it).

The package imports nothing itself: its public names load their module on first use (PEP 562).
A server process imports :mod:`.drift` and :mod:`.promote_gate` (NumPy and torch only), and an
eager import of the metrics here pulled scikit-learn and SciPy into every ``vge serve`` process:
1.1 s of each engine start on the 2-core box (``python -X importtime``).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name → the module that defines it.
_PUBLIC = {
    "UNCERTAINTY_SCORES": "scores",
    "calibrate_abstain_k": "calibration",
    "evaluate_predictions": "evaluate",
    "max_prob_score": "scores",
    "natural_image_patches": "ood",
    "run_evaluation": "evaluate",
    "score_arrays": "scores",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
