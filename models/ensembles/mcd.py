"""Monte Carlo dropout ensembles: MCD and MCD-LLE (SI S3.3).

* **MCD**: one network, ``S`` stochastic forward passes with dropout active and BatchNorm in eval
  mode; members are the S samples.
* **MCD-LLE**: ``H`` heads x ``S`` dropout samples. The backbone is run once per dropout sample
  and its features are re-used by all H heads ("For H > 1, feature representations were re-used to
  improve compute efficiency", SI S3.3), giving ``M = S * H`` members ordered sample-major.

The S passes are batched: the input is tiled S times along the batch dimension, so one backbone call
produces all samples. In training mode a single stochastic pass is used (``train_samples``, default
1), i.e. ordinary dropout training; members at training time are then the H heads.
VGN is not defined for these ensembles (paper Table 2): the factory refuses it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.nets import Backbone

from .base import BatchedHeads, Ensemble, make_dropout_always_on


class MCDropoutEnsemble(Ensemble):
    """``x (B, Cin, H, W) -> EnsembleOutput(p (B, S*H, C), None)``; ``heads=1`` is plain MCD."""

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int,
        samples: int,
        heads: int = 1,
        train_samples: int = 1,
    ) -> None:
        super().__init__()
        if samples < 1 or heads < 1 or train_samples < 1:
            raise ValueError("samples, heads and train_samples must be >= 1")
        self.backbone = make_dropout_always_on(backbone)
        self.heads = make_dropout_always_on(
            BatchedHeads(heads, backbone.out_features, num_classes, backbone.head)
        )
        self.samples = samples
        self.num_heads = heads
        self.train_samples = train_samples
        self.num_classes = num_classes
        self.vgn = None
        self.kind = "mcd" if heads == 1 else "mcd-lle"

    @property
    def members(self) -> int:
        """Members at inference: S * H."""
        return self.samples * self.num_heads

    def member_log_probs(self, x: Tensor) -> Tensor:
        """Member log-probabilities (B, S*H, C); S = ``train_samples`` in training mode."""
        s = self.train_samples if self.training else self.samples
        b = x.shape[0]
        xs = x.repeat(s, *([1] * (x.dim() - 1)))  # (S*B, Cin, H, W): sample-major tiling
        feats = self.backbone(xs)  # (S*B, F): one dropout mask per sample
        logits = self.heads(feats)  # (S*B, H, C): heads share each sample's features
        logits = logits.view(s, b, self.num_heads, -1).permute(1, 0, 2, 3)  # (B, S, H, C)
        return torch.log_softmax(logits.reshape(b, s * self.num_heads, -1), dim=-1)
