"""The paper's MNIST tables, reproduced on the bundled data (issue 8): one command, one document.

Trains the five LeNet-5 configurations of the paper's MNIST experiments on the bundled 8k MNIST
subset — LLE and DE with M = 10, each with and without VGN (learned per-class k), and MCD-LLE with
H = 10 heads x S = 10 dropout samples (M = 100) — evaluates every one on the bundled test split with
the shipped evaluation code (:func:`models.evaluation.evaluate.evaluate_predictions` for the numbers,
:func:`models.evaluation.evaluate.run_evaluation`, i.e. ``vge evaluate``, for its figures and report), adds
two distribution shifts of the test digits (rotated by 90 degrees, and inverted) to the shipped
scikit-image natural-patch OOD set, and writes ``docs/paper-reproduction.md`` with the paper's own
numbers (constants copied by hand from the paper's tables) beside ours, plus the figures the paper
shows under ``docs/paper/``.

Usage::

    python -m benchmarks.paper                # full run (~15-20 min on a 2-core CPU)
    python -m benchmarks.paper --quick        # 2 epochs per model, ~1-2 min, writes under var/
    python -m benchmarks.paper --out docs/paper-reproduction.md [--retrain] [--only lle,de]

Trained models are cached under ``var/paper/<full|quick>/<config>/`` and reused when their card's
training config equals the one requested (``--retrain`` forces training). Nothing here reads
anything outside the repository at run time: the paper's numbers are constants in
:mod:`benchmarks.paper_reference`.

The code is split by job, one module each: :mod:`benchmarks.paper_config` (what is run: the five
configurations, their training protocol, seed, paths), :mod:`benchmarks.paper_run` (training,
forward passes, figures), :mod:`benchmarks.paper_stats` (the numbers of one configuration),
:mod:`benchmarks.paper_paired` (the paired LLE vs LLE-VGN test, as quoted),
:mod:`benchmarks.paper_reference` (the paper's numbers), and the document:
:mod:`benchmarks.paper_tables`, :mod:`benchmarks.paper_prose`, :mod:`benchmarks.paper_document`.
This module is the command line; it re-exports those modules' public names, so
``from benchmarks import paper`` (the tests, ``scripts/paper_paired_test.py``) finds them here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.paper_config import (
    CACHE,
    DEFAULT_OUT,
    FULL_EPOCHS,
    OOD_SETS,
    QUICK_EPOCHS,
    QUICK_OUT,
    RANK_SCORES,
    ROOT,
    SCORE_LABELS,
    SCORES,
    SEED,
    SPECS,
    Spec,
    display_path,
    train_config,
)
from benchmarks.paper_document import (
    FIGURE_ROWS,
    HAND_TAIL_HEADING,
    NUMBERING_NOTE,
    figures_markdown,
    hand_tail,
    render,
)
from benchmarks.paper_paired import PAIRED_TEST, paired_details, paired_matches, paired_summary
from benchmarks.paper_prose import (
    DIFFERENCES,
    disagreement_lines,
    ood_direction,
    reading_lines,
    summary_lines,
)
from benchmarks.paper_reference import (
    CPU_TIMING,
    PAPER_CIFAR10_AUCC,
    PAPER_CIFAR10_KENDALL,
    PAPER_CIFAR10_SPEARMAN,
    PAPER_MNIST_PERFORMANCE,
    PAPER_MNIST_SINGLE,
    PAPER_PARITY_QUOTE,
    PAPER_S3_ROWS,
    PAPER_S7_TIMING,
    PAPER_SVHN_OOD,
    PAPER_VGN_CALIBRATION_QUOTE,
    PAPER_VGN_DIVERSITY,
    PAPER_VGN_VGMU_QUOTE,
    PaperValue,
)
from benchmarks.paper_run import (
    ensure_trained,
    evaluate_model,
    forward_members,
    ood_examples_figure,
    shifted_digits,
)
from benchmarks.paper_stats import ConfigResult, evaluate_members, vgmu_missed
from benchmarks.paper_tables import (
    Table,
    aucc_table,
    coverage_table,
    fmt,
    fmt_paper,
    learned_k_table,
    ood_table,
    paper_ood_table,
    performance_table,
    rank_table,
    selective_table,
    training_table,
)

#: The public names of the benchmark's modules, as ``from benchmarks import paper`` reaches them.
__all__ = [
    "CACHE",
    "CPU_TIMING",
    "DEFAULT_OUT",
    "DIFFERENCES",
    "FIGURE_ROWS",
    "FULL_EPOCHS",
    "HAND_TAIL_HEADING",
    "NUMBERING_NOTE",
    "OOD_SETS",
    "PAIRED_TEST",
    "PAPER_CIFAR10_AUCC",
    "PAPER_CIFAR10_KENDALL",
    "PAPER_CIFAR10_SPEARMAN",
    "PAPER_MNIST_PERFORMANCE",
    "PAPER_MNIST_SINGLE",
    "PAPER_PARITY_QUOTE",
    "PAPER_S3_ROWS",
    "PAPER_S7_TIMING",
    "PAPER_SVHN_OOD",
    "PAPER_VGN_CALIBRATION_QUOTE",
    "PAPER_VGN_DIVERSITY",
    "PAPER_VGN_VGMU_QUOTE",
    "QUICK_EPOCHS",
    "QUICK_OUT",
    "RANK_SCORES",
    "ROOT",
    "SCORES",
    "SCORE_LABELS",
    "SEED",
    "SPECS",
    "ConfigResult",
    "PaperValue",
    "Spec",
    "Table",
    "aucc_table",
    "coverage_table",
    "disagreement_lines",
    "display_path",
    "ensure_trained",
    "evaluate_members",
    "evaluate_model",
    "figures_markdown",
    "fmt",
    "fmt_paper",
    "forward_members",
    "hand_tail",
    "learned_k_table",
    "main",
    "ood_direction",
    "ood_examples_figure",
    "ood_table",
    "paired_details",
    "paired_matches",
    "paired_summary",
    "paper_ood_table",
    "performance_table",
    "rank_table",
    "reading_lines",
    "render",
    "selective_table",
    "shifted_digits",
    "summary_lines",
    "train_config",
    "training_table",
    "vgmu_missed",
]


def _load_average() -> str:
    """The 1-minute load average (``?`` where the platform has none)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: train (or reuse), evaluate, write the document."""
    from benchmarks.report import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_EPOCHS} epochs per model")
    ap.add_argument("--out", type=Path, default=None, help="markdown file (figures: <dir>/paper/)")
    ap.add_argument("--epochs", type=int, default=None, help="override the epochs per model")
    ap.add_argument("--retrain", action="store_true", help="ignore cached models")
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated configurations (" + ",".join(s.key for s in SPECS) + ")",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    load_start = _load_average()
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else FULL_EPOCHS)
    mode = "quick" if args.quick else "full"
    if args.epochs is not None and args.epochs not in (QUICK_EPOCHS, FULL_EPOCHS):
        mode = f"e{epochs}"
    out = (args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)).resolve()
    doc_dir = out.parent
    fig_root = doc_dir / "paper"
    cache = CACHE / mode
    specs = list(SPECS)
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = set(keys) - {s.key for s in SPECS}
        if unknown:
            ap.error(f"unknown configuration(s): {', '.join(sorted(unknown))}")
        specs = [s for s in SPECS if s.key in keys]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    train_s = eval_s = 0.0
    results = []
    for spec in specs:
        t1 = time.perf_counter()
        model_dir, trained = ensure_trained(spec, epochs, cache, args.retrain, log)
        t2 = time.perf_counter()
        train_s += t2 - t1
        log(f"{spec.label}: evaluating")
        result = evaluate_model(spec, model_dir, fig_root / spec.key, doc_dir, log)
        result.training["cached"] = not trained
        eval_s += time.perf_counter() - t2
        c = result.metrics["classification"]
        log(f"{spec.label}: accuracy {c['accuracy']:.4f} ECE {c['ece']:.4f} NLL {c['nll']:.4f}")
        results.append(result)

    examples = ood_examples_figure(fig_root / "ood_examples.png")
    wall = time.perf_counter() - t0
    cmd = " ".join(["python -m benchmarks.paper", *(sys.argv[1:] if argv is None else argv)])
    context = {
        "command": cmd,
        "machine": f"2-core CPU, no GPU ({machine()})",
        "date": _dt.date.today().isoformat(),
        "wall_s": wall,
        "train_s": train_s,
        "eval_s": eval_s,
        "train_total_s": sum(float(r.training.get("train_seconds") or 0.0) for r in results),
        "epochs": epochs,
        "quick": args.quick,
        "ood_examples": examples.relative_to(doc_dir).as_posix(),
        "load": f"{load_start} → {_load_average()}",
    }
    paired = json.loads(PAIRED_TEST.read_text()) if PAIRED_TEST.is_file() else None
    tail = hand_tail(out.read_text(encoding="utf-8")) if out.is_file() else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig_root.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, {**context, "paired": paired}) + tail, encoding="utf-8")
    (fig_root / "results.json").write_text(
        json.dumps(
            {
                "context": context,
                "results": {
                    r.spec.key: {
                        "metrics": r.metrics,
                        "ood": r.ood,
                        "learned_k": r.learned_k,
                        "training": r.training,
                    }
                    for r in results
                },
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    log(f"wrote {out} and {len(list(fig_root.rglob('*.png')))} figures under {fig_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
