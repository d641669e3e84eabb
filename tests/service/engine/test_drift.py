"""service/engine/drift.py in process: the engine's window of served uncertainty, and what happens to its
gauges when the model is swapped out."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from models.evaluation.drift import bin_fractions, uncertainty_reference
from models.serving import FIXED_COLUMNS, ScoreColumns
from service.common.metrics import Metrics
from service.engine import drift
from service.engine.drift import UncertaintyMonitor


def _columns(vgmu: np.ndarray, eu: np.ndarray, abstain: np.ndarray) -> ScoreColumns:
    """A packed block (top-1) with the given scores; prediction 0, the rest zeros."""
    data = np.zeros((len(vgmu), len(FIXED_COLUMNS) + 2))
    data[:, FIXED_COLUMNS.index("vgmu")] = vgmu
    data[:, FIXED_COLUMNS.index("eu")] = eu
    data[:, FIXED_COLUMNS.index("abstain")] = abstain
    return ScoreColumns(data)


@pytest.fixture
def card() -> SimpleNamespace:
    rng = np.random.default_rng(0)
    reference = uncertainty_reference(
        {"vgmu": rng.uniform(0.5, 1.0, 500), "eu": rng.uniform(0.0, 0.01, 500)}, 0.05
    )
    return SimpleNamespace(class_names=["0", "1"], uncertainty_reference=reference)


def _gauges(metrics: Metrics, model: str) -> tuple[float, float, float, float]:
    return (
        metrics.abstain_ratio_window.labels(model=model)._value.get(),
        metrics.uncertainty_drift.labels(model=model, score="vgmu")._value.get(),
        metrics.uncertainty_drift.labels(model=model, score="eu")._value.get(),
        metrics.calibrated_deferral.labels(model=model)._value.get(),
    )


def test_the_window_exports_abstain_ratio_and_drift_against_the_reference(
    card: SimpleNamespace,
) -> None:
    metrics = Metrics()
    monitor = UncertaintyMonitor("m", card, metrics)
    assert _gauges(metrics, "m") == (0.0, 0.0, 0.0, 0.05)  # exported from the start
    n = drift.MIN_SAMPLES
    vgmu, eu = np.full(n, 0.05), np.full(n, 0.5)  # far from the reference: drift
    abstain = (np.arange(n) % 4 == 0).astype(float)
    monitor.observe(_columns(vgmu, eu, abstain))
    ratio, d_vgmu, d_eu, deferral = _gauges(metrics, "m")
    assert ratio == pytest.approx(0.25)
    expected = drift.psi(card.uncertainty_reference["fractions"]["vgmu"], bin_fractions(vgmu))
    assert d_vgmu == pytest.approx(expected) and d_vgmu > 0.25 and d_eu > 0.25
    assert metrics.prediction_vgmu.labels(model="m")._sum.get() == pytest.approx(0.05 * n)


def test_a_swapped_out_model_reads_nan_and_is_no_longer_refreshed(card: SimpleNamespace) -> None:
    """A drift alert on a model that no longer serves must resolve, not hold its last value."""
    metrics = Metrics()
    monitor = UncertaintyMonitor("old", card, metrics)
    n = drift.MIN_SAMPLES
    monitor.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)))
    assert _gauges(metrics, "old")[1] > 0.25  # drifting: the alert's condition holds
    monitor.retire()  # the served model has another name
    assert all(math.isnan(v) for v in _gauges(metrics, "old"))
    monitor._last = -1e9  # due for a refresh: a late batch of the old model must not refresh
    monitor.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)))
    assert all(math.isnan(v) for v in _gauges(metrics, "old"))
    # ... while its answers still count
    assert metrics.prediction_vgmu.labels(model="old")._sum.get() == pytest.approx(0.1 * n)


def test_a_same_named_successor_keeps_its_series_and_the_rest_read_nan(
    card: SimpleNamespace,
) -> None:
    """A reload or a retrained model under the same name: its monitor owns the series it exports;
    what only the old card had (a drift score, a calibrated deferral) reads NaN."""
    metrics = Metrics()
    old = UncertaintyMonitor("m", card, metrics)
    new = UncertaintyMonitor("m", card, metrics)
    old.retire(new)
    n = drift.MIN_SAMPLES
    new.observe(_columns(np.full(n, 0.9), np.full(n, 0.001), np.zeros(n)))
    before = _gauges(metrics, "m")
    old._last = -1e9
    old.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)))
    assert _gauges(metrics, "m") == before and not any(math.isnan(v) for v in before)

    bare = SimpleNamespace(class_names=["0", "1"])  # an older card: no reference, no calibration
    newest = UncertaintyMonitor("m", bare, metrics)
    new.retire(newest)
    ratio, d_vgmu, d_eu, deferral = _gauges(metrics, "m")
    assert ratio == 0.0  # the successor exports it (0 until its window fills)
    assert math.isnan(d_vgmu) and math.isnan(d_eu) and math.isnan(deferral)


def test_the_abstain_window_counts_from_the_load_and_its_help_says_so(
    card: SimpleNamespace,
) -> None:
    """Issue 32: the help an operator reads on /metrics says when the gauge starts counting, with
    the monitor's own numbers; and the monitor does what it says."""
    metrics = Metrics()
    doc = metrics.abstain_ratio_window._documentation
    assert f"last {drift.WINDOW} answered images" in doc
    assert f"reads 0 until {drift.MIN_SAMPLES} images are counted" in doc
    assert "starts when the model is loaded" in doc and "NaN" in doc

    def ratio() -> float:
        return metrics.abstain_ratio_window.labels(model="m")._value.get()

    monitor = UncertaintyMonitor("m", card, metrics)
    few = drift.MIN_SAMPLES - 1
    monitor.observe(_columns(np.full(few, 0.9), np.zeros(few), np.ones(few)))
    assert ratio() == 0.0  # every image abstained, but fewer than MIN_SAMPLES are counted
    monitor.observe(_columns(np.full(1, 0.9), np.zeros(1), np.ones(1)))
    assert ratio() == 1.0  # now the share over all counted, the first image included
    monitor._last = -1e9  # due for a refresh
    w = drift.WINDOW
    monitor.observe(_columns(np.zeros(w), np.zeros(w), np.zeros(w)))
    assert ratio() == 0.0  # only the last WINDOW images count
    monitor._last = -1e9
    n = drift.MIN_SAMPLES
    monitor.observe(_columns(np.full(n, 0.9), np.zeros(n), np.ones(n)))
    assert ratio() == pytest.approx(n / w)
    UncertaintyMonitor("m", card, metrics)  # the model loaded again: a new count from 0
    assert ratio() == 0.0
