"""Prometheus metrics, named exactly as in docs/architecture.md (dashboards depend on the names).

``vge serve`` runs several processes (front ends and an engine, see :mod:`service.supervisor`), so
metrics use prometheus-client's *multiprocess mode*: the supervisor points
``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory before any process imports prometheus-client;
every process writes its samples there, and whichever front end answers ``/metrics`` aggregates all
of them (:meth:`Metrics.render`) — counters and histograms summed over processes, gauges summed over
live processes (``livesum``). Without that variable (a library user, a test) each :class:`Metrics`
keeps its own registry. Latency histograms use :data:`LATENCY_BUCKETS`, which resolve 0.5 ms to 30 s.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from service.common.job_record import JobState

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
#: Buckets for uncertainty scores in [0, 1]: fine near 0, where in-distribution traffic lies
#: (the drift reference's bin edges, models.evaluation.drift.DRIFT_EDGES).
UNCERTAINTY_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0,
)  # fmt: skip
#: Queued → labelled: a minute to a month.
REVIEW_BUCKETS: tuple[float, ...] = (
    60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400,
    30 * 86400,
)  # fmt: skip
LOAD_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Every training-job state, each exported from the start (0 until jobs exist).
JOB_STATES: tuple[JobState, ...] = tuple(JobState)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def observe_many(histogram: Any, values: np.ndarray) -> None:
    """Observe every value of ``values`` on one labelled histogram child, with one increment per
    bucket that received values instead of two per value.

    The same samples as ``for v in values: histogram.observe(v)`` (each value counts in the first
    bucket whose upper bound is ``>= v``; :func:`numpy.searchsorted` with ``side="left"`` finds
    it). In multiprocess mode every increment is a locked write to a mapped file (~1 µs), and the
    engine observes three uncertainty histograms for every image it answers. Reaches into
    prometheus-client's ``_sum``/``_buckets``/``_upper_bounds``; without them (another version)
    it observes value by value.
    """
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for v in values.tolist():
            histogram.observe(v)
        return
    if values.size == 0:
        return
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    total.inc(float(values.sum()))
    for i in np.flatnonzero(counts[: len(bounds)]).tolist():
        buckets[i].inc(int(counts[i]))


def inc_many(counters: list[Any], indices: np.ndarray) -> None:
    """``counters[i].inc()`` for every ``i`` in ``indices``, as one increment per distinct index."""
    counts = np.bincount(indices, minlength=len(counters))
    for i in np.flatnonzero(counts).tolist():
        counters[i].inc(int(counts[i]))


class Metrics:
    """The service's metric families on a private :class:`CollectorRegistry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.request_duration = Histogram(
            "vge_request_duration_seconds",
            "HTTP request latency by route template, method and status code.",
            ["endpoint", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "vge_queue_wait_seconds",
            "Time a request waited in the batcher's queue before its batch started.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "vge_compute_seconds",
            "Forward + scoring time of one batch.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "vge_batch_size",
            "Images per forward pass.",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "vge_queue_depth",
            "Images waiting in the batcher's queue.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.inflight = Gauge(
            "vge_inflight_requests",
            "HTTP requests being handled right now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.predictions = Counter(
            "vge_predictions",
            "Predictions served, by model and whether the model abstained.",
            ["model", "abstained"],
            registry=r,
        )
        self.rejections = Counter(
            "vge_rejections",
            "Requests refused, by reason (queue_full, deadline, bad_input, payload_too_large, "
            "unauthorized).",
            ["reason"],
            registry=r,
        )
        self.model_load = Histogram(
            "vge_model_load_seconds",
            "Time to load and verify a model.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.training_jobs = Gauge(
            "vge_training_jobs",
            "Training jobs by state.",
            ["state"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.device_memory = Gauge(
            "vge_device_memory_bytes",
            "Accelerator memory in use by the engine (an engine on the CPU: its resident set).",
            ["device", "kind"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.engine_ready = Gauge(
            "vge_engine_ready",
            "1 while the engine has a model loaded and admits requests, else 0.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_restore_failed = Gauge(
            "vge_model_restore_failed",
            "1 while the engine serves its start model because the model the history records "
            "(the last promoted or rolled-back one) could not be restored (deleted, weights "
            "altered); see restore_failed in GET /v1/models.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.fleet_converged = Gauge(
            "vge_fleet_converged",
            "In a fleet (VGE_DB_URL): 1 while this replica serves the fleet's model (the newest "
            "entry of the shared model history), 0 while it serves another one because it "
            "could not load the fleet's (missing on its volume, sha256 mismatch, out of "
            "memory; see fleet in GET /v1/models). Absent without a fleet.",
            ["replica"],
            registry=r,
            multiprocess_mode="livemin",
        )

        def uncertainty(score: str, what: str) -> Histogram:
            return Histogram(
                f"vge_prediction_{score}",
                f"{what} of every served image (the answer's member set; [0, 1]).",
                ["model"],
                buckets=UNCERTAINTY_BUCKETS,
                registry=r,
            )

        self.prediction_vgmu = uncertainty("vgmu", "VGMU")
        self.prediction_eu = uncertainty("eu", "epistemic uncertainty EU")
        self.prediction_tu = uncertainty("tu", "total uncertainty TU")
        self.prediction_class = Counter(
            "vge_prediction_class",
            "Served images by predicted class.",
            ["model", "label"],
            registry=r,
        )
        self.uncertainty_drift = Gauge(
            "vge_uncertainty_drift",
            "PSI between the last 2000 served images' uncertainty and the card's validation "
            "reference (< 0.1 none, 0.1-0.25 moderate, > 0.25 significant shift); images "
            "answered on the reference's member set only (a request's vgmu_on may differ).",
            ["model", "score"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.abstain_ratio_window = Gauge(
            "vge_abstain_ratio_window",
            "Share of the served model's last 2000 answered images that its rule abstained "
            "on, answered by the served rule (the card's calibrated abstain_k, or "
            "VGE_ABSTAIN_K, and member set; requests with their own are left out; images with "
            "no digit found are counted in vge_predictions_total, not here). Counting "
            "starts when the model is loaded (engine start, promote, reload, rollback); the "
            "gauge reads 0 until 200 images are counted, then the share over all counted (up "
            "to the last 2000), refreshed at most once a second as images are answered; NaN "
            "once a model of another name serves.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.calibrated_deferral = Gauge(
            "vge_calibrated_deferral",
            "Deferral rate the served abstain_k was calibrated to (model card, validation split).",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        # --- human review (service.common.review_store) ----------------------------------------------
        self.review_queue_depth = Gauge(
            "vge_review_queue_depth",
            "Items waiting for a human label (pending), by model; read from the queue's database.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.review_store_up = Gauge(
            "vge_review_store_up",
            "1 while every process can use the review queue's store (database and image "
            "directory), 0 while one cannot (predictions answer review_status unavailable); "
            "by backend (sqlite, postgresql). Labelled so that only processes with a store "
            "report (multiprocess livemin).",
            ["backend"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.reviews = Counter(
            "vge_reviews",
            "Human decisions on queued items, by outcome: the label agrees with the model, "
            "disagrees, the reviewer answered not_a_digit (not a class), or skipped. An item "
            "skipped and labelled later counts both decisions; a relabel counts none.",
            ["model", "outcome"],
            registry=r,
        )
        self.review_latency = Histogram(
            "vge_review_latency_seconds",
            "Time from queueing to an item's first human decision (a label or a skip).",
            ["model"],
            buckets=REVIEW_BUCKETS,
            registry=r,
        )
        self.review_enqueued = Counter(
            "vge_review_enqueue",
            "Images sent to the review queue, by result (queued, already_queued, queue_full, "
            "unavailable, error; unsupported_input: V2 FP32 input, which is not stored).",
            ["model", "status"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "vge_process_restarts",
            "Server processes restarted after they died, by role (frontend, engine).",
            ["role"],
            registry=r,
        )
        for reason in ("queue_full", "deadline", "bad_input", "payload_too_large", "unauthorized"):
            self.rejections.labels(reason=reason)
        for role in ("frontend", "engine"):  # 0 from the start: an alert on increase() needs it
            self.worker_restarts.labels(role=role)

    def init_job_states(self) -> None:
        """Export every job state (0 until jobs exist); only the process that owns jobs calls it."""
        for state in JOB_STATES:
            self.training_jobs.labels(state=state).set(0)

    def record_predictions(self, model: str, abstains: list[bool]) -> None:
        """Count served predictions for ``model``; ``abstains`` holds one flag per image."""
        n_abstain = sum(1 for a in abstains if a)
        if n_abstain:
            self.predictions.labels(model=model, abstained="true").inc(n_abstain)
        if len(abstains) - n_abstain:
            self.predictions.labels(model=model, abstained="false").inc(len(abstains) - n_abstain)

    def update_device_memory(self, device: str = "cuda") -> None:
        """Refresh the device-memory gauge: CUDA allocator statistics per GPU, or, for an engine on
        the CPU, its resident set size as ``device="cpu"`` (allocated = reserved = RSS)."""
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            if device == "cpu":
                import resource

                # ru_maxrss is the peak, in KiB on Linux; the current RSS is in /proc.
                try:
                    with open("/proc/self/statm") as f:
                        rss = int(f.read().split()[1]) * resource.getpagesize()
                except OSError:
                    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                for kind in ("allocated", "reserved"):
                    self.device_memory.labels(device="cpu", kind=kind).set(rss)
            return
        for i in range(torch.cuda.device_count()):
            dev = f"cuda:{i}"
            self.device_memory.labels(device=dev, kind="allocated").set(
                torch.cuda.memory_allocated(i)
            )
            self.device_memory.labels(device=dev, kind="reserved").set(
                torch.cuda.memory_reserved(i)
            )

    def render(self) -> bytes:
        """The whole server's metrics (all processes) in the Prometheus text exposition format."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            # prometheus_client's __init__ is unannotated
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        self.update_device_memory()
        return generate_latest(self.registry)
