"""The served model: load, verify, describe, and hot-swap (load-then-swap).

A reload or promote loads and verifies the new model completely (in a thread, off the event loop)
and only then swaps one reference. Requests already admitted hold the old predictor and finish on
it; the old model is freed when its last request is done. A failed load leaves the served model
untouched.
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

from service.errors import InvalidValue, NotFound
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("vge.models")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class LoadedModel:
    """A verified, warmed-up predictor and what the API reports about it."""

    predictor: Any
    model_dir: Path
    device: str
    input_shape: tuple[int, ...]
    loaded_at: float = field(default_factory=time.time)

    @property
    def card(self) -> Any:
        return self.predictor.card

    @property
    def name(self) -> str:
        return str(self.card.name)

    @property
    def version(self) -> str:
        return str(self.card.version)

    @property
    def class_names(self) -> list[str]:
        return [str(c) for c in self.card.class_names]

    @property
    def calibrated_abstain_k(self) -> float | None:
        """The card's calibrated abstain_k, when the model was calibrated."""
        k = getattr(self.card, "abstain_k", None)
        return float(k) if k is not None else None

    def describe(self) -> dict[str, Any]:
        """JSON for ``GET /v1/models`` (no filesystem paths: the endpoint is unauthenticated)."""
        card = self.card
        return {
            "name": self.name,
            "version": self.version,
            "description": getattr(card, "description", ""),
            "classes": self.class_names,
            "ensemble_kind": getattr(card, "ensemble", None),
            "members": getattr(card, "members", None),
            "vgn": getattr(card, "vgn", None),
            "device": self.device,
            "abstain_k": self.calibrated_abstain_k,
            "metrics": getattr(card, "metrics", {}),
            "input_shape": list(self.input_shape),
            "created_at": getattr(card, "created_at", None),
            "loaded_at": self.loaded_at,
        }


def default_model_dir() -> Path:
    """The shipped default model (models.zoo)."""
    from models.zoo import default_model_dir as zoo_default

    return Path(zoo_default())


def _load_sync(model_dir: Path, device: str) -> LoadedModel:
    from models.predictor import Predictor

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    predictor = Predictor.from_dir(model_dir, device=device)
    # Probe the input shape and warm the model up, so the first request is not slow.
    x = predictor.prepare(torch.zeros((1, 28, 28), dtype=torch.uint8))
    predictor.forward(x.unsqueeze(0))
    return LoadedModel(predictor, Path(model_dir), str(predictor.device), tuple(x.shape))


class ModelManager:
    """Holds the served model; swaps it atomically."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._current: LoadedModel | None = None
        self._lock = asyncio.Lock()

    @property
    def current(self) -> LoadedModel | None:
        """The served model, or None before the first load."""
        return self._current

    def get(self, name: str | None = None) -> LoadedModel:
        """The served model, checking ``name`` when given (404 for an unknown model)."""
        model = self._current
        if model is None:
            from service.errors import NotReady

            raise NotReady("no model is loaded yet")
        if name is not None and name != model.name:
            raise NotFound(f"unknown model {name!r}; this server serves {model.name!r}")
        return model

    async def load(self, model_dir: Path) -> LoadedModel:
        """Load and verify ``model_dir`` off the event loop, then swap it in."""
        async with self._lock:
            t0 = time.perf_counter()
            loaded = await asyncio.to_thread(_load_sync, model_dir, self.settings.resolved_device())
            self.metrics.model_load.labels(model=loaded.name).observe(time.perf_counter() - t0)
            old, self._current = self._current, loaded
            log.info(
                "serving %s %s from %s on %s%s",
                loaded.name, loaded.version, model_dir, loaded.device,
                f" (replacing {old.name} {old.version})" if old else "",
            )  # fmt: skip
            return loaded

    async def load_initial(self) -> LoadedModel:
        """Load the configured model (``model_dir`` setting, else the shipped default)."""
        return await self.load(self.settings.model_dir or default_model_dir())

    async def reload(self) -> LoadedModel:
        """Load the served model's directory again (e.g. after its files changed)."""
        return await self.load_checked(self.get().model_dir)

    def resolve(self, name: str) -> Path:
        """A model directory under ``models_root`` by name (no paths, no traversal)."""
        if not _NAME_RE.match(name):
            raise InvalidValue(
                f"model name {name!r} is invalid: use the directory name under models_root "
                "(letters, digits, '.', '_', '-')"
            )
        root = self.settings.models_root.resolve()
        path = (root / name).resolve()
        if path.parent != root or not path.is_dir():
            raise NotFound(f"no model {name!r} under models_root ({root})")
        return path

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
