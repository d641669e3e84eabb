"""models.nets.fold: BatchNorm folded into the layer before it answers what the unfolded module
answers, and only foldable pairs are touched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.checkpoint import load_checkpoint
from models.nets import create_backbone
from models.nets.fold import fold_batchnorm
from models.predictor import Predictor
from models.zoo import default_model_dir

torch.set_num_threads(1)


def _randomise_statistics(module: nn.Module, seed: int = 0) -> None:
    """Non-trivial running statistics and affine parameters (fresh ones fold to the identity)."""
    gen = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen))
            m.running_var.copy_(torch.rand(n, generator=gen) * 3 + 0.1)
            m.weight.data.copy_(torch.randn(n, generator=gen))
            m.bias.data.copy_(torch.randn(n, generator=gen))


def test_cnn4_folds_all_five_and_answers_the_same() -> None:
    torch.manual_seed(0)
    net = create_backbone("cnn4").eval()
    _randomise_statistics(net)
    ref = copy.deepcopy(net)
    assert fold_batchnorm(net) == 5  # four Conv2d+BatchNorm2d, one Linear+BatchNorm1d
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    x = torch.randn(6, 1, 28, 28)
    with torch.inference_mode():
        torch.testing.assert_close(net(x), ref(x), rtol=1e-4, atol=1e-5)


def test_one_conv_folds_to_the_hand_computed_weights() -> None:
    conv = nn.Conv2d(1, 2, 1, bias=True)
    bn = nn.BatchNorm2d(2, eps=0.0)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[[[2.0]]], [[[3.0]]]]))
        conv.bias.copy_(torch.tensor([1.0, -1.0]))
        bn.running_mean.copy_(torch.tensor([1.0, 2.0]))
        bn.running_var.copy_(torch.tensor([4.0, 1.0]))
        bn.weight.copy_(torch.tensor([0.5, 2.0]))
        bn.bias.copy_(torch.tensor([0.0, 1.0]))
    seq = nn.Sequential(conv, bn).eval()
    assert fold_batchnorm(seq) == 1
    assert isinstance(seq[1], nn.Identity)
    # W' = W γ/σ, b' = (b − μ) γ/σ + β with σ = √(σ² + ε): (2·0.5/2, 3·2/1), ((1−1)·0.25+0, (−1−2)·2+1)
    torch.testing.assert_close(seq[0].weight.flatten(), torch.tensor([0.5, 6.0]))
    torch.testing.assert_close(seq[0].bias, torch.tensor([0.0, -5.0]))


def test_pairs_that_do_not_fold_are_left_alone() -> None:
    seq = nn.Sequential(
        nn.ReLU(),
        nn.BatchNorm2d(3),  # after no layer
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(5),  # wrong width (a model that would fail anyway)
        nn.Linear(4, 4),
        nn.BatchNorm2d(4),  # wrong kind for a linear layer
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4, track_running_stats=False),  # batch statistics: not an affine map
    ).eval()
    before = [type(m) for m in seq]
    assert fold_batchnorm(seq) == 0
    assert [type(m) for m in seq] == before


def test_training_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="eval mode"):
        fold_batchnorm(create_backbone("cnn4"))


def test_the_served_default_model_is_folded_and_answers_like_the_checkpoint() -> None:
    d = default_model_dir()
    predictor = Predictor.from_dir(d, device="cpu")
    assert not any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in predictor.module.modules()
    )
    unfolded, _ = load_checkpoint(d, torch.device("cpu"))
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, ref = predictor.module(x), unfolded.eval()(x)
    torch.testing.assert_close(ours.p, ref.p, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours.q, ref.q, rtol=1e-4, atol=1e-6)
