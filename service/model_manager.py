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

from models.serving import ScoreOptions, resolve_options
from service.errors import InvalidValue, NotFound, NotReady
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("vge.models")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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


def _load_sync(model_dir: Path, device: str, generation: int, compile_: bool) -> LoadedModel:
    from models.predictor import Predictor

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    predictor = Predictor.from_dir(model_dir, device=device)
    if compile_:
        predictor.compile()
    # Warm up (and, when compiled, capture) so the first request is not slow.
    x = predictor.conform(torch.zeros((1, 28, 28), dtype=torch.uint8)).unsqueeze(0)
    out = predictor.run([x])
    predictor.score_columns(out, predictor.options())
    return LoadedModel(predictor, Path(model_dir), _describe(predictor, generation, device))


class ModelManager:
    """Holds the served model (and the previous generation); swaps atomically."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._current: LoadedModel | None = None
        self._previous: LoadedModel | None = None
        self._generation = 0
        self._lock = asyncio.Lock()

    @property
    def current(self) -> LoadedModel | None:
        return self._current

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

    async def load(self, model_dir: Path) -> LoadedModel:
        """Load and verify ``model_dir`` off the event loop, then swap it in."""
        async with self._lock:
            t0 = time.perf_counter()
            loaded = await asyncio.to_thread(
                _load_sync,
                Path(model_dir),
                self.settings.resolved_device(),
                self._generation + 1,
                self.settings.resolved_compile(),
            )
            self._generation += 1
            self.metrics.model_load.labels(model=loaded.info.name).observe(time.perf_counter() - t0)
            self._previous, self._current = self._current, loaded
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
        return await self.load(resolve_model_dir(self.settings.model_dir))

    async def reload(self) -> LoadedModel:
        """Load the served model's directory again (e.g. after its files changed)."""
        if self._current is None:
            raise NotReady("no model is loaded yet")
        return await self.load_checked(self._current.model_dir)

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
        return await self.load_checked(self.resolve(name))

    async def load_checked(self, path: Path) -> LoadedModel:
        try:
            return await self.load(path)
        except (ValueError, FileNotFoundError, OSError) as exc:  # CheckpointError is a ValueError
            raise InvalidValue(
                f"model at {path.name!r} failed to load and was not served: {exc}"
            ) from None
