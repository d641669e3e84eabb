"""Uncertainty of served traffic, in the engine: histograms, predicted-class mix, and drift.

The engine sees every answer of every front end, so it is where a sliding window of recent
traffic lives. Per answered image it observes ``vge_prediction_vgmu``/``_eu``/``_tu`` and counts
``vge_prediction_class_total``; at most once per second it compares the window (the last
``window`` images) with the model card's validation-split reference using
:func:`models.evaluation.drift.psi` and exports ``vge_uncertainty_drift{score}``, next to
``vge_abstain_ratio_window`` and the card's ``vge_calibrated_deferral``. A card without a
reference (older models) exports no drift gauge.

The window holds only answers scored by the served rule (``served``: the options a request that
gives none gets, ``Predictor.options``): VGMU and EU from its member set (a request's ``vgmu_on`` may ask for
the other), abstentions at its ``abstain_k`` too (the card's calibrated k, or the server's
``VGE_ABSTAIN_K``; a request's ``abstain_k`` moves them). Other answers count in the histograms and class counters only: a client's options alone
must not move a gauge that alerts on a shift of the inputs. The abstain share is the model's own
rule; an image in which the reading finds no digit (``models.prepare.Finding``) is answered
abstained by the front end after scoring, and counts there (``vge_predictions_total``), not here.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from models.evaluation.drift import DRIFT_EDGES, DRIFT_SCORES, bin_fractions, psi
from models.serving import ScoreColumns, ScoreOptions
from service.common.metrics import Metrics, inc_many, observe_many

#: Images in the sliding window; with fewer, drift is not exported yet (too noisy to alert on).
WINDOW = 2000
MIN_SAMPLES = 200
UPDATE_EVERY_S = 1.0


def monitor_inputs(card: Any) -> tuple[dict[str, np.ndarray], float | None]:
    """What a monitor reads of ``card``: the reference fractions per drift score (as arrays of
    :data:`~models.evaluation.drift.DRIFT_EDGES`' bins) and the calibrated deferral rate (the
    reference's, else the calibration's achieved one; None: not calibrated).

    The model manager calls it while it loads a model, before the model is recorded or served
    (``model_manager._load_sync``): a card whose reference the monitor cannot read is refused
    there, never after the swap. ``ValueError`` naming the field otherwise (a card read through
    :class:`models.checkpoint.ModelCard` has been validated against the same shape)."""
    ref = getattr(card, "uncertainty_reference", None) or {}
    reference = {}
    for score, fractions in (ref.get("fractions") or {}).items():
        values = np.asarray(fractions, dtype=np.float64)
        if values.shape != (len(DRIFT_EDGES) - 1,) or not np.isfinite(values).all():
            raise ValueError(
                f"uncertainty_reference.fractions.{score}: {len(DRIFT_EDGES) - 1} finite "
                "fractions expected"
            )
        reference[str(score)] = values
    deferral = ref.get("deferral")
    if deferral is None:
        deferral = (getattr(card, "abstain_calibration", None) or {}).get("achieved_deferral")
    try:
        value = None if deferral is None else float(deferral)
    except (TypeError, ValueError):
        value = float("nan")
    if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"uncertainty_reference.deferral: {deferral!r} is not a rate in [0, 1]")
    return reference, value


class UncertaintyMonitor:
    """Per served model: observe answers, keep the window, export drift."""

    def __init__(
        self,
        model: str,
        card: Any,
        metrics: Metrics,
        served: ScoreOptions,
        window: int = WINDOW,
    ) -> None:
        self.model = model
        self.metrics = metrics
        self.class_names = [str(c) for c in card.class_names]
        self.reference, deferral = monitor_inputs(card)
        if deferral is not None:
            metrics.calibrated_deferral.labels(model=model).set(deferral)
        self._deferral_exported = deferral is not None
        self.retired = False  # the model is no longer served (see retire)
        # The served rule: the options a request that gives none is scored with (the server's
        # VGE_ABSTAIN_K, else the card's calibrated k; the engine resolves them)
        self.members, self.abstain_k = served.members, served.abstain_k
        self._scores = _Ring(window, 2)  # vgmu, eu of answers on the reference's member set
        self._abstain = _Ring(window, 1)  # abstain of those answered at the calibrated k
        self._last = 0.0
        # Labelled children looked up once (the engine observes every scored batch).
        self._classes = [metrics.prediction_class.labels(model=model, label=n)
                         for n in self.class_names]  # fmt: skip
        self._hists = [h.labels(model=model) for h in
                       (metrics.prediction_vgmu, metrics.prediction_eu, metrics.prediction_tu)]  # fmt: skip
        # 0 until the window holds MIN_SAMPLES images: exported from the start, never alerting.
        metrics.abstain_ratio_window.labels(model=model).set(0.0)
        for score in self.reference:
            metrics.uncertainty_drift.labels(model=model, score=score).set(0.0)

    def observe(self, columns: ScoreColumns, options: ScoreOptions) -> None:
        """Record a batch's answers (scored with ``options``); refresh the window gauges at most
        once per second. The window takes them only when scored as the reference was (module
        docstring)."""
        vgmu, eu, tu = columns.column("vgmu"), columns.column("eu"), columns.column("tu")
        for hist, values in zip(self._hists, (vgmu, eu, tu), strict=True):
            observe_many(hist, values)  # one increment per bucket, not per image
        inc_many(self._classes, columns.column("prediction"))
        if options.members != self.members:
            return
        self._scores.add(np.stack((vgmu, eu), axis=1))
        if options.abstain_k == self.abstain_k:
            self._abstain.add(columns.column("abstain")[:, None])
        now = time.monotonic()
        if (
            not self.retired
            and now - self._last >= UPDATE_EVERY_S
            and max(self._scores.n, self._abstain.n) >= MIN_SAMPLES
        ):
            self._last = now
            self.refresh()

    def retire(self, successor: UncertaintyMonitor | None = None) -> None:
        """The model was swapped out: stop refreshing its window gauges (batches still computing
        for it count in the histograms and class counters, but do not refresh them).

        Its window gauges read NaN from now on, except those that ``successor`` — the monitor of
        the model now served under the same name — exports itself: multiprocess gauges cannot be
        removed, and a gauge left at its last value would hold an alert on it
        (``VgeUncertaintyDrift``, ``VgeAbstainRateHigh``) firing for a model that no longer
        serves, or compare the new model's abstentions with the old card's calibration. NaN
        compares false, so those alerts resolve, and dashboards show a gap.
        """
        self.retired = True
        nan = float("nan")
        if successor is None:
            self.metrics.abstain_ratio_window.labels(model=self.model).set(nan)
        kept = set() if successor is None else set(successor.reference)
        for score in set(self.reference) - kept:
            self.metrics.uncertainty_drift.labels(model=self.model, score=score).set(nan)
        if self._deferral_exported and (successor is None or not successor._deferral_exported):
            self.metrics.calibrated_deferral.labels(model=self.model).set(nan)

    def refresh(self) -> None:
        """Export the window's gauges: each once its own part holds ``MIN_SAMPLES`` answers."""
        if self._abstain.n >= MIN_SAMPLES:
            share = float(self._abstain.values[:, 0].mean())
            self.metrics.abstain_ratio_window.labels(model=self.model).set(share)
        if self._scores.n >= MIN_SAMPLES:
            window = self._scores.values
            for i, score in enumerate(DRIFT_SCORES):
                if score in self.reference:
                    value = psi(self.reference[score], bin_fractions(window[:, i]))
                    self.metrics.uncertainty_drift.labels(model=self.model, score=score).set(value)


class _Ring:
    """The last ``size`` rows of ``width`` columns, written in place (vectorised)."""

    def __init__(self, size: int, width: int) -> None:
        self._rows = np.zeros((size, width))
        self._next = 0
        self.n = 0  # rows held (at most size)

    def add(self, rows: np.ndarray) -> None:
        w = len(self._rows)
        rows = rows[-w:]
        self._rows[(self._next + np.arange(len(rows))) % w] = rows
        self._next = (self._next + len(rows)) % w
        self.n = min(self.n + len(rows), w)

    @property
    def values(self) -> np.ndarray:
        """The rows held (in no particular order)."""
        return self._rows[: self.n]
