"""One optimisation step: the loss, training-only augmentation, optimiser and schedules.

Deep ensembles train all M members in one step through ``torch.func.vmap``
(:class:`models.ensembles.deep.DeepEnsemble`; ``forward_sequential`` is the Python loop over
members, kept for tests and the benchmark). vmap stays because it wins on GPU: the issue that asked
for this layout reports the DE vmap step 4.2x faster than the member loop on an H200 (a number not
yet measured into docs/benchmarks.md). It does not win on CPU: docs/benchmarks.md measured a
LeNet-5 DE, M = 10, batch 128, on 2 CPU threads at 87.34 ms per train step with vmap against
81.73 ms with the loop (0.94x) and 37.15 ms against 34.56 ms per inference batch (0.93x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.data import DataBundle, random_affine
from models.ensembles import EnsembleOutput

from .config import TrainConfig
from .outliers import OutlierExposure

__all__ = [
    "Augmenter",
    "Optimisation",
    "augment_batch",
    "build_optimisation",
    "mixture_nll",
    "train_step",
]


def mixture_nll(out: EnsembleOutput, log_p: Tensor, y: Tensor, loss: str = "mixture") -> Tensor:
    """Training loss, mean over the batch. ``log_p`` member log-probs (B, M, C), ``y`` (B,).

    VGN (``out.q`` given): ``-log q̄_y``. Otherwise ``-log p̄_y`` with
    ``log p̄ = logsumexp_m log p_m - log M`` (stable), or the mean member CE for ``loss="members"``.
    """
    if out.q is not None:
        q_bar = out.q.mean(dim=1)  # (B, C)
        return -torch.log(q_bar.gather(1, y[:, None]).squeeze(1).clamp_min(1e-12)).mean()
    if loss == "members":
        b, m, c = log_p.shape
        return F.nll_loss(log_p.reshape(b * m, c), y.repeat_interleave(m))
    log_mix = torch.logsumexp(log_p, dim=1) - math.log(log_p.shape[1])  # (B, C)
    return F.nll_loss(log_mix, y)


def augment_batch(x: Tensor, generator: torch.Generator, fill: list[float]) -> Tensor:
    """The training-time augmentation of one batch (``TrainConfig.augment``); see
    :func:`models.data.random_affine`. A module-level hook so tests can observe where it runs."""
    return random_affine(x, generator, fill)


@dataclass
class Augmenter:
    """Augments training batches with parameters from its own generator (never the global RNG
    that dropout uses), seeded from the config seed and the DDP rank: same seed, same batches."""

    generator: torch.Generator
    fill: list[float]  # black, in normalised units

    @classmethod
    def for_run(cls, config: TrainConfig, bundle: DataBundle, rank: int) -> Augmenter:
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + 7919 * (rank + 1))
        return cls(gen, [-m / s for m, s in zip(bundle.mean, bundle.std, strict=True)])

    def __call__(self, x: Tensor) -> Tensor:
        return augment_batch(x, self.generator, self.fill)


@dataclass
class Optimisation:
    """Adam and the learning-rate schedule: ``per_epoch`` (plateau, cosine) is stepped after
    validation, ``per_step`` (onecycle) after every optimiser step."""

    optimiser: torch.optim.Optimizer
    per_epoch: Any = None
    per_step: Any = None

    @property
    def lr(self) -> float:
        return self.optimiser.param_groups[0]["lr"]

    def step(self, loss: Tensor) -> None:
        self.optimiser.zero_grad(set_to_none=True)
        loss.backward()
        self.optimiser.step()
        if self.per_step is not None:
            self.per_step.step()

    def end_epoch(self, val_loss: float) -> None:
        """Step the epoch schedule (``val_loss`` must be the same on every rank)."""
        if isinstance(self.per_epoch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.per_epoch.step(val_loss)
        elif self.per_epoch is not None:
            self.per_epoch.step()


def build_optimisation(config: TrainConfig, model: nn.Module, steps_per_epoch: int) -> Optimisation:
    """Adam on ``model``'s parameters with ``config``'s learning-rate schedule."""
    lr_sched = torch.optim.lr_scheduler
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    if config.lr_schedule == "plateau":
        return Optimisation(
            opt,
            per_epoch=lr_sched.ReduceLROnPlateau(
                opt,
                mode="min",
                factor=config.lr_factor,
                patience=config.lr_patience,
                threshold=config.min_delta,
                threshold_mode="abs",
            ),
        )
    if config.lr_schedule == "cosine":
        return Optimisation(
            opt,
            per_epoch=lr_sched.CosineAnnealingLR(
                opt, T_max=config.epochs, eta_min=config.lr * config.lr_factor
            ),
        )
    if config.lr_schedule == "onecycle":
        return Optimisation(
            opt,
            per_step=lr_sched.OneCycleLR(
                opt, max_lr=config.lr, total_steps=steps_per_epoch * config.epochs
            ),
        )
    return Optimisation(opt)


def train_step(
    net: nn.Module,
    x: Tensor,
    y: Tensor,
    opt: Optimisation,
    loss_kind: str,
    device: torch.device,
    augment: Augmenter | None = None,
    outliers: OutlierExposure | None = None,
) -> Tensor:
    """Forward, loss, backward and optimiser step on one batch; returns the (detached) loss.
    With ``outliers`` the loss adds outlier exposure (:mod:`models.training.outliers`)."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    if augment is not None:  # training batches only; validation/test never pass here
        x = augment(x)
    if outliers is not None:
        loss = outliers.loss(net, x, y, loss_kind)
    else:
        out, log_p = net(x, return_log_p=True)
        loss = mixture_nll(out, log_p, y, loss_kind)
    opt.step(loss)
    return loss.detach()
