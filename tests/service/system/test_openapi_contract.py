"""The OpenAPI document tells the truth: schemathesis against the live server, with and without
the API key, finds no 5xx, no undocumented status code, no schema-valid request refused (except
where JSON Schema cannot state the rule; see schemathesis.toml) and no wrong ``Allow`` header.

Training-job creation is excluded (it would start real training processes); bounded by
``generation.max-examples`` in schemathesis.toml.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import API_KEY, REPO, Server


def _schemathesis() -> str:
    exe = Path(sys.executable).with_name("schemathesis")
    found = str(exe) if exe.exists() else shutil.which("schemathesis")
    if found is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize("with_key", [True, False])
def test_openapi_contract_holds(server: Server, with_key: bool, tmp_path: Path) -> None:
    _run(server, with_key, tmp_path)


def test_openapi_contract_holds_with_the_review_queue_on(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes], tmp_path: Path
) -> None:
    """The review endpoints answering for real (a queue with items), not 404 "queue is off"."""
    import httpx

    from tests.service.conftest import start_in_process

    srv = start_in_process(
        tmp_path_factory.mktemp("contract-reviews"), tiny_model, review_queue="on",
        api_key=API_KEY,
    )  # fmt: skip
    try:
        files = [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs[:4])]
        httpx.post(srv.url + "/v1/predict?review=always", files=files, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        _run(srv, True, tmp_path)
    finally:
        srv.stop()


def _run(server: Server, with_key: bool, tmp_path: Path) -> None:
    cmd = [
        _schemathesis(), "--no-color", "--config-file", str(REPO / "schemathesis.toml"), "run",
        f"{server.url}/openapi.json", "--exclude-path-regex", "training-jobs", "--seed", "7",
    ]  # fmt: skip
    if with_key:
        cmd += ["-H", f"Authorization: Bearer {API_KEY}"]
    # cwd: schemathesis keeps a cache directory where it runs; not in the repository
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-3000:]
