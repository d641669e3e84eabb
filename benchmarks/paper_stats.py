"""The numbers of one configuration, computed from its member probabilities.

:func:`evaluate_members` runs the shipped evaluation code
(:func:`models.evaluation.evaluate.evaluate_predictions`) on the test split against every OOD set and adds
what the document says beyond it: error-detection AUROC per score, the mean confidence of the
served distribution, and the OOD inputs VGMU misses (:func:`vgmu_missed`). No models, files or
figures: the tests drive it with synthetic members.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from benchmarks.paper_config import SCORES, Spec


@dataclass
class ConfigResult:
    """Everything the document says about one trained configuration."""

    spec: Spec
    metrics: dict[str, Any]  # evaluate_predictions on the test split (ood: the patches set)
    ood: dict[str, dict[str, Any]]  # OOD set key -> evaluate_predictions(...)["ood"]
    error_auroc: dict[str, float | None] = field(default_factory=dict)  # score -> AUROC
    mean_confidence: float | None = None  # mean max-probability of the served distribution
    #: OOD set -> (share of OOD inputs VGMU misses at its ID 95th percentile, share of those
    #: that EPKL flags at its own ID 95th percentile)
    vgmu_missed: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    scores: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # per test digit
    learned_k: list[float] | None = None
    training: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, str] = field(default_factory=dict)  # caption -> path relative to the doc
    report: str | None = None  # per-configuration `vge evaluate` report, relative to the doc


def evaluate_members(
    spec: Spec,
    p: Tensor,
    q: Tensor | None,
    labels: Tensor | np.ndarray,
    ood: Mapping[str, tuple[Tensor, Tensor | None]],
    abstain_k: float = 1.0,
) -> ConfigResult:
    """All numbers of one configuration from its member probabilities (shipped evaluation code).

    ``p``/``q``: test-split members ``(N, M, C)`` (``q`` for VGN models, else ``None``); ``ood``:
    OOD set key -> the same model's members on that set. Each OOD set is passed to
    :func:`models.evaluation.evaluate.evaluate_predictions` with the test split as the in-distribution side;
    ``metrics`` is the evaluation with the first OOD set (identical test-split metrics every time).
    """
    from models.evaluation.evaluate import evaluate_predictions
    from models.evaluation.selective import error_detection_auroc
    from models.uncertainty.scoring import score_members

    if not ood:
        raise ValueError("at least one OOD set is needed")
    per_set: dict[str, dict[str, Any]] = {}
    metrics: dict[str, Any] | None = None
    for name, (p_ood, q_ood) in ood.items():
        m = evaluate_predictions(p, q, labels, p_ood, q_ood, abstain_k=abstain_k)
        per_set[name] = m["ood"]
        if metrics is None:
            metrics = m
    assert metrics is not None
    sc = score_members(
        torch.as_tensor(p), None if q is None else torch.as_tensor(q), abstain_k=abstain_k
    )
    scores = {s: getattr(sc, s).double().numpy() for s in SCORES}
    errors = sc.prediction.numpy() != np.asarray(labels).astype(np.int64).ravel()
    served = torch.as_tensor(q if q is not None else p).double().mean(dim=1)
    return ConfigResult(
        spec=spec,
        metrics=metrics,
        ood=per_set,
        error_auroc={s: error_detection_auroc(u, errors) for s, u in scores.items()},
        mean_confidence=float(served.max(dim=-1).values.mean()),
        vgmu_missed={
            name: vgmu_missed(scores, score_members(*members, abstain_k=abstain_k))
            for name, members in ood.items()
        },
        scores=scores,
    )


def vgmu_missed(id_scores: Mapping[str, np.ndarray], ood: Any) -> tuple[float, float | None]:
    """Share of OOD inputs whose VGMU is below the in-distribution 95th percentile (missed at a
    5 % false-positive budget), and the share of those whose EPKL is above *its* ID 95th
    percentile (caught by the full-simplex score). ``ood`` is an ``EnsembleScores``."""
    v_thr = np.quantile(id_scores["vgmu"], 0.95)
    e_thr = np.quantile(id_scores["epkl"], 0.95)
    v, e = ood.vgmu.double().numpy(), ood.epkl.double().numpy()
    missed = v <= v_thr
    caught = float((e[missed] > e_thr).mean()) if missed.any() else None
    return float(missed.mean()), caught
