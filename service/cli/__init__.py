"""The `vge` console script: one subcommand per module (score, train, evaluate, serve).

Every subcommand reports bad input as a single line on stderr and exits with status 2 — never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

SUBCOMMANDS = ("score", "train", "evaluate", "serve")


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's default prints usage; keep it one line
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vge", description="Variance-Gated Ensembles: score, train, evaluate, serve."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"service.cli.{name}")
        except ModuleNotFoundError as exc:  # a subcommand whose module is not installed
            if exc.name != f"service.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def check_output_dir(path: Path) -> None:
    """Raise :class:`CliError` unless ``path`` can be a directory this process writes: checked
    before the work, not found out when the results are saved (``vge train`` would have trained
    for nothing)."""
    existing = path
    try:
        if path.exists() and not path.is_dir():
            raise CliError(f"{path}: exists and is not a directory")
        while not existing.exists():  # the directory that would hold it
            existing = existing.parent
    except OSError as exc:  # e.g. a parent that cannot be searched
        raise CliError(f"{path}: cannot create or write it ({exc.strerror or exc})") from None
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(
            f"{path}: cannot create or write it ({existing} is not a writable directory)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"vge {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
