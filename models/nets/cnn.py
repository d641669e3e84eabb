"""A small VGG-style CNN for 28x28 digits: the backbone of the shipped default model.

Two blocks of two 3x3 convolutions with BatchNorm and ReLU, each followed by 2x2 max pooling
(32 and 64 channels: 28 -> 14 -> 7), then a 64·7·7 -> 128 fully connected layer with BatchNorm,
ReLU and dropout. The per-member head is a single linear layer 128 -> C (``HeadSpec(())``), so a
last-layer ensemble of M heads costs M·128·C multiply-adds on top of the shared trunk.

With ``branches`` > 1 (TreeNets, Lee et al. 2015) the second block, the feature layer and the
heads split into independent towers after the shared first block (grouped convolutions): member
m reads tower m mod branches only. With ``shared_stem=False`` the first block splits as well, so
the towers share no weights: a deep ensemble of small CNN4s run as one grouped network. Both
tried for issue 33 and not shipped (the default model's README, "separate towers" and "a deep
ensemble of small CNNs"): they raised the members' diversity but cost accuracy and deferred
fewer letters and overlaid digits.

Not from the paper (whose MNIST model is LeNet-5, SI S3.1, kept as a zoo entry): chosen because
the LeNet-5 trunk's 16-dim bottleneck caps accuracy on the 5,600 bundled training digits at
≈0.96, while this trunk reaches ≥0.99 on the same data in a few CPU minutes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .registry import Backbone, HeadSpec, register_backbone


def _block(cin: int, cout: int, groups: int = 1, first_groups: int = 1) -> nn.Sequential:
    # groups > 1: the second convolution is `groups` independent ones, each on its own share of
    # the first's output channels (the branches of CNN4, below); first_groups likewise for the
    # first convolution (towers that share nothing: each reads its own share of the input)
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False, groups=first_groups),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False, groups=groups),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class CNN4(Backbone):
    """``(B, Cin, 28, 28) -> (B, hidden)`` features."""

    def __init__(
        self,
        in_channels: int = 1,
        width: int = 32,
        hidden: int = 128,
        dropout: float = 0.2,
        fc_activation: str = "relu",
        head_hidden: int = 0,
        head_dropout: float = 0.0,
        head_subspace: float = 1.0,
        branches: int = 1,
        branch_width: int = 0,
        shared_stem: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in (("width", width, 1), ("hidden", hidden, 1),
                                 ("head_hidden", head_hidden, 0), ("branches", branches, 1),
                                 ("branch_width", branch_width, 0)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name, rate in (("dropout", dropout), ("head_dropout", head_dropout)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate!r}")
        if not 0.0 < head_subspace <= 1.0:
            raise ValueError(f"head_subspace must be in (0, 1], got {head_subspace!r}")
        if fc_activation not in ("relu", "tanh"):
            raise ValueError(f"fc_activation must be 'relu' or 'tanh', got {fc_activation!r}")
        activation = nn.Tanh() if fc_activation == "tanh" else nn.ReLU(inplace=True)
        if branches == 1 and not shared_stem:
            raise ValueError("shared_stem: false splits towers: it needs branches > 1")
        if branches == 1:
            self.features = nn.Sequential(
                _block(in_channels, width),
                _block(width, 2 * width),
                nn.AdaptiveAvgPool2d(7),  # 7x7 for 28x28 inputs; other sizes pool to the same grid
                nn.Flatten(),
            )
            self.fc = nn.Sequential(
                nn.Linear(2 * width * 49, hidden, bias=False),
                nn.BatchNorm1d(hidden),
                activation,
                nn.Dropout(dropout),
            )
        else:
            # Branches (TreeNets, Lee et al. 2015): the first block is shared; from the second
            # block on, `branches` independent towers of `branch_width` channels each (a grouped
            # convolution), each with its own hidden/branches features (a grouped 7x7
            # convolution over the pooled map: a fully connected layer per branch), and member m
            # reads branch m mod branches only. Members in different branches do not share the
            # features they classify from, so they can disagree off the data as separately
            # trained networks do, at a fraction of a deep ensemble's cost.
            if branches < 1:
                raise ValueError(f"branches must be >= 1, got {branches}")
            if hidden % branches:
                raise ValueError(f"hidden ({hidden}) must be a multiple of branches ({branches})")
            towers = branches * (branch_width or 2 * width // branches)
            # shared_stem False: the first block splits too (each tower gets width/branches of
            # its channels; the first convolution reads the image, which every tower may share),
            # so the towers share no weights at all: a deep ensemble of `branches` small CNN4s
            # (Lakshminarayanan et al. 2017) in one module, run as grouped convolutions
            if not shared_stem and width % branches:
                raise ValueError(
                    f"width ({width}) must be a multiple of branches ({branches}) "
                    "when the towers do not share the first block (shared_stem: false)"
                )
            split = 1 if shared_stem else branches
            self.features = nn.Sequential(
                _block(in_channels, width, groups=split),
                _block(width, towers, groups=branches, first_groups=split),
                nn.AdaptiveAvgPool2d(7),
            )
            self.fc = nn.Sequential(
                nn.Conv2d(towers, hidden, 7, bias=False, groups=branches),  # (B, hidden, 1, 1)
                nn.BatchNorm2d(hidden),
                activation,
                nn.Flatten(),
                nn.Dropout(dropout),
            )
        self.out_features = hidden
        # head_hidden > 0: each member gets its own hidden layer (hidden -> head_hidden -> C, Tanh,
        # dropout), like LeNet-5's 120 -> 84 -> C heads: independent nonlinear heads disagree more
        # away from the data than linear heads on shared features.
        # head_subspace < 1: each member reads its own random share of the 128 features
        self.head = HeadSpec(
            hidden=(head_hidden,) if head_hidden else (),
            activation="tanh",
            dropout=head_dropout,
            subspace=head_subspace,
            groups=branches,
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x))


@register_backbone("cnn4")
def cnn4(**kwargs: Any) -> CNN4:
    """The 4-convolution BatchNorm CNN (see the module docstring); keyword arguments as
    :class:`CNN4`."""
    return CNN4(**kwargs)
