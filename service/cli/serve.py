"""``vge serve``: start the HTTP service. Flags override ``VGE_*`` environment variables."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr, ValidationError

from models.problems import validation_problems
from service.cli.flags import flag_name, is_type, metavar, shown_default

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from service.common.settings import Settings

# `--review-queue` alone means on (the spelling); `--review-queue off` also works.
_BARE_VALUE: dict[str, str] = {"review_queue": "on"}


def cli_fields() -> dict[str, FieldInfo]:
    """The settings that are ``vge serve`` flags: every field but those marked ``NO_FLAG``."""
    from service.common.settings import Settings

    return {
        name: field
        for name, field in Settings.model_fields.items()
        if not (
            isinstance(field.json_schema_extra, dict)
            and field.json_schema_extra.get("cli") is False
        )
    }


def help_text(name: str, field: FieldInfo) -> str:
    """The field's description, then its environment variable and default (never restated by
    hand, so they cannot drift); secrets say to prefer the environment variable."""
    env = f"VGE_{name.upper()}"
    text = (field.description or "").rstrip()
    if is_type(field.annotation, SecretStr):
        text += f" Secret: prefer {env}, a flag shows in the process list."
    text += f" ({env}; default: {shown_default(field)})"
    return text.replace("%", "%%")  # argparse %-formats help strings


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``vge serve`` to the ``vge`` command's subparsers: one flag per setting."""
    p = subparsers.add_parser(
        "serve",
        help="start the HTTP prediction service",
        usage="%(prog)s [-h] [--SETTING VALUE ...]",
        description="Serve a VGE model over HTTP: N front-end processes (FastAPI on uvicorn) and "
        "one engine process that batches across them and runs the model. "
        "Every flag also reads from the VGE_<NAME> environment variable; flags win.",
    )
    for name, field in cli_fields().items():
        extra: dict[str, Any] = {}
        if name in _BARE_VALUE:
            extra = {"nargs": "?", "const": _BARE_VALUE[name]}
        elif is_type(field.annotation, bool):
            extra = {"nargs": "?", "const": "true"}
        # Values stay strings: Settings validates flags exactly as it does VGE_* variables, and a
        # bad one is the same one-line "invalid settings" error (see run).
        p.add_argument(flag_name(name), dest=name, type=str, default=None, metavar=metavar(field),
                       help=help_text(name, field), **extra)  # fmt: skip
    p.set_defaults(func=run, handler=run)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``VGE_*`` environment variables, overridden by the flags given (raises ValidationError)."""
    from service.common.settings import Settings

    overrides = {n: getattr(args, n) for n in cli_fields() if getattr(args, n, None) is not None}
    # --model-dir is the configured model like VGE_MODEL_DIR: the engine compares it with the
    # previous start's (service.engine.model_manager.ModelManager.load_initial).
    return Settings(**overrides)


def run(args: argparse.Namespace) -> int:
    """Build settings (env + flags), then serve until SIGTERM."""
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        problems = validation_problems(exc.errors(), what="settings")
        print(f"vge serve: error: invalid settings: {problems}", file=sys.stderr)
        return 2
    # Every file and directory the server and its processes create (review images, SQLite
    # databases, job folders and logs, trained models) gets this mask; children inherit it.
    os.umask(settings.resolved_umask())
    if settings.model_dir is None:
        from models.zoo import resolve_model_dir

        if not resolve_model_dir(None).is_dir():
            print(
                f"vge serve: error: the shipped default model is missing at {resolve_model_dir(None)};"
                " pass --model-dir (or VGE_MODEL_DIR)",
                file=sys.stderr,
            )
            return 2
    from service.supervisor import run as serve

    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m service.cli.serve``)."""
    parser = argparse.ArgumentParser(prog="vge")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
