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
rollback) is recorded in :class:`ModelHistory` (the jobs database) *before* it is swapped in, with
the weights' sha256, and only once everything that can fail about it has passed (:func:`_load_sync`:
the card validated whole, the weights checked against it, the monitor's inputs, the warm-up): a
model is in the history only if it served. The rule of what a start serves: a promote or rollback
survives restarts of the same configuration; a start whose configured model (--model-dir /
VGE_MODEL_DIR, or none = the shipped default) differs from the previous start's serves what it was
told and logs it (:meth:`ModelManager.load_initial`). A recorded model that cannot be loaded, for
whatever reason, is never replaced silently and never stops the server: the start model is served,
an ERROR log line names the directory and what to do, ``vge_model_restore_failed`` is 1 and
``/v1/models`` carries ``restore_failed``, until a promote, reload or rollback records what is
served.

**The promote gate** (:func:`gate_comparison`): before a promote serves a candidate, it and the
served model are evaluated on the same fixed data (the bundled MNIST test split and the held-out
digits, 3,600 images, through the serving path at each model's calibrated ``abstain_k``); a
candidate worse than the served model beyond the ``promote_max_*`` tolerances is refused (409 with
the comparison) unless the request says ``force``. The comparison is stored in the history entry.
Rollback is not gated: it is the escape hatch.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.checkpoint import (
    MODEL_NAME_PATTERN,
    WEIGHTS_FILE,
    CheckpointError,
    ModelCard,
    file_sha256,
)
from service.common.db import Database
from service.common.errors import Conflict, InvalidValue, NotFound, NotReady
from service.common.metrics import Metrics
from service.common.model_info import ModelInfo
from service.common.settings import Settings
from service.engine.predictor import ServedPredictor

log = logging.getLogger("vge.models")

_NAME_RE = re.compile(MODEL_NAME_PATTERN)


@dataclass(frozen=True)
class LoadedModel:
    """A verified, warmed-up predictor in the engine."""

    predictor: ServedPredictor
    model_dir: Path
    info: ModelInfo


def resolve_model_dir(model_dir: Path | None) -> Path:
    """``model_dir`` as given; a bare name of a shipped model when no such directory exists; the
    shipped default when unset (:func:`models.zoo.resolve_model_dir`)."""
    from models.zoo import resolve_model_dir as zoo_resolve

    return zoo_resolve(model_dir)


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


_HISTORY_SCHEMA = """
CREATE TABLE IF NOT EXISTS model_history (
    id TEXT PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    replica TEXT NOT NULL,
    action TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    model_dir TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS model_history_replica_at ON model_history (replica, at);
CREATE TABLE IF NOT EXISTS model_start_config (
    replica TEXT PRIMARY KEY,
    configured TEXT NOT NULL,
    at DOUBLE PRECISION NOT NULL
)
"""

#: :meth:`ModelHistory.configured` of a start that names no model (the shipped default).
CONFIGURED_DEFAULT = ""


def configured_model(model_dir: Path | None) -> str:
    """How a start's configured model is recorded and compared: ``--model-dir`` /
    ``VGE_MODEL_DIR`` resolved to an absolute directory (a shipped model's name to its
    directory), or :data:`CONFIGURED_DEFAULT` when none is given. "None" is its own
    configuration: it follows the shipped default wherever the package is installed."""
    if model_dir is None or str(model_dir) == "":
        return CONFIGURED_DEFAULT
    return str(resolve_model_dir(model_dir).resolve())


def describe_configured(configured: str | None) -> str:
    """A recorded configuration as a person reads it in the log and the history's notes."""
    if configured is None:
        return "not recorded"
    return "none (the shipped default)" if configured == CONFIGURED_DEFAULT else configured


#: Columns added after the table was first created; older databases get them at start
#: (:meth:`Database.add_column`). ``comparison`` holds the promote gate's comparison as JSON text.
_HISTORY_COLUMNS = (("weights_sha256", "TEXT"), ("comparison", "TEXT"), ("note", "TEXT"))


def _iso(at: float) -> str:
    """An epoch time as ISO 8601 UTC (seconds), as ``/v1/models`` shows times."""
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


class ModelHistory:
    """Every model this replica chose to serve, in order (start, promote, promote_job, reload,
    rollback), durably, with the weights' sha256 and the promote gate's comparison.

    The newest entry is the model the engine restores at its next start. The shipped models,
    models under models_root and job models alike: rolling back needs only the directory, so any
    earlier entry can be served again (while its directory holds the recorded weights). An engine
    restart that restores the newest entry adds no entry (it changes nothing), so "roll back"
    without a target still means "the model before the latest change".
    """

    def __init__(self, db: Database, replica: str) -> None:
        self.db = db
        self.replica = replica
        db.script(_HISTORY_SCHEMA)
        for column, decl in _HISTORY_COLUMNS:
            db.add_column("model_history", column, decl)

    def record(
        self,
        action: str,
        info: ModelInfo,
        model_dir: Path,
        *,
        weights_sha256: str = "",
        comparison: dict[str, Any] | None = None,
        note: str | None = None,
    ) -> dict[str, Any]:
        """Insert one entry (before the model is swapped in: what is served is always recorded);
        returns it as :meth:`entries` shows it."""
        row = {
            "id": uuid.uuid4().hex[:16],
            "at": time.time(),
            "replica": self.replica,
            "action": action,
            "model": info.name,
            "version": info.version,
            "model_dir": str(Path(model_dir).resolve()),
            "weights_sha256": weights_sha256 or None,
            "comparison": None if comparison is None else json.dumps(comparison),
            "note": note,
        }
        self.db.execute(
            f"INSERT INTO model_history ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
        return self._decoded(row)

    @staticmethod
    def _decoded(row: dict[str, Any]) -> dict[str, Any]:
        """A row with its comparison parsed from JSON."""
        out = dict(row)
        raw = out.get("comparison")
        out["comparison"] = json.loads(raw) if isinstance(raw, str) and raw else None
        return out

    def entries(self, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first."""
        rows = self.db.fetchall(
            "SELECT * FROM model_history WHERE replica = ? ORDER BY at DESC, id DESC LIMIT ?",
            (self.replica, limit),
        )
        return [self._decoded(r) for r in rows]

    def latest(self) -> dict[str, Any] | None:
        """The newest entry: the model this replica should be serving (None: never served)."""
        rows = self.entries(1)
        return rows[0] if rows else None

    def configured(self) -> str | None:
        """The configured model of this replica's previous start (:func:`configured_model`), or
        None when no start recorded one (a database from before configurations were kept)."""
        row = self.db.fetchone(
            "SELECT configured FROM model_start_config WHERE replica = ?", (self.replica,)
        )
        return None if row is None else str(row["configured"])

    def set_configured(self, configured: str) -> None:
        """Record the configured model of this start (one row per replica: the latest)."""
        self.db.execute(
            "INSERT INTO model_start_config (replica, configured, at) VALUES (?, ?, ?) "
            "ON CONFLICT (replica) DO UPDATE SET configured = excluded.configured, "
            "at = excluded.at",
            (self.replica, configured, time.time()),
        )

    def latest_start(self) -> dict[str, Any] | None:
        """The newest ``start`` entry: the configured model of the last start that recorded one."""
        row = self.db.fetchone(
            "SELECT * FROM model_history WHERE replica = ? AND action = 'start' "
            "ORDER BY at DESC, id DESC LIMIT 1",
            (self.replica,),
        )
        return self._decoded(row) if row is not None else None

    def target(self, entry_id: str | None) -> dict[str, Any]:
        """The entry to roll back to: ``entry_id``, else the one before the latest (undo)."""
        if entry_id is not None:
            row = self.db.fetchone(
                "SELECT * FROM model_history WHERE id = ? AND replica = ?", (entry_id, self.replica)
            )
            if row is None:
                raise NotFound(f"no model history entry {entry_id!r} on this replica")
            return self._decoded(row)
        entries = self.entries(2)
        if len(entries) < 2:
            raise Conflict("nothing to roll back to: this replica has served only one model")
        return entries[1]


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


# --------------------------------------------------------------------------- the promote gate

#: What the gate evaluates on: MNIST digits no model trained here ever saw in training or model
#: selection (the bundled test split, and the 2,000 held-out digits outside the bundled 8k).
GATE_DATA = "bundled MNIST test split (1,600 digits) + held-out MNIST digits (2,000)"
_DIGITS = [str(i) for i in range(10)]


@functools.lru_cache(maxsize=1)
def gate_data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The gate's evaluation data by part: uint8 images ``(N, 28, 28)`` and digit labels."""
    from models.data import bundled_split, load_bundled_mnist, load_holdout_mnist

    images, labels = load_bundled_mnist()
    idx = bundled_split()["test"]
    held_images, held_labels = load_holdout_mnist()
    return {"test": (images[idx], labels[idx]), "holdout": (held_images, held_labels)}


def gate_skip_reason(card: ModelCard) -> str | None:
    """Why the gate cannot evaluate ``card``'s model on its digits (None: it can).

    The data's labels are the digits 0-9: a model whose classes are not exactly the names
    ``"0"`` … ``"9"`` (in any order) answers other questions, and accuracy on digits says nothing
    about it. Inputs of another channel count or size are conformed as the server conforms
    uploads (gray to RGB, resized), so a digit model of another input shape is still compared.
    """
    names = [str(c) for c in card.class_names]
    if sorted(names) != _DIGITS:
        shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        return (
            f"{card.name} {card.version}'s classes ({shown}) are not the ten digits '0'…'9' of "
            "the gate's evaluation data"
        )
    return None


def _rates(correct: np.ndarray, abstain: np.ndarray) -> dict[str, Any]:
    accepted = ~abstain
    return {
        "n": int(correct.size),
        "accuracy": round(float(correct.mean()), 5),
        "accepted_accuracy": round(float(correct[accepted].mean()), 5) if accepted.any() else None,
        "deferral": round(float(abstain.mean()), 5),
    }


def evaluate_for_gate(predictor: ServedPredictor, batch: int) -> dict[str, Any]:
    """Accuracy, accepted-answer accuracy and deferral rate of ``predictor`` on :func:`gate_data`,
    through the serving path (``conform``, ``run``, ``score_columns``) at the card's calibrated
    ``abstain_k`` for its answer members (1.0 when uncalibrated), in batches of ``batch``.

    Thread-safe on a served predictor (it is called beside the batcher's compute thread).
    """
    card = predictor.card
    options = predictor.options(top_k=1)
    digit_of = np.array([int(c) for c in card.class_names])
    same_shape = card.in_channels == 1 and tuple(card.input_size) == (28, 28)
    parts, corrects, abstains = {}, [], []
    for part, (images, labels) in gate_data().items():
        if same_shape:
            x = images[:, None]
        else:
            x = np.stack([predictor.conform(torch.from_numpy(im)[None]).numpy() for im in images])
        preds, flags = [], []
        for start in range(0, len(x), batch):
            columns = predictor.score_columns(predictor.run([x[start : start + batch]]), options)
            preds.append(columns.column("prediction"))
            flags.append(columns.column("abstain"))
        correct = digit_of[np.concatenate(preds)] == labels
        abstain = np.concatenate(flags)
        parts[part] = _rates(correct, abstain)
        corrects.append(correct)
        abstains.append(abstain)
    return {
        "model": card.name,
        "version": card.version,
        "abstain_k": round(float(options.abstain_k), 5),
        "members": options.members,
        **_rates(np.concatenate(corrects), np.concatenate(abstains)),
        "by_part": parts,
    }


def compare_for_gate(
    served: dict[str, Any], candidate: dict[str, Any], settings: Settings
) -> dict[str, Any]:
    """The gate's comparison of two :func:`evaluate_for_gate` results: tolerances, deltas
    (candidate − served) and ``failures``, one sentence per metric worse beyond its tolerance."""
    tolerances = {
        "accuracy_drop": settings.promote_max_accuracy_drop,
        "accepted_accuracy_drop": settings.promote_max_accepted_accuracy_drop,
        "deferral_rise": settings.promote_max_deferral_rise,
    }
    eps = 1e-9  # at exactly the tolerance it passes, whatever the float round-off
    failures: list[str] = []
    deltas: dict[str, float | None] = {}
    for metric, tolerance, what in (
        ("accuracy", tolerances["accuracy_drop"], "accuracy"),
        ("accepted_accuracy", tolerances["accepted_accuracy_drop"], "accepted-answer accuracy"),
    ):
        s, c = served[metric], candidate[metric]
        if s is None:  # the served model accepts nothing: nothing to fall short of
            deltas[metric] = None
        elif c is None:
            deltas[metric] = None
            failures.append(f"the candidate accepts no answer (deferral 1.0); the served "
                            f"model's {what} is {s:.4f}")  # fmt: skip
        else:
            deltas[metric] = round(c - s, 5)
            if c < s - tolerance - eps:
                failures.append(f"{what} {c:.4f} is {s - c:.4f} below the served model's "
                                f"{s:.4f} (tolerance {tolerance:g})")  # fmt: skip
    s, c = served["deferral"], candidate["deferral"]
    deltas["deferral"] = round(c - s, 5)
    tolerance = tolerances["deferral_rise"]
    if c > s + tolerance + eps:
        failures.append(f"deferral rate {c:.4f} is {c - s:.4f} above the served model's {s:.4f} "
                        f"(tolerance {tolerance:g})")  # fmt: skip
    return {
        "data": GATE_DATA,
        "tolerances": tolerances,
        "served": served,
        "candidate": candidate,
        "deltas": deltas,
        "failures": failures,
    }


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
        self, settings: Settings, metrics: Metrics, history: ModelHistory | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.history = history
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
        info = replace(loaded.info, description={**loaded.info.description, **served})
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
            return self._swap(loaded, self._served(entry, action, gate=comparison))

    async def load_initial(self, first_start: bool = True) -> LoadedModel:
        """The model to serve at an engine start, by the rule: a promote or rollback survives
        restarts of the same configuration; a start whose configured model (--model-dir /
        VGE_MODEL_DIR, or none = the shipped default) differs from the previous start's serves
        what it was told and logs it.

        So at the first engine start of a ``vge serve`` run (``first_start``) the configured
        model (:func:`configured_model`) is compared with the one the previous start recorded
        (:meth:`ModelHistory.configured`): the same, and the newest history entry is restored
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
                previous = await asyncio.to_thread(self.history.configured)
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
        async with self._lock:
            try:
                await asyncio.to_thread(check_recorded_weights, latest)
                loaded = await self._load(Path(latest["model_dir"]))
            except Exception as exc:  # noqa: BLE001 - any failure: serve the start model, loudly
                return await self._restore_failed(latest, recorded, exc, start_dir, first_start)
        log.info("restored %s (weights sha256 verified)", recorded)
        restored_from = {"history_id": latest["id"], "action": latest["action"],
                         "at": _iso(latest["at"])}  # fmt: skip
        return self._swap(loaded, self._served(latest, "restored", restored_from=restored_from))

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

    async def _gate(self, candidate: LoadedModel, force: bool) -> dict[str, Any]:
        """Compare ``candidate`` with the served model (:func:`compare_for_gate`); the
        comparison, with its ``verdict`` (passed, forced, skipped), or :class:`PromoteRefused`."""
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
                self.settings,
            )
        except Exception as exc:  # noqa: BLE001 - never serve unchecked because the check broke
            log.exception("promote gate: the evaluation failed")
            problem = f"{type(exc).__name__}: {exc}"
            comparison = {"data": GATE_DATA, "failures": [f"the evaluation failed ({problem})"]}
        comparison["seconds"] = round(time.perf_counter() - t0, 3)
        comparison["force"] = force
        name = f"{candidate.info.name} {candidate.info.version}"
        if not comparison["failures"]:
            comparison["verdict"] = "passed"
            log.info("promote gate passed: %s", name)
            return comparison
        why = "; ".join(comparison["failures"])
        if force:
            comparison["verdict"] = "forced"
            log.warning("promote gate: %s is worse than the served model (%s); served anyway "
                        "(force)", name, why)  # fmt: skip
            return comparison
        comparison["verdict"] = "refused"
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
        """A model directory under ``models_root`` by name (no paths, no traversal)."""
        if not _NAME_RE.match(name):
            raise InvalidValue(
                f"model name {name!r} is invalid: use the directory name under models_root "
                "(letters, digits, '.', '_', '-')"
            )
        root = self.settings.models_root.resolve()
        path = (root / name).resolve()
        if path.parent == root and path.is_dir():
            return path
        from models.zoo import zoo_model_dir, zoo_models

        shipped = zoo_model_dir(name)
        if shipped is not None:  # the shipped models can always be promoted back (by name)
            return shipped
        raise NotFound(
            f"no model {name!r} under models_root ({root}) or among the shipped models "
            f"({', '.join(zoo_models())})"
        )

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
