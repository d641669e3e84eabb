"""The `vge` console script: one subcommand per module (score, train, evaluate, serve).

Every subcommand reports bad input as a single line on stderr and exits with status 2 — never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = ("score", "train", "evaluate", "serve")


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage; keep it one line
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
