"""LeNet-5 style backbone for 28x28 grayscale digits, exactly as in SI S3.1 (MNIST).

Two 5x5 convolutional blocks (1->6, 6->16 channels), each Tanh -> 2x2 average pooling -> spatial
dropout (p=0.1); adaptive average pooling to a 16-dim vector; MLP 16->120 + Tanh + dropout. The
classifier head 120->84->C (Tanh, dropout) is per member and lives in the ensemble (``HeadSpec``).
"""

from __future__ import annotations

from torch import Tensor, nn

from .registry import Backbone, HeadSpec, register_backbone


class LeNet5(Backbone):
    """Shared LeNet-5 feature extractor: ``(B, Cin, H, W) -> (B, hidden)``."""

    def __init__(
        self, in_channels: int = 1, dropout: float = 0.1, hidden: int = 120, head_hidden: int = 84
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            # padding=2 keeps the classic LeNet-5 geometry on 28x28 inputs: 28 -> 14 -> 10 -> 5
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Dropout2d(dropout),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Dropout2d(dropout),
            nn.AdaptiveAvgPool2d(1),  # (B, 16, 1, 1): the fixed 16-dim representation
            nn.Flatten(),
        )
        self.mlp = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Dropout(dropout))
        self.out_features = hidden
        self.head = HeadSpec(hidden=(head_hidden,), activation="tanh", dropout=dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, Cin, H, W) -> features (B, 120)."""
        return self.mlp(self.features(x))


@register_backbone("lenet5")
def lenet5(
    in_channels: int = 1, dropout: float = 0.1, hidden: int = 120, head_hidden: int = 84
) -> LeNet5:
    """LeNet-5 (SI S3.1). ``hidden``/``head_hidden`` are 120/84 in the paper."""
    return LeNet5(in_channels=in_channels, dropout=dropout, hidden=hidden, head_hidden=head_hidden)
