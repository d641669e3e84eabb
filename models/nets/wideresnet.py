"""WideResNet-28-10 backbone (Zagoruyko & Komodakis) for 32x32 RGB images (SI S3.1).

Pre-activation wide BasicBlocks (BN-ReLU-conv3x3-Dropout2d-BN-ReLU-conv3x3), three groups of
``(depth - 4) / 6`` blocks with widths 16k, 32k, 64k, final BN-ReLU, global average pooling, then the
paper's extra Linear -> BatchNorm1d -> ReLU -> Dropout block. ``depth``/``widen_factor`` configurable.
"""

from __future__ import annotations

from torch import Tensor, nn

from .registry import Backbone, HeadSpec, register_backbone
from .resnet import embedding_block


class WideBasic(nn.Module):
    """Pre-activation wide residual block with spatial dropout between the convolutions."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.drop = nn.Dropout2d(dropout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=stride, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self.drop(self.conv1(self.relu(self.bn1(x))))
        out = self.conv2(self.relu(self.bn2(out)))
        return out + self.shortcut(x)


class WideResNet(Backbone):
    """WRN-depth-k feature extractor: ``(B, Cin, 32, 32) -> (B, fc_features)``."""

    def __init__(
        self,
        in_channels: int = 3,
        depth: int = 28,
        widen_factor: int = 10,
        dropout: float = 0.3,
        fc_features: int | None = None,
    ) -> None:
        super().__init__()
        if (depth - 4) % 6 != 0 or depth < 10:
            raise ValueError(f"WideResNet depth must be 6n+4 with n >= 1, got {depth}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.stem = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        layers: list[nn.Module] = []
        cin = widths[0]
        for g, w in enumerate(widths[1:]):
            for j in range(n):
                layers.append(
                    WideBasic(cin, w, stride=2 if (g > 0 and j == 0) else 1, dropout=dropout)
                )
                cin = w
        self.layers = nn.Sequential(*layers)
        self.post = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )  # (B, cin)
        fc = fc_features or cin
        self.fc = embedding_block(cin, fc, dropout)
        self.out_features = fc
        self.head = HeadSpec(hidden=(), activation="relu", dropout=0.0)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, Cin, H, W) -> features (B, fc_features)."""
        return self.fc(self.post(self.layers(self.stem(x))))


@register_backbone("wrn28_10")
def wrn28_10(
    in_channels: int = 3,
    dropout: float = 0.3,
    depth: int = 28,
    widen_factor: int = 10,
    fc_features: int | None = None,
) -> WideResNet:
    """WideResNet-28-10 (SI S3.1); pass ``depth=10, widen_factor=1`` for a tiny test variant."""
    return WideResNet(
        in_channels=in_channels,
        depth=depth,
        widen_factor=widen_factor,
        dropout=dropout,
        fc_features=fc_features,
    )
