"""Training jobs in the engine: accept, schedule, cancel and record them.

:class:`JobManager` resolves and validates submissions, queues jobs (at most
``max_queued_jobs`` waiting), runs up to ``max_concurrent_jobs`` at once, each in its own
process (``multiprocessing`` spawn context, lowered CPU priority) so serving latency is not
hurt; relays progress events; cancels cooperatively (``should_stop``), then by terminating the
process after a grace period. A finished job's model lands in ``models_root/<job id>`` and can
be promoted. Jobs that were queued or running when the server died are marked ``interrupted``
at the next start.

Split by job: the records live in :mod:`service.engine.job_store` (:class:`JobStore`, SQL, so a
restart loses no history) and the code that runs inside a job's own process in
:mod:`service.engine.training_child` (:func:`~service.engine.training_child.child_main`, the
spawn target); this module is the manager between them.

A submission that names no architecture retrains the served model: its card's recipe, its name
with version ``<served version>-<job id>`` (so ``/v2/models/{name}`` URLs keep working after a
promote) and, when they fit, its weights (fine-tuning; ``"init": "scratch"`` opts out). A
submission is validated whole before anything is written; ``reviews[+mnist-bundled]`` exports the
labelled review images into the job's own folder (``jobs_dir/<job id>/reviews``), deleted when
the job ends however it ends. Images a reviewer marked *not a digit* are no class: with
``reviews+mnist-bundled`` they go to that folder's ``outliers/`` and train as outliers of outlier
exposure (models.training.outliers; switched on at :data:`REVIEW_OUTLIER_EXPOSURE` when the
recipe has it off and the submission does not set ``outlier_exposure``); ``reviews`` alone
(an ImageFolder of classes) leaves them out.

States: :class:`~service.common.job_record.JobState` (``queued`` → ``running`` → ``succeeded`` |
``failed`` | ``cancelled`` | ``interrupted``); records: :class:`~service.common.job_record.Job`.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.data import MIXED_SUFFIX, parse_imagefolder
from service.common.db import Database
from service.common.errors import Conflict, InvalidValue, NotFound
from service.common.job_logs import LOG_NAME, read_tail
from service.common.job_record import ACTIVE, Job, JobRow, JobState
from service.common.metrics import JOB_STATES, Metrics
from service.common.settings import Settings
from service.engine.job_store import JobStore
from service.engine.training_child import child_main

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event as ProcessEvent

    from models.training import TrainConfig
    from service.common.review_store import ReviewStore

log = logging.getLogger("vge.jobs")

#: The outlier-exposure weight a ``reviews+mnist-bundled`` job trains with when reviewers marked
#: images *not a digit*, its recipe has outlier exposure off (0) and the submission does not set
#: ``outlier_exposure``: the shipped OE model's weight (models/zoo/cnn4-lle-vgn-oe-mnist.yaml).
#: Without it those images would not be used at all.
REVIEW_OUTLIER_EXPOSURE = 1.0
#: A fine-tune (``init_from`` set) without its own ``lr`` runs at the recipe's lr times this.
FINE_TUNE_LR_FACTOR = 0.1

#: A submission's ``init``: start from the served model's weights, or from fresh ones.
INIT_CHOICES = ("served", "scratch")
#: A version derived for a retrained model ends with its job's id; a retrain of a retrained model
#: replaces that ending instead of adding another (``2.0.0-job-<a>`` -> ``2.0.0-job-<b>``).
_RETRAIN_SUFFIX = re.compile(r"-job-[0-9a-f]{12}$")
_SERVER_SET = {
    "data_root": "data_root is set by the server (VGE_DATA_ROOT); leave it out and give "
    "ImageFolder paths relative to it, e.g. dataset: imagefolder:my-images",
    "init_from": "init_from is set by the server; give init: served to start from the served "
    "model's weights, or init: scratch",
}
CANCEL_GRACE_S = 10.0
#: How often a running job's monitor looks for a cancel made through another replica.
CANCEL_POLL_S = 1.0
#: How often finished jobs' logs past their retention are looked for (at most).
LOG_SWEEP_INTERVAL_S = 3600.0


@dataclass
class _Running:
    process: SpawnProcess
    stop: ProcessEvent
    events: Queue[dict[str, Any]]  # the training child's events (JSON documents)
    thread: threading.Thread


class JobManager:
    """Queues, runs, cancels and records training jobs."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.store = JobStore(
            Database(settings.jobs_database_url), settings.resolved_replica_name()
        )
        self._ctx = mp.get_context("spawn")
        self._running: dict[str, _Running] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._submit_lock = threading.Lock()  # one submission at a time: capacity, then export
        self._stopping = threading.Event()  # set by shutdown: the log sweeper ends
        self._sweeper: threading.Thread | None = None
        self.reviews: ReviewStore | None = None  # set by the engine when the queue is on

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Mark jobs left queued/running by a previous process as interrupted."""
        for job in self.store.in_state(*ACTIVE):
            self.store.update(
                job["id"], state=JobState.INTERRUPTED, finished_at=time.time(),
                error="the server stopped while this job was queued or running",
            )  # fmt: skip
            self._remove_export(job["id"])
            log.warning("job %s marked interrupted (server restarted)", job["id"])
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.settings.models_root.mkdir(parents=True, exist_ok=True)
        self._refresh_gauge()
        if self.settings.job_log_retention_days > 0:
            self._sweeper = threading.Thread(
                target=self._sweep_logs_forever, daemon=True, name="vge-job-log-sweeper"
            )
            self._sweeper.start()

    def sweep_logs(self, now: float | None = None) -> list[str]:
        """Delete the folders (logs) of this replica's jobs that ended more than
        ``job_log_retention_days`` ago; the ids whose folder was deleted. The job's record,
        events and trained model stay: only its log goes."""
        now = time.time() if now is None else now
        cutoff = now - self.settings.job_log_retention_days * 86400.0
        removed = []
        for job_id in self.store.finished_before(cutoff):
            folder = self.settings.jobs_dir / job_id
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(job_id)
        if removed:
            log.info("deleted the logs of %d job(s) past their retention: %s", len(removed),
                     ", ".join(removed))  # fmt: skip
        return removed

    def _sweep_logs_forever(self) -> None:
        """Sweep at start, then every :data:`LOG_SWEEP_INTERVAL_S` (or a tenth of the retention
        when that is shorter) until :meth:`shutdown`."""
        interval = min(LOG_SWEEP_INTERVAL_S, self.settings.job_log_retention_days * 8640.0)
        while True:
            try:
                self.sweep_logs()
            except Exception:  # noqa: BLE001 - a database outage: logged, tried again later
                log.warning("sweeping job logs failed; retrying later", exc_info=True)
            if self._stopping.wait(max(1.0, interval)):
                return

    def shutdown(self, timeout_s: float = CANCEL_GRACE_S) -> None:
        """Stop running jobs (cooperatively, then by force) and mark them interrupted."""
        self._stopping.set()
        with self._lock:
            self._closed = True
            running = dict(self._running)
        for r in running.values():
            r.stop.set()
        deadline = time.monotonic() + timeout_s
        for r in running.values():
            r.process.join(max(0.0, deadline - time.monotonic()))
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(5)
        for r in running.values():
            r.thread.join(5)
        for job in self.store.in_state(*ACTIVE):
            self.store.update(job["id"], state=JobState.INTERRUPTED, finished_at=time.time(),
                              error="the server shut down while this job was queued or running")  # fmt: skip
            self._remove_export(job["id"])
        self._refresh_gauge()
        if self._sweeper is not None:
            self._sweeper.join(5)
        self.store.close()

    # ------------------------------------------------------------------ API
    def submit(self, config: dict[str, Any], served: Path | None = None) -> Job:
        """Resolve and validate a submission, record it queued, start it when a slot is free.

        ``served`` is the directory of the model the server serves now. A submission that names
        no architecture field trains that model's own configuration (:meth:`_resolve`) under its
        name with a new version. Everything that can be checked is checked before anything is
        written: the config, the device, the architecture and its bounds, whether the starting
        weights fit, and the queue's capacity; only then are reviewed images exported, into the
        job's own folder (removed when the job ends).
        """
        with self._submit_lock:
            job_id = f"job-{uuid.uuid4().hex[:12]}"
            cfg, reviews = self._resolve(job_id, dict(config), served)
            self._check_capacity()
            if reviews:
                mixed = cfg.dataset.endswith(MIXED_SUFFIX)
                self._export_reviews(self._export_dir(job_id), outliers=mixed)
            try:
                self.store.create(job_id, cfg.model_dump(mode="json"))
            except BaseException:
                self._remove_export(job_id)
                raise
        log.info("job %s queued: %s %s", job_id, cfg.model_name(), cfg.version)
        self._refresh_gauge()
        self._launch_queued()
        return self.get(job_id)

    def _resolve(
        self, job_id: str, config: dict[str, Any], served: Path | None
    ) -> tuple[TrainConfig, bool]:
        """The validated :class:`TrainConfig` of a submission, and whether it trains on reviews.

        * No architecture field (``backbone``, ``ensemble``, ``members``, ``vgn``, ...): the
          served model's configuration from its card (:func:`models.training.served_config`:
          architecture, loss, schedule, augmentation, stopping, calibration target), named as
          the served model with version ``<served version>-<job id>``; the submission's fields
          override it. Architecture fields given change only those fields of the served
          configuration. Without a served model: the library defaults, as ``vge train``.
        * ``init``: ``"served"`` starts from the served weights (fine-tuning), ``"scratch"`` from
          fresh ones. Default: ``"served"`` when the weights fit (same architecture, a dataset
          prepared like the served model's: e.g. ``reviews+mnist-bundled`` for a model trained
          on ``mnist-bundled``), else ``"scratch"``.
        """
        from pydantic import ValidationError

        from models.checkpoint import CheckpointError, read_card
        from models.training import TrainConfig, config_error_message, served_config
        from models.training.warmstart import check_init

        init = config.pop("init", None)
        if init not in (None, *INIT_CHOICES):
            raise InvalidValue(f"init must be one of {', '.join(map(repr, INIT_CHOICES))}")
        for key in ("data_root", "init_from"):
            if config.get(key) is not None:
                raise InvalidValue(_SERVER_SET[key])
        card = None
        if served is not None:
            try:
                card = read_card(served)
            except CheckpointError as exc:  # the served model's card vanished from disk
                log.warning("jobs: cannot read the served model's card: %s", exc)
        if init == "served" and card is None:
            raise InvalidValue("init 'served': no served model card to start from")
        user = dict(config)
        if card is not None:
            base = served_config(card)
            if "vgn" in user and user["vgn"] != card.vgn:
                base.pop("loss", None)  # the served loss suits its own gate, re-resolved
                base.pop("k", None)
            if "backbone" in user and user["backbone"] != base.get("backbone"):
                base.pop("backbone_kwargs", None)  # the served backbone's, not the new one's
            for one, other in (("target_risk", "target_deferral"),
                               ("target_deferral", "target_risk")):  # fmt: skip
                if user.get(one) is not None:
                    base.pop(other, None)  # the calibration the job asks for replaces the served
            # <served version>-<job id>, the served part cut so that it stays a card's version
            served_version = _RETRAIN_SUFFIX.sub("", card.version)[: 64 - len(job_id) - 1]
            base.update(
                name=card.name,
                version=f"{served_version}-{job_id}",
                description=f"{card.name} {card.version} retrained by training job {job_id}",
            )
            config = {**base, **user}
            if "image_size" not in user and not _resized_by(config.get("dataset")):
                config.pop("image_size", None)  # the served recipe's, for a dataset it fits
        reviews = config.get("dataset") in ("reviews", "reviews+mnist-bundled")
        if config.get("dataset") == "reviews+mnist-bundled":
            config = self._with_review_outliers(config, user)
        config = self._place_data(config, job_id)
        try:
            cfg = TrainConfig.model_validate(config)
        except ValidationError as exc:
            raise InvalidValue(config_error_message(exc)) from None
        _check_device(cfg.device)
        if card is not None and init != "scratch":
            with_init = cfg.model_copy(update={"init_from": str(served)})
            if init == "served":
                cfg = with_init  # check_architecture says why when they do not fit
            else:
                try:
                    check_init(with_init, card)
                    cfg = with_init
                except ValueError:
                    pass  # another architecture or data: trained from scratch
        if cfg.init_from is not None and "lr" not in user:
            # Fine-tuning at the recipe's peak lr undoes what the served weights learnt (the
            # shipped cnn4, 2 epochs on the bundled digits: 0.986 test accuracy at its lr 0.003,
            # 0.9925 at 0.0003; it serves 0.990): a tenth of it, unless the job says otherwise.
            cfg = cfg.model_copy(update={"lr": cfg.lr * FINE_TUNE_LR_FACTOR})
        try:
            cfg.check_architecture(card)
        except ValueError as exc:
            raise InvalidValue(f"invalid training config: {exc}") from None
        self._check_memory(cfg)
        return cfg, reviews

    def _with_review_outliers(self, config: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
        """A ``reviews+mnist-bundled`` job's config, with outlier exposure on at
        :data:`REVIEW_OUTLIER_EXPOSURE` when reviewers marked images *not a digit*, the recipe
        has it off and the submission does not set ``outlier_exposure`` (the job's answer shows
        the config it runs). A submission's own ``outlier_exposure: 0`` is kept, and logged:
        those images are then not used."""
        if self.reviews is None:
            return config  # _place_data says the queue is off
        n = self.reviews.not_a_digit_count()
        if not n or config.get("outlier_exposure"):
            return config
        if "outlier_exposure" in user:
            log.warning("jobs: outlier_exposure 0 given: the %d image(s) reviewers marked not a "
                        "digit are not used", n)  # fmt: skip
            return config
        log.info("jobs: %d image(s) marked not a digit: outlier exposure on at weight %g", n,
                 REVIEW_OUTLIER_EXPOSURE)  # fmt: skip
        return {**config, "outlier_exposure": REVIEW_OUTLIER_EXPOSURE}

    def memory_budget(self, device: str | None) -> int:
        """The bytes one job may need: ``job_memory_budget_bytes``, else
        :data:`JOB_MEMORY_FRACTION` of the memory of the device it trains on (its GPU's, or the
        host's RAM or cgroup limit; :func:`models.training.budget.device_memory`)."""
        from models.training.budget import JOB_MEMORY_FRACTION, device_memory

        if self.settings.job_memory_budget_bytes:
            return self.settings.job_memory_budget_bytes
        dev = device_memory(device)
        return int(JOB_MEMORY_FRACTION[dev.kind] * dev.total)

    def _check_memory(self, cfg: TrainConfig) -> None:
        """Refuse (422) a job whose estimated peak memory (parameters, gradients, optimiser
        state, the best-weights copy, one batch's activations:
        :func:`models.training.budget.estimate_training_memory`) is over :meth:`memory_budget`;
        the message gives the estimate by part and by how much it is over."""
        from models.training.budget import estimate_training_memory, gib

        try:
            estimate = estimate_training_memory(cfg)
        except ValueError as exc:
            raise InvalidValue(f"invalid training config: {exc}") from None
        except (TypeError, RuntimeError, ArithmeticError) as exc:  # a forward pass it cannot run
            raise InvalidValue(
                f"invalid training config: the model cannot run one batch "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"check backbone_kwargs {cfg.backbone_kwargs}"
            ) from None
        budget = self.memory_budget(cfg.device)
        if estimate.total_bytes > budget:
            source = (
                "VGE_JOB_MEMORY_BUDGET_BYTES"
                if self.settings.job_memory_budget_bytes
                else "VGE_JOB_MEMORY_BUDGET_BYTES unset: a share of the training device's memory"
            )
            raise InvalidValue(
                f"the training job needs about {estimate.describe()}; that is "
                f"{gib(estimate.total_bytes - budget)} over the job memory budget of {gib(budget)} "
                f"({source}): lower batch_size, members or the backbone's size"
            )

    def _check_capacity(self) -> None:
        """Refuse a job that would wait beyond ``max_queued_jobs`` (409 naming the limit)."""
        with self._lock:
            queued = len(self.store.in_state(JobState.QUEUED))
            free = max(0, self.settings.max_concurrent_jobs - len(self._running))
        limit = self.settings.max_queued_jobs
        if queued + 1 > free + limit:
            raise Conflict(
                f"the training queue is full: {queued} job(s) waiting, at most {limit} may wait "
                f"(VGE_MAX_QUEUED_JOBS={limit}) behind {self.settings.max_concurrent_jobs} "
                "running (VGE_MAX_CONCURRENT_JOBS); retry when one finishes, or cancel one"
            )

    def _place_data(self, config: dict[str, Any], job_id: str) -> dict[str, Any]:
        """Datasets live under ``data_root``: set it, and confine ImageFolder paths to it.
        ``reviews[+mnist-bundled]`` names the job's own export folder (written after validation,
        by :meth:`_export_reviews`)."""
        root = self.settings.data_root.resolve()
        config["data_root"] = str(root)
        dataset = config.get("dataset")
        if dataset in ("reviews", "reviews+mnist-bundled"):
            if self.reviews is None:
                raise InvalidValue(
                    f"dataset {dataset!r} needs the review queue: start the server with "
                    "VGE_REVIEW_QUEUE=on"
                )
            exported = self._export_dir(job_id)
            config["dataset"] = f"imagefolder:{exported}{dataset.removeprefix('reviews')}"
        elif isinstance(dataset, str) and (folder := parse_imagefolder(dataset)) is not None:
            rel, mixed = folder
            try:
                path = (root / rel).resolve()
                is_dir = path.is_dir()
            except (OSError, RuntimeError) as exc:  # a name too long, a symlink loop
                raise InvalidValue(
                    f"dataset path {rel[:200]!r} cannot be read under {str(root)!r}: "
                    f"{exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
                ) from None
            if path != root and root not in path.parents:
                raise InvalidValue(
                    f"dataset path {rel[:200]!r} is outside the data root {str(root)!r} "
                    "(VGE_DATA_ROOT); put the ImageFolder under it"
                )
            if not is_dir:
                raise InvalidValue(
                    f"dataset path {rel[:200]!r} is not a directory under {str(root)!r}"
                )
            config["dataset"] = f"imagefolder:{path}{MIXED_SUFFIX if mixed else ''}"
        return config

    def _export_dir(self, job_id: str) -> Path:
        """Where a job's reviewed images are exported: its own folder, removed when it ends."""
        return (self.settings.jobs_dir / job_id / "reviews").resolve()

    def _remove_export(self, job_id: str) -> None:
        """Delete a job's exported review images (a job that has ended no longer needs them)."""
        folder = self._export_dir(job_id)
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
            log.info("job %s: removed its exported review images", job_id)

    def _export_reviews(self, folder: Path, *, outliers: bool = True) -> None:
        """Write the human-labelled review items as an ImageFolder into ``folder`` (the job's
        own, so a job trains on the labels as they were when it was submitted): one folder per
        class, named by :func:`service.common.review_images.class_folder` (the class name when it is a
        safe folder name, never a path), and with ``outliers`` the images marked *not a digit*
        in ``outliers/`` (no class; ``reviews+mnist-bundled`` reads them as outliers). Nothing is
        left behind when it fails or finds nothing to export."""
        reviews = self.reviews
        assert reviews is not None, "checked when the job was accepted (_place_data)"
        n = 0
        root = folder.resolve()
        try:
            for path, png in reviews.export_items(outliers=outliers):
                # export_items names each image <safe class folder>/<sha256>.png; checked again
                # here, where it becomes a file: nothing is written outside the job's folder.
                target = (root / path).resolve()
                if target.parent.parent != root:
                    raise InvalidValue(f"review export: {path!r} is not a class folder's image")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(png)
                n += 1
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if n == 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise InvalidValue(
                "dataset 'reviews' has nothing to train on: no review item is labelled yet"
                + (
                    ""
                    if outliers
                    else " with a class (not-a-digit items train as outliers only, "
                    "with dataset 'reviews+mnist-bundled')"
                )
            )
        log.info("exported %d reviewed images to %s", n, folder)

    def get(self, job_id: str) -> Job:
        row = self.store.get(job_id)
        if row is None:
            raise NotFound(f"unknown training job {job_id!r}")
        return Job(**row, events=self.store.events(job_id))

    def list(self, limit: int = 100) -> list[JobRow]:
        return self.store.list(limit)

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job (running: cooperative stop, forced after a grace)."""
        with self._lock:
            job = self.store.get(job_id)
            if job is None:
                raise NotFound(f"unknown training job {job_id!r}")
            if job["state"].terminal:
                raise Conflict(f"job {job_id} is already {job['state']}; nothing to cancel")
            self.store.update(job_id, cancel_requested=1)
            # queued, and still so when written (a replica may be launching it: one of the two
            # conditional writes wins, store.start_running or this)
            if job["state"] is JobState.QUEUED and self.store.cancel_queued(job_id, time.time()):
                self._remove_export(job_id)
            elif job_id in self._running:
                self._stop(self._running[job_id])
        self._refresh_gauge()
        return self.get(job_id)

    def logs(self, job_id: str, tail: int = 200) -> str:
        """The last ``tail`` lines of a job's log, read from its end (never the whole file);
        empty once the log is past its retention (``VGE_JOB_LOG_RETENTION_DAYS``)."""
        if self.store.get(job_id) is None:
            raise NotFound(f"unknown training job {job_id!r}")
        return read_tail(self.settings.jobs_dir / job_id, tail)

    # ------------------------------------------------------------------ internals
    def _refresh_gauge(self) -> None:
        counts = self.store.counts()
        for state in JOB_STATES:
            self.metrics.training_jobs.labels(state=state).set(counts.get(state, 0))

    def _stop_if_cancelled_elsewhere(self, job_id: str, r: _Running) -> None:
        """Stop this replica's running job when a cancel reached it through another replica
        sharing the jobs database (which can only mark it: the process is this one's)."""
        if r.stop.is_set():
            return
        try:
            job = self.store.get(job_id)
        except Exception:  # noqa: BLE001 - a database outage: asked again at the next poll
            return
        if job is not None and job["cancel_requested"]:
            log.info("job %s: cancelled through another replica; stopping it", job_id)
            self._stop(r)

    def _stop(self, r: _Running) -> None:
        """Ask a running job to stop (cooperative), and force it after :data:`CANCEL_GRACE_S`."""
        r.stop.set()
        threading.Thread(target=self._force_stop, args=(r,), daemon=True).start()

    @staticmethod
    def _force_stop(r: _Running) -> None:
        r.process.join(CANCEL_GRACE_S)
        if r.process.is_alive():
            r.process.terminate()

    def _launch_queued(self) -> None:
        with self._lock:
            if self._closed:
                return
            for job in self.store.in_state(JobState.QUEUED):
                if len(self._running) >= self.settings.max_concurrent_jobs:
                    break
                self._launch(job)

    def _launch(self, job: JobRow) -> None:
        job_id = job["id"]
        # Everything that can fail before the process runs, first: the job stays queued (the
        # next launch tries again) rather than running with no process
        job_dir = self.settings.jobs_dir / job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        out_dir = self.settings.models_root / job_id
        events = self._ctx.Queue()
        stop = self._ctx.Event()
        if not self.store.start_running(job_id, time.time()):
            return  # cancelled meanwhile (through another replica): never started
        process = self._ctx.Process(
            target=child_main,
            args=(job_id, json.dumps(job["config"]), str(out_dir), str(job_dir / LOG_NAME),
                  events, stop, os.getpid(), self.settings.job_log_max_bytes),
            name=f"vge-train-{job_id}",
            daemon=True,
        )  # fmt: skip
        try:
            process.start()
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory or processes: said, not hung
            self.store.update(job_id, state=JobState.FAILED, finished_at=time.time(),
                              error=f"the training process could not start: {exc}")  # fmt: skip
            log.exception("job %s: the training process could not start", job_id)
            self._refresh_gauge()
            return
        thread = threading.Thread(target=self._monitor, args=(job_id,), daemon=True,
                                  name=f"vge-monitor-{job_id}")  # fmt: skip
        self._running[job_id] = _Running(process, stop, events, thread)
        thread.start()
        log.info("job %s started (pid %s)", job_id, process.pid)
        self._refresh_gauge()

    def _monitor(self, job_id: str) -> None:
        """Relay a job's events to the store until its process exits; then record the outcome."""
        r = self._running[job_id]
        result: dict[str, Any] | None = None
        error: str | None = None
        last_metrics: dict[str, Any] = {}
        checked = time.monotonic()
        while True:
            try:
                event = r.events.get(timeout=0.25)
            except queue.Empty:
                if not r.process.is_alive():
                    try:  # drain what the child sent just before exiting
                        event = r.events.get(timeout=0.5)
                    except queue.Empty:
                        break
                else:
                    event = None
            except Exception:  # noqa: BLE001 - a torn message (the child killed mid-send)
                log.exception("job %s: its event channel broke; waiting for its process", job_id)
                break
            if time.monotonic() - checked >= CANCEL_POLL_S:  # however busy the channel is
                checked = time.monotonic()
                self._stop_if_cancelled_elsewhere(job_id, r)
            if event is None:
                continue
            kind = event.get("type")
            if kind == "_result":
                result = event
            elif kind == "_error":
                error = event.get("error")
            else:
                self.store.add_event(job_id, event)
                for key in ("train_loss", "val_loss", "val_accuracy", "epoch"):
                    if event.get(key) is not None and kind in ("epoch", "done"):
                        last_metrics[key] = event[key]
        r.process.join(5)
        job = self.store.get(job_id)
        cancelled = job is not None and job["cancel_requested"]
        # The run has read its images, whatever its outcome: removed before the outcome is
        # recorded, so a client that sees the job ended never finds its export still there.
        self._remove_export(job_id)
        now = time.time()
        stopped = result is not None and result.get("stopped")  # by cancel or shutdown
        if cancelled or (stopped and self._closed):
            # A job stopped early leaves no model: what it saved before it stopped would
            # otherwise be promotable by its directory's name.
            shutil.rmtree(self.settings.models_root / job_id, ignore_errors=True)
        if cancelled:
            self.store.update(job_id, state=JobState.CANCELLED, finished_at=now,
                              metrics=last_metrics)  # fmt: skip
        elif result is not None and not stopped:
            self.store.update(job_id, state=JobState.SUCCEEDED, finished_at=now,
                              model_dir=result["model_dir"], metrics=last_metrics)  # fmt: skip
        elif self._closed:
            self.store.update(job_id, state=JobState.INTERRUPTED, finished_at=now,
                              error="the server shut down while this job ran")  # fmt: skip
        else:
            self.store.update(
                job_id, state=JobState.FAILED, finished_at=now, metrics=last_metrics,
                error=error or f"training process exited with code {r.process.exitcode}",
            )  # fmt: skip
        ended = self.store.get(job_id)
        log.info("job %s finished: %s", job_id, ended["state"] if ended else "gone")
        with self._lock:
            self._running.pop(job_id, None)
        if not self._closed:
            self._refresh_gauge()
            self._launch_queued()


def _resized_by(dataset: str | None) -> bool:
    """Whether ``image_size`` applies to ``dataset``: the reviews folder (an ImageFolder once
    exported), or :func:`models.training.config.resizes_images`."""
    from models.training.config import resizes_images

    return dataset == "reviews" or resizes_images(dataset or "")


def _check_device(device: str | None) -> None:
    """A job's ``device`` must exist on this server (422 at submission, not a failed job later)."""
    from models.training.runtime import check_device

    try:
        check_device(device)
    except ValueError as exc:
        raise InvalidValue(
            f"invalid training config: {exc}; leave device out to use the server's"
        ) from None
