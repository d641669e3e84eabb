"""Evaluation figures as PNG files (matplotlib, Agg canvas; no pyplot global state, thread-safe).

Each function draws one figure, writes it to ``path`` and returns the path:

* :func:`reliability_diagram` — accuracy vs confidence per ECE bin, with the bin counts (§4.4)
* :func:`margin_variance_geometry` — x = ``p̄1 − p̄2``, y = ``s1 + s2``, colour = VGMU (paper Fig. 4)
* :func:`risk_coverage_plot` — selective risk vs coverage per uncertainty score
* :func:`aucc_plot` — cumulative uncertainty-mass curves with the diagonal (paper Fig. 3)
* :func:`learned_k_plot` — the VGN's learned per-class ``k`` (paper §4.4, "Effects of learned k")
* :func:`deferral_curve_plot` — abstain ``k`` calibration curve (deferral and accepted risk vs ``k``)
* :func:`ood_roc_plot` — ROC curves of OOD detection per score (paper Fig. 6)
* :func:`confident_errors_plot` — the misclassified inputs the score ranks as most certain
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from numpy.typing import ArrayLike
from sklearn.metrics import roc_curve

from models.evaluation.classification import ReliabilityBins, as_numpy
from models.evaluation.selective import RiskCoverage
from models.uncertainty.margin import top2
from models.uncertainty.moments import ensemble_moments
from models.uncertainty.validation import check_probs

DPI = 120


def _figure(width: float = 5.0, height: float = 4.0) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def reliability_diagram(
    bins: ReliabilityBins, path: str | Path, title: str = "Reliability"
) -> Path:
    """Bars: accuracy per confidence bin; line: perfect calibration; lower panel: samples per bin."""
    fig = _figure(5.0, 5.0)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    width = np.diff(bins.edges)
    centers = bins.edges[:-1] + width / 2
    nonempty = bins.count > 0
    top.bar(
        centers[nonempty],
        bins.accuracy[nonempty],
        width=width[nonempty] * 0.95,
        color="#4C72B0",
        edgecolor="black",
        linewidth=0.5,
        label="accuracy",
    )
    gap = bins.confidence[nonempty] - bins.accuracy[nonempty]
    top.bar(
        centers[nonempty],
        gap,
        bottom=bins.accuracy[nonempty],
        width=width[nonempty] * 0.95,
        facecolor="none",
        edgecolor="#C44E52",
        hatch="//",
        linewidth=0.8,
        label="gap to confidence",
    )
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfectly calibrated")
    top.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title=title)
    top.legend(loc="upper left", fontsize=8)
    bottom.bar(centers, bins.count, width=width * 0.95, color="grey")
    bottom.set(xlabel="confidence (max probability)", ylabel="samples")
    return _save(fig, path)


def margin_variance(p: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates of paper Fig. 4: margin ``p̄1 − p̄2`` and combined spread ``s1 + s2`` per sample."""
    P = check_probs(torch.as_tensor(as_numpy(p)))
    mean, s = ensemble_moments(P)
    i1, i2 = top2(mean)
    margin = mean.gather(-1, i1[:, None]) - mean.gather(-1, i2[:, None])
    spread = s.gather(-1, i1[:, None]) + s.gather(-1, i2[:, None])
    return margin[:, 0].numpy(), spread[:, 0].numpy()


def margin_variance_geometry(
    p: ArrayLike,
    vgmu: ArrayLike,
    path: str | Path,
    title: str = "Margin–variance geometry",
    abstain_k: float | None = None,
) -> Path:
    """Scatter of ``(p̄1 − p̄2, s1 + s2)`` coloured by VGMU (viridis: yellow = high uncertainty).

    With ``abstain_k`` the abstain boundary ``margin = k·(s1 + s2)`` is drawn: samples on or left of
    the line are deferred.
    """
    margin, spread = margin_variance(p)
    u = as_numpy(vgmu).astype(np.float64).ravel()
    order = np.argsort(u)  # draw high-uncertainty points last so they stay visible
    fig = _figure(5.5, 4.2)
    ax = fig.subplots()
    sc = ax.scatter(margin[order], spread[order], c=u[order], cmap="viridis", s=6, vmin=0, vmax=1)
    fig.colorbar(sc, ax=ax, label="VGMU")
    if abstain_k is not None and abstain_k > 0:
        ys = np.linspace(0, max(float(spread.max()), 1e-6), 50)
        ax.plot(
            np.minimum(abstain_k * ys, 1.0),
            ys,
            "r--",
            linewidth=1,
            label=f"abstain boundary k = {abstain_k:.3g}",
        )
        ax.legend(loc="upper right", fontsize=8)
    ax.set(
        xlabel=r"margin $\bar p_1 - \bar p_2$",
        ylabel=r"spread $s_1 + s_2$",
        xlim=(0, 1),
        title=title,
    )
    return _save(fig, path)


def risk_coverage_plot(
    curves: Mapping[str, RiskCoverage],
    path: str | Path,
    aurc: Mapping[str, float] | None = None,
    title: str = "Risk–coverage",
) -> Path:
    """Selective risk vs coverage, one line per score (legend shows AURC when given)."""
    fig = _figure()
    ax = fig.subplots()
    for name, rc in curves.items():
        label = f"{name} (AURC {aurc[name]:.4f})" if aurc and name in aurc else name
        ax.plot(
            np.concatenate([[0.0], rc.coverage]),
            np.concatenate([[rc.risk[0]], rc.risk]),
            label=label,
        )
    ax.set(
        xlabel="coverage", ylabel="selective risk (error among accepted)", xlim=(0, 1), title=title
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, path)


def aucc_plot(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    path: str | Path,
    values: Mapping[str, float] | None = None,
    title: str = "Uncertainty mass concentration",
) -> Path:
    """Cumulative share of uncertainty mass vs fraction of samples (descending), with the diagonal."""
    fig = _figure()
    ax = fig.subplots()
    for name, (x, y) in curves.items():
        label = f"{name} (AUCc {values[name]:.3f})" if values and name in values else name
        ax.plot(x, y, label=label)
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="no concentration (0.5)")
    ax.set(
        xlabel="fraction of samples (highest uncertainty first)",
        ylabel="cumulative share of uncertainty mass",
        xlim=(0, 1),
        ylim=(0, 1),
        title=title,
    )
    ax.legend(fontsize=8)
    return _save(fig, path)


def learned_k_plot(
    k: Sequence[float], path: str | Path, class_names: Sequence[str] | None = None
) -> Path:
    """Bar chart of the learned per-class VGN sensitivity ``k`` (``k ≈ 0.693`` at initialisation)."""
    values = np.asarray(k, dtype=np.float64).ravel()
    names = list(class_names) if class_names is not None else [str(i) for i in range(values.size)]
    fig = _figure(max(4.0, 0.35 * values.size + 1.5), 3.5)
    ax = fig.subplots()
    ax.bar(range(values.size), values, color="#55A868", edgecolor="black", linewidth=0.5)
    ax.axhline(np.log(2.0), color="k", linestyle="--", linewidth=1, label="init softplus(0) = ln 2")
    ax.set_xticks(range(values.size), names, rotation=90 if values.size > 12 else 0, fontsize=8)
    ax.set(xlabel="class", ylabel="learned k", title="VGN: learned k per class")
    ax.legend(fontsize=8)
    return _save(fig, path)


def deferral_curve_plot(calibration: Mapping, path: str | Path) -> Path:
    """Deferral rate and accepted-error rate vs abstain ``k`` from :func:`calibrate_abstain_k`."""
    pts = [c for c in calibration["curve"] if c.get("abstain_k") is not None]
    ks = np.array([c["abstain_k"] for c in pts])
    deferral = np.array([np.nan if c.get("deferral") is None else c["deferral"] for c in pts])
    risk = np.array([np.nan if c.get("risk") is None else c["risk"] for c in pts])
    fig = _figure()
    ax = fig.subplots()
    ax.plot(ks, deferral, "o-", markersize=3, label="deferral rate")
    ax.plot(ks, risk, "s-", markersize=3, label="error among accepted")
    ax.axvline(
        calibration["abstain_k"],
        color="r",
        linestyle="--",
        linewidth=1,
        label=f"chosen k = {calibration['abstain_k']:.3g}",
    )
    ax.set_xscale("symlog", linthresh=1e-2)
    ax.set_xlim(left=0)
    ax.set(xlabel="abstain k", ylabel="rate", ylim=(0, 1), title="Deferral threshold calibration")
    ax.legend(fontsize=8)
    return _save(fig, path)


def ood_roc_plot(
    id_scores: Mapping[str, ArrayLike],
    ood_scores: Mapping[str, ArrayLike],
    path: str | Path,
    title: str = "OOD detection",
) -> Path:
    """ROC curves (OOD = positive) per score, with AUROC in the legend."""
    from models.evaluation.ood import ood_auroc

    fig = _figure()
    ax = fig.subplots()
    for name in id_scores:
        if name not in ood_scores:
            continue
        a, b = as_numpy(id_scores[name]).ravel(), as_numpy(ood_scores[name]).ravel()
        fpr, tpr, _ = roc_curve(np.r_[np.zeros(a.size), np.ones(b.size)], np.r_[a, b])
        ax.plot(fpr, tpr, label=f"{name} (AUROC {ood_auroc(a, b):.3f})")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    ax.set(
        xlabel="false-positive rate (ID flagged)",
        ylabel="true-positive rate (OOD flagged)",
        xlim=(0, 1),
        ylim=(0, 1),
        title=title,
    )
    ax.legend(fontsize=8)
    return _save(fig, path)


def confident_errors_plot(
    images: torch.Tensor,
    labels: ArrayLike,
    predictions: ArrayLike,
    uncertainty: ArrayLike,
    path: str | Path,
    class_names: Sequence[str] | None = None,
    count: int = 8,
) -> Path:
    """The ``count`` errors with the lowest uncertainty (the ones that cost error-detection AUROC).

    ``images`` are model inputs ``(N, Cin, H, W)`` (each shown min–max scaled); each panel gives
    the true and predicted class and the error's rank: the share of all samples that are less
    uncertain (1.0 = the most uncertain sample, as a good score ranks every error).
    """
    y, pred = as_numpy(labels).astype(int), as_numpy(predictions).astype(int)
    u = as_numpy(uncertainty).astype(np.float64)
    wrong = np.flatnonzero(pred != y)
    chosen = wrong[np.argsort(u[wrong], kind="stable")[:count]]
    names = list(class_names) if class_names is not None else [str(i) for i in range(y.max() + 1)]
    fig = _figure(1.4 * max(len(chosen), 1) + 0.4, 2.0)
    if chosen.size == 0:
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, "no errors", ha="center", va="center")
        return _save(fig, path)
    for j, i in enumerate(chosen):
        ax = fig.add_subplot(1, len(chosen), j + 1)
        img = images[i].detach().float().cpu()
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-12)
        ax.imshow(img.permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray", vmin=0, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
        rank = float((u < u[i]).mean())
        ax.set_title(f"true {names[y[i]]}, pred {names[pred[i]]}\nrank {rank:.2f}", fontsize=8)
    fig.suptitle("Most confident errors (by VGMU)", fontsize=9)
    return _save(fig, path)


def ood_examples_plot(
    images: Mapping[str, np.ndarray],
    answers: Mapping[str, tuple[np.ndarray, np.ndarray]],
    path: str | Path,
    class_names: Sequence[str] | None = None,
    per_group: int = 8,
) -> Path:
    """The first ``per_group`` images of each OOD-suite group with the model's answer: the
    predicted class, or "defer" (red title: answered, a non-digit taken for a digit; green:
    deferred). ``answers[group] = (prediction, abstain)``."""
    groups = list(images)
    fig = _figure(per_group * 0.9, len(groups) * 1.05)
    axes = np.atleast_2d(fig.subplots(len(groups), per_group))
    for r, group in enumerate(groups):
        pred, abstain = answers[group]
        for c in range(per_group):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= len(images[group]):
                ax.axis("off")
                continue
            ax.imshow(np.asarray(images[group][c]).squeeze(), cmap="gray", vmin=0, vmax=255)
            label = class_names[int(pred[c])] if class_names else str(int(pred[c]))
            deferred = bool(abstain[c])
            ax.set_title(
                "defer" if deferred else f"→ {label}",
                fontsize=7,
                color="green" if deferred else "red",
            )
            if c == 0:
                ax.set_ylabel(group.replace("_", " "), fontsize=7)
    return _save(fig, path)
