"""The training loss of the digits, :func:`digit_loss`: its own module because two steps use it.

The plain training step (:func:`models.training.step.train_step`) and outlier exposure's step
(:meth:`models.training.outliers.OutlierExposure.loss`, which adds the outliers' term to it) both
train the digits with this loss, and the step module imports outlier exposure: kept in either of
them it would close an import circle. It depends on nothing of the training package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from models.ensembles import EnsembleOutput

__all__ = ["digit_loss", "member_variance", "mixture_nll"]


def mixture_nll(
    out: EnsembleOutput,
    log_p: Tensor,
    y: Tensor,
    loss: str = "mixture",
    weights: Tensor | None = None,
) -> Tensor:
    """Training loss, mean over the batch. ``log_p`` member log-probs (B, M, C), ``y`` (B,).

    VGN (``out.q`` given): ``-log q̄_y``. Otherwise ``-log p̄_y`` with
    ``log p̄ = logsumexp_m log p_m - log M`` (stable), or the mean member CE for ``loss="members"``.

    ``weights`` (B, M): each digit's bagging weights (:mod:`~.bootstrap`). With the mixture
    (and VGN) the mean over the members becomes the weighted mean ``Σ_m w_m q_m / Σ_m w_m``:
    each digit's mixture is over the members that drew it, weighted by their counts, and every
    digit a member drew still counts once in the batch mean (a digit no member drew is left
    out). With ``members`` it is bagging exactly: ``Σ_{i,m} w_im CE_im / Σ_{i,m} w_im``, each
    member's cross-entropy over its own resample. Equal weights give the unweighted loss. On a
    VGN model a member with weight 0 still moves the others' gate (the gate reads every
    member's spread), so only its own likelihood term is dropped.
    """
    if weights is not None:
        return _weighted_nll(out, log_p, y, loss, weights)
    if out.q is not None:
        q_bar = out.q.mean(dim=1)  # (B, C)
        return -torch.log(q_bar.gather(1, y[:, None]).squeeze(1).clamp_min(1e-12)).mean()
    if loss == "members":
        b, m, c = log_p.shape
        return F.nll_loss(log_p.reshape(b * m, c), y.repeat_interleave(m))
    log_mix = torch.logsumexp(log_p, dim=1) - math.log(log_p.shape[1])  # (B, C)
    return F.nll_loss(log_mix, y)


def _weighted_nll(
    out: EnsembleOutput, log_p: Tensor, y: Tensor, loss: str, weights: Tensor
) -> Tensor:
    """:func:`mixture_nll` with bagging weights ``(B, M)``."""
    if weights.shape != log_p.shape[:2]:
        raise ValueError(
            f"bagging weights {tuple(weights.shape)} do not match (B, M) of {tuple(log_p.shape)}"
        )
    keep = weights.sum(dim=1) > 0  # (B,)
    if not bool(keep.any()):  # no member drew any digit of this batch: nothing to fit (the
        # graph still reaches every parameter the loss would, the VGN layer's k included, so
        # DDP finds no unused parameter)
        return (out.q if out.q is not None else log_p).sum() * 0.0
    idx = y[keep][:, None, None].expand(-1, log_p.shape[1], 1)  # (B', M, 1)
    if out.q is None and loss == "members":
        w = weights[keep]
        return -(w * log_p[keep].gather(2, idx).squeeze(2)).sum() / w.sum()
    w = weights[keep] / weights[keep].sum(dim=1, keepdim=True)  # (B', M), rows sum to 1
    if out.q is not None:
        q_y = out.q[keep].gather(2, idx).squeeze(2)  # (B', M)
        return -torch.log((w * q_y).sum(dim=1).clamp_min(1e-12)).mean()
    log_p_y = log_p[keep].gather(2, idx).squeeze(2)  # (B', M)
    return -torch.logsumexp(log_p_y + torch.log(w), dim=1).mean()


def member_variance(p: Tensor) -> Tensor:
    """Members' variance of ``p`` (B, M, C), unbiased over M, summed over classes, mean over the
    batch: C x the paper's diversity ``E_{i,c}[Var_M]`` (SI S3.3) of the batch. ``M = 1``: 0."""
    if p.shape[1] < 2:
        return p.new_zeros(())
    return p.var(dim=1).sum(dim=1).mean()


def digit_loss(
    out: EnsembleOutput,
    log_p: Tensor,
    y: Tensor,
    loss: str = "mixture",
    repulsion: float = 0.0,
    weights: Tensor | None = None,
) -> Tensor:
    """:func:`mixture_nll` minus ``repulsion`` x :func:`member_variance` of the members' ``p``.

    The second term is negative correlation learning (Liu & Yao 1999): with the mixture loss the
    likelihood constrains the members' mean on a digit, not how they split its remaining mass,
    and the term pushes them apart there (``TrainConfig.member_repulsion``; 0 = the NLL alone).
    On a VGN model the NLL is of the gated mean q̄ while the term is of the ungated ``p`` (the
    diversity the card reports): the gate then shrinks what the spread costs the likelihood.
    ``weights``: the digits' bagging weights (:func:`mixture_nll`).
    """
    nll = mixture_nll(out, log_p, y, loss, weights)
    return nll - repulsion * member_variance(out.p) if repulsion else nll
