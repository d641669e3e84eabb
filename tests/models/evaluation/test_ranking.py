"""Rank consistency and AUCc."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.evaluation.ranking import aucc, aucc_curve, kendall_tau, rank_consistency, spearman_rho


def test_aucc_of_constant_scores_is_one_half() -> None:
    assert aucc(np.full(7, 0.3)) == pytest.approx(0.5, abs=1e-12)


def test_aucc_hand_computed() -> None:
    # scores [0, 3, 0, 1] sorted descending [3, 1, 0, 0], total 4
    # y = [0, 0.75, 1, 1, 1] at x = [0, .25, .5, .75, 1]
    # trapezoids: .25·(0+.75)/2 + .25·(.75+1)/2 + .25·1 + .25·1 = .09375 + .21875 + .25 + .25 = 0.8125
    x, y = aucc_curve([0.0, 3.0, 0.0, 1.0])
    assert x.tolist() == [0, 0.25, 0.5, 0.75, 1.0]
    assert y.tolist() == [0, 0.75, 1.0, 1.0, 1.0]
    assert aucc([0.0, 3.0, 0.0, 1.0]) == pytest.approx(0.8125)


def test_aucc_all_mass_on_one_sample_is_maximal() -> None:
    n = 10
    u = np.zeros(n)
    u[3] = 0.9
    assert aucc(u) == pytest.approx(1 - 1 / (2 * n))


def test_aucc_of_all_zero_scores_is_no_concentration() -> None:
    assert aucc(np.zeros(5)) == 0.5


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40), st.floats(0.1, 100))
def test_aucc_bounds_and_invariances(values: list[float], scale: float) -> None:
    u = np.asarray(values)
    a = aucc(u)
    assert 0.5 - 1e-9 <= a <= 1 - 1 / (2 * len(u)) + 1e-9
    assert aucc(u * scale) == pytest.approx(a, abs=1e-9)  # only relative mass matters
    assert aucc(u[::-1]) == pytest.approx(a, abs=1e-12)  # order of samples is irrelevant


def test_aucc_rejects_non_finite() -> None:
    with pytest.raises(ValueError, match="finite"):
        aucc([0.1, float("nan")])


def test_rank_correlations_hand_computed() -> None:
    a = [1, 2, 3, 4]
    assert spearman_rho(a, [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau(a, [4, 3, 2, 1]) == pytest.approx(-1.0)
    # b = [1, 3, 2, 4]: one discordant pair (2,3) out of 6 → τ = (5 − 1)/6 = 2/3
    assert kendall_tau(a, [1, 3, 2, 4]) == pytest.approx(2 / 3)
    # ρ = 1 − 6 Σd²/(n(n²−1)) = 1 − 6·2/60 = 0.8
    assert spearman_rho(a, [1, 3, 2, 4]) == pytest.approx(0.8)


def test_rank_correlation_of_constant_score_is_none() -> None:
    assert spearman_rho([1, 2, 3], [5, 5, 5]) is None
    assert kendall_tau([1, 2, 3], [5, 5, 5]) is None


def test_rank_consistency_against_references() -> None:
    rng = np.random.default_rng(0)
    v = rng.random(50)
    out = rank_consistency({"vgmu": v, "eu": v**2, "epkl": -v, "tu": v})
    assert set(out) == {"eu", "epkl"}  # epjs absent, tu not a reference
    assert out["eu"]["spearman"] == pytest.approx(1.0) and out["eu"]["kendall"] == pytest.approx(
        1.0
    )
    assert out["epkl"]["spearman"] == pytest.approx(-1.0)
