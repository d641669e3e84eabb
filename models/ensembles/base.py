"""Shared pieces of the ensembles: the output type, fused per-member heads, always-on dropout.

Every ensemble maps ``x (B, Cin, H, W)`` to :class:`EnsembleOutput` with raw member probabilities
``p (B, M, C)`` and, for VGN models, gated members ``q (B, M, C)`` (paper Section 3.1, SI S6).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.nets import HeadSpec

__all__ = [
    "BatchedHeads",
    "Ensemble",
    "EnsembleOutput",
    "MCDropout",
    "MCDropout2d",
    "make_dropout_always_on",
]


class EnsembleOutput(NamedTuple):
    """``p``: member probabilities (B, M, C); ``q``: VGN-gated members (B, M, C) or ``None``."""

    p: Tensor
    q: Tensor | None

    def rows(self, index: Tensor) -> EnsembleOutput:
        """The rows ``index`` (a batch index tensor) of both ``p`` and ``q``."""
        return EnsembleOutput(self.p[index], None if self.q is None else self.q[index])


class Ensemble(nn.Module):
    """The contract every ensemble (DE, LLE, MCD, MCD-LLE) keeps.

    Subclasses set ``kind`` (``"de" | "lle" | "mcd" | "mcd-lle"``), ``members`` (M, the member
    axis of the output), ``num_classes`` and ``vgn`` (the VGN layer or ``None``), and implement
    :meth:`member_log_probs`. :meth:`forward` is shared: ``p = exp(log_p)`` and, with a gate,
    ``q = VGN(p)`` (paper Section 3.1). ``return_log_p=True`` also returns the member
    log-probabilities, for a numerically stable training loss; it is an argument of ``forward``
    (not a separate method) so that DistributedDataParallel's forward hooks run.
    """

    kind: str
    members: int
    num_classes: int
    vgn: nn.Module | None  # set in __init__: a class attribute would shadow the registered module

    def member_log_probs(self, x: Tensor) -> Tensor:
        """Member log-probabilities ``(B, M, C)`` for inputs ``x (B, Cin, H, W)``."""
        raise NotImplementedError

    @overload
    def forward(self, x: Tensor, return_log_p: Literal[False] = False) -> EnsembleOutput: ...

    @overload
    def forward(self, x: Tensor, return_log_p: Literal[True]) -> tuple[EnsembleOutput, Tensor]: ...

    def forward(
        self, x: Tensor, return_log_p: bool = False
    ) -> EnsembleOutput | tuple[EnsembleOutput, Tensor]:
        """:class:`EnsembleOutput`; with ``return_log_p`` also the member log-probs ``(B, M, C)``."""
        log_p = self.member_log_probs(x)
        p = log_p.exp()
        q = self.vgn(p) if self.vgn is not None else None
        out = EnsembleOutput(p, q)
        return (out, log_p) if return_log_p else out


_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


class BatchedHeads(nn.Module):
    """M independent MLP classifier heads evaluated as batched matmuls (one einsum per layer).

    Heads follow the backbone's :class:`HeadSpec` (SI S3.1: LeNet's ``120 -> 84 -> C`` with Tanh and
    dropout; a single linear layer after the ResNet/WRN extra FC block). Weights are stored stacked,
    ``weight_i (M, d_in, d_out)``, so M = 100 heads cost one batched GEMM per layer rather than
    100 small ones (the efficiency point of last-layer ensembles, Section 4). Each head is
    initialised independently like ``nn.Linear`` (U(-1/sqrt(d_in), 1/sqrt(d_in))).
    """

    def __init__(self, members: int, in_features: int, num_classes: int, spec: HeadSpec) -> None:
        super().__init__()
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        if spec.activation not in _ACTIVATIONS:
            raise ValueError(f"unknown head activation {spec.activation!r}")
        self.members = members
        self.num_classes = num_classes
        self.activation = spec.activation
        dims = [in_features, *spec.hidden, num_classes]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for d_in, d_out in zip(dims[:-1], dims[1:], strict=True):
            bound = 1.0 / math.sqrt(d_in)
            self.weights.append(
                nn.Parameter(torch.empty(members, d_in, d_out).uniform_(-bound, bound))
            )
            self.biases.append(nn.Parameter(torch.empty(members, d_out).uniform_(-bound, bound)))
        self.dropout = nn.Dropout(spec.dropout)
        if not 0.0 < spec.subspace <= 1.0:
            raise ValueError(f"head subspace must be in (0, 1], got {spec.subspace}")
        if spec.groups < 1 or in_features % spec.groups:
            raise ValueError(f"{in_features} features do not split into {spec.groups} groups")
        if spec.subspace < 1.0 or spec.groups > 1:
            # member m reads `keep` features of its own block (block m mod groups; the whole
            # vector when groups = 1), drawn once from the global RNG (seeded like the weights)
            # and saved with them: (M, d_in, 1) zeros and ones
            block = in_features // spec.groups
            keep = max(1, round(spec.subspace * block))
            chosen = torch.rand(members, block).argsort(dim=1)[:, :keep]
            chosen = chosen + (torch.arange(members) % spec.groups).unsqueeze(1) * block
            mask = torch.zeros(members, in_features).scatter_(1, chosen, 1.0)
            self.register_buffer("feature_mask", mask.unsqueeze(-1))
        else:
            self.feature_mask = None

    def forward(self, features: Tensor) -> Tensor:
        """``features`` (B, F) shared by all heads, or (B, M, F) per member -> logits (B, M, C)."""
        act = _ACTIVATIONS[self.activation]
        n = len(self.weights)
        h = features
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            if i == 0 and self.feature_mask is not None:
                w = w * self.feature_mask  # (M, d_in, d_out): the features member m does not read
            if h.dim() == 2:
                h = torch.einsum("bf,mfo->bmo", h, w) + b  # (B, M, d_out)
            else:
                h = torch.einsum("bmf,mfo->bmo", h, w) + b  # (B, M, d_out)
            if i < n - 1:
                h = self.dropout(act(h))
        return h


class MCDropout(nn.Dropout):
    """Dropout that stays active in eval mode (Monte Carlo dropout, Gal & Ghahramani)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, training=True)


class MCDropout2d(nn.Dropout2d):
    """Spatial dropout that stays active in eval mode."""

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout2d(x, self.p, training=True)


def make_dropout_always_on(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Dropout``/``nn.Dropout2d`` in ``module`` (in place) by an always-on twin.

    MC dropout needs dropout active while BatchNorm uses its running statistics (SI S3.3). Swapping
    the modules once, instead of toggling ``.training`` around each call, keeps ``forward`` free of
    state changes and therefore safe to call from several threads.
    """
    for name, child in module.named_children():
        if isinstance(child, nn.Dropout2d) and not isinstance(child, MCDropout2d):
            setattr(module, name, MCDropout2d(child.p))
        elif isinstance(child, nn.Dropout) and not isinstance(child, MCDropout):
            setattr(module, name, MCDropout(child.p))
        else:
            make_dropout_always_on(child)
    return module
