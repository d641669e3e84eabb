"""OOD AUROC / FPR@95 and the offline natural-image OOD set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.evaluation.ood import (
    BUNDLED_IMAGES,
    fpr_at_tpr,
    natural_image_patches,
    ood_auroc,
    ood_metrics,
)


def test_separable_scores_give_auroc_one_and_fpr_zero() -> None:
    id_s, ood_s = np.linspace(0, 0.4, 50), np.linspace(0.5, 1, 30)
    assert ood_auroc(id_s, ood_s) == 1.0
    assert fpr_at_tpr(id_s, ood_s) == 0.0
    assert ood_auroc(ood_s, id_s) == 0.0  # reversed detector
    assert fpr_at_tpr(ood_s, id_s) == 1.0


def test_auroc_and_fpr95_hand_computed() -> None:
    # ID [0.1, 0.2, 0.3, 0.6], OOD [0.4, 0.5, 0.7, 0.8].
    # Pairs (ood > id): 0.4 beats 3, 0.5 beats 3, 0.7 beats 4, 0.8 beats 4 → 14/16 = 0.875.
    # TPR ≥ 0.95 needs all 4 OOD flagged → threshold 0.4 → ID flagged: 0.6 → FPR 1/4.
    id_s, ood_s = [0.1, 0.2, 0.3, 0.6], [0.4, 0.5, 0.7, 0.8]
    assert ood_auroc(id_s, ood_s) == pytest.approx(0.875)
    assert fpr_at_tpr(id_s, ood_s) == pytest.approx(0.25)
    assert ood_metrics({"a": id_s, "b": id_s}, {"a": ood_s}) == {
        "a": {"auroc": pytest.approx(0.875), "fpr95": pytest.approx(0.25)}
    }


def test_identical_distributions_give_chance_auroc() -> None:
    s = np.arange(10.0)
    assert ood_auroc(s, s) == pytest.approx(0.5)


def test_patches_are_deterministic_uint8_in_the_requested_format() -> None:
    a = natural_image_patches(64, channels=1, size=28)
    b = natural_image_patches(64, channels=1, size=28)
    assert a.dtype == torch.uint8 and a.shape == (64, 1, 28, 28)
    assert torch.equal(a, b)
    assert not torch.equal(a, natural_image_patches(64, channels=1, size=28, seed=1))
    rgb = natural_image_patches(8, channels=3, size=(32, 24))
    assert rgb.shape == (8, 3, 32, 24)
    # natural images: patches differ from each other and are not blank
    flat = a.reshape(64, -1).float()
    assert flat.std(dim=1).mean() > 5 and torch.unique(flat, dim=0).shape[0] == 64


def test_patches_cycle_when_more_are_requested_than_the_pool_holds() -> None:
    big = natural_image_patches(2000, channels=1, size=8)
    assert big.shape[0] == 2000
    assert len(BUNDLED_IMAGES) >= 10


def test_patch_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="channels"):
        natural_image_patches(4, channels=2)
    with pytest.raises(ValueError, match="n must"):
        natural_image_patches(0)
