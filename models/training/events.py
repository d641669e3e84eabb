"""Progress of a run: the events handed to ``on_event`` (rank 0 only) and the tqdm bar.

Events are dicts with ``type`` in {start, step, epoch, done} and ``epoch``, ``step``,
``total_steps``, ``eta_s`` always present (``None`` where not meaningful), plus
``train_size``/``val_size``/``world_size``/``device``/``name`` (start), ``train_loss`` (step,
epoch), ``val_loss``/``val_accuracy``/``best_val_loss`` (epoch) and ``val_loss``/``val_accuracy``/
``test_accuracy``/``test_nll``/``best_epoch``/``cancelled``/``path`` (done).
:mod:`service.engine.jobs` relays them to job records.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from models.checkpoint import ModelCard
from models.data import DataBundle

from .runtime import Runtime

__all__ = ["EventFn", "Progress"]

EventFn = Callable[[dict[str, Any]], None]


class Progress:
    """Counts steps, estimates the time left, emits events and drives the terminal bar."""

    def __init__(
        self, emit: EventFn, name: str, epochs: int, steps_per_epoch: int, rt: Runtime
    ) -> None:
        self.emit, self.name, self.epochs, self.rt = emit, name, epochs, rt
        self.total_steps = steps_per_epoch * epochs
        self.step = 0
        self._t0 = time.perf_counter()
        self._bar: Any = None

    def start(self, bundle: DataBundle) -> None:
        self.emit(
            {
                "type": "start",
                "epoch": 0,
                "step": 0,
                "total_steps": self.total_steps,
                "train_size": len(bundle.train),
                "val_size": len(bundle.val),
                # images reviewers marked not a digit, which outlier exposure draws on (outliers.py)
                "reviewed_outliers": len(bundle.extra.get("outliers", ())),
                "world_size": self.rt.world,
                "device": str(self.rt.device),
                "name": self.name,
            }
        )
        from tqdm.auto import tqdm

        self._t0 = time.perf_counter()
        self._bar = tqdm(
            total=self.total_steps,
            disable=None if self.rt.is_main else True,
            desc=self.name,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_step(self, epoch: int, train_loss: float, best_val_loss: float) -> None:
        """After an optimiser step; ``train_loss`` is the epoch's running mean."""
        self.step += 1
        elapsed = time.perf_counter() - self._t0
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{train_loss:.4f}", best_val=f"{best_val_loss:.4f}")
        self.emit(
            {
                "type": "step",
                "epoch": epoch,
                "step": self.step,
                "total_steps": self.total_steps,
                "train_loss": train_loss,
                "eta_s": elapsed / self.step * (self.total_steps - self.step),
            }
        )

    def on_epoch(self, record: dict[str, float], best_val_loss: float) -> None:
        """After validation; ``record`` is the history entry of the epoch."""
        epoch = int(record["epoch"])
        per_epoch = (time.perf_counter() - self._t0) / epoch
        self.emit(
            {
                "type": "epoch",
                "epoch": epoch,
                "step": self.step,
                "total_steps": self.total_steps,
                "train_loss": record["train_loss"],
                "val_loss": record["val_loss"],
                "val_accuracy": record["val_accuracy"],
                "best_val_loss": best_val_loss,
                "eta_s": per_epoch * (self.epochs - epoch),
            }
        )
        bar = self._bar
        if self.rt.is_main and bar is not None and not bar.disable:  # terminal: a line per epoch
            bar.write(
                f"epoch {epoch}: train_loss {record['train_loss']:.4f}  val_loss "
                f"{record['val_loss']:.4f}  val_acc {record['val_accuracy']:.4f}"
            )

    def done(self, card: ModelCard, out_dir: Path) -> None:
        """After the checkpoint is written (rank 0)."""
        t = card.training
        self.emit(
            {
                "type": "done",
                "epoch": t["epochs_run"],
                "step": None,
                "total_steps": None,
                "val_loss": card.metrics["best_val_loss"],
                "val_accuracy": card.metrics["val_accuracy"],
                "test_accuracy": card.metrics["test_accuracy"],
                "test_nll": card.metrics["test_nll"],
                "best_epoch": t["best_epoch"],
                "cancelled": t["cancelled"],
                "path": str(out_dir),
                "eta_s": 0.0,
            }
        )
