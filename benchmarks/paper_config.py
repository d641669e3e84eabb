"""What the paper benchmark runs: its five configurations, their training protocol, seed and paths.

The experiment definitions of ``python -m benchmarks.paper``, in one place: which models are
trained (:data:`SPECS`) and how (:func:`train_config`, the same protocol for all five, which
``scripts/paper_paired_test.py`` reuses), where they are cached, and which uncertainty scores and
OOD sets every table compares. Everything else of the benchmark reads these names from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "paper-reproduction.md"
QUICK_OUT = ROOT / "var" / "paper" / "quick" / "paper-reproduction.md"
CACHE = ROOT / "var" / "paper"


#: Seed of training and of the (stochastic, for MC dropout) evaluation forward passes.
SEED = 0
#: Epochs of the full run (one-cycle schedule over all of them, best-validation weights kept).
FULL_EPOCHS = 60
#: Epochs of ``--quick``.
QUICK_EPOCHS = 2
#: Uncertainty scores compared throughout (keys of ``EnsembleScores``; paper §4: VGMU vs EU / MI /
#: EPKL / EPJS).
SCORES = ("vgmu", "eu", "mutual_information", "epkl", "epjs")
SCORE_LABELS = {
    "vgmu": "VGMU",
    "eu": "EU",
    "mutual_information": "MI",
    "epkl": "EPKL",
    "epjs": "EPJS",
}
#: Scores VGMU is rank-compared with (paper Table 3 columns; keys of ``rank_consistency``).
RANK_SCORES = ("epjs", "epkl", "eu")
#: OOD sets, in table order: key -> description.
OOD_SETS = {
    "patches": "scikit-image natural-image patches (1,000; the shipped `vge evaluate` OOD set)",
    "rotated": "test digits rotated by 90° (1,600)",
    "inverted": "test digits with inverted intensities, 255 − x (1,600)",
}


@dataclass(frozen=True)
class Spec:
    """One configuration of the reproduction."""

    key: str  # file-name friendly id
    label: str  # as the paper names it
    ensemble: str  # models.ensembles kind
    vgn: bool
    members: int  # de/lle: M; mcd-lle: H heads
    mc_samples: int = 10  # mcd-lle: S dropout samples per head

    @property
    def m_total(self) -> int:
        """Members scored at inference (M; S * H for MCD-LLE)."""
        return self.members * self.mc_samples if self.ensemble == "mcd-lle" else self.members

    @property
    def size(self) -> str:
        """``M = 10`` or ``M = 100 (10 H × 10 S)``."""
        if self.ensemble == "mcd-lle":
            return f"M = {self.m_total} ({self.members} H × {self.mc_samples} S)"
        return f"M = {self.members}"


SPECS: tuple[Spec, ...] = (
    Spec("lle", "LLE", "lle", False, 10),
    Spec("lle-vgn", "LLE-VGN", "lle", True, 10),
    Spec("de", "DE", "de", False, 10),
    Spec("de-vgn", "DE-VGN", "de", True, 10),
    Spec("mcd-lle", "MCD-LLE", "mcd-lle", False, 10, 10),
)


def train_config(spec: Spec, epochs: int) -> Any:
    """The :class:`models.training.TrainConfig` of one configuration (same protocol for all)."""
    from models.training import TrainConfig

    return TrainConfig(
        name=f"paper-lenet5-{spec.key}-mnist",
        description=f"benchmarks.paper: LeNet-5 {spec.label} ({spec.size}) on bundled MNIST",
        dataset="mnist-bundled",
        backbone="lenet5",
        ensemble=spec.ensemble,
        members=spec.members,
        mc_samples=spec.mc_samples,
        vgn=spec.vgn,
        epochs=epochs,
        lr=3e-3,
        lr_schedule="onecycle",
        batch_size=128,
        patience=epochs,
        augment=True,
        min_delta=1e-4,
        seed=SEED,
        device="cpu",
        target_deferral=0.05,
    )


def display_path(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)
