"""Backbones (SI S3.1): registry, LeNet-5 structure, tiny ResNet/WRN variants."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.nets import available_backbones, create_backbone, register_backbone
from models.nets.lenet import LeNet5

torch.set_num_threads(1)


def test_registry_lists_and_rejects_unknown():
    assert {"lenet5", "resnet18", "wrn28_10"} <= set(available_backbones())
    with pytest.raises(ValueError, match="available: .*lenet5"):
        create_backbone("vgg16")
    with pytest.raises(ValueError, match="already registered"):
        register_backbone("lenet5")(lambda **kw: None)


def test_lenet5_matches_si_s31():
    net = create_backbone("lenet5")
    assert isinstance(net, LeNet5)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
        (1, 6, (5, 5)),
        (6, 16, (5, 5)),
    ]
    assert sum(isinstance(m, nn.Tanh) for m in net.features) == 2
    assert sum(isinstance(m, nn.AvgPool2d) and m.kernel_size == 2 for m in net.features) == 2
    drops = [m for m in net.features if isinstance(m, nn.Dropout2d)]
    assert [d.p for d in drops] == [0.1, 0.1]
    lin = net.mlp[0]
    assert (lin.in_features, lin.out_features) == (16, 120)
    assert net.out_features == 120
    assert net.head.hidden == (84,) and net.head.activation == "tanh" and net.head.dropout == 0.1
    net.eval()
    x = torch.randn(3, 1, 28, 28)
    assert net.features(x).shape == (3, 16)  # the fixed 16-dim representation
    assert net(x).shape == (3, 120)


@pytest.mark.parametrize(
    ("name", "kw", "feat"),
    [
        ("resnet18", {"widths": (4, 8), "blocks": (1, 1), "dropout": 0.1}, 8),
        ("resnet18", {"widths": (4, 8), "blocks": (1, 1), "fc_features": 12}, 12),
        ("wrn28_10", {"depth": 10, "widen_factor": 1}, 64),
    ],
)
def test_tiny_residual_backbones(name, kw, feat):
    net = create_backbone(name, **kw)
    assert net.out_features == feat
    assert any(isinstance(m, nn.Dropout2d) for m in net.modules())  # spatial dropout in blocks
    assert any(isinstance(m, nn.BatchNorm1d) for m in net.fc)  # extra Linear+BN+ReLU+Dropout
    assert isinstance(net.fc[-1], nn.Dropout) and net.fc[-1].p == kw.get("dropout", 0.3)
    out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, feat)
    out.sum().backward()


def test_resnet18_full_size_and_wrn_depth_check():
    n = sum(p.numel() for p in create_backbone("resnet18").parameters())
    assert 11_000_000 < n < 12_000_000  # 11.2M conv trunk + 512x512 extra FC block
    with pytest.raises(ValueError, match="6n\\+4"):
        create_backbone("wrn28_10", depth=12)
