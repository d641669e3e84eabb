"""ResNet-18 backbone for 32x32 RGB images (SVHN, CIFAR-10/100; SI S3.1).

CIFAR-style stem (3x3 conv, no max-pool), BasicBlocks with spatial dropout between the two
convolutions, BatchNorm, ReLU, global average pooling, then the paper's extra fully connected block
Linear -> BatchNorm1d -> ReLU -> Dropout before classification. Dropout p=0.1 (SVHN) or 0.3 (CIFAR).
``widths``/``blocks`` are configurable so tests can build tiny variants.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .registry import Backbone, HeadSpec, register_backbone


def embedding_block(in_features: int, out_features: int, dropout: float) -> nn.Sequential:
    """The extra block before classification (SI S3.1): Linear → BatchNorm → ReLU → Dropout."""
    return nn.Sequential(
        nn.Linear(in_features, out_features),
        nn.BatchNorm1d(out_features),
        nn.ReLU(),
        nn.Dropout(dropout),
    )


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-Dropout2d-conv3x3-BN (+ projection shortcut) -> ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout2d(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.drop(self.relu(self.bn1(self.conv1(x))))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(Backbone):
    """CIFAR ResNet feature extractor: ``(B, Cin, 32, 32) -> (B, fc_features)``."""

    def __init__(
        self,
        in_channels: int = 3,
        widths: Sequence[int] = (64, 128, 256, 512),
        blocks: Sequence[int] = (2, 2, 2, 2),
        dropout: float = 0.3,
        fc_features: int | None = None,
    ) -> None:
        super().__init__()
        if len(widths) != len(blocks) or not widths:
            raise ValueError("widths and blocks must be non-empty and of equal length")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks, strict=True)):
            for j in range(n):
                layers.append(
                    BasicBlock(cin, w, stride=2 if (i > 0 and j == 0) else 1, dropout=dropout)
                )
                cin = w
        self.layers = nn.Sequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # GAP: (B, cin)
        fc = fc_features or cin
        self.fc = embedding_block(cin, fc, dropout)
        self.out_features = fc
        self.head = HeadSpec(hidden=(), activation="relu", dropout=0.0)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, Cin, H, W) -> features (B, fc_features)."""
        return self.fc(self.pool(self.layers(self.stem(x))))


@register_backbone("resnet18")
def resnet18(
    in_channels: int = 3,
    dropout: float = 0.3,
    widths: Sequence[int] = (64, 128, 256, 512),
    blocks: Sequence[int] = (2, 2, 2, 2),
    fc_features: int | None = None,
) -> ResNet:
    """ResNet-18 (SI S3.1); pass small ``widths``/``blocks`` for tests."""
    return ResNet(
        in_channels=in_channels,
        widths=widths,
        blocks=blocks,
        dropout=dropout,
        fc_features=fc_features,
    )
