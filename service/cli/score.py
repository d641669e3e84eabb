"""`vge score INPUT`: score any ensemble's member probabilities, one JSON object per sample (JSON Lines)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tokenize
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from models.uncertainty import score_ensemble
from service.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="score member probabilities (B, M, C) from a .npy/.npz file",
        description="Read member probabilities (B, M, C) from a .npy file (or .npz with key 'probs') "
        "and print one JSON object per sample.",
    )
    p.add_argument("input", type=Path, help=".npy file, or .npz with key 'probs'")
    p.add_argument(
        "--gate-k",
        type=float,
        default=None,
        help="gate the members with VGN at fixed k, in [0.001, 10000]",
    )
    p.add_argument(
        "--abstain-k", type=float, default=1.0, help="deferral threshold (>= 0, default 1.0)"
    )
    p.add_argument(
        "--vgmu-on",
        choices=("p", "q"),
        default=None,
        help="member set the answer comes from: q (gated; default with --gate-k) or p (raw)",
    )
    p.set_defaults(func=run)


#: What a damaged .npy/.npz raises while NumPy reads it: a bad zip or a member failing its CRC,
#: a compressed member that does not inflate (zlib.error), a header that does not parse
#: (tokenize.TokenError, SyntaxError), an unsupported zip compression (NotImplementedError), an
#: object array (ValueError: pickles are refused), a short file (EOFError).
_UNREADABLE = (
    ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, tokenize.TokenError,
    SyntaxError, NotImplementedError,
)  # fmt: skip


def load_probs(path: Path) -> np.ndarray:
    """Load the ``(B, M, C)`` array; every failure becomes a :class:`CliError` naming the problem."""
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    try:
        data = np.load(path, allow_pickle=False)
    except _UNREADABLE as exc:
        raise CliError(f"{path}: not a readable .npy/.npz file ({exc})") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            if "probs" not in data.files:
                raise CliError(
                    f"{path}: .npz has no array named 'probs' (found: {', '.join(data.files) or 'none'})"
                )
            try:
                data = data["probs"]
            except _UNREADABLE as exc:
                # an object array (pickles are refused), a member that fails its CRC
                raise CliError(f"{path}: 'probs' cannot be read ({exc})") from None
            if not isinstance(data, np.ndarray):  # a member that is not .npy: NpzFile gives bytes
                raise CliError(f"{path}: 'probs' is not a .npy array inside the .npz")
    if not np.issubdtype(data.dtype, np.number) or np.issubdtype(data.dtype, np.complexfloating):
        raise CliError(f"{path}: expected a real numeric array, got dtype {data.dtype}")
    if data.dtype.kind == "f" and data.itemsize > 8:  # long double: torch has no such type
        data = data.astype(np.float64)
    return data


def run(args: argparse.Namespace) -> int:
    probs = load_probs(args.input)
    try:
        scores = score_ensemble(
            torch.from_numpy(np.ascontiguousarray(probs)),
            gate_k=args.gate_k,
            abstain_k=args.abstain_k,
            vgmu_on=args.vgmu_on,
        )
    except ValueError as exc:
        raise CliError(f"{args.input}: {exc}") from None
    out = sys.stdout
    try:
        for record in scores.to_records():
            out.write(json.dumps(record) + "\n")
        out.flush()
    except BrokenPipeError:  # e.g. `vge score big.npy | head -1`: the reader has gone, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # the exit's flush must not fail
        return 1
    return 0
