"""`vge evaluate MODEL_DIR`: evaluate a saved model; write metrics.json, PNG plots and report.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.cli import CliError, check_output_dir

#: Where results go without ``--out``, relative to the working directory: one folder per model and
#: split, written over by the next run of the same pair. ``/runs/`` is git-ignored in the repository, so
#: an evaluation from its root leaves the working tree clean (model directories may be read-only
#: package data, so never beside the model).
DEFAULT_OUT_ROOT = Path("runs") / "eval"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="evaluate a saved model (metrics, selective prediction, OOD, plots, report)",
        description="Run a saved model on a split of its dataset (bundled MNIST: the fixed test or "
        "validation split, or the held-out digits) and on the project's offline OOD suite (per group: "
        "abstain rate at the served k, AUROC/FPR@95 of VGMU and the baselines; docs/ood-suite.md); "
        "write metrics.json, PNG plots and report.md.",
    )
    p.add_argument(
        "model_dir",
        type=Path,
        help="directory with model.safetensors and model_card.json, or a shipped model's name "
        "('default': the shipped default)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (default: {DEFAULT_OUT_ROOT}/<MODEL_DIR name>-<SPLIT> under the "
        "working directory; git-ignored in the repository)",
    )
    p.add_argument(
        "--split",
        choices=("test", "val", "holdout", "test+holdout"),
        default="test",
        help="data split (default: test); holdout: the 2,000 MNIST digits outside the bundled "
        "8k, never used for training or any choice; test+holdout: both pooled (mnist-bundled "
        "models only)",
    )
    p.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="root of torchvision datasets (never downloads)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from models.evaluation.evaluate import run_evaluation

    model_dir: Path = args.model_dir
    from models.zoo import resolve_model_dir

    # 'default' (the shipped default) or any shipped model's name, when no such directory exists.
    model_dir = resolve_model_dir(None if str(model_dir) == "default" and not model_dir.exists()
                                  else model_dir)  # fmt: skip
    if not model_dir.is_dir():
        raise CliError(f"{model_dir}: no such model directory")
    out = args.out if args.out is not None else DEFAULT_OUT_ROOT / f"{model_dir.name}-{args.split}"
    check_output_dir(out)
    try:
        metrics = run_evaluation(model_dir, out, split=args.split, data_root=args.data_root)
    except (ValueError, OSError, RuntimeError) as exc:  # CheckpointError is a ValueError
        if isinstance(exc, OSError) and str(exc.filename or "").startswith(str(out)):
            raise CliError(f"{out}: cannot write results ({exc.strerror or exc})") from None
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CliError(f"{model_dir}: {message}") from None
    cls = metrics["classification"]
    ood = metrics.get("ood") or {}
    vgmu_ood = (ood.get("scores") or {}).get("vgmu", {})
    vgmu = metrics["selective"]["vgmu"]
    err_auroc = "undefined"
    if vgmu.get("error_auroc") is not None:
        lo, hi = vgmu["error_auroc_ci95"]
        err_auroc = f"{vgmu['error_auroc']:.3f} (95 % CI {lo:.3f}-{hi:.3f})"
    abst = metrics["abstention"]
    print(
        f"{metrics['model']['name']} on {metrics['data']}: accuracy {cls['accuracy']:.4f}, "
        f"ECE {cls['ece']:.4f}, deferral {abst['deferral']:.3f} at abstain_k "
        f"{abst['abstain_k']:.3g}, AURC(VGMU) {vgmu['aurc']:.4f}, error-detection AUROC(VGMU) "
        f"{err_auroc}, OOD AUROC(VGMU) {vgmu_ood.get('auroc', float('nan')):.4f}",
        file=sys.stdout,
    )
    suite = metrics.get("ood_suite")
    if suite:
        parts = []
        for name, g in suite["groups"].items():
            target = "" if g["target"] is None else f" (target {g['target']:.0%})"
            if g.get("target_kind") == "deferred_or_right":
                parts.append(
                    f"{name} {g['abstain_rate']:.1%}, deferred or right "
                    f"{g['deferred_or_right']:.1%}{target}"
                )
            else:
                parts.append(f"{name} {g['abstain_rate']:.1%}{target}")
        print(
            "OOD suite, abstained at the served k: "
            + ", ".join(parts)
            + f"; VGMU OOD AUROC far groups {suite['far']['scores']['vgmu']['auroc']:.3f}, "
            f"all groups {suite['all']['scores']['vgmu']['auroc']:.3f}"
        )
    print(f"wrote {out.resolve()}: metrics.json, report.md and {len(metrics['plots'])} plots")
    return 0
