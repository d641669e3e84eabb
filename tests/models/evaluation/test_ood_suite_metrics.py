"""Per-group OOD metrics (models/evaluation/ood_suite.py) on ensembles whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.evaluation.ood_suite import deferred_or_right, ood_suite_metrics
from models.evaluation.scores import max_prob_score


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
    assert photos["predicted"][0] == 50 and photos["target"] == 0.98
    assert m["groups"]["rotated_digits"]["target"] is None
    assert m["groups"]["rotated_digits"]["target_kind"] is None
    assert letters["target_kind"] == "abstain" and letters["deferred_or_right"] is None
    assert m["far"]["n"] == 100 and m["all"]["n"] == 150
    assert m["far"]["abstain_rate"] == pytest.approx(0.5)


def _sure(classes: list[int], c: int = 10, m: int = 3) -> torch.Tensor:
    """Members all certain of ``classes[i]`` (accepted at any k)."""
    logits = torch.zeros(len(classes), m, c)
    logits[torch.arange(len(classes)), :, torch.tensor(classes)] = 12.0
    return logits.softmax(-1)


def test_deferred_or_right_by_hand() -> None:
    abstain = np.array([True, False, False, False])
    pred = np.array([3, 4, 5, 6])
    assert deferred_or_right(abstain, pred, np.array([0, 4, 0, 6])) == 0.75
    with pytest.raises(ValueError, match="labels must be"):
        deferred_or_right(abstain, pred, np.zeros((4, 2), int))


def test_shrunk_digits_target_is_deferred_or_right_with_no_digit_images_deferred() -> None:
    p_id = _members(100, 3, 10, True, 0)
    # 10 shrunk digits, each answered (confident): 6 right, 2 wrong, 2 wrong but the reading
    # found no digit there (served: abstain)
    answered = [1, 2, 3, 4, 5, 6, 7, 7, 9, 9]
    truth = np.array([1, 2, 3, 4, 5, 6, 0, 0, 0, 0])
    no_digit = np.array([False] * 8 + [True, True])
    groups = {
        "shrunk_digits": (_sure(answered), None),
        "overlaid_digits": (_sure([0] * 4), None),
        "rotated_digits": (_sure([0, 1]), None),
    }
    labels = {
        "shrunk_digits": truth,
        "overlaid_digits": np.array([[0, 1]] * 4),
        "rotated_digits": np.array([0, 2]),
    }
    m = ood_suite_metrics(p_id, None, groups, 1.0, {"shrunk_digits": no_digit}, labels)
    shrunk = m["groups"]["shrunk_digits"]
    assert shrunk["abstain_rate"] == pytest.approx(0.2) and shrunk["no_digit"] == 2
    assert shrunk["deferred_or_right"] == pytest.approx(0.8)
    assert shrunk["target"] == 0.98 and shrunk["target_kind"] == "deferred_or_right"
    assert shrunk["meets_target"] is False
    overlaid = m["groups"]["overlaid_digits"]  # two classes: no deferred-or-right, abstain target
    assert overlaid["deferred_or_right"] is None and overlaid["target_kind"] == "abstain"
    assert overlaid["target"] == 0.80 and overlaid["meets_target"] is False
    rotated = m["groups"]["rotated_digits"]  # reported, no target
    assert rotated["deferred_or_right"] == 0.5 and rotated["meets_target"] is None
    # all right: meets the target; without labels the target cannot be judged
    two = {"shrunk_digits": (_sure([1, 2]), None)}
    m = ood_suite_metrics(p_id, None, two, 1.0, None, {"shrunk_digits": np.array([1, 2])})
    assert m["groups"]["shrunk_digits"]["meets_target"] is True
    m = ood_suite_metrics(p_id, None, two, 1.0)
    g = m["groups"]["shrunk_digits"]
    assert g["deferred_or_right"] is None and g["meets_target"] is None
    assert "max_prob" in g["scores"]


def test_max_prob_is_one_minus_the_served_means_top_class() -> None:
    p = torch.tensor([[[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]], [[0.1, 0.1, 0.8], [0.2, 0.2, 0.6]]])
    q = torch.tensor([[[0.2, 0.7, 0.1], [0.4, 0.4, 0.2]], [[0.3, 0.3, 0.4], [0.3, 0.3, 0.4]]])
    # p̄ = [0.6, 0.25, 0.15], [0.15, 0.15, 0.7]; q̄ = [0.3, 0.55, 0.15], [0.3, 0.3, 0.4]
    assert max_prob_score(p).tolist() == pytest.approx([0.4, 0.3])
    assert max_prob_score(p, q).tolist() == pytest.approx([0.45, 0.6])  # VGN: served from q̄


class _Members(torch.nn.Module):
    """Three linear members over the pixels: ``(N, 1, 28, 28)`` -> ``.p`` ``(N, 3, 10)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(28 * 28, 3 * 10)

    def forward(self, x: torch.Tensor):  # noqa: ANN201 (an object with .p and .q, as Ensemble's)
        from types import SimpleNamespace

        p = self.linear(x.flatten(1)).view(-1, 3, 10).softmax(-1)
        return SimpleNamespace(p=p, q=None)


def test_the_cards_suite_has_the_configured_size_and_none_for_zero() -> None:
    """``TrainConfig.ood_suite_per_group`` reaches the card: that many images a group, 0 none;
    the model is put back in training mode either way."""
    from models.evaluation.ood_suite import card_ood_suite

    torch.manual_seed(0)
    model = _Members().train()
    p_id = _members(40, 3, 10, True, 0)
    card = card_ood_suite(model, (0.13,), (0.31,), (28, 28), p_id, None, 1.0, n_per_group=6)
    assert card is not None and model.training
    assert {g["n"] for g in card["groups"].values()} == {6}
    assert card["all"]["n"] == 6 * len(card["groups"])
    assert card_ood_suite(model, (0.13,), (0.31,), (28, 28), p_id, None, 1.0, n_per_group=0) is None
    assert card_ood_suite(model, (0.5,) * 3, (0.2,) * 3, (28, 28), p_id, None, 1.0) is None
