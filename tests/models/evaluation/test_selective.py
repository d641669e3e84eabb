"""Risk–coverage, AURC, E-AURC, coverage at a target risk."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.evaluation.selective import (
    aurc,
    coverage_at_risk,
    error_detection_auroc,
    error_detection_auroc_ci,
    excess_aurc,
    optimal_aurc,
    risk_coverage_curve,
    selective_metrics,
)

U = np.array([0.1, 0.2, 0.3, 0.4])
E = np.array([0, 1, 0, 1])
# r_k for k = 1..4: 0/1, 1/2, 1/3, 2/4 → AURC = (0 + 1/2 + 1/3 + 1/2)/4 = 1/3
# oracle (E = 2, N = 4): 0, 0, 1/3, 2/4 → AURC* = (1/3 + 1/2)/4 = 5/24 → E-AURC = 1/3 − 5/24 = 1/8


def test_aurc_and_eaurc_hand_computed() -> None:
    assert aurc(U, E) == pytest.approx(1 / 3)
    assert optimal_aurc(E) == pytest.approx(5 / 24)
    assert excess_aurc(U, E) == pytest.approx(1 / 8)


def test_risk_coverage_curve_hand_computed() -> None:
    rc = risk_coverage_curve(U, E)
    assert rc.coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert rc.risk == pytest.approx([0.0, 0.5, 1 / 3, 0.5])
    assert rc.thresholds.tolist() == U.tolist()


def test_coverage_at_risk_hand_computed() -> None:
    assert coverage_at_risk(U, E, 0.4) == {
        "target_risk": 0.4,
        "coverage": 0.75,
        "risk": pytest.approx(1 / 3),
        "threshold": 0.3,
    }
    assert coverage_at_risk(U, E, 0.0)["coverage"] == 0.25
    assert coverage_at_risk(U[::-1], E, 0.0)["coverage"] == 0.0  # most confident sample is wrong


def test_perfect_ranking_has_zero_excess_aurc() -> None:
    rng = np.random.default_rng(1)
    errors = rng.random(200) < 0.3
    u = errors + rng.random(200) * 0.5  # every error more uncertain than every correct sample
    assert excess_aurc(u, errors) == pytest.approx(0.0, abs=1e-15)
    assert aurc(u, errors) == pytest.approx(optimal_aurc(errors))


def test_constant_score_aurc_is_the_error_rate() -> None:
    errors = np.array([1, 0, 0, 1, 0, 0, 0, 0])
    assert aurc(np.full(8, 0.5), errors) == pytest.approx(0.25)


def test_ties_use_expected_risk_independent_of_input_order() -> None:
    # u = [0.1, 0.1, 0.3], one error inside the tie: r_1 = 0.5/1, r_2 = 1/2, r_3 = 1/3
    expected = (0.5 + 0.5 + 1 / 3) / 3
    assert aurc([0.1, 0.1, 0.3], [1, 0, 0]) == pytest.approx(expected)
    assert aurc([0.1, 0.1, 0.3], [0, 1, 0]) == pytest.approx(expected)
    rc = risk_coverage_curve([0.1, 0.1, 0.3], [1, 0, 0])
    assert rc.coverage.tolist() == pytest.approx([2 / 3, 1.0])  # only achievable thresholds


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1, allow_nan=False), st.booleans()), min_size=1, max_size=60)
)
def test_eaurc_is_nonnegative_and_aurc_bounded(pairs: list[tuple[float, bool]]) -> None:
    u = np.array([p[0] for p in pairs])
    e = np.array([p[1] for p in pairs])
    assert excess_aurc(u, e) >= -1e-12
    assert 0.0 <= aurc(u, e) <= 1.0


def test_selective_metrics_keys_and_validation() -> None:
    m = selective_metrics(U, E)
    assert set(m) == {"aurc", "eaurc", "error_auroc", "coverage_at_risk"}
    assert set(m["coverage_at_risk"]) == {"0.01", "0.02", "0.05"}
    with pytest.raises(ValueError, match="0/1"):
        aurc(U, [0, 2, 0, 1])
    with pytest.raises(ValueError, match="length"):
        aurc(U, [0, 1])


def test_error_detection_auroc_hand_computed() -> None:
    # errors at u = 0.4 and 0.2; correct at 0.1, 0.2, 0.3. Pairs (error, correct) where the error
    # is more uncertain: 0.4 beats all 3; 0.2 beats 0.1, ties 0.2 (½), loses to 0.3 -> 4.5 / 6
    assert error_detection_auroc([0.1, 0.2, 0.3, 0.4, 0.2], [0, 0, 0, 1, 1]) == pytest.approx(0.75)
    assert error_detection_auroc([0.1, 0.9], [0, 1]) == 1.0
    assert error_detection_auroc([0.9, 0.1], [0, 1]) == 0.0
    assert error_detection_auroc([0.1, 0.2], [0, 0]) is None  # no error: undefined
    assert error_detection_auroc([0.1, 0.2], [1, 1]) is None


def test_error_detection_auroc_ci_brackets_the_estimate_and_narrows_with_more_errors() -> None:
    rng = np.random.default_rng(0)

    def sample(n: int, rate: float) -> tuple[np.ndarray, np.ndarray]:
        e = rng.random(n) < rate
        return rng.normal(loc=e * 1.5), e  # errors score higher on average: AUROC ≈ 0.86

    u, e = sample(1600, 0.01)
    lo, hi = error_detection_auroc_ci(u, e)
    assert lo <= error_detection_auroc(u, e) <= hi
    assert error_detection_auroc_ci(u, e) == (lo, hi)  # seeded: reproducible
    u2, e2 = sample(1600, 0.2)
    lo2, hi2 = error_detection_auroc_ci(u2, e2)
    assert hi2 - lo2 < (hi - lo) / 2  # 320 errors resolve it far better than 16
    assert error_detection_auroc_ci([0.1, 0.2], [0, 0]) is None
    perfect = error_detection_auroc_ci([0.1, 0.2, 0.9], [0, 0, 1])
    assert perfect == (1.0, 1.0)
    assert "error_auroc_ci95" in selective_metrics(u, e, with_ci=True)
