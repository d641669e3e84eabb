"""One line naming every problem of a pydantic ``ValidationError``: the one formatter of the
project's validation errors (request bodies and query parameters, settings, training configs),
so a client, an operator and a CLI user read the same words for the same mistake."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["validation_problems"]


def validation_problems(
    errors: Iterable[Any],
    *,
    what: str = "request",
    skip: Sequence[str] = (),
    max_name: int | None = None,
) -> str:
    """``"loc: message; loc: message"`` for pydantic's ``exc.errors()``.

    ``what`` names a problem without a location; ``skip`` drops location parts that say where
    FastAPI found the field (``body``, ``query``) rather than which field; ``max_name`` cuts a
    location (an unknown query parameter's name is the client's, of any length: a 10 KB name
    made a 10 KB error). pydantic's ``"Value error, "`` prefix of a validator's message is dropped and an unknown
    field says so before pydantic's words.
    """
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in skip) or what
        if max_name is not None and len(loc) > max_name:
            loc = loc[: max_name - 3] + "..."
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field ({msg})"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts) or f"invalid {what}"
