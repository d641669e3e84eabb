"""Last-layer ensemble (LLE): one shared backbone, M independent classifier heads (SI S3.1).

The heads are fused into batched matmuls (:class:`BatchedHeads`), so the cost of M = 100 heads is
close to that of one. With ``vgn=True`` the member probabilities are passed through the VGN layer
(paper Section 3.1), learning per-class ``k`` unless a fixed ``k`` is given.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.nets import Backbone

from .base import BatchedHeads, Ensemble


class LastLayerEnsemble(Ensemble):
    """``x (B, Cin, H, W) -> EnsembleOutput(p (B, M, C), q (B, M, C) | None)``."""

    kind = "lle"

    def __init__(
        self, backbone: Backbone, num_classes: int, members: int, vgn: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.heads = BatchedHeads(members, backbone.out_features, num_classes, backbone.head)
        self.vgn = vgn
        self.members = members
        self.num_classes = num_classes

    def member_log_probs(self, x: Tensor) -> Tensor:
        """Member log-probabilities (B, M, C)."""
        return torch.log_softmax(self.heads(self.backbone(x)), dim=-1)
