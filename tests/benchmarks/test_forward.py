"""benchmarks.forward --compare: the served forward pass of models side by side."""

from __future__ import annotations

import pytest

from benchmarks.forward import compare


def test_compare_times_each_model_and_states_the_ratio_to_the_first(capsys) -> None:
    """Two zoo models, one round: a median per model, in order, and a table row each whose ratio
    is that median over the first model's."""
    names = ["cnn4-lle-vgn-doe-mnist", "lenet5-lle-vgn-mnist"]
    medians = compare(names, threads=1, batch=4, rounds=1)
    assert len(medians) == 2 and all(m > 0 for m in medians)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[0][2:] for r in rows] == names
    ratio = float(rows[1].rstrip(" |").split(" | ")[-1].rstrip("×"))
    assert ratio == pytest.approx(medians[1] / medians[0], abs=0.006)
    assert rows[0].endswith("| 1.00× |")
