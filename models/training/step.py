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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.data import (
    DataBundle,
    denormalise_uint8,
    elastic_displacement,
    normalise_uint8,
    random_affine,
)

from .config import TrainConfig
from .loss import digit_loss
from .outliers import OutlierExposure

__all__ = [
    "Augmenter",
    "Optimisation",
    "augment_batch",
    "build_optimisation",
    "train_step",
]


def augment_batch(
    x: Tensor, generator: torch.Generator, fill: list[float], elastic: float = 0.0
) -> Tensor:
    """The training-time augmentation of one batch (``TrainConfig.augment``): a random affine
    transform, with an elastic distortion of strength ``elastic`` (``augment_elastic``) in the
    same resampling; see :func:`models.data.random_affine`. A module-level hook so tests can
    observe where it runs."""
    b, _, h, w = x.shape
    disp = elastic_displacement(b, h, w, elastic, generator) if elastic and b else None
    return random_affine(x, generator, fill, displacement=disp)


def photographed(digit: Tensor, g: torch.Generator) -> Tensor:
    """uint8 ``(28, 28)`` white-on-black digit → a uint8 picture of it as a pen, a camera or a
    scanner gives it (``TrainConfig.augment_read``): a stroke width (as drawn, thick pen,
    marker, thin), broken strokes (chalk), a larger page at a random place, dark ink on light
    paper half of the time, uneven light, blur and sensor noise. Generic degradations, not the
    evaluation families of :mod:`models.data_photos`."""

    def u() -> float:
        return float(torch.rand((), generator=g))

    x = digit.float()[None, None] / 255.0  # (1, 1, 28, 28)
    width = int(torch.randint(4, (), generator=g))
    if width in (1, 2):
        for _ in range(width):
            x = F.max_pool2d(x, 3, 1, 1)
    elif width == 3:
        x = -F.max_pool2d(-x, 3, 1, 1) if u() < 0.5 else x
    if width == 0 and u() < 0.5:  # chalk: strokes broken into grains
        x = x * (torch.rand(x.shape, generator=g) > 0.05 + 0.2 * u())
    side = int(28 * (1.0 + 1.5 * u()))
    page = torch.zeros(1, 1, side, side)
    oy, ox = int((side - 28) * u()), int((side - 28) * u())
    page[..., oy : oy + 28, ox : ox + 28] = x
    lo, hi = 0.3 * u(), 0.6 + 0.4 * u()
    page = lo + (hi - lo) * page
    if u() < 0.5:
        page = 1.0 - page  # dark ink on light paper
    ramp = torch.linspace(0.0, 1.0, side)
    page = page * (1.0 - 0.3 * u() * (ramp[None, :] if u() < 0.5 else ramp[:, None]))
    sigma = 1.2 * u()
    if sigma > 0.3:
        from torchvision.transforms.v2.functional import gaussian_blur

        page = gaussian_blur(page, [5, 5], [sigma, sigma])
    page = page + 0.05 * u() * torch.randn(page.shape, generator=g)
    return page.clamp(0, 1).mul(255).round().to(torch.uint8)[0, 0]


@dataclass
class Augmenter:
    """Augments training batches with parameters from its own generator (never the global RNG
    that dropout uses), seeded from the config seed and the DDP rank: same seed, same batches.
    With ``read_share`` that share of every batch is also :func:`photographed` and read back as
    the server reads an upload (:func:`models.prepare.canonicalise`), so the model learns the
    digits the reading gives, not only MNIST's."""

    generator: torch.Generator
    fill: list[float]  # black, in normalised units
    read_share: float = 0.0
    elastic: float = 0.0
    norm: tuple[tuple[float, ...], tuple[float, ...]] = ((0.0,), (1.0,))  # digits' mean, std

    @classmethod
    def for_run(cls, config: TrainConfig, bundle: DataBundle, rank: int) -> Augmenter:
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + 7919 * (rank + 1))
        share = config.augment_read
        if share and (bundle.in_channels != 1 or tuple(bundle.input_size) != (28, 28)):
            raise ValueError("augment_read needs 1-channel 28x28 digits (the served reading's)")
        return cls(
            gen,
            [-m / s for m, s in zip(bundle.mean, bundle.std, strict=True)],
            share,
            config.augment_elastic,
            (tuple(bundle.mean), tuple(bundle.std)),
        )

    def __call__(self, x: Tensor) -> Tensor:
        x = augment_batch(x, self.generator, self.fill, self.elastic)
        n = round(self.read_share * x.shape[0])
        if n:
            from models.prepare import Finding, canonicalise

            rows = torch.randperm(x.shape[0], generator=self.generator)[:n]
            read = []
            for digit in denormalise_uint8(x[rows], *self.norm)[:, 0]:
                got = canonicalise(photographed(digit, self.generator))
                read.append(got.image[0] if got.finding == Finding.ok else digit)
            x = x.clone()
            x[rows] = normalise_uint8(torch.stack(read).unsqueeze(1), *self.norm)
        return x


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
    repulsion: float = 0.0,
    weights: Tensor | None = None,
) -> Tensor:
    """Forward, loss, backward and optimiser step on one batch; returns the (detached) loss.
    With ``outliers`` the loss adds outlier exposure (:mod:`models.training.outliers`);
    ``repulsion`` is the digits' negative-correlation weight and ``weights`` (B, M) their
    bagging weights (:func:`~.loss.digit_loss`)."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    if weights is not None:
        weights = weights.to(device, non_blocking=True)
    if augment is not None:  # training batches only; validation/test never pass here
        x = augment(x)
    if outliers is not None:
        loss = outliers.loss(net, x, y, loss_kind, repulsion, weights)
    else:
        out, log_p = net(x, return_log_p=True)
        loss = digit_loss(out, log_p, y, loss_kind, repulsion, weights)
    opt.step(loss)
    return loss.detach()
