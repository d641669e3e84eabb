"""Markdown evaluation report: the metrics of :func:`models.evaluation.evaluate.evaluate_predictions` as tables,
with the PNG figures embedded by relative path (so the report renders next to its plots)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Human-readable names of the uncertainty scores (:data:`models.evaluation.UNCERTAINTY_SCORES`).
SCORE_LABELS = {
    "vgmu": "VGMU",
    "max_prob": "1 − max prob",
    "tu": "TU",
    "au": "AU",
    "eu": "EU",
    "mutual_information": "MI",
    "epkl": "EPKL",
    "epjs": "EPJS",
    "epce": "EPCE",
}


_DIST = {"p": "p̄ (mean of the raw members)", "q": "q̄ (mean of the VGN-gated members)"}


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v == 0 or abs(v) >= 10 ** -(digits - 1) else f"{v:.3g}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render_report(
    metrics: Mapping[str, Any],
    plots: Mapping[str, str] | None = None,
    title: str = "Evaluation report",
    context: Mapping[str, Any] | None = None,
) -> str:
    """Markdown text for ``metrics`` (the dict of ``evaluate_predictions``).

    Args:
        plots: ``{caption: relative PNG path}``, embedded in order at the end.
        context: extra key/values listed under the title (model name, split, …).
    """
    out = [f"# {title}", ""]
    for key, value in (context or {}).items():
        out.append(f"- **{key}**: {_fmt(value)}")
    out += [
        f"- **samples**: {metrics['n_samples']} · **classes**: {metrics['n_classes']} · "
        f"**members**: {metrics['n_members']} · **VGN-gated**: {_fmt(metrics['gated'])}",
        "",
        "## Predictive performance and calibration",
        "",
        f"Predictive distribution: {_DIST[metrics['predictive']]}. ECE uses 15 equal-width "
        "bins; Brier is summed over classes; diversity is the member variance averaged over samples "
        "and classes (SI S3.3).",
        "",
    ]
    cls = metrics["classification"]
    keys = ["accuracy", "macro_f1", "ece", "nll", "brier"]
    rows = [[_DIST[metrics["predictive"]], *[cls[k] for k in keys]]]
    if metrics.get("classification_raw"):
        rows.append([_DIST["p"], *[metrics["classification_raw"][k] for k in keys]])
    out += _table(["distribution", "accuracy", "macro-F1", "ECE", "NLL", "Brier"], rows)
    out += _table(
        ["members", "diversity E[Var_M]"], [[k, v] for k, v in metrics["diversity"].items()]
    )

    ab = metrics["abstention"]
    out += [
        "## Abstention (margin rule, paper §3.2)",
        "",
        f"Predict iff p̄1 − k·s1 > p̄2 + k·s2 with k = {ab['abstain_k']:g}: deferral "
        f"{_fmt(ab['deferral'])}, error among accepted {_fmt(ab['accepted_risk'])} "
        f"({ab['n_accepted']} accepted).",
        "",
    ]

    out += ["## Uncertainty scores", ""]
    sel = metrics["selective"]
    risk_keys = list(next(iter(sel.values()))["coverage_at_risk"]) if sel else []
    rows = []
    for name, s in sel.items():
        rows.append(
            [
                SCORE_LABELS.get(name, name),
                metrics["uncertainty_means"].get(name),
                metrics["aucc"].get(name),
                s["aurc"],
                s["eaurc"],
                s.get("error_auroc"),
                *[s["coverage_at_risk"][r] for r in risk_keys],
            ]
        )
    out += [
        "Mean score; AUCc (uncertainty-mass concentration, 0.5 = none; §4.2); AURC / E-AURC "
        "(selective risk, lower is better); error AUROC (telling the served errors from the "
        "correct answers, 1 = every error more uncertain); coverage at a target selective risk.",
        "",
    ]
    out += _table(
        ["score", "mean", "AUCc", "AURC", "E-AURC", "error AUROC",
         *[f"cov@risk≤{r}" for r in risk_keys]],
        rows,
    )  # fmt: skip
    ci = sel.get("vgmu", {}).get("error_auroc_ci95")
    if ci is not None:
        n_err = round(metrics["n_samples"] * (1.0 - metrics["classification"]["accuracy"]))
        out += [
            "",
            f"VGMU error AUROC, 95 % bootstrap interval: {ci[0]:.3f}–{ci[1]:.3f} "
            f"({n_err} errors among {metrics['n_samples']} samples).",
            "",
        ]

    out += _auroc_section(metrics)

    rc = metrics["rank_consistency"]
    out += ["## Rank consistency with VGMU (§4.1)", ""]
    out += _table(
        ["score", "Spearman ρ", "Kendall τ"],
        [[SCORE_LABELS.get(k, k), v["spearman"], v["kendall"]] for k, v in rc.items()],
    )

    if metrics.get("ood"):
        ood = metrics["ood"]
        out += [
            "## Out-of-distribution detection (§4.6)",
            "",
            f"{ood['n_id']} in-distribution vs {ood['n_ood']} OOD samples"
            + (f" ({ood['source']})" if ood.get("source") else "")
            + f"; abstain rate on OOD {_fmt(ood['abstain_rate'])}.",
            "",
        ]
        out += _table(
            ["score", "AUROC", "FPR@95"],
            [[SCORE_LABELS.get(k, k), v["auroc"], v["fpr95"]] for k, v in ood["scores"].items()],
        )

    if metrics.get("ood_suite"):
        out += _suite_section(metrics["ood_suite"])

    if metrics.get("calibration"):
        cal = metrics["calibration"]
        # a card's calibration may hold abstain_k alone (its schema requires no more)
        how = (
            f"Mode `{cal['mode']}`, target {cal['target']:g}: "
            if cal.get("mode") is not None and cal.get("target") is not None
            else ""
        )
        k = f"abstain k = {cal['abstain_k']:.4g}" if cal.get("abstain_k") is not None else ""
        served = (metrics.get("abstention") or {}).get("abstain_k")
        differs = (
            f" The numbers above are at the k the server answers with, {served:.4g}: this "
            "calibration is for another member set than the one it answers from."
            if served is not None and cal.get("abstain_k") is not None
            and abs(float(served) - float(cal["abstain_k"])) > 1e-9
            else ""
        )  # fmt: skip
        out += [
            "## Deferral threshold calibration",
            "",
            f"Chosen on the validation split when the model was trained. {how}{k}, "
            f"achieved deferral {_fmt(cal.get('achieved_deferral'))}, "
            f"error among accepted {_fmt(cal.get('achieved_risk'))}.{differs}",
            "",
        ]

    if plots:
        out += ["## Figures", ""]
        for caption, rel in plots.items():
            out += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    return "\n".join(out).rstrip() + "\n"


#: Scores of the one-table comparison (issue 33): does VGMU add anything over the softmax margin?
COMPARED_SCORES = ("vgmu", "max_prob", "tu", "eu", "mutual_information", "epkl")


def _auroc_section(metrics: Mapping[str, Any]) -> list[str]:
    """One table: OOD AUROC (the suite's far groups pooled when evaluated, else the OOD set) and
    error-detection AUROC of :data:`COMPARED_SCORES`."""
    suite = metrics.get("ood_suite") or {}
    if suite.get("far"):
        ood, what = suite["far"]["scores"], "the OOD suite's five far groups pooled"
    elif metrics.get("ood"):
        ood, what = metrics["ood"]["scores"], "the OOD set above"
    else:
        ood, what = {}, "no OOD set"
    sel = metrics["selective"]
    names = [k for k in COMPARED_SCORES if k in sel or k in ood]
    if not names:
        return []
    out = [
        "## OOD and error-detection AUROC per score",
        "",
        f"OOD AUROC: OOD images vs the in-distribution split ({what}); error-detection AUROC: the "
        "served errors vs the correct answers. 1 − max prob is the served mean's (q̄ for VGN "
        "models) softmax margin: VGMU adds something only where it beats it.",
        "",
    ]
    rows = [
        [
            SCORE_LABELS.get(k, k),
            (ood.get(k) or {}).get("auroc"),
            (sel.get(k) or {}).get("error_auroc"),
        ]
        for k in names
    ]
    return out + _table(["score", "OOD AUROC (far, pooled)", "error-detection AUROC"], rows)


#: Scores shown in the per-group OOD table (VGMU, the softmax margin and the paper's baselines).
SUITE_SCORES = ("vgmu", "max_prob", "eu", "mutual_information", "epkl", "epjs")


def _suite_section(suite: Mapping[str, Any]) -> list[str]:
    """The OOD suite per group: abstain rate at the served k (and, for labelled digits, the
    share deferred or right) against its target, AUROC and FPR@95 of VGMU and the baselines
    (docs/ood-suite.md)."""
    out = [
        "## OOD suite, per group",
        "",
        f"The project's OOD suite (docs/ood-suite.md) against the in-distribution split; abstain "
        f"rate of the served rule at k = {suite['abstain_k']:.4g}; deferred or right: abstained "
        "on or answered with the true class (labelled digit groups). A target applies to the "
        "abstain rate, or where marked (d/r) to the share deferred or right. `far`: the five far "
        "groups pooled; `all`: every group.",
        "",
    ]
    header = ["group", "n", "abstain rate", "deferred or right", "target"]
    header += [f"AUROC {SCORE_LABELS[k]}" for k in SUITE_SCORES]
    header += [f"FPR@95 {SCORE_LABELS[k]}" for k in ("vgmu", "epkl")]
    rows = []
    entries = [*suite["groups"].items(), *((k, suite[k]) for k in ("far", "all") if k in suite)]
    for name, g in entries:
        sc = g["scores"]
        target = g.get("target")
        met = "" if g.get("meets_target") is None else (" ✓" if g["meets_target"] else " ✗")
        kind = " (d/r)" if g.get("target_kind") == "deferred_or_right" else ""
        shown = "—" if target is None else f"≥ {target:g}{kind}{met}"
        rows.append(
            [name, g["n"], g["abstain_rate"], g.get("deferred_or_right"), shown]
            + [(sc.get(k) or {}).get("auroc") for k in SUITE_SCORES]
            + [sc[k]["fpr95"] for k in ("vgmu", "epkl")]
        )
    return out + _table(header, rows)


def write_report(
    metrics: Mapping[str, Any],
    path: str | Path,
    plots: Mapping[str, str] | None = None,
    title: str = "Evaluation report",
    context: Mapping[str, Any] | None = None,
) -> Path:
    """Write :func:`render_report` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(metrics, plots, title, context), encoding="utf-8")
    return path
