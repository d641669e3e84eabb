"""The document's markdown tables: number formatting and one table per section.

Each table sets this reproduction's numbers (a :class:`~benchmarks.paper_stats.ConfigResult` per
configuration) beside the paper's (:mod:`benchmarks.paper_reference`); formatting is shared so
that every table prints numbers, missing values (``—``) and the paper's ``mean ± std`` alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.paper_config import OOD_SETS, RANK_SCORES, SCORE_LABELS, SCORES
from benchmarks.paper_reference import (
    PAPER_CIFAR10_AUCC,
    PAPER_CIFAR10_KENDALL,
    PAPER_CIFAR10_SPEARMAN,
    PAPER_MNIST_PERFORMANCE,
    PAPER_SVHN_OOD,
    PaperValue,
)
from benchmarks.paper_stats import ConfigResult

_NUMBER = re.compile(r"^(—|\(?-?\d[\d.e+-]*( ± [\d.]+\)?(e-?\d+)?)?)$")


@dataclass(frozen=True)
class Table:
    """A markdown table: header cells and rows of already formatted cells."""

    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        """GitHub-flavoured markdown; columns holding only numbers (or ``—``) right-aligned."""
        numeric = [
            i > 0 and all(_NUMBER.match(row[i]) for row in self.rows)
            for i in range(len(self.header))
        ]
        lines = [
            "| " + " | ".join(self.header) + " |",
            "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def fmt(v: float | None, digits: int = 3) -> str:
    """A number for a table; ``—`` for missing/non-finite; scientific below 1e-2 (diversity)."""
    if v is None or not math.isfinite(float(v)):
        return "—"
    v = float(v)
    if v != 0 and abs(v) < 10 ** -(digits - 1) and digits >= 3:
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def fmt_paper(v: PaperValue, digits: int = 3) -> str:
    """``mean ± std`` of a paper value (``—`` when the paper reports none)."""
    if v is None:
        return "—"
    mean, std = v
    if not math.isfinite(std):
        return fmt(mean, digits)
    if mean != 0 and abs(mean) < 1e-2:
        exp = math.floor(math.log10(abs(mean)))
        return f"({mean / 10**exp:.1f} ± {std / 10**exp:.1f})e{exp}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _paper(table: Mapping[str, Mapping[str, Any]], key: str, name: str) -> PaperValue:
    return table.get(key, {}).get(name)


def performance_table(results: Sequence[ConfigResult]) -> Table:
    """Accuracy, macro-F1, ECE, NLL, Brier, diversity: ours beside SI Table S3."""
    header = [
        "configuration",
        "accuracy",
        "paper",
        "macro-F1",
        "paper",
        "ECE",
        "paper",
        "NLL",
        "Brier",
        "diversity p",
        "diversity q",
        "paper",
        "paper's M",
    ]
    rows = []
    for r in results:
        c = r.metrics["classification"]
        key = r.spec.key
        rows.append(
            [
                f"{r.spec.label} ({r.spec.size})",
                fmt(c["accuracy"], 4),
                fmt_paper(_paper(PAPER_MNIST_PERFORMANCE, key, "accuracy")),
                fmt(c["macro_f1"], 4),
                fmt_paper(_paper(PAPER_MNIST_PERFORMANCE, key, "f1")),
                fmt(c["ece"], 4),
                fmt_paper(_paper(PAPER_MNIST_PERFORMANCE, key, "ece")),
                fmt(c["nll"], 4),
                fmt(c["brier"], 4),
                fmt(r.metrics["diversity"]["p"]),
                fmt(r.metrics["diversity"].get("q")),
                fmt_paper(_paper(PAPER_MNIST_PERFORMANCE, key, "diversity")),
                PAPER_MNIST_PERFORMANCE.get(key, {}).get("m", "—"),
            ]
        )
    return Table(header, rows)


def selective_table(results: Sequence[ConfigResult]) -> Table:
    """AURC and E-AURC (×100) per uncertainty score and error-detection AUROC (ours only)."""
    header = ["configuration", "error rate"]
    header += [f"AURC {SCORE_LABELS[s]}" for s in SCORES]
    header += [f"E-AURC {SCORE_LABELS[s]}" for s in SCORES]
    rows = []
    for r in results:
        sel = r.metrics["selective"]
        rows.append(
            [
                r.spec.label,
                fmt(1.0 - r.metrics["classification"]["accuracy"], 4),
                *[fmt(100 * sel[s]["aurc"], 3) for s in SCORES],
                *[fmt(100 * sel[s]["eaurc"], 3) for s in SCORES],
            ]
        )
    return Table(header, rows)


def coverage_table(results: Sequence[ConfigResult], target: str = "0.01") -> Table:
    """Error-detection AUROC and coverage at a target selective risk per score, plus the served
    abstain rule."""
    header = ["configuration"]
    header += [f"error AUROC {SCORE_LABELS[s]}" for s in SCORES]
    header += [f"cov@risk≤{float(target):.0%} {SCORE_LABELS[s]}" for s in SCORES]
    header += ["abstain k", "deferral", "error among accepted"]
    rows = []
    for r in results:
        sel = r.metrics["selective"]
        ab = r.metrics["abstention"]
        rows.append(
            [
                r.spec.label,
                *[fmt(r.error_auroc.get(s)) for s in SCORES],
                *[fmt(sel[s]["coverage_at_risk"][target]) for s in SCORES],
                fmt(ab["abstain_k"]),
                fmt(ab["deferral"]),
                fmt(ab["accepted_risk"], 4),
            ]
        )
    return Table(header, rows)


def aucc_table(results: Sequence[ConfigResult]) -> Table:
    """AUCc per score: ours on MNIST, the paper's CIFAR-10 Table 4 beside it."""
    header = ["configuration", *[f"AUCc {SCORE_LABELS[s]}" for s in SCORES]]
    header += ["paper VGMU", "paper EPJS", "paper EPKL", "paper EU", "paper's setting"]
    rows = []
    for r in results:
        a = r.metrics["aucc"]
        key = r.spec.key
        ref = PAPER_CIFAR10_AUCC.get(key, {})
        rows.append(
            [
                r.spec.label,
                *[fmt(a[s]) for s in SCORES],
                *[fmt_paper(ref.get(s)) for s in ("vgmu", "epjs", "epkl", "eu")],
                f"CIFAR-10, {ref['m']}" if ref else "—",
            ]
        )
    return Table(header, rows)


def rank_table(results: Sequence[ConfigResult]) -> Table:
    """Spearman ρ and Kendall τ of VGMU vs EPJS / EPKL / EU, ours beside the paper's CIFAR-10."""
    header = ["configuration", "vs"]
    header += ["ρ (ours)", "paper ρ", "τ (ours)", "paper τ"]
    rows = []
    for r in results:
        rc = r.metrics["rank_consistency"]
        key = r.spec.key
        for s in RANK_SCORES:
            rows.append(
                [
                    r.spec.label,
                    SCORE_LABELS[s],
                    fmt(rc[s]["spearman"]),
                    fmt_paper(_paper(PAPER_CIFAR10_SPEARMAN, key, s)),
                    fmt(rc[s]["kendall"]),
                    fmt_paper(_paper(PAPER_CIFAR10_KENDALL, key, s)),
                ]
            )
    return Table(header, rows)


def ood_table(results: Sequence[ConfigResult], ood_set: str) -> Table:
    """AUROC and FPR@95 of every score on one OOD set (OOD = positive, score = detector)."""
    header = ["configuration"]
    header += [f"AUROC {SCORE_LABELS[s]}" for s in SCORES]
    header += [f"FPR@95 {SCORE_LABELS[s]}" for s in SCORES]
    header += ["abstain rate"]
    rows = []
    for r in results:
        o = r.ood[ood_set]
        rows.append(
            [
                r.spec.label,
                *[fmt(o["scores"][s]["auroc"]) for s in SCORES],
                *[fmt(o["scores"][s]["fpr95"]) for s in SCORES],
                fmt(o["abstain_rate"]),
            ]
        )
    return Table(header, rows)


def paper_ood_table(results: Sequence[ConfigResult]) -> Table:
    """The paper's SVHN -> CIFAR-10 VGMU numbers beside our VGMU on each OOD set."""
    header = ["configuration"]
    header += [f"AUROC VGMU {k}" for k in OOD_SETS]
    header += ["paper AUROC VGMU", "paper FPR@95 VGMU", "paper's setting (SVHN → CIFAR-10)"]
    rows = []
    for r in results:
        ref = PAPER_SVHN_OOD.get(r.spec.key)
        rows.append(
            [
                r.spec.label,
                *[fmt(r.ood[k]["scores"]["vgmu"]["auroc"]) for k in OOD_SETS if k in r.ood],
                fmt_paper(ref["auroc_vgmu"]) if ref else "—",
                fmt_paper(ref["fpr95_vgmu"]) if ref else "—",
                ref["note"] if ref else "not reported (the paper's OOD study is LLE and MCD-LLE)",
            ]
        )
    return Table(header, rows)


def learned_k_table(results: Sequence[ConfigResult]) -> Table | None:
    """Learned per-class k of the VGN models (paper Fig. 5: DE-VGN learns larger k than LLE-VGN)."""
    gated = [r for r in results if r.learned_k]
    if not gated:
        return None
    n = len(gated[0].learned_k or [])
    header = ["configuration", *[str(c) for c in range(n)], "mean"]
    rows = [
        [
            r.spec.label,
            *[fmt(v, 2) for v in (r.learned_k or [])],
            fmt(float(np.mean(r.learned_k or [np.nan])), 2),
        ]
        for r in gated
    ]
    return Table(header, rows)


def training_table(results: Sequence[ConfigResult]) -> Table:
    """How each model was trained: epochs run, best epoch, validation, seconds."""
    header = [
        "configuration",
        "members scored",
        "epochs run",
        "best epoch",
        "best val NLL",
        "val accuracy",
        "train seconds",
        "source",
    ]
    rows = []
    for r in results:
        t = r.training
        rows.append(
            [
                r.spec.label,
                str(r.spec.m_total),
                str(t.get("epochs_run", "—")),
                str(t.get("best_epoch", "—")),
                fmt(t.get("best_val_loss"), 4),
                fmt(t.get("val_accuracy"), 4),
                fmt(t.get("train_seconds"), 1),
                "cached" if t.get("cached") else "trained in this run",
            ]
        )
    return Table(header, rows)
