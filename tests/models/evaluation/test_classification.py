"""Classification metrics against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.evaluation.classification import (
    accuracy,
    brier_score,
    classification_metrics,
    diversity,
    expected_calibration_error,
    macro_f1,
    negative_log_likelihood,
    reliability_bins,
)

# Four binary samples. Confidence = max prob; 15 bins of width 1/15, bin index ceil(15·conf) − 1:
#   [0.90, 0.10] y=0 → conf 0.90, correct, 15·0.90 = 13.5 → bin 13
#   [0.92, 0.08] y=1 → conf 0.92, wrong,   15·0.92 = 13.8 → bin 13
#   [0.62, 0.38] y=0 → conf 0.62, correct, 15·0.62 =  9.3 → bin 9
#   [0.30, 0.70] y=1 → conf 0.70, correct, 15·0.70 = 10.5 → bin 10
# bin 13: acc 1/2, conf (0.90 + 0.92)/2 = 0.91, |gap| 0.41, weight 2/4
# bin  9: acc 1,   conf 0.62, |gap| 0.38, weight 1/4
# bin 10: acc 1,   conf 0.70, |gap| 0.30, weight 1/4
# ECE = 0.5·0.41 + 0.25·0.38 + 0.25·0.30 = 0.205 + 0.095 + 0.075 = 0.375
PROBS = np.array([[0.90, 0.10], [0.92, 0.08], [0.62, 0.38], [0.30, 0.70]])
LABELS = np.array([0, 1, 0, 1])


def test_ece_hand_computed() -> None:
    assert expected_calibration_error(PROBS, LABELS) == pytest.approx(0.375, abs=1e-12)


def test_reliability_bins_hand_computed() -> None:
    bins = reliability_bins(PROBS, LABELS)
    assert bins.count.tolist() == [0] * 9 + [1, 1, 0, 0, 2, 0]
    assert bins.accuracy[13] == 0.5 and bins.confidence[13] == pytest.approx(0.91)
    assert np.isnan(bins.accuracy[0])  # empty bin


def test_accuracy_nll_brier_hand_computed() -> None:
    assert accuracy(PROBS, LABELS) == 0.75
    # NLL = −(ln 0.90 + ln 0.08 + ln 0.62 + ln 0.70)/4
    expected_nll = -(math.log(0.90) + math.log(0.08) + math.log(0.62) + math.log(0.70)) / 4
    assert negative_log_likelihood(PROBS, LABELS) == pytest.approx(expected_nll)
    # Brier: 0.1²+0.1² = 0.02; 0.92²·2 = 1.6928; 0.38²·2 = 0.2888; 0.3²·2 = 0.18 → 2.1816/4
    assert brier_score(PROBS, LABELS) == pytest.approx(2.1816 / 4)


def test_macro_f1_hand_computed() -> None:
    # predictions [0, 0, 0, 1] vs labels [0, 1, 0, 1]
    # class 0: tp 2, fp 1, fn 0 → P 2/3, R 1 → F1 0.8; class 1: tp 1, fp 0, fn 1 → F1 2/3
    assert macro_f1(PROBS, LABELS) == pytest.approx((0.8 + 2 / 3) / 2)


def test_perfectly_confident_and_correct_is_perfect() -> None:
    probs = np.eye(3)[[0, 1, 2, 1]]
    m = classification_metrics(probs, [0, 1, 2, 1])
    assert m == {
        "accuracy": 1.0,
        "macro_f1": 1.0,
        "ece": 0.0,
        "nll": pytest.approx(0.0),
        "brier": 0.0,
    }


def test_nll_is_finite_for_confidently_wrong_predictions() -> None:
    assert negative_log_likelihood(np.array([[1.0, 0.0]]), [1]) == pytest.approx(-math.log(1e-12))


def test_ece_is_zero_when_confidence_matches_accuracy() -> None:
    # 10 samples at confidence 0.7 (same bin), 7 of them correct
    probs = np.tile([0.7, 0.3], (10, 1))
    labels = np.array([0] * 7 + [1] * 3)
    assert expected_calibration_error(probs, labels) == pytest.approx(0.0, abs=1e-12)


def test_diversity_hand_computed_and_tensor_input() -> None:
    # Members [1, 0] and [0, 1]: unbiased variance per class ((0.5)² + (0.5)²)/1 = 0.5
    P = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    assert diversity(P) == pytest.approx(0.5)
    assert diversity(torch.full((4, 1, 3), 1 / 3)) == 0.0  # single member
    assert diversity(torch.full((4, 5, 3), 1 / 3)) == 0.0  # identical members


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        accuracy(np.ones(3), [0, 0, 0])
    with pytest.raises(ValueError, match="labels must lie"):
        accuracy(PROBS, [0, 1, 2, 0])
    with pytest.raises(ValueError, match="labels must be"):
        accuracy(PROBS, [0, 1])
