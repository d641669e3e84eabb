"""Write one benchmark's markdown section into docs/benchmarks.md, replacing its previous run."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery section is written by the script it names; rerun the command to refresh it.\n"


def machine() -> str:
    """One line describing where the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} logical cores, {dev}; torch {torch.__version__} "
        f"({_threads(torch.get_num_threads())}); {_dt.date.today().isoformat()}"
    )


def write_section(name: str, command: str, body: str) -> None:
    """Replace (or append) the section ``name`` in docs/benchmarks.md."""
    text = DOC.read_text() if DOC.exists() else HEADER
    block = (
        f"<!-- BEGIN {name} -->\n## {name}\n\nMachine: {machine()}  \nCommand: `{command}`\n\n"
        f"{body.rstrip()}\n<!-- END {name} -->\n"
    )
    pattern = re.compile(
        rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->\n", re.S
    )
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block
    )
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)


def _threads(n: int) -> str:
    return "1 thread" if n == 1 else f"{n} threads"
