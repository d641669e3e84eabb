"""A model's evaluation (paper §4 and SI S3.3/S4): every metric from member probabilities, and the
run behind ``vge evaluate``.

* :func:`evaluate_predictions` — every metric from member probabilities, as a JSON-ready dict (the
  training code stores it in the model card).
* :func:`run_evaluation` — load a saved model, run a data split and the offline OOD set, write
  ``metrics.json``, PNG figures and ``report.md`` (what ``vge evaluate`` runs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from models.evaluation.calibration import calibrate_abstain_k
from models.evaluation.classification import (
    as_numpy,
    classification_metrics,
    diversity,
    reliability_bins,
)
from models.evaluation.ood import natural_image_patches, ood_metrics
from models.evaluation.ranking import aucc, aucc_curve, rank_consistency
from models.evaluation.scores import UNCERTAINTY_SCORES, max_prob_score, score_arrays
from models.evaluation.selective import risk_coverage_curve, selective_metrics
from models.uncertainty.scoring import EnsembleScores, score_members
from models.uncertainty.validation import check_probs

__all__ = [
    "UNCERTAINTY_SCORES",
    "calibrate_abstain_k",
    "evaluate_predictions",
    "max_prob_score",
    "natural_image_patches",
    "run_evaluation",
    "score_arrays",
]

#: Scores drawn in the comparison figures (the paper's VGMU vs EU / EPKL / EPJS).
PLOTTED_SCORES = ("vgmu", "eu", "epkl", "epjs")
#: Size of the natural-image OOD set used by :func:`run_evaluation`.
OOD_SAMPLES = 1000


@dataclass(frozen=True)
class _Evaluation:
    metrics: dict[str, Any]
    scores: dict[str, np.ndarray]  # per-sample ID scores
    ood_scores: dict[str, np.ndarray] | None
    errors: np.ndarray
    predictive: np.ndarray  # (N, C) predictive distribution


def _score_arrays(scores: EnsembleScores, p: Tensor, q: Tensor | None) -> dict[str, np.ndarray]:
    return score_arrays(scores, p, q)


def _clean(obj: Any) -> Any:
    """Replace non-finite floats by ``None`` so the result is strict JSON."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _evaluate(
    p: Tensor,
    q: Tensor | None,
    labels: Any,
    p_ood: Tensor | None = None,
    q_ood: Tensor | None = None,
    abstain_k: float = 1.0,
    ood_no_digit: np.ndarray | None = None,
) -> _Evaluation:
    """``ood_no_digit`` (bool per OOD row): images the served reading found no digit in; they
    abstain and rank most uncertain, as they are answered (:data:`.ood_suite.NO_DIGIT_SCORE`)."""
    p = check_probs(torch.as_tensor(as_numpy(p)))
    q = None if q is None else check_probs(torch.as_tensor(as_numpy(q)))
    y = as_numpy(labels).astype(np.int64).ravel()
    n, m, c = p.shape
    if n == 0:
        raise ValueError("evaluation needs at least one sample")
    if y.shape[0] != n:
        raise ValueError(f"labels must have {n} entries (one per sample); got {y.shape[0]}")
    scores = score_members(p, q, abstain_k=abstain_k)
    arrays = _score_arrays(scores, p, q)
    errors = (scores.prediction.numpy() != y).astype(np.float64)

    gated = q is not None
    predictive = (q if gated else p).mean(dim=1).double().numpy()
    accepted = ~scores.abstain.numpy()
    metrics: dict[str, Any] = {
        "n_samples": n,
        "n_classes": c,
        "n_members": m,
        "gated": gated,
        "predictive": "q" if gated else "p",
        "classification": classification_metrics(predictive, y),
        "classification_raw": classification_metrics(p.mean(dim=1).double().numpy(), y)
        if gated
        else None,
        "diversity": {"p": diversity(p), **({"q": diversity(q)} if gated else {})},
        "abstention": {
            "abstain_k": float(abstain_k),
            "deferral": float(1.0 - accepted.mean()),
            "n_accepted": int(accepted.sum()),
            "accepted_risk": float(errors[accepted].mean()) if accepted.any() else None,
        },
        "uncertainty_means": {k: float(v.mean()) for k, v in arrays.items()},
        "rank_consistency": rank_consistency(arrays),
        "aucc": {k: aucc(v) for k, v in arrays.items()},
        "selective": {
            k: selective_metrics(v, errors, with_ci=k == "vgmu") for k, v in arrays.items()
        },
        "ood": None,
    }

    ood_arrays = None
    if p_ood is not None:
        if gated != (q_ood is not None):
            raise ValueError("give q_ood exactly when q is given (same model on both sets)")
        p_ood = check_probs(torch.as_tensor(as_numpy(p_ood)))
        q_ood = None if q_ood is None else check_probs(torch.as_tensor(as_numpy(q_ood)))
        ood_scores = score_members(p_ood, q_ood, abstain_k=abstain_k)
        ood_arrays = _score_arrays(ood_scores, p_ood, q_ood)
        abstained = ood_scores.abstain.numpy()
        if ood_no_digit is not None and ood_no_digit.any():
            from models.evaluation.ood_suite import NO_DIGIT_SCORE

            abstained = abstained | ood_no_digit
            for a in ood_arrays.values():
                a[ood_no_digit] = NO_DIGIT_SCORE
        metrics["ood"] = {
            "n_id": n,
            "n_ood": int(ood_scores.prediction.shape[0]),
            "abstain_rate": float(abstained.mean()),
            "scores": ood_metrics(arrays, ood_arrays),
        }
    return _Evaluation(_clean(metrics), arrays, ood_arrays, errors, predictive)


def evaluate_predictions(
    p: Tensor,
    q: Tensor | None,
    labels: Any,
    p_ood: Tensor | None = None,
    q_ood: Tensor | None = None,
    abstain_k: float = 1.0,
) -> dict[str, Any]:
    """Every evaluation metric from member probabilities, as a JSON-ready nested dict.

    Args:
        p: raw member probabilities ``(N, M, C)``; ``q``: VGN-gated members or ``None``.
        labels: true classes ``(N,)``.
        p_ood, q_ood: the same model's members on an OOD set (optional; ``q_ood`` iff ``q``).
        abstain_k: deferral threshold of the margin rule (paper §3.2).

    Returns keys ``n_samples, n_classes, n_members, gated, predictive ("q" for VGN models — the
    mixture trained by NLL — else "p"), classification {accuracy, macro_f1, ece, nll, brier} of that
    predictive mean, classification_raw (same for p̄; VGN models only, else None), diversity {p[, q]},
    abstention {abstain_k, deferral, n_accepted, accepted_risk}, uncertainty_means {score},
    rank_consistency {eu|epkl|epjs: {spearman, kendall}} (VGMU vs each), aucc {score},
    selective {score: {aurc, eaurc, error_auroc (+ error_auroc_ci95 for vgmu), coverage_at_risk {"0.01", "0.02", "0.05"}}}, ood (None, or
    {n_id, n_ood, abstain_rate, scores {score: {auroc, fpr95}}})``. Scores are the
    ``EnsembleScores`` uncertainty fields and ``max_prob`` (:data:`UNCERTAINTY_SCORES`); selective
    errors are those of ``EnsembleScores.prediction`` (the class the service serves). Undefined
    values are ``None``.
    """
    return _evaluate(p, q, labels, p_ood, q_ood, abstain_k).metrics


# --------------------------------------------------------------------------- run_evaluation


def _card_get(card: Any, *names: str, default: Any = None) -> Any:
    """First present attribute/key of the model card among ``names``."""
    for name in names:
        value = card.get(name) if isinstance(card, Mapping) else getattr(card, name, None)
        if value is not None:
            return value
    return default


def forward_all(predictor: Any, x: Tensor, batch_size: int = 256) -> tuple[Tensor, Tensor | None]:
    """Run the predictor on prepared inputs ``(N, Cin, H, W)`` in batches; stack ``p`` and ``q``."""
    ps, qs = [], []
    for start in range(0, x.shape[0], batch_size):
        out = predictor.forward(x[start : start + batch_size])
        ps.append(out.p.detach().cpu())
        if out.q is not None:
            qs.append(out.q.detach().cpu())
    return torch.cat(ps), (torch.cat(qs) if qs else None)


def _prepare_all(predictor: Any, images: Tensor) -> Tensor:
    """uint8 images ``(N, C, H, W)`` -> model inputs, through ``Predictor.read`` under the model's
    own prepare (the served path, issue 32), then :func:`models.data.normalise_uint8`."""
    from models.data import normalise_uint8

    read = torch.stack([predictor.read(img).image for img in images])
    return normalise_uint8(read, predictor.card.mean, predictor.card.std)


#: Evaluation splits: the dataset's test and validation splits; for models trained on the bundled
#: MNIST digits also the 2,000 held-out digits and the test split pooled with them.
SPLITS = ("test", "val", "holdout", "test+holdout")


def load_split(
    predictor: Any, split: str, data_root: str | Path | None
) -> tuple[Tensor, np.ndarray, str]:
    """Prepared inputs ``(N, Cin, H, W)``, labels and a description of the evaluation split.

    Models trained on the bundled MNIST subset (card ``dataset`` ``"mnist-bundled"`` or empty) are fed
    the raw uint8 digits through ``Predictor.prepare``, exactly as the service would; other datasets
    come from :func:`models.data.load_dataset` (already normalised; never downloads).
    """
    from models import data

    name = str(_card_get(predictor.card, "dataset", default="") or "mnist-bundled")
    if split in ("holdout", "test+holdout"):
        if name != "mnist-bundled":
            raise ValueError(
                f"split {split!r} uses the held-out MNIST digits, for models trained on "
                f"mnist-bundled; this model was trained on {name!r}: use 'test' or 'val'"
            )
        images, labels = data.load_holdout_mnist()
        source = f"held-out MNIST ({len(labels)} digits outside the bundled 8k)"
        if split == "test+holdout":  # pooled: more errors, a finer error-detection AUROC
            b_images, b_labels = data.load_bundled_mnist()
            idx = data.bundled_split()["test"]
            images = np.concatenate([b_images[idx], images])
            labels = np.concatenate([b_labels[idx], labels])
            source = f"bundled MNIST test split ({idx.size}) + {source}"
        x = _prepare_all(predictor, torch.from_numpy(images).unsqueeze(1))
        return x, labels, source
    if name == "mnist-bundled":
        images, labels = data.load_bundled_mnist()
        idx = data.bundled_split()[split]
        x = _prepare_all(predictor, torch.from_numpy(images[idx]).unsqueeze(1))
        return x, labels[idx], f"bundled MNIST, {split} split ({idx.size} digits)"
    bundle = data.load_dataset(name, data_root=data_root, allow_download=False)
    ds = bundle.test if split == "test" else bundle.val
    xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)
    return (
        torch.stack(xs),
        np.asarray([int(v) for v in ys]),
        f"{name}, {split} split ({len(ds)} images)",
    )


def run_evaluation(
    model_dir: str | Path,
    out_dir: str | Path,
    split: str = "test",
    data_root: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate a saved model on a data split and the OOD suite; write the artefacts.

    OOD: for 1-channel 28×28 models the project's OOD suite (:mod:`models.data_ood`, 500 images
    per group): ``metrics["ood_suite"]`` per group (:func:`.ood_suite.ood_suite_metrics`) and
    ``metrics["ood"]`` on the far groups pooled; other models get the natural-image patches.

    Writes into ``out_dir``: ``metrics.json`` (the dict returned), ``report.md`` and PNG figures
    (reliability diagram, margin–variance geometry, risk–coverage, AUCc curves, OOD ROC, and — when
    the card has them — learned k per class and the deferral calibration curve). The abstain ``k`` is
    the card's calibrated value when present, else 1.0. ``data_root`` is only used for torchvision
    datasets (nothing is downloaded).
    """
    from models.evaluation import plots
    from models.evaluation.report import write_report
    from models.predictor import Predictor

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    predictor = Predictor.from_dir(model_dir)
    card = predictor.card
    calibration = _card_get(card, "abstain_calibration", "calibration")
    # the k the server answers with: the card's calibration for the served member set (a card
    # from before 0.2 calibrated p; its VGN model answers from q, at k 1.0)
    abstain_k = float(predictor.options().abstain_k)

    x, labels, source = load_split(predictor, split, data_root)
    p, q = forward_all(predictor, x)
    channels = int(_card_get(card, "in_channels", default=x.shape[1]))
    size = tuple(_card_get(card, "input_size", default=tuple(x.shape[2:])))
    suite = None
    if channels == 1 and tuple(size) == (28, 28):  # the OOD suite is MNIST-shaped
        from models.data import normalise_uint8
        from models.data_ood.suite import FAR_GROUPS
        from models.evaluation.ood_suite import ood_suite_metrics, suite_members

        suite_images, suite, no_digit, suite_labels = suite_members(
            lambda b: forward_all(predictor, b),
            lambda u: normalise_uint8(u, predictor.card.mean, predictor.card.std),
            predictor.prepare_mode,
        )
        p_ood = torch.cat([suite[g][0] for g in FAR_GROUPS])
        q_ood = None if q is None else torch.cat([suite[g][1] for g in FAR_GROUPS])
        ood_no_digit = np.concatenate([no_digit[g] for g in FAR_GROUPS])
        ood_source = (
            "the project's OOD suite, far groups pooled (" + ", ".join(FAR_GROUPS) + "; "
            "docs/ood-suite.md)"
        )
    else:
        ood_no_digit = None
        ood_images = natural_image_patches(OOD_SAMPLES, channels=channels, size=size)
        p_ood, q_ood = forward_all(predictor, _prepare_all(predictor, ood_images))
        ood_source = "scikit-image sample photographs, 64×64 crops resized to the input"

    ev = _evaluate(p, q, labels, p_ood, q_ood, abstain_k=abstain_k, ood_no_digit=ood_no_digit)
    metrics = dict(ev.metrics)
    metrics["model"] = {
        "name": str(_card_get(card, "name", default=model_dir.name)),
        "version": _card_get(card, "version"),
        "dir": str(model_dir),
    }
    metrics["split"] = split
    metrics["data"] = source
    metrics["ood"]["source"] = ood_source
    if suite is not None:
        metrics["ood_suite"] = _clean(
            ood_suite_metrics(p, q, suite, abstain_k, no_digit, suite_labels)
        )
    if calibration:
        metrics["calibration"] = {k: v for k, v in dict(calibration).items() if k != "curve"}

    out_dir.mkdir(parents=True, exist_ok=True)
    figs: dict[str, str] = {}
    figs["Reliability diagram"] = plots.reliability_diagram(
        reliability_bins(ev.predictive, labels), out_dir / "reliability.png"
    ).name
    figs["Margin–variance geometry (paper Fig. 4)"] = plots.margin_variance_geometry(
        q if q is not None else p,  # the served members (answer_members)
        ev.scores["vgmu"],
        out_dir / "margin_variance.png",
        abstain_k=abstain_k,
    ).name
    shown = {k: ev.scores[k] for k in PLOTTED_SCORES}
    figs["Risk–coverage"] = plots.risk_coverage_plot(
        {k: risk_coverage_curve(v, ev.errors) for k, v in shown.items()},
        out_dir / "risk_coverage.png",
        aurc={k: metrics["selective"][k]["aurc"] for k in shown},
    ).name
    figs["Uncertainty mass concentration (AUCc)"] = plots.aucc_plot(
        {k: aucc_curve(v) for k, v in shown.items()},
        out_dir / "aucc.png",
        values={k: metrics["aucc"][k] for k in shown},
    ).name
    figs["OOD detection ROC"] = plots.ood_roc_plot(
        shown, {k: ev.ood_scores[k] for k in PLOTTED_SCORES}, out_dir / "ood_roc.png"
    ).name
    figs["Most confident errors"] = plots.confident_errors_plot(
        x,
        labels,
        ev.predictive.argmax(axis=1),
        ev.scores["vgmu"],
        out_dir / "confident_errors.png",
        _card_get(card, "class_names"),
    ).name
    if suite is not None:
        answers = {}
        for group, (pg, qg) in suite.items():
            s = score_members(pg, qg, abstain_k=abstain_k)
            answers[group] = (s.prediction.numpy(), s.abstain.numpy())
        figs["OOD suite: the model's answers (first 8 of each group)"] = plots.ood_examples_plot(
            suite_images, answers, out_dir / "ood_examples.png", _card_get(card, "class_names")
        ).name
    learned_k = _card_get(card, "learned_k")
    if learned_k is not None and len(learned_k) > 0:
        figs["Learned k per class"] = plots.learned_k_plot(
            learned_k, out_dir / "learned_k.png", _card_get(card, "class_names")
        ).name
    if calibration and calibration.get("curve"):
        figs["Deferral calibration"] = plots.deferral_curve_plot(
            calibration, out_dir / "deferral_calibration.png"
        ).name

    metrics["plots"] = figs
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    write_report(
        metrics,
        out_dir / "report.md",
        plots=figs,
        title=f"Evaluation: {metrics['model']['name']}",
        context={"split": split, "data": source, "abstain_k": abstain_k},
    )
    return metrics
