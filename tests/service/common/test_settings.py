"""Settings: env prefix VGE_, flags override env, eager validation with fix-it messages."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.cli.serve import register, settings_from_args
from service.common.settings import NO_FLAG, Settings
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
        ({"engine_start": "fork"}, "needs device=cpu .*VGE_DEVICE=cpu or VGE_ENGINE_START=spawn"),
        ({"engine_start": "fork", "device": "cuda"}, "CUDA must start in a clean process"),
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


def _flag_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    serve = register(parser.add_subparsers(dest="command"))
    return {a.option_strings[0]: a for a in serve._actions if a.option_strings != ["-h", "--help"]}


def test_every_setting_is_a_flag_and_every_flag_a_setting() -> None:
    """The flags are generated from Settings: they cannot drift from it. Only fields marked
    NO_FLAG (derived or internal) have none."""
    no_flag = {n for n, f in Settings.model_fields.items() if f.json_schema_extra == NO_FLAG}
    assert no_flag == {"model_dir_explicit"}  # a one-start override: environment only
    actions = _flag_actions()
    assert {a.dest for a in actions.values()} == set(Settings.model_fields) - no_flag
    assert set(actions) == {"--" + n.replace("_", "-") for n in Settings.model_fields} - {
        "--model-dir-explicit"
    }
    for action in actions.values():
        assert action.dest in Settings.model_fields and action.default is None  # env stays


def test_help_shows_each_settings_description_env_var_and_default() -> None:
    for flag, action in _flag_actions().items():
        field = Settings.model_fields[action.dest]
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None else str(default)
        assert field.description, f"{action.dest} needs a description in settings.py"
        assert action.help is not None
        assert action.help.endswith(f"(VGE_{action.dest.upper()}; default: {shown})"), flag
    helps = {flag: a.help for flag, a in _flag_actions().items()}
    assert "prefer VGE_API_KEY" in str(helps["--api-key"])
    assert "prefer VGE_REVIEWER_KEYS" in str(helps["--reviewer-keys"])
    assert "default: 8000" in str(helps["--port"])
    assert _flag_actions()["--batch-wait"].metavar == "{adaptive,always}"
    r = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr  # argparse %-formats help: a stray % would fail here
    assert "(VGE_PORT; default: 8000)" in " ".join(r.stdout.split())


def test_review_queue_alone_means_on_and_model_dir_flag_is_the_configured_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("VGE_REVIEW_QUEUE", raising=False)
    monkeypatch.delenv("VGE_MODEL_DIR_EXPLICIT", raising=False)
    assert settings_from_args(_parse("--review-queue")).review_queue == "on"
    assert settings_from_args(_parse("--review-queue", "off")).review_queue == "off"
    monkeypatch.setenv("VGE_MODEL_DIR", str(tmp_path))
    assert not settings_from_args(_parse()).model_dir_explicit
    # --model-dir configures the model as VGE_MODEL_DIR does: no override of the history (the
    # engine serves it when it differs from the previous start's configured model)
    s = settings_from_args(_parse("--model-dir", str(tmp_path)))
    assert s.model_dir == tmp_path and not s.model_dir_explicit


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "abc"], "port: Input should be a valid integer"),
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
        (["--batch-wait", "never"], "batch_wait: Input should be 'adaptive' or 'always'"),
    ],
)
def test_vge_serve_reports_a_bad_flag_value_in_one_line(argv: list[str], words: str) -> None:
    """The real `vge` CLI: flags are validated by Settings like VGE_* variables; no server
    starts."""
    r = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("vge serve: error: invalid settings: ") and words in r.stderr


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"umask": "999"}, "VGE_UMASK"),
        ({"umask": "1000"}, "from 0 to 0777"),
        ({"repository_index_models": "ok,../etc"}, "'../etc' is not a model directory name"),
        ({"job_log_max_bytes": 10}, "greater than or equal to 4096"),
        ({"db_url": "mysql://u:Hunter2@h/db"}, r"'mysql://u:\*\*\*@h/db' is not supported"),
    ],
)
def test_issue_36_settings_say_how_to_fix(kwargs: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words) as err:
        Settings(**kwargs)
    assert "Hunter2" not in str(err.value)


def test_umask_and_exposed_models_are_parsed() -> None:
    s = Settings(umask="22", repository_index_models=" a , b.v2 ,")
    assert (s.umask, s.resolved_umask()) == ("0022", 0o022)
    assert s.repository_index_names() == ["a", "b.v2"]
    assert Settings().resolved_umask() == 0o077 and Settings().repository_index_names() == []
    assert "Hunter2" not in repr(Settings(db_url="postgresql://u:Hunter2@h/db"))


@pytest.mark.parametrize(
    "url",
    ["u:S3cretPW@host/db", "host=h user=u password=S3cretPW dbname=d", "mysql://u:S3cretPW@h/d"],
)
def test_an_unsupported_database_url_is_refused_without_its_secret(url: str) -> None:
    """Found by review (2026-11-29): a value with no scheme (no URL for the mask to find its
    password in) was printed whole in the refusal."""
    from service.common.db import check_url

    with pytest.raises(ValueError, match="is not supported") as err:
        check_url(url, "db_url (VGE_DB_URL / --db-url)")
    assert "S3cretPW" not in str(err.value)


def test_engine_threads_and_front_ends_count_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review (2026-11-29): the engine's intra-op threads counted the machine's cores
    (os.cpu_count) where the front ends count the process's affinity: a container allowed a few
    cores of a 64-core host got 32 threads. Both count the affinity (here a host of 64 cores is
    what os.cpu_count says; the affinity is this box's)."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    from service.common.settings import Settings

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    allowed = len(os.sched_getaffinity(0))
    settings = Settings(device="cpu")
    assert settings.resolved_torch_threads() == max(1, allowed // 2)
    assert settings.resolved_workers() == max(1, allowed - 1)
