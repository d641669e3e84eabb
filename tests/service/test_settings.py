"""Settings: env prefix VGE_, flags override env, eager validation with fix-it messages."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from pydantic import ValidationError

from service.cli.serve import register, settings_from_args
from service.common.settings import Settings
from tests.service.conftest import REPO


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGE_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("VGE_PORT", "9001")
    s = settings_from_args(_parse("--max-batch-size", "16", "--max-queue-delay-ms", "3"))
    assert (s.max_batch_size, s.port, s.max_queue_delay_s) == (16, 9001, 0.003)
    assert s.api_key is None and s.device == "auto"


def test_max_batch_size_is_sized_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 (the default) is 32 on a CPU and 256 on a CUDA GPU; a set value wins on either."""
    monkeypatch.delenv("VGE_MAX_BATCH_SIZE", raising=False)
    assert Settings(device="cpu").resolved_max_batch_size() == 32
    assert Settings(device="cuda").resolved_max_batch_size() == 256
    assert Settings(device="cuda:1").resolved_max_batch_size() == 256
    assert Settings(device="cuda", max_batch_size=48).resolved_max_batch_size() == 48
    assert Settings(device="cpu", max_batch_size=8).resolved_max_batch_size() == 8


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"device": "gpu"}, "VGE_DEVICE"),
        ({"jobs_db_url": "postgres://db"}, "sqlite:///"),
        ({"api_key": "short"}, "VGE_API_KEY"),
        ({"max_images": 100, "max_queue_length": 10}, "VGE_MAX_QUEUE_LENGTH"),
        ({"model_dir": "/no/such/dir"}, "VGE_MODEL_DIR"),
        ({"abstain_k": -1}, "greater than or equal"),
    ],
)
def test_validation_messages_say_how_to_fix(kwargs: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        Settings(**kwargs)


def test_cli_reports_bad_settings_in_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "service.cli.serve", "--device", "gpu"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "VGE_DEVICE" in r.stderr


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 1), (16, 15)])
def test_default_front_ends_leave_a_core_to_the_engine(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert Settings(workers=0).resolved_workers() == expected
    assert Settings(workers=3).resolved_workers() == 3  # an explicit count is kept
