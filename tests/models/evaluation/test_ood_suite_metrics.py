"""Per-group OOD metrics (models/evaluation/ood_suite.py) on ensembles whose answer is known."""

from __future__ import annotations

import pytest
import torch

from models.evaluation.ood_suite import ood_suite_metrics


def _members(n: int, m: int, c: int, confident: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, m, c, generator=g) * 0.1
    if confident:
        logits[:, :, 0] += 12.0  # every member sure of class 0: accepted, VGMU near 0
    return logits.softmax(-1)


def test_flat_outliers_are_deferred_and_separated() -> None:
    p_id = _members(200, 5, 10, True, 0)
    groups = {
        "letters": (_members(50, 5, 10, False, 1), None),  # flat mean: deferred
        "photos": (_members(50, 5, 10, True, 2), None),  # confident: accepted
        "rotated_digits": (_members(50, 5, 10, False, 3), None),
    }
    m = ood_suite_metrics(p_id, None, groups, abstain_k=1.0)
    letters, photos = m["groups"]["letters"], m["groups"]["photos"]
    assert letters["abstain_rate"] == 1.0 and letters["meets_target"] is True
    assert letters["scores"]["vgmu"]["auroc"] == 1.0 and letters["scores"]["vgmu"]["fpr95"] == 0.0
    assert photos["abstain_rate"] == 0.0 and photos["meets_target"] is False
    assert photos["predicted"][0] == 50 and photos["target"] == 0.9
    assert m["groups"]["rotated_digits"]["target"] is None
    assert m["far"]["n"] == 100 and m["all"]["n"] == 150
    assert m["far"]["abstain_rate"] == pytest.approx(0.5)
