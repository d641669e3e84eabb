"""PSI drift score: hand-computed values and properties."""

import math

import numpy as np
import pytest

from models.evaluation.drift import DRIFT_EDGES, bin_fractions, psi, uncertainty_reference


def test_psi_by_hand() -> None:
    r, w = [0.5, 0.5], [0.9, 0.1]
    want = (0.9 - 0.5) * math.log(0.9 / 0.5) + (0.1 - 0.5) * math.log(0.1 / 0.5)
    assert psi(r, w) == pytest.approx(want, rel=1e-12)
    assert psi(r, r) == 0.0
    assert psi(r, w) == pytest.approx(psi(w, r))  # symmetric


def test_empty_bins_stay_finite_and_large_shift_is_large() -> None:
    ref = bin_fractions(np.full(1000, 0.0005))  # everything in the first bin
    shifted = bin_fractions(np.full(1000, 0.9))  # everything in the last
    assert math.isfinite(psi(ref, shifted)) and psi(ref, shifted) > 0.25 * 10


def test_bins_and_reference() -> None:
    f = bin_fractions([0.0, 0.0015, 0.5, 1.0, 2.0])  # 2.0 is clipped into the last bin
    assert f.sum() == pytest.approx(1.0) and len(f) == len(DRIFT_EDGES) - 1
    assert f[0] == 0.2 and f[1] == 0.2 and f[-1] == 0.4
    ref = uncertainty_reference({"vgmu": [0.1, 0.2], "eu": [0.0, 0.0]}, 0.05)
    assert ref["n"] == 2 and ref["deferral"] == 0.05 and set(ref["fractions"]) == {"vgmu", "eu"}


def test_same_distribution_has_small_psi() -> None:
    g = np.random.default_rng(0)
    a, b = g.beta(0.5, 20, 5000), g.beta(0.5, 20, 5000)
    assert psi(bin_fractions(a), bin_fractions(b)) < 0.02
