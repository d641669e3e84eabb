"""service/engine/drift.py in process: the engine's window of served uncertainty, and what happens to its
gauges when the model is swapped out."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from models.evaluation.drift import bin_fractions, uncertainty_reference
from models.serving import FIXED_COLUMNS, ScoreColumns, ScoreOptions, resolve_options
from service.common.metrics import Metrics
from service.engine import drift
from service.engine.drift import UncertaintyMonitor

#: Options scored as the test cards' reference (no VGN: p; not calibrated: any k).
REF = ScoreOptions(abstain_k=1.0, members="p", top_k=1)


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
    monitor = UncertaintyMonitor("m", card, metrics, REF)
    assert _gauges(metrics, "m") == (0.0, 0.0, 0.0, 0.05)  # exported from the start
    n = drift.MIN_SAMPLES
    vgmu, eu = np.full(n, 0.05), np.full(n, 0.5)  # far from the reference: drift
    abstain = (np.arange(n) % 4 == 0).astype(float)
    monitor.observe(_columns(vgmu, eu, abstain), REF)
    ratio, d_vgmu, d_eu, deferral = _gauges(metrics, "m")
    assert ratio == pytest.approx(0.25)
    expected = drift.psi(card.uncertainty_reference["fractions"]["vgmu"], bin_fractions(vgmu))
    assert d_vgmu == pytest.approx(expected) and d_vgmu > 0.25 and d_eu > 0.25
    assert metrics.prediction_vgmu.labels(model="m")._sum.get() == pytest.approx(0.05 * n)


def test_a_swapped_out_model_reads_nan_and_is_no_longer_refreshed(card: SimpleNamespace) -> None:
    """A drift alert on a model that no longer serves must resolve, not hold its last value."""
    metrics = Metrics()
    monitor = UncertaintyMonitor("old", card, metrics, REF)
    n = drift.MIN_SAMPLES
    monitor.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)), REF)
    assert _gauges(metrics, "old")[1] > 0.25  # drifting: the alert's condition holds
    monitor.retire()  # the served model has another name
    assert all(math.isnan(v) for v in _gauges(metrics, "old"))
    monitor._last = -1e9  # due for a refresh: a late batch of the old model must not refresh
    monitor.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)), REF)
    assert all(math.isnan(v) for v in _gauges(metrics, "old"))
    # ... while its answers still count
    assert metrics.prediction_vgmu.labels(model="old")._sum.get() == pytest.approx(0.1 * n)


def test_a_same_named_successor_keeps_its_series_and_the_rest_read_nan(
    card: SimpleNamespace,
) -> None:
    """A reload or a retrained model under the same name: its monitor owns the series it exports;
    what only the old card had (a drift score, a calibrated deferral) reads NaN."""
    metrics = Metrics()
    old = UncertaintyMonitor("m", card, metrics, REF)
    new = UncertaintyMonitor("m", card, metrics, REF)
    old.retire(new)
    n = drift.MIN_SAMPLES
    new.observe(_columns(np.full(n, 0.9), np.full(n, 0.001), np.zeros(n)), REF)
    before = _gauges(metrics, "m")
    old._last = -1e9
    old.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)), REF)
    assert _gauges(metrics, "m") == before and not any(math.isnan(v) for v in before)

    bare = SimpleNamespace(class_names=["0", "1"])  # an older card: no reference, no calibration
    newest = UncertaintyMonitor("m", bare, metrics, REF)
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

    monitor = UncertaintyMonitor("m", card, metrics, REF)
    few = drift.MIN_SAMPLES - 1
    monitor.observe(_columns(np.full(few, 0.9), np.zeros(few), np.ones(few)), REF)
    assert ratio() == 0.0  # every image abstained, but fewer than MIN_SAMPLES are counted
    monitor.observe(_columns(np.full(1, 0.9), np.zeros(1), np.ones(1)), REF)
    assert ratio() == 1.0  # now the share over all counted, the first image included
    monitor._last = -1e9  # due for a refresh
    w = drift.WINDOW
    monitor.observe(_columns(np.zeros(w), np.zeros(w), np.zeros(w)), REF)
    assert ratio() == 0.0  # only the last WINDOW images count
    monitor._last = -1e9
    n = drift.MIN_SAMPLES
    monitor.observe(_columns(np.full(n, 0.9), np.zeros(n), np.ones(n)), REF)
    assert ratio() == pytest.approx(n / w)
    UncertaintyMonitor("m", card, metrics, REF)  # the model loaded again: a new count from 0
    assert ratio() == 0.0


def test_the_window_takes_only_answers_scored_as_the_reference_was() -> None:
    """Found by review (2026-11-29): the window took every answer, so clients sending
    vgmu_on=p to a model whose reference is on q (or their own abstain_k) moved the drift and
    abstain gauges with no change in the inputs (PSI 0.27 → 1.16 on the same 2,000 digits).
    Now VGMU and EU come from answers on the reference's member set, abstentions from those at
    its calibrated k; every answer still counts in the histograms."""
    rng = np.random.default_rng(1)
    reference = uncertainty_reference(
        {"vgmu": rng.uniform(0.5, 1.0, 500), "eu": rng.uniform(0.0, 0.01, 500)}, 0.05
    )
    card = SimpleNamespace(class_names=["0", "1"], uncertainty_reference=reference, vgn=True,
                           abstain_k_for=lambda m: 3.0 if m == "q" else 5.0)  # fmt: skip
    metrics = Metrics()

    def rule(default_abstain_k: float | None) -> ScoreOptions:  # as the engine's predictor.options
        calibrated = {m: card.abstain_k_for(m) for m in ("p", "q")}
        return resolve_options(model="m", vgn=True, calibrated_k=calibrated, num_classes=2,
                               default_abstain_k=default_abstain_k)  # fmt: skip

    monitor = UncertaintyMonitor("m", card, metrics, rule(None))
    n = drift.MIN_SAMPLES
    served = ScoreOptions(abstain_k=3.0, members="q", top_k=1)
    on_p = ScoreOptions(abstain_k=3.0, members="p", top_k=1)
    other_k = ScoreOptions(abstain_k=50.0, members="q", top_k=1)
    like = rng.uniform(0.5, 1.0, n), rng.uniform(0.0, 0.01, n)
    monitor.observe(_columns(np.full(n, 0.05), np.full(n, 0.5), np.ones(n)), on_p)
    monitor.observe(_columns(*like, np.ones(n)), other_k)  # scores kept, abstentions not
    monitor.observe(_columns(*like, np.zeros(n)), served)
    monitor.refresh()
    abstain, vgmu, eu, _ = _gauges(metrics, "m")
    assert abstain == 0.0  # the served k's answers only
    assert vgmu < 0.1 and eu < 0.1  # the q answers only: like the reference
    assert metrics.prediction_vgmu.labels(model="m")._sum.get() > 0  # every answer observed
    count = sum(
        s.value for m in metrics.prediction_vgmu.collect() for s in m.samples
        if s.name.endswith("_count") and s.labels.get("model") == "m"
    )  # fmt: skip
    assert count == 3 * n
    # With a server-wide VGE_ABSTAIN_K every default request carries it: that is the rule then
    # (the window stayed empty, the gauge at 0, its alert unable to fire)
    wide = UncertaintyMonitor("w", card, metrics, rule(2.0))
    assert (wide.members, wide.abstain_k) == ("q", 2.0)
    wide.observe(_columns(*like, np.ones(n)), ScoreOptions(abstain_k=2.0, members="q", top_k=1))
    wide.refresh()
    assert _gauges(metrics, "w")[0] == 1.0
