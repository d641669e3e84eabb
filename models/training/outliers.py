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

Images a reviewer marked *not a digit* (the review queue; ``imagefolder:<path>+mnist-bundled``
data carries them as ``bundle.extra["outliers"]``, :func:`models.data.load_dataset`) join the
pool as outliers, never as a class. They are few against the generated pool (tens against
12,000), so drawn uniformly most would never be seen by a short fine-tune (64 draws a step from
12,000: each image about 0.5 times in 2 epochs of the bundled digits); instead
:data:`REVIEWED_SHARE` of every outlier batch is drawn from them, as every human-labelled digit
is seen once an epoch.

Two refinements (``TrainConfig.outlier_targets``, ``outlier_overlays``, ``outlier_prepare``):

* **disagreeing members** (``outlier_targets="disagree"``): instead of asking every member for
  the flat answer, member ``m`` is asked for class ``(r + m) mod C`` on an outlier (``r`` fixed
  per pool image for the run: a target a member can learn, as a random one drawn per step is
  not — its expectation is the flat answer again), ``E_m[−log r_{m,t_m}]`` on the served
  members ``r`` (``q`` with VGN). The mean is
  still flat (exactly so when C divides M), so the served margin rule defers as before, but now
  the members *disagree* where the data gave them no evidence: the epistemic part of the
  decomposition (EU = TU − AU, §3.3) and the spread that the gate and VGMU read become the
  signal, as in a deep ensemble off its data (Lakshminarayanan et al. 2017), rather than a mean
  that every member flattens alike. Diversity driven by chosen targets on chosen inputs is the
  idea of diverse/repulsive ensembles (D'Angelo & Fortuin 2021) made explicit and cheap.
* **overlays** (near OOD): a share of every outlier batch is two training digits of different
  classes ``a ≠ b`` overlaid (pixelwise max, the second shifted by up to 2 px): an image a person
  would defer; new pairs every step. Its target splits the answer between ``a < b``: the even
  members are asked for ``a``, the odd ones for ``b`` (disagree), or ½/½ on the mean (uniform).
* ``outlier_prepare``: the pool and the overlays are read as the server reads an upload
  (:func:`models.prepare.canonicalise`), so a letter is seen framed like a digit, as served;
  an image the reading refuses (no digit found) is kept as drawn: serving never shows the model
  one, and the pool keeps its families.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.data import DataBundle, denormalise_uint8, normalise_uint8, read_as_served
from models.ensembles import EnsembleOutput

from .loss import digit_loss

__all__ = [
    "REVIEWED_SHARE",
    "OutlierExposure",
    "overlay_pairs",
    "uniform_cross_entropy",
]

#: The share of each outlier batch drawn from the reviewed outliers when there are any.
REVIEWED_SHARE = 0.25


def _log_mixture(out: EnsembleOutput, log_p: Tensor) -> Tensor:
    """``log r̄`` (B, C) of the served mixture: q̄ for VGN models, else p̄ (stable)."""
    if out.q is not None:
        return torch.log(out.q.mean(dim=1).clamp_min(1e-12))
    return torch.logsumexp(log_p, dim=1) - math.log(log_p.shape[1])


def uniform_cross_entropy(out: EnsembleOutput, log_p: Tensor) -> Tensor:
    """``−mean_c log r̄_c`` averaged over the batch; ``r̄`` the served mixture (q̄ or p̄)."""
    return -_log_mixture(out, log_p).mean()


@dataclass
class OutlierExposure:
    """A pool of normalised outlier images and the generator that draws each step's batch."""

    pool: Tensor  # (N, 1, H, W), normalised like the digits
    batch_size: int
    weight: float
    generator: torch.Generator
    #: (R, 1, H, W) images reviewers marked not a digit, normalised like the digits; None: none
    reviewed: Tensor | None = None
    #: "uniform" (flat mean) or "disagree" (member m confident on its own class)
    targets: str = "uniform"
    #: uint8 (N, 28, 28) training digits and their labels (N,) that overlays are drawn from
    #: afresh every step; None: no overlays
    digits: Tensor | None = None
    digit_labels: Tensor | None = None
    overlays_per_batch: int = 0
    #: read overlays as served (models.prepare) before normalising them
    prepare: bool = False
    #: normalisation of the digits (mean, std per channel), for the overlays made every step
    norm: tuple[tuple[float, ...], tuple[float, ...]] = ((0.0,), (1.0,))
    #: ``disagree``: each pool image's fixed class offset r (member m's target (r + m) mod C),
    #: drawn once per run, so that a member's answer on an outlier is a function it can learn
    pool_offsets: Tensor | None = None
    reviewed_offsets: Tensor | None = None

    @property
    def reviewed_per_batch(self) -> int:
        """How many of each batch come from :attr:`reviewed` (:data:`REVIEWED_SHARE`, at
        least 1 when there are any)."""
        if self.reviewed is None or self.reviewed.shape[0] == 0:
            return 0
        return max(1, round(REVIEWED_SHARE * (self.batch_size - self.overlays_per_batch)))

    @classmethod
    def for_run(cls, config, bundle: DataBundle, rank: int = 0) -> OutlierExposure:  # noqa: ANN001
        """The pool for ``config`` (``outlier_pool`` images of seed ``config.seed``), normalised
        with the dataset's mean and std, and the dataset's reviewed outliers
        (``bundle.extra["outliers"]``, uint8 ``(R, 1, 28, 28)``) when it has any; with
        ``outlier_overlays`` a pool of overlaid training-digit pairs. Only for 1-channel 28×28
        data (the generators' size)."""
        from models.data_ood import outlier_exposure_set

        if bundle.in_channels != 1 or tuple(bundle.input_size) != (28, 28):
            raise ValueError(
                "outlier_exposure needs 1-channel 28x28 images (its outliers are MNIST-sized); "
                f"this dataset has {bundle.in_channels} channel(s) of {bundle.input_size}"
            )
        norm = (tuple(bundle.mean), tuple(bundle.std))
        images, _ = outlier_exposure_set(
            config.outlier_pool, seed=config.seed, version=config.outlier_set
        )
        if config.outlier_prepare:
            images = read_as_served(images, keep_unread=True)
        x = normalise_uint8(torch.from_numpy(images).unsqueeze(1), *norm)
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + 104_729 * (rank + 1))
        reviewed = None
        extra = bundle.extra.get("outliers")
        if extra is not None and len(extra):
            reviewed = normalise_uint8(torch.as_tensor(extra).reshape(-1, 1, 28, 28), *norm)
        digits = labels = None
        n_overlay = 0
        if config.outlier_overlays > 0:
            from torch.utils.data import DataLoader

            train_x, labels = next(iter(DataLoader(bundle.train, batch_size=len(bundle.train))))
            digits = denormalise_uint8(train_x, *norm)[:, 0]
            n_overlay = max(1, round(config.outlier_overlays * config.outlier_batch_size))
        offsets = torch.Generator().manual_seed(config.seed * 1_000_003 + 15_485_863)
        n_classes = bundle.num_classes
        return cls(
            x,
            config.outlier_batch_size,
            config.outlier_exposure,
            gen,
            reviewed,
            config.outlier_targets,
            digits,
            None if labels is None else labels.long(),
            n_overlay,
            config.outlier_prepare,
            norm,
            torch.randint(n_classes, (x.shape[0],), generator=offsets),
            None
            if reviewed is None
            else torch.randint(n_classes, (reviewed.shape[0],), generator=offsets),
        )

    def batch(self, device: torch.device) -> Tensor:
        """A random batch: :attr:`overlays_per_batch` overlaid pairs made afresh from the
        training digits first (their classes in :attr:`last_overlay_classes`), then
        :attr:`reviewed_per_batch` reviewed outliers, then the generated pool (their fixed
        offsets in :attr:`last_offsets`); the non-overlay images are mirrored and/or turned by a
        multiple of 90° at random (outliers have no orientation to keep)."""
        n_ov, n_rev = self.overlays_per_batch, self.reviewed_per_batch
        n_gen = self.batch_size - n_ov - n_rev
        idx = torch.randint(self.pool.shape[0], (n_gen,), generator=self.generator)
        x = self.pool[idx]
        offsets = [] if self.pool_offsets is None else [self.pool_offsets[idx]]
        if n_rev:
            assert self.reviewed is not None
            ridx = torch.randint(self.reviewed.shape[0], (n_rev,), generator=self.generator)
            x = torch.cat([self.reviewed[ridx], x])
            if self.reviewed_offsets is not None:
                offsets.insert(0, self.reviewed_offsets[ridx])
        n = x.shape[0]
        flip = torch.rand(n, generator=self.generator) < 0.5
        x[flip] = x[flip].flip(-1)
        turn = torch.rand(n, generator=self.generator) < 0.5
        x[turn] = x[turn].transpose(-1, -2)
        self.last_offsets = torch.cat(offsets) if offsets else None
        self.last_overlay_classes = None
        if n_ov:
            assert self.digits is not None and self.digit_labels is not None
            ov, pair = overlay_pairs(self.digits, self.digit_labels, n_ov, self.generator)
            if self.prepare:
                ov = torch.from_numpy(read_as_served(ov.numpy(), keep_unread=True))
            x = torch.cat([normalise_uint8(ov.unsqueeze(1), *self.norm), x])
            self.last_overlay_classes = pair
        return x.to(device, non_blocking=True)

    def member_targets(self, n: int, members: int, classes: int) -> Tensor:
        """``(n, M)`` target classes of the members on the last batch of ``n`` outliers
        (``disagree``), each a function of the image and the member that the member can learn:
        on an overlay of classes ``a < b`` the even members are asked for ``a`` and the odd
        ones for ``b`` (so on any digit between two classes the members split rather than all
        hedging alike); on another outlier member ``m`` is asked for ``(r + m) mod C`` with the
        image's fixed offset ``r`` (every member a different class when M ≤ C: a flat mean)."""
        m = torch.arange(members)
        r = self.last_offsets
        assert r is not None, "disagree targets need the pool's fixed offsets (for_run sets them)"
        n_ov = self.overlays_per_batch
        t = torch.empty(n, members, dtype=torch.long)
        t[n_ov:] = (r[:, None] + m) % classes
        if n_ov:
            pair = self.last_overlay_classes  # (n_ov, 2)
            assert pair is not None
            low, high = pair.min(1).values, pair.max(1).values
            t[:n_ov] = torch.where(m % 2 == 0, low[:, None], high[:, None])
        return t

    def outlier_loss(self, out: EnsembleOutput, log_p: Tensor) -> Tensor:
        """The outliers' part of the loss (before ``weight``), mean over the outlier batch."""
        n_ov = self.overlays_per_batch
        if self.targets == "disagree":
            b, m, c = out.p.shape
            t = self.member_targets(b, m, c).to(out.p.device)
            log_r = log_p if out.q is None else torch.log(out.q.clamp_min(1e-12))
            return -log_r.gather(2, t.unsqueeze(-1)).mean()
        gen = EnsembleOutput(out.p[n_ov:], None if out.q is None else out.q[n_ov:])
        loss = uniform_cross_entropy(gen, log_p[n_ov:]) * (out.p.shape[0] - n_ov)
        if n_ov:
            pair = self.last_overlay_classes
            assert pair is not None
            log_mix = _log_mixture(out.rows(torch.arange(n_ov)), log_p[:n_ov])
            loss = loss - 0.5 * log_mix.gather(1, pair.to(log_mix.device)).sum()
        return loss / out.p.shape[0]

    def loss(
        self,
        net: nn.Module,
        x: Tensor,
        y: Tensor,
        loss_kind: str,
        repulsion: float = 0.0,
        weights: Tensor | None = None,
    ) -> Tensor:
        """The digits' training loss (:func:`~.loss.digit_loss`, ``repulsion`` its
        negative-correlation weight, ``weights`` their bagging weights) plus ``weight`` × the
        outliers' loss.

        Digits and outliers go through one forward pass, and every BatchNorm layer normalises
        the whole batch with the statistics of its digits alone, and tracks those alone
        (:func:`_digit_batchnorm`): outliers are normalised as they will be when served (by
        digit statistics) and never shift the running statistics. Two alternatives failed on
        the shipped cnn4: BatchNorm over the mixed batch, as Hendrycks et al. do for CIFAR
        (digits and noise have very different statistics; validation NLL 0.2-0.8 by
        mid-schedule against 0.035 without outliers), and a second pass with BatchNorm in eval
        mode for the outliers (the eval-mode path, never trained on digits, learned to answer
        uniformly for everything: validation accuracy 0.29 at epoch 3). The outliers get flips
        and turns (:meth:`batch`), not the digits' affine augmentation.
        """
        x_out = self.batch(x.device)
        b = y.shape[0]
        with _digit_batchnorm(net, b):
            out, log_p = net(torch.cat([x, x_out]), return_log_p=True)
        id_out = EnsembleOutput(out.p[:b], None if out.q is None else out.q[:b])
        ood_out = EnsembleOutput(out.p[b:], None if out.q is None else out.q[b:])
        return digit_loss(
            id_out, log_p[:b], y, loss_kind, repulsion, weights
        ) + self.weight * self.outlier_loss(ood_out, log_p[b:])


def overlay_pairs(
    digits: Tensor, labels: Tensor, n: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``n`` images of two digits of different classes overlaid (pixelwise max; the second
    shifted by up to 2 px each way) and their classes ``(n, 2)``; ``digits`` uint8 (N, H, W)."""
    if labels.unique().numel() < 2:
        raise ValueError("outlier_overlays needs training digits of at least two classes")
    i = torch.randint(len(labels), (n,), generator=generator)
    j = torch.randint(len(labels), (n,), generator=generator)
    same = labels[i] == labels[j]
    while same.any():  # redraw the partner of a same-class pair
        j[same] = torch.randint(len(labels), (int(same.sum()),), generator=generator)
        same = labels[i] == labels[j]
    shift = torch.randint(-2, 3, (n, 2), generator=generator)
    second = torch.stack(
        [
            torch.roll(digits[b], (int(dy), int(dx)), (0, 1))
            for b, (dy, dx) in zip(j, shift, strict=True)
        ]
    )
    return torch.maximum(digits[i], second), torch.stack([labels[i], labels[j]], 1)


def _bn_on_first(m: nn.modules.batchnorm._BatchNorm, x: Tensor, n: int) -> Tensor:
    """Training-mode batch norm of ``x`` with the mean and variance of its first ``n`` rows;
    the running statistics are updated from those rows only (as ``F.batch_norm`` would)."""
    dims = [0, *range(2, x.dim())]
    head = x[:n]
    mean = head.mean(dims)
    var = head.var(dims, unbiased=False)
    if m.track_running_stats and m.running_mean is not None:
        count = head.numel() / head.shape[1]
        original = getattr(m, "_oe_momentum", m.momentum)  # paused to 0 by _pause_tracking
        momentum = 0.1 if original is None else original
        with torch.no_grad():
            m.running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
            unbiased = var.detach() * count / max(count - 1, 1)
            m.running_var.mul_(1 - momentum).add_(momentum * unbiased)
            m.num_batches_tracked.add_(1)
    shape = [1, -1] + [1] * (x.dim() - 2)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + m.eps)
    if m.affine:
        y = y * m.weight.view(shape) + m.bias.view(shape)
    return y


@contextmanager
def _digit_batchnorm(net: nn.Module, n: int) -> Iterator[None]:
    """Within the block, every BatchNorm layer in training mode normalises its input with the
    statistics of the first ``n`` rows (the digits) and tracks only those."""
    handles = []
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            handles.append(
                m.register_forward_hook(lambda mod, inp, out: _bn_on_first(mod, inp[0], n))
            )
            handles.append(m.register_forward_pre_hook(_pause_tracking))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and hasattr(m, "_oe_momentum"):
                m.momentum = m._oe_momentum
                m.num_batches_tracked.sub_(1)
                del m._oe_momentum


def _pause_tracking(m: nn.Module, inp: tuple[Tensor, ...]) -> None:
    """Before BatchNorm's own forward: momentum 0, so it leaves the running statistics alone
    (its output is then replaced by :func:`_bn_on_first`, which updates them from the digits)."""
    if not hasattr(m, "_oe_momentum"):
        m._oe_momentum = m.momentum
    m.momentum = 0.0


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, dataset, batch_size: int = 512) -> None:  # noqa: ANN001
    """Set every BatchNorm layer's running statistics to the exact mean and variance of
    ``dataset`` (the un-augmented training digits), as served inputs are normalised.

    Why: with outlier exposure the network learns channels that fire on outliers and barely
    vary on digits; normalised by the digits' small variance they amplify the lag of the
    exponential running average, and the eval-mode answer drifts from the training-mode one
    (validation NLL 0.45 in eval mode against 0.17 with batch statistics after two epochs).
    Recomputing the population statistics after every epoch (as SWA's ``update_bn`` does)
    removes the lag. Dropout and other layers stay in eval mode; nothing else changes."""
    from torch.utils.data import DataLoader

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    was_training = model.training
    model.eval()
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
        m.train()
    device = next(model.parameters()).device
    for x, _ in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        model(x.to(device))
    for m, (momentum, tracked) in zip(norms, saved, strict=True):
        m.momentum = momentum
        m.num_batches_tracked.copy_(tracked)
    model.train(was_training)
