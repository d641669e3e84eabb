"""Outlier exposure (Hendrycks, Mazeika, Dietterich, ICLR 2019) for the served mixture.

Each training step also sees ``outlier_batch_size`` generated non-digits
(:func:`models.data_ood.outlier_exposure_set`: fonts, photographs and noise/texture families
kept apart from the evaluation suite, see docs/ood-suite.md) in the same forward pass as the
digits, and the loss adds

    λ · E_outliers[ −(1/C) Σ_c log r̄_c ]

the cross-entropy from the uniform distribution to the served mixture ``r̄`` (the gated
members' mean q̄ for VGN models, paper §3.1, else p̄). It pushes the answer on non-digits to a
flat mean, where the top-2 margin is small and the served rule (§3.2) defers. The outliers
pass through BatchNorm with the digits' running statistics (see :meth:`OutlierExposure.loss`). λ is
``TrainConfig.outlier_exposure`` (Hendrycks et al. use 0.5); 0 turns it off.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.data import DataBundle
from models.ensembles import EnsembleOutput

__all__ = ["OutlierExposure", "uniform_cross_entropy"]


def uniform_cross_entropy(out: EnsembleOutput, log_p: Tensor) -> Tensor:
    """``−mean_c log r̄_c`` averaged over the batch; ``r̄`` the served mixture (q̄ or p̄)."""
    if out.q is not None:
        log_mix = torch.log(out.q.mean(dim=1).clamp_min(1e-12))
    else:
        log_mix = torch.logsumexp(log_p, dim=1) - math.log(log_p.shape[1])
    return -log_mix.mean()


@dataclass
class OutlierExposure:
    """A pool of normalised outlier images and the generator that draws each step's batch."""

    pool: Tensor  # (N, 1, H, W), normalised like the digits
    batch_size: int
    weight: float
    generator: torch.Generator

    @classmethod
    def for_run(cls, config, bundle: DataBundle, rank: int = 0) -> OutlierExposure:  # noqa: ANN001
        """The pool for ``config`` (``outlier_pool`` images of seed ``config.seed``), normalised
        with the dataset's mean and std. Only for 1-channel 28×28 data (the generators' size)."""
        from models.data_ood import outlier_exposure_set

        if bundle.in_channels != 1 or tuple(bundle.input_size) != (28, 28):
            raise ValueError(
                "outlier_exposure needs 1-channel 28x28 images (its outliers are MNIST-sized); "
                f"this dataset has {bundle.in_channels} channel(s) of {bundle.input_size}"
            )
        images, _ = outlier_exposure_set(config.outlier_pool, seed=config.seed)
        x = torch.from_numpy(images).float().div_(255.0).unsqueeze(1)
        x = (x - bundle.mean[0]) / bundle.std[0]
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + 104_729 * (rank + 1))
        return cls(x, config.outlier_batch_size, config.outlier_exposure, gen)

    def batch(self, device: torch.device) -> Tensor:
        """A random batch of the pool, each image mirrored and/or turned by a multiple of 90°
        at random (outliers have no orientation to keep)."""
        idx = torch.randint(self.pool.shape[0], (self.batch_size,), generator=self.generator)
        x = self.pool[idx]
        flip = torch.rand(self.batch_size, generator=self.generator) < 0.5
        x[flip] = x[flip].flip(-1)
        turn = torch.rand(self.batch_size, generator=self.generator) < 0.5
        x[turn] = x[turn].transpose(-1, -2)
        return x.to(device, non_blocking=True)

    def loss(self, net: nn.Module, x: Tensor, y: Tensor, loss_kind: str) -> Tensor:
        """The digits' training loss plus ``weight`` × the outliers' uniform cross-entropy.

        The outliers go through a second forward pass with BatchNorm in eval mode: normalised
        by the digits' running statistics, exactly as they will be when served, and without
        moving those statistics. (One pass over digits and outliers together, as Hendrycks et
        al. do for CIFAR, mixed two very different pixel statistics into BatchNorm here: the
        validation NLL of the shipped cnn4 went from 0.035 to 0.2-0.8 by mid-schedule.) Under
        DDP, where a step may run one forward pass only, both go through one pass together.
        The outliers get flips and turns (:meth:`batch`), not the digits' affine augmentation.
        """
        from torch.nn.parallel import DistributedDataParallel

        from .step import mixture_nll

        x_out = self.batch(x.device)
        if isinstance(net, DistributedDataParallel):
            out, log_p = net(torch.cat([x, x_out]), return_log_p=True)
            b = y.shape[0]
            id_out = EnsembleOutput(out.p[:b], None if out.q is None else out.q[:b])
            ood_out = EnsembleOutput(out.p[b:], None if out.q is None else out.q[b:])
            id_log_p, ood_log_p = log_p[:b], log_p[b:]
        else:
            id_out, id_log_p = net(x, return_log_p=True)
            with _batchnorm_frozen(net):
                ood_out, ood_log_p = net(x_out, return_log_p=True)
        return mixture_nll(id_out, id_log_p, y, loss_kind) + self.weight * uniform_cross_entropy(
            ood_out, ood_log_p
        )


@contextmanager
def _batchnorm_frozen(net: nn.Module) -> Iterator[None]:
    """BatchNorm layers in eval mode (running statistics, not updated) for the duration; every
    other layer (dropout) keeps its mode."""
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    modes = [m.training for m in norms]
    for m in norms:
        m.train(False)
    try:
        yield
    finally:
        for m, mode in zip(norms, modes, strict=True):
            m.train(mode)
