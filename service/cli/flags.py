"""Command-line flags read from a pydantic model's fields, shared by ``vge serve`` (``Settings``)
and ``vge train`` (``TrainConfig``): one ``--field-name`` per field, its metavar, choices and
shown default taken from the field, so a flag cannot drift from the field it sets.

What a subcommand decides itself: which fields are flags, the help text, and how values reach
the model (``vge serve`` passes strings to ``Settings`` like ``VGE_*`` variables; ``vge train``
passes them to ``load_config``). Scalars stay strings for the model to validate (one error
format for files, variables and flags); list and dict fields are JSON (:func:`json_value`).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import SecretStr

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

__all__ = [
    "choice_of",
    "choices",
    "flag_name",
    "is_structured",
    "is_type",
    "json_value",
    "metavar",
    "shown_default",
]


def flag_name(field: str) -> str:
    """``backbone_kwargs`` -> ``--backbone-kwargs``."""
    return f"--{field.replace('_', '-')}"


def choices(annotation: Any) -> tuple[Any, ...] | None:
    """A ``Literal``'s values (also inside ``X | None``), else None."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if (found := choices(arg)) is not None:
            return found
    return None


def is_type(annotation: Any, typ: type) -> bool:
    """Whether ``annotation`` is ``typ`` or a union holding it (``SecretStr | None``)."""
    return annotation is typ or any(is_type(a, typ) for a in typing.get_args(annotation))


def is_structured(annotation: Any) -> bool:
    """Whether ``annotation`` is, or a union holds, a list or a dict (given as JSON on the
    command line: ``--backbone-kwargs '{"width": 64}'``, ``--k '[0.5, 0.7]'``)."""
    if typing.get_origin(annotation) in (list, dict) or annotation in (list, dict):
        return True
    return typing.get_origin(annotation) is not Literal and any(
        is_structured(a) for a in typing.get_args(annotation)
    )


def json_value(text: str) -> Any:
    """argparse ``type`` of a list or dict field: the value parsed as JSON (a bad one is
    argparse's one-line "invalid JSON value" error)."""
    return json.loads(text)


json_value.__name__ = "JSON"  # argparse names the type in its error: "invalid JSON value: 'x'"


def choice_of(values: tuple[Any, ...]) -> Callable[[str], Any]:
    """argparse ``type`` of a Literal field: the text as the choice it spells (``"2"`` -> ``2``
    for ``Literal[1, 2]``); anything else stays text, for argparse's "invalid choice" error."""
    spelt = {str(v): v for v in values}

    def parse(text: str) -> Any:
        return spelt.get(text, text)

    parse.__name__ = "choice"
    return parse


def metavar(field: FieldInfo) -> str:
    """``{a,b}`` for a Literal or a bool, ``JSON`` for a list/dict, else the value's kind."""
    found = choices(field.annotation)
    if found is None and is_type(field.annotation, bool):
        found = ("true", "false")
    if found is not None:
        return "{" + ",".join(str(c) for c in found) + "}"
    if is_structured(field.annotation):
        return "JSON"
    for typ, word in ((SecretStr, "SECRET"), (bool, "BOOL"), (int, "INT"), (float, "NUMBER"),
                      (Path, "PATH")):  # fmt: skip
        if is_type(field.annotation, typ):
            return word
    return "TEXT"


def shown_default(field: FieldInfo, default: Any = None) -> str:
    """The field's default as help shows it (``unset`` for None; ``default`` stands in for a
    required field's)."""
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if default == "":
        return "empty"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, (dict, list)):
        return json.dumps(default)
    return str(default)
