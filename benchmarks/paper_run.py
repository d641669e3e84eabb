"""Training, forward passes and figures: the part of the paper benchmark that needs models on disk.

:func:`ensure_trained` trains a configuration into the cache (or reuses the model there whose
card holds the same config); :func:`evaluate_model` runs the shipped ``vge evaluate`` on it, the
served forward pass (:func:`forward_members`) on the test digits and every OOD set, hands the
members to :func:`benchmarks.paper_stats.evaluate_members` and draws the extra figures. Minutes
per model on a CPU, so the tests exercise only the pure parts (:func:`shifted_digits`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.paper_config import SEED, Spec, display_path, train_config
from benchmarks.paper_stats import ConfigResult, evaluate_members


def ensure_trained(
    spec: Spec, epochs: int, cache: Path, retrain: bool, log: Callable[[str], None]
) -> tuple[Path, bool]:
    """Train ``spec`` into ``cache/<key>`` unless a model with the same config is there already.

    Returns the model directory and whether it was trained now.
    """
    from models.checkpoint import read_card
    from models.training import train

    config = train_config(spec, epochs)
    model_dir = cache / spec.key
    wanted = config.model_dump(mode="json")
    if not retrain and (model_dir / "model_card.json").is_file():
        try:
            card = read_card(model_dir)
            if card.training.get("config") == wanted and not card.training.get("cancelled"):
                log(f"{spec.label}: cached model in {model_dir}")
                return model_dir, False
        except Exception as exc:  # noqa: BLE001 - any unreadable cache is retrained
            log(f"{spec.label}: cache unreadable ({exc}); retraining")

    def on_event(e: dict[str, Any]) -> None:
        if e["type"] == "epoch" and (e["epoch"] % 10 == 0 or e["epoch"] == epochs):
            log(
                f"  {spec.label} epoch {e['epoch']}/{epochs}: train {e['train_loss']:.4f} "
                f"val {e['val_loss']:.4f} acc {e['val_accuracy']:.4f}"
            )

    log(f"{spec.label}: training {spec.size}, {epochs} epochs -> {model_dir}")
    train(config, model_dir, on_event=on_event)
    return model_dir, True


def shifted_digits(images: Tensor, kind: str) -> Tensor:
    """A distribution shift of uint8 digits ``(N, 1, H, W)``: ``rotated`` (90°) or ``inverted``."""
    if kind == "rotated":
        return torch.rot90(images, k=1, dims=(-2, -1)).contiguous()
    if kind == "inverted":
        return 255 - images
    raise ValueError(f"unknown shift {kind!r}; expected 'rotated' or 'inverted'")


def ood_examples_figure(path: Path, per_row: int = 10) -> Path:
    """A grid of inputs: test digits, the two shifts of them, and natural-image patches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from models import data
    from models.evaluation.ood import natural_image_patches

    images, labels = data.load_bundled_mnist()
    idx = data.bundled_split()["test"]
    first = [idx[labels[idx] == c][0] for c in range(per_row)]  # one digit of each class
    test = torch.from_numpy(images[first]).unsqueeze(1)
    rows = {
        "test digits (ID)": test,
        "rotated 90°": shifted_digits(test, "rotated"),
        "inverted": shifted_digits(test, "inverted"),
        "scikit-image patches": natural_image_patches(per_row, channels=1, size=28),
    }
    fig = Figure(figsize=(per_row * 0.8, len(rows) * 0.95), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), per_row)
    for r, (name, imgs) in enumerate(rows.items()):
        for c in range(per_row):
            ax = axes[r, c]
            ax.imshow(imgs[c, 0].numpy(), cmap="gray", vmin=0, vmax=255)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def forward_members(
    predictor: Any, images: Tensor, batch_size: int = 256
) -> tuple[Tensor, Tensor | None]:
    """uint8 images -> (p, q) through the served preparation (``Predictor.prepare``), batched."""
    ps, qs = [], []
    for start in range(0, images.shape[0], batch_size):
        x = torch.stack([predictor.prepare(img) for img in images[start : start + batch_size]])
        out = predictor.forward(x)
        ps.append(out.p)
        if out.q is not None:
            qs.append(out.q)
    return torch.cat(ps), (torch.cat(qs) if qs else None)


def evaluate_model(
    spec: Spec, model_dir: Path, fig_dir: Path, doc_dir: Path, log: Callable[[str], None]
) -> ConfigResult:
    """Forward passes, numbers (:func:`evaluate_members`) and figures of one trained model."""
    from models import data
    from models.evaluation import plots
    from models.evaluation.evaluate import OOD_SAMPLES, PLOTTED_SCORES, run_evaluation
    from models.evaluation.ood import natural_image_patches
    from models.predictor import Predictor
    from models.uncertainty.scoring import score_members

    # The shipped `vge evaluate`: report.md, metrics.json and its figures, per model.
    torch.manual_seed(SEED)  # MC-dropout members are stochastic: same draws as below
    shipped = run_evaluation(model_dir, fig_dir, split="test")
    # The committed metrics.json should not name this machine's absolute paths.
    metrics_file = fig_dir / "metrics.json"
    saved = json.loads(metrics_file.read_text(encoding="utf-8"))
    saved["model"]["dir"] = display_path(model_dir)
    metrics_file.write_text(json.dumps(saved, indent=2), encoding="utf-8")

    torch.manual_seed(SEED)
    predictor = Predictor.from_dir(model_dir, device="cpu")
    images, labels = data.load_bundled_mnist()
    idx = data.bundled_split()["test"]
    test = torch.from_numpy(images[idx]).unsqueeze(1)
    y = labels[idx]
    p, q = forward_members(predictor, test)
    card = predictor.card
    patches = natural_image_patches(
        OOD_SAMPLES, channels=card.in_channels, size=tuple(card.input_size)
    )
    sets = {"patches": forward_members(predictor, patches)}
    for kind in ("rotated", "inverted"):
        sets[kind] = forward_members(predictor, shifted_digits(test, kind))
    abstain_k = float(shipped["abstention"]["abstain_k"])
    result = evaluate_members(spec, p, q, y, sets, abstain_k=abstain_k)

    # Same code, same members: our numbers must be the shipped report's numbers.
    ours, theirs = result.metrics["classification"], shipped["classification"]
    if (
        abs(ours["accuracy"] - theirs["accuracy"]) > 1e-12
        or abs(ours["nll"] - theirs["nll"]) > 1e-9
    ):
        log(f"WARNING {spec.label}: test metrics differ from run_evaluation ({ours} vs {theirs})")

    # Extra figures: ROC curves of the two digit shifts (the patches ROC comes from run_evaluation).
    for kind in ("rotated", "inverted"):
        ood_scores = score_members(*sets[kind], abstain_k=abstain_k)
        plots.ood_roc_plot(
            {s: result.scores[s] for s in PLOTTED_SCORES},
            {s: getattr(ood_scores, s).double().numpy() for s in PLOTTED_SCORES},
            fig_dir / f"ood_roc_{kind}.png",
            title=f"OOD detection: {kind} digits ({spec.label})",
        )

    result.learned_k = list(card.learned_k) if card.learned_k else None
    t = card.training
    result.training = {
        "epochs_run": t.get("epochs_run"),
        "best_epoch": t.get("best_epoch"),
        "train_seconds": t.get("train_seconds"),
        "best_val_loss": card.metrics.get("best_val_loss"),
        "val_accuracy": card.metrics.get("val_accuracy"),
    }
    result.figures = {
        f.name: f.relative_to(doc_dir).as_posix() for f in sorted(fig_dir.glob("*.png"))
    }
    report = fig_dir / "report.md"
    result.report = report.relative_to(doc_dir).as_posix() if report.is_file() else None
    return result
