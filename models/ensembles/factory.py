"""``build_ensemble``: one entry point from configuration to an ensemble module.

Used by training and by :func:`models.checkpoint.load_checkpoint` to rebuild a model from its card,
so the (kind, backbone, kwargs, members, vgn, k) tuple fully determines the architecture.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor, nn

from models.nets import create_backbone

from .base import BatchedHeads
from .deep import DeepEnsemble
from .lle import LastLayerEnsemble
from .mcd import MCDropoutEnsemble

EnsembleKind = Literal["de", "lle", "mcd", "mcd-lle"]
KINDS: tuple[str, ...] = ("de", "lle", "mcd", "mcd-lle")
VGN_KINDS: tuple[str, ...] = ("de", "lle")


def normalise_kind(kind: str) -> str:
    """Canonical ensemble kind (``"MCD_LLE"`` -> ``"mcd-lle"``); ValueError when unknown."""
    k = kind.strip().lower().replace("_", "-")
    if k not in KINDS:
        raise ValueError(f"unknown ensemble kind {kind!r}; expected one of {', '.join(KINDS)}")
    return k


class _Member(nn.Module):
    """One DE member: backbone + single classifier head -> logits (B, C)."""

    def __init__(self, backbone: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = BatchedHeads(1, backbone.out_features, num_classes, backbone.head)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))[:, 0]  # (B, C)


def build_ensemble(
    kind: str,
    backbone: str,
    num_classes: int,
    members: int,
    vgn: bool = False,
    in_channels: int = 1,
    *,
    backbone_kwargs: dict[str, Any] | None = None,
    k: float | list[float] | None = None,
    mc_samples: int = 10,
    train_samples: int = 1,
) -> nn.Module:
    """Build an ensemble returning ``EnsembleOutput(p (B, M, C), q)``.

    * ``kind="de"``: ``members`` independent networks (vectorised with ``torch.func``).
    * ``kind="lle"``: shared backbone, ``members`` heads.
    * ``kind="mcd"``: ``members`` = S stochastic passes of one network.
    * ``kind="mcd-lle"``: ``members`` = H heads, ``mc_samples`` = S dropout samples (M = S*H).
    * ``vgn=True`` (DE/LLE only, paper Table 2) adds the VGN layer; ``k=None`` learns per-class k.
    """
    kind = normalise_kind(kind)
    if members < 1:
        raise ValueError(f"members must be >= 1, got {members}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if vgn and kind not in VGN_KINDS:
        raise ValueError(
            f"VGN is only defined for deep ensembles and last-layer ensembles (de, lle), not for "
            f"{kind!r}: MC-dropout members are not trained jointly (paper Table 2)"
        )
    if vgn and members < 2:
        raise ValueError("VGN needs at least 2 members (it gates on the member spread)")
    kw = dict(backbone_kwargs or {})
    kw["in_channels"] = in_channels

    def make_backbone() -> nn.Module:
        return create_backbone(backbone, **kw)

    vgn_layer: nn.Module | None = None
    if vgn:
        from models.uncertainty.vgn import VGN

        vgn_layer = VGN(num_classes, k=k)

    if kind == "de":
        return DeepEnsemble(
            lambda: _Member(make_backbone(), num_classes), num_classes, members, vgn=vgn_layer
        )
    if kind == "lle":
        return LastLayerEnsemble(make_backbone(), num_classes, members, vgn=vgn_layer)
    if kind == "mcd":
        return MCDropoutEnsemble(
            make_backbone(), num_classes, samples=members, heads=1, train_samples=train_samples
        )
    return MCDropoutEnsemble(
        make_backbone(), num_classes, samples=mc_samples, heads=members, train_samples=train_samples
    )
