"""The served model, in the engine: load, verify, warm up, and hot-swap (load-then-swap).

A reload or promote loads and verifies the new model completely (in a thread, off the event loop)
and only then swaps one reference and bumps the *generation*. Requests carry the generation their
inputs were prepared for; queued requests of the previous generation still run on the previous
predictor (kept until the next swap), and a batch never mixes generations, so in-flight batches
finish on the old model. A failed load leaves the served model untouched.

:class:`ModelInfo` is what front ends know about the served model (they never load it): name,
version, classes, input shape, which member set answers, the calibrated ``abstain_k`` per member
set, and the JSON that ``GET /v1/models`` shows.

**The served model is durable state.** Every change of the served model (start, promote, reload,
rollback) is recorded in the model history (:class:`service.engine.repository.ModelRepository`:
the jobs database, or the fleet's) *before* it is swapped in, with the weights' sha256, and only
once everything that can fail about it has passed (:func:`_load_sync`: the card validated whole,
the weights checked against it, the monitor's inputs, the warm-up): a model is in the history only
if it served. The rule of what a start serves: a promote or rollback
survives restarts of the same configuration; a start whose configured model (--model-dir /
VGE_MODEL_DIR, or none = the shipped default) differs from the previous start's serves what it was
told and logs it (:meth:`ModelManager.load_initial`). A recorded model that cannot be loaded, for
whatever reason, is never replaced silently and never stops the server: the start model is served,
an ERROR log line names the directory and what to do, ``vge_model_restore_failed`` is 1 and
``/v1/models`` carries ``restore_failed``, until a promote, reload or rollback records what is
served.

**The promote gate** (:meth:`ModelManager._gate`): before a promote serves a candidate, it and
the served model are evaluated on the same fixed data (the bundled MNIST test split and the
held-out digits, 3,600 images, through the serving path at each model's calibrated ``abstain_k``);
a candidate worse than the served model beyond the ``promote_max_*`` tolerances is refused (409
with the comparison) unless the request says ``force``. The comparison is stored in the history
entry. Rollback is not gated: it is the escape hatch. What the gate checks and decides is
evaluation (:mod:`models.evaluation.promote_gate`); here it is asked, cached, logged and turned
into :class:`PromoteRefused`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.checkpoint import WEIGHTS_FILE, CheckpointError, file_sha256
from models.evaluation.promote_gate import (
    GATE_DATA,
    GateTolerances,
    compare_for_gate,
    evaluate_for_gate,
    gate_skip_reason,
    gate_verdict,
)
from service.common.catalogue import resolve_by_name
from service.common.errors import Conflict, InvalidValue, NotReady
from service.common.metrics import Metrics
from service.common.model_info import ModelInfo
from service.common.settings import Settings
from service.engine.predictor import ServedPredictor
from service.engine.repository import (
    FLEET_RETRY_S,
    ModelRepository,
    configured_model,
    describe_configured,
    resolve_model_dir,
)
from service.engine.repository import iso as _iso

log = logging.getLogger("vge.models")


@dataclass(frozen=True)
class LoadedModel:
    """A verified, warmed-up predictor in the engine."""

    predictor: ServedPredictor
    model_dir: Path
    info: ModelInfo


def _describe(predictor: ServedPredictor, generation: int, device: str) -> ModelInfo:
    card = predictor.card
    calibrated = {m: card.abstain_k_for(m) for m in ("p", "q")}
    info = ModelInfo(
        generation=generation,
        name=card.name,
        version=card.version,
        class_names=tuple(str(c) for c in card.class_names),
        vgn=bool(card.vgn),
        in_channels=int(card.in_channels),
        input_size=(int(card.input_size[0]), int(card.input_size[1])),
        calibrated_k=calibrated,
        description={},
    )
    description = {
        "name": card.name,
        "version": card.version,
        "description": card.description,
        "classes": list(info.class_names),
        "ensemble_kind": card.ensemble,
        "members": card.members,
        "vgn": card.vgn,
        "answer_members": info.answer_members,
        "device": device,
        "abstain_k": calibrated[info.answer_members],
        "abstain_k_by_members": calibrated,
        "metrics": card.metrics,
        "input_shape": list(info.input_shape),
        # FP32 ``input`` = (pixels / 255 - mean) / std per channel (models.data.normalise_uint8):
        # what a client needs to build it (V2 metadata and config show the same).
        "input_mean": [float(m) for m in card.mean],
        "input_std": [float(s) for s in card.std],
        "created_at": card.created_at,
        "loaded_at": time.time(),
    }
    return ModelInfo(**{**info.__dict__, "description": description})


class ModelLoadError(ValueError):
    """A model directory that cannot be served: its card, its weights, the monitor's inputs or
    its warm-up failed. The message names the directory, the step and the problem (a 422 to the
    operator who asked for it; at an engine start, the reason in ``restore_failed``)."""


def _load_sync(
    model_dir: Path, device: str, generation: int, compile_: bool, max_batch: int = 1
) -> LoadedModel:
    """Everything that can fail about serving ``model_dir``, before any of it is recorded or
    served: the card validated whole and the weights checked against it
    (:func:`models.checkpoint.load_checkpoint`), the uncertainty monitor's inputs
    (:func:`service.engine.drift.monitor_inputs`), the description, and a warm-up through the
    serving path whose answers must be finite. Raises :class:`ModelLoadError` (or
    ``CheckpointError``, also a ``ValueError``) naming the step; a model that returns from here
    only has to be recorded and swapped in."""
    from models.predictor import Predictor, bucket_sizes
    from service.engine.drift import monitor_inputs

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    step = "loading"
    try:
        predictor = Predictor.from_dir(model_dir, device=device)
        step = "the uncertainty monitor's inputs"
        monitor_inputs(predictor.card)
        step = "compiling"
        if compile_:  # every bucket a batch of up to max_batch runs in: compiled and captured now
            predictor.compile(warm_up=bucket_sizes(max_batch))
        # Warm up (and, when compiled, capture) so the first request is not slow.
        step = "the warm-up"
        x = predictor.conform(torch.zeros((1, 28, 28), dtype=torch.uint8)).unsqueeze(0)
        out = predictor.run([x])
        columns = predictor.score_columns(out, predictor.options())
        if not np.isfinite(columns.data).all():
            raise ValueError("the model's answer to a blank image is not finite (NaN/inf weights?)")
        step = "its description"
        info = _describe(predictor, generation, device)
    except (ValueError, OSError) as exc:
        if step == "loading":  # CheckpointError, a missing file: they name the file and field
            raise
        raise ModelLoadError(f"{model_dir}: {step} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any failure of this model: refused, named
        problem = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelLoadError(
            f"{model_dir}: {step} failed: {type(exc).__name__}: {problem}"
        ) from exc
    return LoadedModel(predictor, Path(model_dir), info)


def check_recorded_weights(entry: dict[str, Any]) -> None:
    """Raise naming the problem when ``entry``'s directory is gone or its weights no longer hash
    to the sha256 recorded when it was served (entries of older versions recorded none)."""
    model_dir = Path(entry["model_dir"])
    if not model_dir.is_dir():
        raise FileNotFoundError(f"the directory {model_dir} does not exist (deleted or moved)")
    recorded = entry.get("weights_sha256")
    if recorded:
        weights = model_dir / WEIGHTS_FILE
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} does not exist")
        digest = file_sha256(weights)
        if digest != recorded:
            raise CheckpointError(
                f"{weights}: sha256 {digest[:16]}… is not the {recorded[:16]}… recorded when it "
                "was served (the weights were replaced since)"
            )


def _same_start(current: LoadedModel, entry: dict[str, Any]) -> bool:
    """Whether ``entry`` is another replica's start on the model ``current`` serves: the same
    directory, weights (sha256), name and version. Replicas that start together each record
    their start, and those entries are adopted as they are; a promote, rollback or reload is
    always loaded, since it may re-read a card rewritten in place (a new version, a recalibrated
    ``abstain_k``) over the same weights."""
    card = current.predictor.card
    return (
        entry.get("action") == "start"
        and str(current.model_dir.resolve()) == entry["model_dir"]
        and (entry.get("weights_sha256") or card.weights_sha256) == card.weights_sha256
        and (entry.get("model"), entry.get("version")) == (card.name, card.version)
    )


class PromoteRefused(Conflict):
    """The promote gate found the candidate worse than the served model (409, with the
    comparison); ``force`` serves it anyway."""

    code = "promote_refused"

    def __init__(self, message: str, comparison: dict[str, Any]) -> None:
        super().__init__(message)
        self.comparison = comparison


class ModelManager:
    """Holds the served model (and the previous generation); records, gates and swaps."""

    def __init__(
        self, settings: Settings, metrics: Metrics, history: ModelRepository | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        #: where the served-model state, its history and the catalogue live (None: nowhere, a
        #: library user's engine); :attr:`ModelRepository.fleet`: every replica serves its latest
        self.history = history
        #: a fleet replica's state (None: not in a fleet): whether it serves the fleet's model
        #: (``converged``), the fleet's entry, and why not (``error``); in ``/v1/models``
        self.fleet: dict[str, Any] | None = None
        if history is not None and history.fleet:
            self.fleet = {"replica": history.replica, "converged": False,
                          "fleet_model": None, "error": None}  # fmt: skip
        #: the fleet entry that failed to load here, and when (retried after FLEET_RETRY_S)
        self._fleet_failed: tuple[str, float] | None = None
        self._fleet_reported = 0.0
        self._current: LoadedModel | None = None
        self._previous: LoadedModel | None = None
        self._generation = 0
        self._lock = asyncio.Lock()
        #: gate evaluations by (weights sha256, card JSON): each model is evaluated once
        self._evaluations: dict[tuple[str, str], dict[str, Any]] = {}
        #: why the recorded model was not restored at start (None: it was, or nothing to restore)
        self.restore_failed: dict[str, Any] | None = None

    @property
    def current(self) -> LoadedModel | None:
        return self._current

    def generation_of(self, predictor: ServedPredictor) -> int | None:
        """The generation ``predictor`` was loaded as, if it is still current or previous."""
        for loaded in (self._current, self._previous):
            if loaded is not None and loaded.predictor is predictor:
                return loaded.info.generation
        return None

    def predictor_for(self, generation: int) -> ServedPredictor:
        """The predictor of ``generation`` (current or previous), else a 503 asking for a retry."""
        for loaded in (self._current, self._previous):
            if loaded is not None and loaded.info.generation == generation:
                return loaded.predictor
        if self._current is None:
            raise NotReady("no model is loaded yet")
        raise NotReady(
            "the served model was swapped twice while this request waited; retry",
            headers={"Retry-After": "1"},
        )

    # ------------------------------------------------------------------ load and swap
    async def _load(self, model_dir: Path) -> LoadedModel:
        """Load, verify and warm up ``model_dir`` off the event loop (not served yet)."""
        t0 = time.perf_counter()
        loaded = await asyncio.to_thread(
            _load_sync,
            Path(model_dir),
            self.settings.resolved_device(),
            self._generation + 1,
            self.settings.resolved_compile(),
            self.settings.resolved_max_batch_size(),
        )
        self.metrics.model_load.labels(model=loaded.info.name).observe(time.perf_counter() - t0)
        return loaded

    def _swap(self, loaded: LoadedModel, served: dict[str, Any]) -> LoadedModel:
        """Serve ``loaded`` (one reference swap); ``served`` says since when and why, and goes
        into the description ``/v1/models`` shows."""
        description = {**loaded.info.description, **served}
        if self.fleet is not None:
            description["fleet"] = dict(self.fleet)
        info = replace(loaded.info, description=description)
        loaded = replace(loaded, info=info)
        self._generation = info.generation
        self._previous, self._current = self._current, loaded
        old = self._previous
        log.info(
            "serving %s %s from %s on %s (%s)%s",
            info.name, info.version, loaded.model_dir, info.description["device"],
            served["served_because"],
            f", replacing {old.info.name} {old.info.version}" if old else "",
        )  # fmt: skip
        return loaded

    @staticmethod
    def _served(entry: dict[str, Any] | None, because: str, **more: Any) -> dict[str, Any]:
        """The served-state fields of ``/v1/models`` for a model chosen by ``entry``."""
        return {
            "served_since": _iso(entry["at"] if entry else time.time()),
            "served_because": because,
            "history_id": entry["id"] if entry else None,
            "restored_from": None,
            "restore_failed": None,
            "gate": entry.get("comparison") if entry else None,
            **more,
        }

    async def load(
        self,
        model_dir: Path,
        action: str = "load",
        *,
        gate: bool = False,
        force: bool = False,
        note: str | None = None,
    ) -> LoadedModel:
        """Load and verify ``model_dir`` off the event loop; with ``gate``, compare it with the
        served model (:meth:`_gate`, may refuse); record it in the history as ``action``; only
        then swap it in. A failure at any step leaves the served model untouched."""
        async with self._lock:
            loaded = await self._load(Path(model_dir))
            comparison = await self._gate(loaded, force) if gate else None
            entry = None
            if self.history is not None:
                entry = await asyncio.to_thread(
                    self.history.record, action, loaded.info, model_dir,
                    weights_sha256=loaded.predictor.card.weights_sha256,
                    comparison=comparison, note=note,
                )  # fmt: skip
            if self.restore_failed is not None:
                log.warning("model restore failure resolved: %s now records what is served", action)
                self.restore_failed = None
            self.metrics.model_restore_failed.set(0)
            self._fleet_set(entry, None)
            return self._swap(loaded, self._served(entry, action, gate=comparison))

    async def load_initial(self, first_start: bool = True) -> LoadedModel:
        """The model to serve at an engine start, by the rule: a promote or rollback survives
        restarts of the same configuration; a start whose configured model (--model-dir /
        VGE_MODEL_DIR, or none = the shipped default) differs from the previous start's serves
        what it was told and logs it.

        So at the first engine start of a ``vge serve`` run (``first_start``) the configured
        model (:func:`configured_model`) is compared with the one the previous start recorded
        (:meth:`ModelRepository.previous_configuration`): the same, and the newest history
        entry is restored
        (after checking its weights' sha256 and loading it whole); another, and the configured
        model is served and recorded as a ``start`` whose note names both. The engine's restarts
        within a run always restore. An empty history serves the configured model;
        ``model_dir_explicit`` (``VGE_MODEL_DIR_EXPLICIT``) serves it at this start whatever the
        history says. A database from before configurations were recorded compares
        ``VGE_MODEL_DIR`` with the newest ``start`` entry, as that version did.

        A recorded model that fails at any step (its files, card, weights, monitor, warm-up,
        memory: any ``Exception``) never stops the start: the configured model serves, reported
        (:attr:`restore_failed`, an ERROR log line, ``vge_model_restore_failed``); at a restart,
        should the configured model fail too, the shipped default serves. A configured model
        that fails at the first start is a configuration error: the start fails, naming it."""
        start_dir = resolve_model_dir(self.settings.model_dir)
        configured = configured_model(self.settings.model_dir)
        latest = previous = None
        if self.history is not None:
            latest = await asyncio.to_thread(self.history.latest)
            if first_start:
                previous = await asyncio.to_thread(self.history.previous_configuration, configured)
        self.metrics.model_restore_failed.set(0)
        if latest is None:
            loaded = await self.load(start_dir, "start")
            await self._remember_configured(configured)
            return loaded
        recorded = f"{latest['model']} {latest['version']} from {latest['model_dir']} " \
                   f"({latest['action']} at {_iso(latest['at'])})"  # fmt: skip
        if first_start:
            note = await self._new_configuration(configured, previous, start_dir)
            if note is not None:
                log.warning(
                    "%s: serving %s, not %s, which the model history records (a promote or "
                    "rollback survives restarts of the same configuration only)",
                    note, start_dir, recorded,
                )  # fmt: skip
                loaded = await self.load(start_dir, "start", note=note)
                await self._remember_configured(configured)
                return loaded
            await self._remember_configured(configured)
        replaced: BaseException | None = None
        async with self._lock:
            try:
                await asyncio.to_thread(check_recorded_weights, latest)
                loaded = await self._load(Path(latest["model_dir"]))
            except (CheckpointError, FileNotFoundError) as exc:
                if not (first_start and self._own_start_of(latest, start_dir)):
                    return await self._restore_failed(latest, recorded, exc, start_dir, first_start)
                replaced = exc  # below, once the lock is free (load takes it)
            except Exception as exc:  # noqa: BLE001 - any failure: serve the start model, loudly
                return await self._restore_failed(latest, recorded, exc, start_dir, first_start)
        if replaced is not None:
            # Nothing was promoted since this replica's last start, and the model it configures
            # has new files since (an upgrade of the image or package that ships the default, a
            # model directory replaced in place): serve them, as a start with this
            # configuration would, and record it; not a failed restore (no alarm).
            problem = str(replaced).splitlines()[0] if str(replaced) else type(replaced).__name__
            note = f"the configured model's files changed since its last start ({problem})"
            log.warning("%s: serving %s; the history recorded %s", note, start_dir, recorded)
            return await self.load(start_dir, "start", note=note)
        log.info("restored %s (weights sha256 verified)", recorded)
        restored_from = {"history_id": latest["id"], "action": latest["action"],
                         "at": _iso(latest["at"])}  # fmt: skip
        self._fleet_set(latest, None)
        return self._swap(loaded, self._served(latest, "restored", restored_from=restored_from))

    def _own_start_of(self, entry: dict[str, Any], start_dir: Path) -> bool:
        """Whether ``entry`` is this replica's own start on the model it configures now (the
        same directory, or one no longer there: the configured model moved with an upgrade)."""
        if entry.get("action") != "start" or self.history is None:
            return False
        if entry.get("replica") not in (None, self.history.replica):
            return False
        recorded = Path(entry["model_dir"])
        return recorded == start_dir.resolve() or not recorded.exists()

    async def _new_configuration(
        self, configured: str, previous: str | None, start_dir: Path
    ) -> str | None:
        """Why this first start serves its configured model rather than the history's newest
        entry (the note of its ``start`` entry), or None: restore."""
        if self.settings.model_dir_explicit:
            return "model_dir given explicitly (VGE_MODEL_DIR_EXPLICIT)"
        if previous is not None:
            if previous == configured:
                return None
            return (
                f"configured model changed: {describe_configured(configured)}, was "
                f"{describe_configured(previous)}"
            )
        # No configuration recorded yet (an older database): its rule, VGE_MODEL_DIR against
        # the newest start entry; a start naming no model restored.
        if self.settings.model_dir is None or self.history is None:
            return None
        last = await asyncio.to_thread(self.history.latest_start)
        if last is not None and Path(start_dir).resolve() != Path(last["model_dir"]):
            return f"configured model changed: {configured}, was {last['model_dir']}"
        return None

    async def _remember_configured(self, configured: str) -> None:
        """Record this start's configured model (what the next start compares with)."""
        if self.history is not None:
            await asyncio.to_thread(self.history.set_configured, configured)

    async def _restore_failed(
        self,
        latest: dict[str, Any],
        recorded: str,
        exc: BaseException,
        start_dir: Path,
        first_start: bool = True,
    ) -> LoadedModel:
        """Serve the start model instead of the recorded one that failed (lock held), and say so
        in the log (ERROR), the metric and ``/v1/models``. Nothing is recorded: every start
        retries the recorded model until an operator chooses one (promote, rollback, reload).

        At an engine restart (not ``first_start``) a start model that fails too gives way to the
        shipped default: a restart never ends in an engine that cannot serve, and so never in
        a supervisor that gives up. At the first start it is a configuration error (raised)."""
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fix = (
            f"put the model back at {latest['model_dir']} and restart the server, or choose the "
            "model to serve: POST /v1/models/promote or /v1/models/rollback, or start with "
            "--model-dir"
        )
        log.error(
            "cannot restore the served model: the model history records %s, but it cannot be "
            "loaded: %s. Serving the start model from %s instead (vge_model_restore_failed 1). "
            "To fix: %s", recorded, problem, start_dir, fix,
        )  # fmt: skip
        self._fleet_set(latest, f"cannot load the fleet's model: {problem}")
        self._fleet_failed = (latest["id"], time.monotonic())
        self.restore_failed = {
            "model": latest["model"],
            "version": latest["version"],
            "model_dir": latest["model_dir"],
            "history_id": latest["id"],
            "recorded_action": latest["action"],
            "recorded_at": _iso(latest["at"]),
            "error": problem,
            "fix": fix,
        }
        self.metrics.model_restore_failed.set(1)
        try:
            loaded = await self._load(start_dir)
        except Exception as start_exc:
            default = resolve_model_dir(None)
            if first_start or Path(start_dir).resolve() == default.resolve():
                raise
            start_problem = str(start_exc).splitlines()[0] or type(start_exc).__name__
            log.error(
                "the start model %s cannot be loaded either (%s): serving the shipped default "
                "%s", start_dir, start_problem, default,
            )  # fmt: skip
            self.restore_failed["start_model_error"] = start_problem
            loaded = await self._load(default)
        return self._swap(loaded, self._served(None, "start", restore_failed=self.restore_failed))

    # ------------------------------------------------------------------ the fleet
    def _fleet_set(self, entry: dict[str, Any] | None, error: str | None) -> None:
        """A fleet replica's state: ``entry`` is the fleet's model; ``error`` None means this
        replica serves it (``vge_fleet_converged`` 1), else why it does not (0). Shown in
        ``/v1/models`` from the next swap or :meth:`_refresh_fleet`."""
        if self.fleet is None:
            return
        fleet_model = None
        if entry is not None:
            fleet_model = {k: entry.get(k) for k in ("id", "action", "replica", "model", "version",
                                                     "model_dir", "weights_sha256")}  # fmt: skip
            fleet_model["at"] = _iso(entry["at"])
        converged = entry is not None and error is None
        self.fleet = {"replica": self.fleet["replica"], "converged": converged,
                      "fleet_model": fleet_model, "error": error}  # fmt: skip
        self.metrics.fleet_converged.labels(replica=self.fleet["replica"]).set(int(converged))
        if converged:
            self._fleet_failed = None

    def _refresh_fleet(self, **served: Any) -> None:
        """Show the fleet state (and ``served`` fields) in the served model's description
        without a swap (same predictor, same generation)."""
        current = self._current
        if current is None or self.fleet is None:
            return
        description = {**current.info.description, **served, "fleet": dict(self.fleet)}
        self._current = replace(current, info=replace(current.info, description=description))

    async def follow_fleet(self) -> bool:
        """A fleet replica: serve the fleet's model (the repository's newest entry) when this
        replica does not. The same weights already served (replicas that started together each
        recorded them) are adopted as they are; others are loaded the way every model is
        (:func:`check_recorded_weights`: the sha256 recorded when it was served; then
        :meth:`_load`: card, weights, monitor, warm-up) and only then swapped in, so in-flight
        requests finish on the old model. A model that cannot be loaded here (missing on this
        replica's volume, sha256 mismatch, out of memory) leaves the served one untouched,
        said in ``/v1/models`` (``fleet.error``), ``vge_fleet_converged`` 0 and an ERROR line,
        and is tried again after :data:`FLEET_RETRY_S`. Returns whether what the front ends
        show changed (the engine then tells them)."""
        repo = self.history
        if self.fleet is None or repo is None:
            return False
        changed = False
        async with self._lock:
            # Read under the lock: a read made while this replica's own promote held it is the
            # entry before that promote, and acting on it swapped the old model back in for a
            # poll interval right after the promote answered 200.
            latest = await asyncio.to_thread(repo.latest)
            current = self._current
            if latest is None or current is None:
                return False
            before = dict(self.fleet)
            if current.info.description.get("history_id") == latest["id"]:
                self._fleet_set(latest, None)
            elif _same_start(current, latest):
                self._fleet_set(latest, None)
                self._refresh_fleet(history_id=latest["id"])
                changed = True
            else:
                failed = self._fleet_failed
                if (
                    failed is not None
                    and failed[0] == latest["id"]
                    and (time.monotonic() - failed[1] < FLEET_RETRY_S)
                ):
                    return False
                self.metrics.fleet_converged.labels(replica=self.fleet["replica"]).set(0)
                try:
                    await asyncio.to_thread(check_recorded_weights, latest)
                    loaded = await self._load(Path(latest["model_dir"]))
                except Exception as exc:  # noqa: BLE001 - any failure: keep serving, say why
                    problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    if failed is None or failed[0] != latest["id"]:
                        log.error(
                            "fleet: cannot serve the fleet's model %s %s from %s (%s by %s at "
                            "%s): %s. Still serving %s %s (vge_fleet_converged 0); retrying "
                            "every %g s", latest["model"], latest["version"],
                            latest["model_dir"], latest["action"], latest["replica"],
                            _iso(latest["at"]), problem, current.info.name,
                            current.info.version, FLEET_RETRY_S,
                        )  # fmt: skip
                    self._fleet_failed = (latest["id"], time.monotonic())
                    self._fleet_set(latest, f"cannot load the fleet's model: {problem}")
                else:
                    if self.restore_failed is not None:
                        self.restore_failed = None
                        self.metrics.model_restore_failed.set(0)
                    self._fleet_set(latest, None)
                    self._swap(loaded, self._served(latest, "fleet"))
                    changed = True
            self._refresh_fleet()
            changed = changed or self.fleet != before
        await self.report_fleet(force=changed)
        return changed

    async def report_fleet(self, force: bool = True) -> None:
        """Tell the fleet what this replica serves (:meth:`ModelRepository.report`): now when
        ``force``, else at most every 10 s (a heartbeat). A database outage is not an error
        here: the next report says it."""
        repo, current = self.history, self._current
        if self.fleet is None or repo is None or current is None:
            return
        now = time.monotonic()
        if not force and now - self._fleet_reported < 10.0:
            return
        fleet_model = self.fleet.get("fleet_model") or {}
        state = {
            "converged": self.fleet["converged"],
            "history_id": current.info.description.get("history_id"),
            "model": current.info.name,
            "version": current.info.version,
            "model_dir": str(current.model_dir.resolve()),
            "weights_sha256": current.predictor.card.weights_sha256,
            "fleet_history_id": fleet_model.get("id"),
            "error": self.fleet["error"],
        }
        try:
            await asyncio.to_thread(repo.report, state)
            self._fleet_reported = now
        except Exception as exc:  # noqa: BLE001 - reported again at the next heartbeat
            log.debug("fleet: report failed: %s", exc)

    # ------------------------------------------------------------------ the promote gate
    async def _evaluation(self, predictor: ServedPredictor) -> dict[str, Any]:
        """:func:`evaluate_for_gate` of ``predictor``, once per model (cached)."""
        card = predictor.card
        key = (card.weights_sha256, card.model_dump_json())
        result = self._evaluations.get(key)
        if result is None:
            batch = self.settings.resolved_max_batch_size()
            result = await asyncio.to_thread(evaluate_for_gate, predictor, batch)
            if len(self._evaluations) >= 16:
                self._evaluations.clear()
            self._evaluations[key] = result
        return result

    def _tolerances(self) -> GateTolerances:
        """The gate's tolerances: the ``promote_max_*`` settings."""
        return GateTolerances(
            accuracy_drop=self.settings.promote_max_accuracy_drop,
            accepted_accuracy_drop=self.settings.promote_max_accepted_accuracy_drop,
            deferral_rise=self.settings.promote_max_deferral_rise,
        )

    async def _gate(self, candidate: LoadedModel, force: bool) -> dict[str, Any]:
        """Compare ``candidate`` with the served model (:func:`compare_for_gate`, its verdict
        :func:`gate_verdict`); the comparison, with its ``verdict`` (passed, forced, skipped), or
        :class:`PromoteRefused`."""
        served = self._current
        assert served is not None
        t0 = time.perf_counter()
        reason = gate_skip_reason(candidate.predictor.card) or gate_skip_reason(
            served.predictor.card
        )
        if reason is not None:
            log.warning("promote gate skipped: %s; promoting without a comparison", reason)
            return {"verdict": "skipped", "reason": reason, "data": GATE_DATA, "force": force}
        try:
            comparison = compare_for_gate(
                await self._evaluation(served.predictor),
                await self._evaluation(candidate.predictor),
                self._tolerances(),
            )
        except Exception as exc:  # noqa: BLE001 - never serve unchecked because the check broke
            log.exception("promote gate: the evaluation failed")
            problem = f"{type(exc).__name__}: {exc}"
            comparison = {"data": GATE_DATA, "failures": [f"the evaluation failed ({problem})"]}
        comparison["seconds"] = round(time.perf_counter() - t0, 3)
        comparison["force"] = force
        name = f"{candidate.info.name} {candidate.info.version}"
        verdict = comparison["verdict"] = gate_verdict(comparison["failures"], force)
        if verdict == "passed":
            log.info("promote gate passed: %s", name)
            return comparison
        why = "; ".join(comparison["failures"])
        if verdict == "forced":
            log.warning("promote gate: %s is worse than the served model (%s); served anyway "
                        "(force)", name, why)  # fmt: skip
            return comparison
        log.warning("promote gate refused %s: %s", name, why)
        raise PromoteRefused(
            f"promote refused: {name} is worse than the served {served.info.name} "
            f"{served.info.version} on {GATE_DATA}: {why}. It was not served; promote with "
            '"force": true to serve it anyway',
            comparison,
        )

    # ------------------------------------------------------------------ operations
    async def reload(self) -> LoadedModel:
        """Load the served model's directory again (e.g. after its files changed)."""
        if self._current is None:
            raise NotReady("no model is loaded yet")
        return await self.load_checked(self._current.model_dir, "reload")

    def resolve(self, name: str) -> Path:
        """A model directory under ``models_root`` by name, or a shipped model's
        (:func:`service.common.catalogue.resolve_by_name`: no paths, no traversal)."""
        return resolve_by_name(self.settings, name)

    async def promote(self, name: str, force: bool = False) -> LoadedModel:
        """Load ``models_root/name`` (or a shipped model), pass the gate, serve it."""
        return await self.load_checked(self.resolve(name), "promote", gate=True, force=force)

    async def rollback(self, entry_id: str | None) -> LoadedModel:
        """Serve an earlier model of the history again (default: the one before the current).

        Not gated: rollback is the escape hatch when a promoted model disappoints. The entry's
        weights must still hash to what was recorded."""
        if self.history is None:
            raise NotReady("this server keeps no model history")
        entry = await asyncio.to_thread(self.history.target, entry_id)
        path = Path(entry["model_dir"])
        try:
            await asyncio.to_thread(check_recorded_weights, entry)
        except (ValueError, OSError) as exc:
            raise InvalidValue(
                f"history entry {entry['id']} ({entry['model']} {entry['version']}) cannot be "
                f"served again: {exc}"
            ) from None
        note = f"to {entry['id']} ({entry['action']} at {_iso(entry['at'])})"
        return await self.load_checked(path, "rollback", note=note)

    async def load_checked(
        self, path: Path, action: str = "load", *, gate: bool = False, force: bool = False,
        note: str | None = None,
    ) -> LoadedModel:  # fmt: skip
        """:meth:`load`, a model that fails to load being a 422 naming it."""
        try:
            return await self.load(path, action, gate=gate, force=force, note=note)
        except (ValueError, FileNotFoundError, OSError) as exc:  # CheckpointError is a ValueError
            raise InvalidValue(
                f"model at {path.name!r} failed to load and was not served: {exc}"
            ) from None
