"""Outlier exposure in training (models/training/outliers.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.ensembles import EnsembleOutput
from models.training import TrainConfig, train
from models.training.outliers import OutlierExposure, overlay_pairs, uniform_cross_entropy


def test_uniform_cross_entropy_is_log_c_at_the_uniform_and_larger_elsewhere() -> None:
    flat = torch.full((4, 3, 10), 0.1)
    assert float(uniform_cross_entropy(EnsembleOutput(flat, flat), flat.log())) == pytest.approx(
        math.log(10)
    )
    sure = torch.softmax(torch.randn(4, 3, 10) * 5, -1)
    assert float(uniform_cross_entropy(EnsembleOutput(sure, None), sure.log())) > math.log(10)


def test_a_run_with_outlier_exposure_trains_and_records_it(tmp_path: Path) -> None:
    config = TrainConfig(
        name="tiny-oe",
        max_train_samples=128,
        epochs=1,
        members=2,
        batch_size=64,
        vgn=True,
        outlier_exposure=0.5,
        outlier_batch_size=16,
        outlier_pool=64,
        device="cpu",
    )
    out = train(config, tmp_path / "m")
    card = json.loads((out / "model_card.json").read_text())
    assert card["training"]["config"]["outlier_exposure"] == 0.5
    assert set(card["metrics"]["evaluation"]["ood_suite"]["groups"]) >= {"letters", "noise"}


def test_outlier_exposure_refuses_images_it_cannot_match() -> None:
    from models.data import DataBundle
    from models.training.outliers import OutlierExposure

    bundle = DataBundle("x", None, None, None, ["a", "b"], 3, (32, 32), (0.5,) * 3, (0.2,) * 3, "")
    with pytest.raises(ValueError, match="1-channel 28x28"):
        OutlierExposure.for_run(TrainConfig(outlier_exposure=0.5), bundle)


def test_outliers_never_touch_batchnorm_statistics() -> None:
    """With outliers appended, the digits' outputs and the running statistics are exactly those
    of a pass over the digits alone (BatchNorm normalises by, and tracks, the digits only)."""
    import copy

    from models.training.outliers import _digit_batchnorm

    torch.manual_seed(0)
    net = TrainConfig(backbone="cnn4", members=2, vgn=True).build(10, 1).train()
    for m in net.modules():  # dropout off, so the two passes are comparable
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    twin = copy.deepcopy(net)
    x, noise = torch.randn(8, 1, 28, 28), torch.rand(5, 1, 28, 28) * 9
    with _digit_batchnorm(net, 8):
        mixed = net(torch.cat([x, noise]))
    alone = twin(x)
    torch.testing.assert_close(mixed.q[:8], alone.q, rtol=1e-4, atol=1e-6)
    for (name, a), (_, b) in zip(net.named_buffers(), twin.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert all(m.momentum == 0.1 for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_batchnorm_recalibration_sets_the_population_statistics() -> None:
    from torch.utils.data import TensorDataset

    from models.training.outliers import recalibrate_batchnorm

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)).train()
    x = torch.randn(320, 1, 4, 4) * 3 + 1
    recalibrate_batchnorm(net, TensorDataset(x, torch.zeros(320)), batch_size=64)
    feats = net[0](x).detach()
    bn = net[1]
    torch.testing.assert_close(bn.running_mean, feats.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        bn.running_var, feats.var((0, 2, 3), unbiased=True), rtol=5e-2, atol=1e-3
    )
    assert bn.momentum == 0.1 and int(bn.num_batches_tracked) == 0 and net.training


def _exposure(targets: str, overlays: int = 0) -> OutlierExposure:
    """6 outliers a batch: ``overlays`` of them overlaid from 4 one-bar 'digits' of classes
    3, 7, 1 and 2, the rest from a pool of 8 blank images with fixed offsets 0..7."""
    digits = torch.zeros(4, 28, 28, dtype=torch.uint8)
    for k in range(4):
        digits[k, 4 + 6 * k, 5:20] = 255
    return OutlierExposure(
        torch.zeros(8, 1, 28, 28),
        6,
        1.0,
        torch.Generator().manual_seed(0),
        None,
        targets,
        digits if overlays else None,
        torch.tensor([3, 7, 1, 2]) if overlays else None,
        overlays,
        pool_offsets=torch.arange(8),
    )


def test_disagreeing_members_spread_over_every_class_and_split_an_overlay_between_its_two() -> None:
    """outlier_targets=disagree: on a generated outlier the M = C members are asked for C
    different classes, from the image's fixed offset (a flat mean, and a target each member can
    learn); on an overlay of classes a < b the even members are asked for a, the odd for b."""
    oe = _exposure("disagree", overlays=2)
    x = oe.batch(torch.device("cpu"))
    assert x.shape == (6, 1, 28, 28)
    assert bool((x[:2] > 0).flatten(1).any(1).all()) and bool((x[2:] == 0).all())
    pair = oe.last_overlay_classes
    offsets = oe.last_offsets
    t = oe.member_targets(6, 10, 10)
    for row, r in zip(t[2:], offsets, strict=True):
        assert row.tolist() == [(int(r) + m) % 10 for m in range(10)]  # one member per class
    for row, (a, b) in zip(t[:2], pair.tolist(), strict=True):
        assert a != b
        assert row[0::2].tolist() == [min(a, b)] * 5 and row[1::2].tolist() == [max(a, b)] * 5
    again = oe.member_targets(6, 10, 10)  # the same batch: the same targets (nothing drawn)
    assert torch.equal(again, t)


def test_the_disagree_loss_is_the_members_cross_entropy_to_their_own_targets() -> None:
    """E_{i,m}[-log r_{i,m,t_im}], hand-checked: members that each put 0.9 on their own target
    score -log 0.9; the same members all agreeing on one class score far worse."""
    oe = _exposure("disagree")
    oe.batch(torch.device("cpu"))
    t = oe.member_targets(6, 10, 10)
    own = torch.full((6, 10, 10), 0.1 / 9).scatter_(2, t.unsqueeze(-1), 0.9)
    loss = oe.outlier_loss(EnsembleOutput(own, own), own.log())
    assert float(loss) == pytest.approx(-math.log(0.9), rel=1e-6)
    agree = torch.full((6, 10, 10), 0.1 / 9)
    agree[..., 0] = 0.9
    assert float(oe.outlier_loss(EnsembleOutput(agree, agree), agree.log())) > 3.0


def test_uniform_targets_ask_an_overlay_for_half_of_each_of_its_classes() -> None:
    """outlier_targets=uniform with overlays: generated outliers score the uniform cross-entropy,
    an overlay −½(log r̄_a + log r̄_b); hand-computed on a flat answer: log 10 for every row."""
    oe = _exposure("uniform", overlays=2)
    oe.batch(torch.device("cpu"))
    flat = torch.full((6, 3, 10), 0.1)
    assert float(oe.outlier_loss(EnsembleOutput(flat, flat), flat.log())) == pytest.approx(
        math.log(10)
    )


def test_overlay_pairs_are_two_digits_of_different_classes() -> None:
    digits = torch.zeros(20, 28, 28, dtype=torch.uint8)
    labels = torch.arange(20) % 4
    for k in range(20):
        digits[k, 4 + 6 * (k % 4), 5:20] = 50 + k  # a bar per class, rows 6 apart
    ov, pairs = overlay_pairs(digits, labels, 200, torch.Generator().manual_seed(1))
    assert ov.shape == (200, 28, 28) and bool((pairs[:, 0] != pairs[:, 1]).all())
    # both bars drawn whole: a shift of at most 2 px never lays one class's row on another's
    assert bool(((ov > 0).flatten(1).sum(1) == 30).all())
    with pytest.raises(ValueError, match="two classes"):
        overlay_pairs(digits, torch.zeros(20, dtype=torch.long), 4, torch.Generator())


def test_a_calibration_split_is_carved_from_train_stratified_and_calibrates_with_val(
    tmp_path: Path,
) -> None:
    """calibration_split: that share of the training digits, stratified and disjoint from what
    trains, joins the validation split in calibrating abstain_k (the card's n_samples)."""
    from models.data import load_dataset
    from models.training.data import carve_calibration

    bundle = load_dataset("mnist-bundled")
    carved = carve_calibration(bundle, 0.125)
    assert len(carved.calib) == 700 and len(carved.train) == 4900 and carved.val is bundle.val
    assert not set(carved.calib.indices) & set(carved.train.indices)
    counts = torch.bincount(torch.stack([bundle.train[i][1] for i in carved.calib.indices]))
    assert int(counts.min()) >= 60 and int(counts.max()) <= 80  # ~70 per class
    config = TrainConfig(
        name="tiny-doe",
        max_train_samples=256,
        epochs=1,
        members=10,
        batch_size=64,
        vgn=True,
        outlier_exposure=1.0,
        outlier_batch_size=16,
        outlier_pool=64,
        outlier_targets="disagree",
        outlier_overlays=0.25,
        outlier_prepare=True,
        outlier_set=2,
        calibration_split=0.25,
        device="cpu",
    )
    card = json.loads((train(config, tmp_path / "m") / "model_card.json").read_text())
    assert card["abstain_calibration"]["n_samples"] == 800 + 64  # val + a quarter of 256


def test_outlier_set_version_2_adds_computer_modern_letters_and_keeps_version_1() -> None:
    """Version 2 of the generated set adds Latin letters in the Computer Modern faces (drawn,
    with ink); version 1 is what it was (models trained on it reproduce); others are refused."""
    from models.data_ood.outliers import (
        OUTLIER_CM_FONTS,
        OUTLIER_FAMILIES_V2,
        outlier_exposure_set,
    )
    from models.data_ood.suite import SUITE_FONTS

    assert not set(OUTLIER_CM_FONTS) & set(SUITE_FONTS)
    v1, fam1 = outlier_exposure_set(200, seed=3)
    v1_again, _ = outlier_exposure_set(200, seed=3, version=1)
    assert (v1 == v1_again).all() and fam1.max() == 7
    v2, fam2 = outlier_exposure_set(200, seed=3, version=2)
    cm = v2[fam2 == list(OUTLIER_FAMILIES_V2).index("cm_letters")]
    assert len(cm) == 26  # floor(200 · 0.15 / 1.15)
    assert int((cm.reshape(len(cm), -1) > 128).sum(1).min()) > 20
    with pytest.raises(ValueError, match="version must be 1, 2 or 3"):
        outlier_exposure_set(10, version=4)


def test_outlier_set_version_3_adds_pillows_sans_letters_and_keeps_version_2() -> None:
    """Version 3 adds Latin letters in Pillow's built-in Aileron (not a suite face); version 2's
    families keep their bytes (each family draws from its own seed)."""
    from models.data_ood import render
    from models.data_ood.outliers import OUTLIER_FAMILIES_V3, outlier_exposure_set
    from models.data_ood.suite import SUITE_FONTS

    assert render.PILLOW_FONT not in SUITE_FONTS
    assert render._font(render.PILLOW_FONT, 64).getname()[0] == "Aileron"
    v2, fam2 = outlier_exposure_set(300, seed=3, version=2)
    v3, fam3 = outlier_exposure_set(300, seed=3, version=3)
    sans = v3[fam3 == list(OUTLIER_FAMILIES_V3).index("sans_letters")]
    assert len(sans) == 34  # floor(300 · 0.15 / 1.30)
    assert int((sans.reshape(len(sans), -1) > 128).sum(1).min()) > 20  # drawn, with ink
    cm = list(OUTLIER_FAMILIES_V3).index("cm_letters")
    assert (v3[fam3 == cm][:20] == v2[fam2 == cm][:20]).all()  # same draws, fewer of them


def test_augment_read_draws_digits_as_photos_and_reads_them_back_as_served() -> None:
    """augment_read: that share of a batch is drawn as a photo or scan and read back by the
    served reading; the rest is only the affine augmentation. The pictures are uint8 pages at
    least as large as the digit; the reading brings (most of) them back to a 28×28 digit."""
    from models.data import load_dataset
    from models.prepare import Finding, canonicalise
    from models.training.step import Augmenter, photographed

    g = torch.Generator().manual_seed(0)
    digits = torch.from_numpy(__import__("models.data").data.load_bundled_mnist()[0][:40])
    pages = [photographed(d, g) for d in digits]
    assert all(p.dtype == torch.uint8 and p.shape[0] >= 28 and p.shape[1] >= 28 for p in pages)
    # 81 % of 400 are read as a digit; the rest (blur and noise read as texture, a faint one as
    # blank) keep their digit as it was
    assert sum(canonicalise(p).finding == Finding.ok for p in pages) >= 26
    assert any(p.shape[0] > 28 for p in pages) and any(float(p.float().mean()) > 128 for p in pages)

    bundle = load_dataset("mnist-bundled", max_train_samples=64)
    x = torch.stack([bundle.train[i][0] for i in range(32)])
    config = TrainConfig(augment=True, augment_read=0.25, seed=3)
    plain = Augmenter.for_run(TrainConfig(augment=True, seed=3), bundle, 0)(x)
    read = Augmenter.for_run(config, bundle, 0)(x)
    changed = (read != plain).flatten(1).any(1)
    assert int(changed.sum()) == 8  # a quarter of 32, the same affine draws before it
    with pytest.raises(ValueError, match="set augment"):
        TrainConfig(augment_read=0.5)


def test_both_training_steps_pass_the_repulsion_weight_on_to_the_digits() -> None:
    """With weight λ each step's loss is its loss without, minus λ x the members' variance of
    the digits' p (dropout off; the outliers are not repelled): the plain step (two equal twins,
    the loss read before their step) and outlier exposure's (two equal exposures draw the same
    batch; BatchNorm normalises by the digits alone, so their p is that of the digits' pass)."""
    import copy

    from models.training import member_variance
    from models.training.step import Optimisation, train_step

    torch.manual_seed(0)
    net = TrainConfig(backbone="cnn4", members=3, vgn=True).build(10, 1).train()
    for m in net.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x, y = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    with torch.no_grad():
        variance = float(member_variance(net(x).p))
        plain = float(_exposure("disagree").loss(net, x, y, "mixture"))
        repelled = float(_exposure("disagree").loss(net, x, y, "mixture", 0.7))
    assert variance > 0
    assert plain - repelled == pytest.approx(0.7 * variance, rel=1e-4)
    step_losses = []
    for weight in (0.0, 0.7):
        twin = copy.deepcopy(net)
        opt = Optimisation(torch.optim.SGD(twin.parameters(), lr=0.0))
        cpu = torch.device("cpu")
        step_losses.append(float(train_step(twin, x, y, opt, "mixture", cpu, None, None, weight)))
    assert step_losses[0] - step_losses[1] == pytest.approx(0.7 * variance, rel=1e-4)
