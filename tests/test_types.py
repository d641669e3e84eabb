"""The type checker, as a test: mypy over what ``[tool.mypy]`` in pyproject.toml names (strict for
``service/`` and the typed parts of ``models/``; its per-module rules live there).

A test rather than a step of its own in the README's command, so pytest-xdist runs its ~25 s of
one core beside the other tests instead of before all of them (CI on the 2-core box is bounded
at 10 minutes). It fails with mypy's report.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout, done.stdout
