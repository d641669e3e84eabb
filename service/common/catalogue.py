"""The catalogue: which model directories a name means, and which the operator exposes.

Read by the engine (promote by name, :mod:`service.engine.repository`) and by the front ends (the
anonymous V2 repository index), so it lives on the common side: a pure function of the settings
and the files, no state of either process.
"""

from __future__ import annotations

from pathlib import Path

from models.checkpoint import MODEL_NAME_PATTERN
from service.common.errors import InvalidValue, NotFound
from service.common.settings import Settings

__all__ = ["loadable_models", "resolve_by_name"]


def resolve_by_name(settings: Settings, name: str) -> Path:
    """The model directory a promote by ``name`` means: ``models_root/name`` (no paths, no
    traversal), else a shipped model of that name; 400/404 naming the problem."""
    import re

    from models.zoo import zoo_model_dir, zoo_models

    if not re.match(MODEL_NAME_PATTERN, name):
        raise InvalidValue(
            f"model name {name!r} is invalid: use the directory name under models_root "
            "(letters, digits, '.', '_', '-')"
        )
    root = settings.models_root.resolve()
    try:
        path = (root / name).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise InvalidValue(f"{root / name} cannot be resolved ({exc})") from None
    if path.parent == root and path.is_dir():
        return path
    shipped = zoo_model_dir(name)
    if shipped is not None:  # the shipped models can always be promoted back (by name)
        return shipped
    if (root / name).is_symlink():  # it exists, but leads out of models_root: refused
        raise InvalidValue(
            f"{root / name} is a symbolic link (to {path}): promote serves directories under "
            "models_root only; copy or move the model there"
        )
    raise NotFound(
        f"no model {name!r} under models_root ({root}) or among the shipped models "
        f"({', '.join(zoo_models())})"
    )


def loadable_models(settings: Settings) -> dict[str, Path]:
    """The models the V2 repository index lists as promotable, by the name promote takes: the
    directories under ``models_root`` named in ``VGE_REPOSITORY_INDEX_MODELS`` that hold a model
    card (not symlinks), then the shipped models. Not every directory under ``models_root``:
    the index is anonymous, and job ids and directory names are the operator's to show."""
    from models.zoo import zoo_dir, zoo_models

    loadable: dict[str, Path] = {}
    root = settings.models_root
    for name in settings.repository_index_names():
        card = root / name / "model_card.json"
        if card.is_file() and not (root / name).is_symlink():
            loadable[name] = root / name
    for name in zoo_models():
        loadable.setdefault(name, zoo_dir() / name)
    return loadable
