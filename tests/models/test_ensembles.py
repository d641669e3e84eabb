"""Ensembles: DE (vectorised), LLE (fused heads), MCD, MCD-LLE; VGN only for DE/LLE."""

from __future__ import annotations

import pytest
import torch

from models.ensembles import (
    BatchedHeads,
    DeepEnsemble,
    EnsembleOutput,
    LastLayerEnsemble,
    MCDropoutEnsemble,
    build_ensemble,
)
from models.nets import HeadSpec

torch.set_num_threads(1)
TINY_RES = {"widths": (4, 8), "blocks": (1, 1)}


def _x(n=4):
    torch.manual_seed(1)
    return torch.randn(n, 1, 28, 28)


@pytest.mark.parametrize(
    ("kind", "vgn", "m_eval"),
    [
        ("de", True, 3),
        ("de", False, 3),
        ("lle", True, 3),
        ("lle", False, 3),
        ("mcd", False, 3),
        ("mcd-lle", False, 6),
    ],
)
def test_output_contract(kind, vgn, m_eval):
    torch.manual_seed(0)
    model = build_ensemble(kind, "lenet5", 10, 3, vgn, 1, mc_samples=2).eval()
    out = model(_x())
    assert isinstance(out, EnsembleOutput)
    assert out.p.shape == (4, m_eval, 10)
    torch.testing.assert_close(out.p.sum(-1), torch.ones(4, m_eval))
    if vgn:
        assert out.q is not None and out.q.shape == out.p.shape
        torch.testing.assert_close(out.q.sum(-1), torch.ones(4, m_eval))
        assert not torch.allclose(out.q, out.p)
    else:
        assert out.q is None


@pytest.mark.parametrize("kind", ["mcd", "mcd-lle", "MCD_LLE"])
def test_vgn_refused_for_mc_dropout(kind):
    with pytest.raises(ValueError, match="Table 2"):
        build_ensemble(kind, "lenet5", 10, 3, vgn=True)


def test_unknown_kind_and_bad_members():
    with pytest.raises(ValueError, match="unknown ensemble kind"):
        build_ensemble("bagging", "lenet5", 10, 3)
    with pytest.raises(ValueError, match="members"):
        build_ensemble("lle", "lenet5", 10, 0)


def test_de_vectorised_equals_sequential_and_members_differ():
    torch.manual_seed(0)
    de = build_ensemble("de", "resnet18", 5, 3, in_channels=1, backbone_kwargs=TINY_RES).eval()
    assert isinstance(de, DeepEnsemble)
    x = _x()
    vec = de.member_logits(x)
    seq = de.forward_sequential(x)
    torch.testing.assert_close(vec, seq, rtol=1e-5, atol=1e-5)
    assert (vec[:, 0] - vec[:, 1]).abs().max() > 1e-3  # independent initialisations


def test_de_batchnorm_statistics_are_per_member():
    torch.manual_seed(0)
    de = build_ensemble("de", "resnet18", 5, 3, in_channels=1, backbone_kwargs=TINY_RES)
    name = "buf__backbone__stem__1__running_mean"
    before = getattr(de, name).clone()  # (M, C)
    assert before.shape[0] == 3
    de.train()
    de(_x(8) + 2.0)
    after = getattr(de, name)
    assert (after - before).abs().sum() > 0  # updated in place through vmap
    assert not torch.allclose(after[0], after[1])  # each member's own statistics
    de.eval()
    snapshot = after.clone()
    de(_x())
    torch.testing.assert_close(getattr(de, name), snapshot)  # eval leaves stats alone


def test_de_dropout_masks_differ_per_member_in_training():
    torch.manual_seed(0)
    de = build_ensemble("de", "lenet5", 10, 2)
    # give both members identical weights: differences can then only come from dropout
    for p in de.params.values():
        p.data[1] = p.data[0]
    de.train()
    lp = de.member_log_probs(_x())
    assert not torch.allclose(lp[:, 0], lp[:, 1])
    de.eval()
    lp = de.member_log_probs(_x())
    torch.testing.assert_close(lp[:, 0], lp[:, 1])


def test_batched_heads_equal_loop_of_linear_layers():
    torch.manual_seed(0)
    heads = BatchedHeads(5, 12, 4, HeadSpec(hidden=(7,), activation="tanh", dropout=0.0))
    f = torch.randn(3, 12)
    out = heads(f)  # (B, M, C)
    for m in range(5):
        h = torch.tanh(f @ heads.weights[0][m] + heads.biases[0][m])
        ref = h @ heads.weights[1][m] + heads.biases[1][m]
        torch.testing.assert_close(out[:, m], ref)
    assert not torch.allclose(heads.weights[0][0], heads.weights[0][1])


def test_subspace_heads_each_read_their_own_features():
    """HeadSpec.subspace: member m's logits depend on its own fixed half of the features only."""
    torch.manual_seed(0)
    heads = BatchedHeads(4, 12, 3, HeadSpec(subspace=0.5))
    mask = heads.feature_mask[..., 0].bool()  # (M, F)
    assert mask.sum(1).tolist() == [6, 6, 6, 6] and len({tuple(r.tolist()) for r in mask}) == 4
    f = torch.randn(5, 12)
    out = heads(f)
    for m in range(4):
        moved = f.clone()
        moved[:, ~mask[m]] += 10.0  # what member m does not read
        torch.testing.assert_close(heads(moved)[:, m], out[:, m])
        ref = f[:, mask[m]] @ heads.weights[0][m][mask[m]] + heads.biases[0][m]
        torch.testing.assert_close(out[:, m], ref)
    assert "feature_mask" in dict(heads.named_buffers())  # saved with the weights
    assert "feature_mask" not in dict(BatchedHeads(4, 12, 3, HeadSpec()).named_buffers())
    with pytest.raises(ValueError, match="subspace must be in"):
        BatchedHeads(4, 12, 3, HeadSpec(subspace=0.0))


def test_grouped_heads_read_only_their_own_block():
    """HeadSpec.groups: member m reads block m mod groups of the features and nothing else; with
    subspace < 1, a random share of that block."""
    torch.manual_seed(0)
    heads = BatchedHeads(6, 12, 3, HeadSpec(groups=3))
    mask = heads.feature_mask[..., 0].bool()  # (M, F)
    for m in range(6):
        assert mask[m].nonzero().flatten().tolist() == list(range(4 * (m % 3), 4 * (m % 3) + 4))
    halves = BatchedHeads(4, 12, 3, HeadSpec(groups=2, subspace=0.5)).feature_mask[..., 0].bool()
    assert halves.sum(1).tolist() == [3, 3, 3, 3]
    assert not halves[0, 6:].any() and not halves[1, :6].any() and not halves[2, 6:].any()
    with pytest.raises(ValueError, match="do not split into 5 groups"):
        BatchedHeads(4, 12, 3, HeadSpec(groups=5))


def test_branched_cnn4_members_see_only_their_own_tower():
    """CNN4(branches=2): the first block is shared, member m's answer depends on tower m mod 2
    only (its convolutions, its feature layer), and the served fold answers the same."""
    from models.nets import create_backbone
    from models.nets.fold import fold_batchnorm

    torch.manual_seed(0)
    model = LastLayerEnsemble(create_backbone("cnn4", hidden=16, branches=2, branch_width=8), 10, 4)
    model.eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        before = model.member_log_probs(x)
        # the second block's grouped convolution: output channels 8..15 are tower 1
        model.backbone.features[1][3].weight[8:] += 1.0
        after = model.member_log_probs(x)
    torch.testing.assert_close(after[:, 0::2], before[:, 0::2])  # even members: tower 0
    assert (after[:, 1::2] - before[:, 1::2]).abs().max() > 1e-3
    with torch.no_grad():
        unfolded = model(x).q
        assert fold_batchnorm(model) == 5  # four convolutions and the grouped feature layer
        torch.testing.assert_close(model(x).q, unfolded, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of branches"):
        create_backbone("cnn4", hidden=15, branches=2)


def test_cnn4_towers_without_a_shared_stem_are_a_deep_ensemble():
    """shared_stem=False: every convolution after the image is grouped, so moving any weight of
    tower 1 (here its first block's second convolution) leaves tower 0's members unchanged; the
    fold still answers the same, and a width the towers cannot split is refused."""
    from models.nets import create_backbone
    from models.nets.fold import fold_batchnorm

    torch.manual_seed(0)
    net = create_backbone("cnn4", width=8, hidden=16, branches=2, branch_width=8, shared_stem=False)
    model = LastLayerEnsemble(net, 10, 4)
    model.eval()
    x = torch.randn(3, 1, 28, 28)
    convs = [m for m in net.features.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.groups for c in convs] == [1, 2, 2, 2]  # the image is read by every tower
    with torch.no_grad():
        before = model.member_log_probs(x)
        net.features[0][3].weight[4:] += 1.0  # first block, second convolution: tower 1
        after = model.member_log_probs(x)
        torch.testing.assert_close(after[:, 0::2], before[:, 0::2])
        assert (after[:, 1::2] - before[:, 1::2]).abs().max() > 1e-3
        unfolded = model(x).q
        assert fold_batchnorm(model) == 5
        torch.testing.assert_close(model(x).q, unfolded, atol=1e-6, rtol=1e-5)
    shared = create_backbone("cnn4", width=8, hidden=16, branches=2, branch_width=8)
    assert [m.groups for m in shared.features.modules() if isinstance(m, torch.nn.Conv2d)] == [
        1,
        1,
        1,
        2,
    ]
    with pytest.raises(ValueError, match="shared_stem"):
        create_backbone("cnn4", width=9, hidden=16, branches=2, shared_stem=False)
    with pytest.raises(ValueError, match="needs branches > 1"):
        create_backbone("cnn4", shared_stem=False)


def test_lle_shares_backbone_and_scales_to_100_heads():
    torch.manual_seed(0)
    lle = build_ensemble("lle", "lenet5", 10, 100, vgn=True).eval()
    assert isinstance(lle, LastLayerEnsemble)
    calls = []
    lle.backbone.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape))
    out = lle(_x())
    assert out.p.shape == (4, 100, 10) and out.q.shape == (4, 100, 10)
    assert calls == [torch.Size([4, 1, 28, 28])]  # one backbone pass for all heads


def test_vgn_k_is_learned_through_the_ensemble():
    torch.manual_seed(0)
    lle = build_ensemble("lle", "lenet5", 10, 4, vgn=True)
    out = lle(_x())
    loss = -torch.log(out.q.mean(1)[:, 3]).mean()
    loss.backward()
    assert lle.vgn.k_logit.grad is not None and lle.vgn.k_logit.grad.abs().sum() > 0
    fixed = build_ensemble("lle", "lenet5", 10, 4, vgn=True, k=0.5)
    torch.testing.assert_close(fixed.vgn.k, torch.full((10,), 0.5))


def test_mcd_is_stochastic_at_inference_with_batchnorm_frozen():
    torch.manual_seed(0)
    mcd = build_ensemble(
        "mcd", "resnet18", 5, 4, in_channels=1, backbone_kwargs={**TINY_RES, "dropout": 0.3}
    )
    assert isinstance(mcd, MCDropoutEnsemble)
    mcd.train()
    assert mcd(_x()).p.shape == (4, 1, 5)  # one stochastic pass while training
    mcd.eval()
    bn = mcd.backbone.stem[1]
    stats = bn.running_mean.clone()
    x = _x()
    p1, p2 = mcd(x).p, mcd(x).p
    assert p1.shape == (4, 4, 5)
    assert not torch.allclose(p1[:, 0], p1[:, 1])  # samples differ: dropout active
    assert not torch.allclose(p1, p2)
    torch.testing.assert_close(bn.running_mean, stats)  # BN in eval mode
    assert not bn.training


def test_mcd_lle_reuses_features_across_heads():
    torch.manual_seed(0)
    model = build_ensemble("mcd-lle", "lenet5", 10, 3, mc_samples=4).eval()
    calls = []
    model.backbone.register_forward_hook(lambda mod, inp, out: calls.append(out.detach()))
    out = model(_x(2))
    assert out.p.shape == (2, 12, 10) and model.members == 12
    assert len(calls) == 1 and calls[0].shape == (8, 120)  # S*B rows: one pass per sample
    feats = calls[0].view(4, 2, 120)
    assert not torch.allclose(feats[0], feats[1])  # different dropout masks per sample
    # members are sample-major: heads 0..H-1 of sample 0 first; recompute sample 0 head 0
    heads = model.heads
    torch.manual_seed(123)
    model.heads.dropout.p = 0.0  # make the head deterministic for the check
    model.backbone.register_forward_hook(lambda mod, inp, o: feats[0].repeat(4, 1))
    out2 = model(_x(2))
    ref = torch.softmax(heads(feats[0]), -1)  # (B, H, C)
    torch.testing.assert_close(out2.p[:, :3], ref)


def test_every_ensemble_keeps_the_typed_contract() -> None:
    """DE, LLE, MCD, MCD-LLE: one base class, one forward, the same output type and log-probs."""
    from models.ensembles import Ensemble, EnsembleOutput, build_ensemble

    x = torch.randn(3, 1, 28, 28)
    for kind, vgn in (("de", True), ("lle", True), ("mcd", False), ("mcd-lle", False)):
        net = build_ensemble(kind, "lenet5", num_classes=10, members=2, vgn=vgn).eval()
        assert isinstance(net, Ensemble) and net.kind == kind and (net.vgn is not None) == vgn
        out, log_p = net(x, return_log_p=True)
        assert isinstance(out, EnsembleOutput) and out.p.shape == (3, net.members, 10)
        torch.testing.assert_close(out.p, log_p.exp())
        assert (out.q is not None) == vgn
