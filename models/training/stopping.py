"""Early stopping on the validation loss, keeping the best weights."""

from __future__ import annotations

import math

from torch import Tensor, nn

__all__ = ["EarlyStopping"]


class EarlyStopping:
    """Tracks the best validation loss (an improvement must beat it by more than ``min_delta``),
    snapshots the weights at each improvement and stops after ``patience`` epochs without one.
    Before any epoch the snapshot is the initial weights."""

    def __init__(self, model: nn.Module, patience: int, min_delta: float) -> None:
        self.model, self.patience, self.min_delta = model, patience, min_delta
        self.best_loss, self.best_epoch, self.bad_epochs = math.inf, 0, 0
        self._best_state = self._snapshot()

    def _snapshot(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def update(self, epoch: int, val_loss: float) -> bool:
        """Record an epoch's validation loss; True when it improved (weights snapshotted)."""
        if val_loss < self.best_loss - self.min_delta:
            self.best_loss, self.best_epoch, self.bad_epochs = val_loss, epoch, 0
            self._best_state = self._snapshot()
            return True
        self.bad_epochs += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.bad_epochs >= self.patience

    def restore(self) -> None:
        """Load the best weights seen back into the model."""
        self.model.load_state_dict(self._best_state)
