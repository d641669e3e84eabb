"""Outlier exposure in training (models/training/outliers.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.ensembles import EnsembleOutput
from models.training import TrainConfig, train
from models.training.outliers import uniform_cross_entropy


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
