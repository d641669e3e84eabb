"""The served model, in the engine: load, verify, warm up, and hot-swap (load-then-swap).

A reload or promote loads and verifies the new model completely (in a thread, off the event loop)
and only then swaps one reference and bumps the *generation*. Requests carry the generation their
inputs were prepared for; queued requests of the previous generation still run on the previous
predictor (kept until the next swap), and a batch never mixes generations, so in-flight batches
finish on the old model. A failed load leaves the served model untouched.

:class:`ModelInfo` is what front ends know about the served model (they never load it): name,
version, classes, input shape, which member set answers, the calibrated ``abstain_k`` per member
set, and the JSON that ``GET /v1/models`` shows.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.checkpoint import MODEL_NAME_PATTERN
from models.serving import ScoreOptions, resolve_options
from service.db import Database
from service.errors import Conflict, InvalidValue, NotFound, NotReady
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("vge.models")

_NAME_RE = re.compile(MODEL_NAME_PATTERN)


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs to prepare inputs, resolve options and encode answers."""

    generation: int
    name: str
    version: str
    class_names: tuple[str, ...]
    vgn: bool
    in_channels: int
    input_size: tuple[int, int]
    calibrated_k: dict[str, float | None]  # by member set, "p" / "q"
    description: dict[str, Any] = field(compare=False)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, *self.input_size)

    @property
    def answer_members(self) -> str:
        return "q" if self.vgn else "p"

    def options(
        self,
        *,
        abstain_k: float | None,
        vgmu_on: str | None,
        top_k: int,
        default_abstain_k: float | None,
    ) -> ScoreOptions:
        """Request options for the served model (:func:`models.serving.resolve_options`, as
        :meth:`models.predictor.Predictor.options` does in the engine); a misuse is a 422."""
        try:
            return resolve_options(
                model=self.name,
                vgn=self.vgn,
                calibrated_k=self.calibrated_k,
                num_classes=len(self.class_names),
                abstain_k=abstain_k,
                vgmu_on=vgmu_on,
                top_k=top_k,
                default_abstain_k=default_abstain_k,
            )
        except ValueError as exc:
            raise InvalidValue(str(exc)) from None


@dataclass(frozen=True)
class LoadedModel:
    """A verified, warmed-up predictor in the engine."""

    predictor: Any
    model_dir: Path
    info: ModelInfo


def default_model_dir() -> Path:
    """The shipped default model (models.zoo)."""
    from models.zoo import default_model_dir as zoo_default

    return Path(zoo_default())


def resolve_model_dir(model_dir: Path | None) -> Path:
    """``model_dir`` as given; a bare name of a shipped model when no such directory exists; the
    shipped default when unset."""
    if model_dir is None:
        return default_model_dir()
    if not model_dir.exists() and len(model_dir.parts) == 1:
        from models.zoo import zoo_model_dir

        shipped = zoo_model_dir(str(model_dir))
        if shipped is not None:
            return shipped
    return model_dir


def _describe(predictor: Any, generation: int, device: str) -> ModelInfo:
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
        "created_at": card.created_at,
        "loaded_at": time.time(),
    }
    return ModelInfo(**{**info.__dict__, "description": description})


def _load_sync(
    model_dir: Path, device: str, generation: int, compile_: bool, max_batch: int = 1
) -> LoadedModel:
    from models.predictor import Predictor, bucket_sizes

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    predictor = Predictor.from_dir(model_dir, device=device)
    if compile_:  # every bucket a batch of up to max_batch runs in: compiled and captured now
        predictor.compile(warm_up=bucket_sizes(max_batch))
    # Warm up (and, when compiled, capture) so the first request is not slow.
    x = predictor.conform(torch.zeros((1, 28, 28), dtype=torch.uint8)).unsqueeze(0)
    out = predictor.run([x])
    predictor.score_columns(out, predictor.options())
    return LoadedModel(predictor, Path(model_dir), _describe(predictor, generation, device))


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
CREATE INDEX IF NOT EXISTS model_history_replica_at ON model_history (replica, at)
"""


class ModelHistory:
    """Every model this replica served, in order (start, promote, reload, rollback), durably.

    The shipped models, models under models_root and job models alike: rolling back needs only the
    directory, so any earlier entry can be served again (while its directory exists).
    """

    def __init__(self, db: Database, replica: str) -> None:
        self.db = db
        self.replica = replica
        db.script(_HISTORY_SCHEMA)

    def record(self, action: str, info: ModelInfo, model_dir: Path) -> None:
        import uuid

        self.db.execute(
            "INSERT INTO model_history (id, at, replica, action, model, version, model_dir) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (uuid.uuid4().hex[:16], time.time(), self.replica, action, info.name, info.version,
             str(Path(model_dir).resolve())),
        )  # fmt: skip

    def entries(self, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first."""
        return self.db.fetchall(
            "SELECT * FROM model_history WHERE replica = ? ORDER BY at DESC, id DESC LIMIT ?",
            (self.replica, limit),
        )

    def target(self, entry_id: str | None) -> dict[str, Any]:
        """The entry to roll back to: ``entry_id``, else the one before the latest (undo)."""
        if entry_id is not None:
            row = self.db.fetchone(
                "SELECT * FROM model_history WHERE id = ? AND replica = ?", (entry_id, self.replica)
            )
            if row is None:
                raise NotFound(f"no model history entry {entry_id!r} on this replica")
            return row
        entries = self.entries(2)
        if len(entries) < 2:
            raise Conflict("nothing to roll back to: this replica has served only one model")
        return entries[1]


class ModelManager:
    """Holds the served model (and the previous generation); swaps atomically."""

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

    @property
    def current(self) -> LoadedModel | None:
        return self._current

    def generation_of(self, predictor: Any) -> int | None:
        """The generation ``predictor`` was loaded as, if it is still current or previous."""
        for loaded in (self._current, self._previous):
            if loaded is not None and loaded.predictor is predictor:
                return loaded.info.generation
        return None

    def predictor_for(self, generation: int) -> Any:
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

    async def load(self, model_dir: Path, action: str = "load") -> LoadedModel:
        """Load and verify ``model_dir`` off the event loop, then swap it in (and record it in the
        history as ``action``)."""
        async with self._lock:
            t0 = time.perf_counter()
            loaded = await asyncio.to_thread(
                _load_sync,
                Path(model_dir),
                self.settings.resolved_device(),
                self._generation + 1,
                self.settings.resolved_compile(),
                self.settings.resolved_max_batch_size(),
            )
            self._generation += 1
            self.metrics.model_load.labels(model=loaded.info.name).observe(time.perf_counter() - t0)
            self._previous, self._current = self._current, loaded
            if self.history is not None:
                await asyncio.to_thread(self.history.record, action, loaded.info, model_dir)
            old = self._previous
            log.info(
                "serving %s %s from %s on %s%s",
                loaded.info.name, loaded.info.version, model_dir,
                loaded.info.description["device"],
                f" (replacing {old.info.name} {old.info.version})" if old else "",
            )  # fmt: skip
            return loaded

    async def load_initial(self) -> LoadedModel:
        """Load the configured model (``model_dir``: a directory or a zoo model's name; else the
        shipped default)."""
        return await self.load(resolve_model_dir(self.settings.model_dir), "start")

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

    async def promote(self, name: str) -> LoadedModel:
        """Load ``models_root/name`` and serve it."""
        return await self.load_checked(self.resolve(name), "promote")

    async def rollback(self, entry_id: str | None) -> LoadedModel:
        """Serve an earlier model of the history again (default: the one before the current)."""
        if self.history is None:
            raise NotReady("this server keeps no model history")
        entry = await asyncio.to_thread(self.history.target, entry_id)
        return await self.load_checked(Path(entry["model_dir"]), "rollback")

    async def load_checked(self, path: Path, action: str = "load") -> LoadedModel:
        try:
            return await self.load(path, action)
        except (ValueError, FileNotFoundError, OSError) as exc:  # CheckpointError is a ValueError
            raise InvalidValue(
                f"model at {path.name!r} failed to load and was not served: {exc}"
            ) from None
