"""benchmarks.budget: one SNR ranking answers every deferral threshold."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.budget import budget, main


def test_budget_by_hand() -> None:
    """Digits' SNRs 1..100: the k deferring 5 % of them is 5; of the group's SNRs (2, 4, 6, 8, 50),
    two are ≤ 5 (40 %); deferring 80 % of the group needs k = 8, which defers 8 % of digits. At
    half the digits (k = 50) the whole group is deferred, and all of it needs k = 50 too."""
    digits = np.arange(1, 101, dtype=float)
    group = np.array([2.0, 4.0, 6.0, 8.0, 50.0])
    assert budget(digits, group, 0.05, 0.80) == pytest.approx((0.4, 0.08))
    assert budget(digits, group, 0.50, 1.0) == pytest.approx((1.0, 0.5))


def test_runs_on_the_default(capsys) -> None:
    main(["cnn4-lle-vgn-doe-mnist", "--per-group", "20"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| cnn4")]
    assert len(rows) == 1 and rows[0].count("%") == 4
