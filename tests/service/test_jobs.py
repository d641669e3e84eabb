"""Training jobs: lifecycle on a tiny config, cancel, promote, and restart persistence."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import API_KEY, Server, start_server

H = {"Authorization": f"Bearer {API_KEY}"}
TINY = {"name": "job-model", "version": "3.0.0", "epochs": 1, "max_train_samples": 256,
        "members": 2, "ensemble": "lle", "batch_size": 64, "device": "cpu", "seed": 1}  # fmt: skip
LONG = {**TINY, "name": "long", "epochs": 200, "max_train_samples": 4096, "patience": 200}


def _wait(server: Server, job_id: str, states: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.url}/v1/training-jobs/{job_id}", headers=H, timeout=10).json()
        if job["state"] in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} never reached {states}: {job}\n{server.log()}")


def _until(cond: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_job_lifecycle_cancel_promote_and_restart(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> None:
    work = tmp_path_factory.mktemp("jobs")
    srv = start_server(work, tiny_model, api_key=API_KEY)
    try:
        with srv.client(headers=H) as c:
            r = c.post("/v1/training-jobs", json=TINY)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            assert r.json()["state"] in ("queued", "running")
            done = _wait(srv, job_id, {"succeeded", "failed"})
            assert done["state"] == "succeeded", done
            types = [e["type"] for e in done["events"]]
            assert types[0] == "start" and "epoch" in types and types[-1] == "done"
            assert done["metrics"]["val_accuracy"] is not None
            assert Path(done["model_dir"]).parent == work / "models"
            assert "training" in c.get(f"/v1/training-jobs/{job_id}/logs").text
            assert c.post(f"/v1/training-jobs/{job_id}/cancel").status_code == 409

            # force: a one-epoch model on 256 digits is no better than the served tiny one, and
            # the promote gate (tested in test_model_state.py) would refuse it on chance alone
            r = c.post("/v1/models/promote", json={"job_id": job_id, "force": True})
            assert r.status_code == 200, r.text
            assert c.get("/v1/models").json()["models"][0]["name"] == "job-model"

            # cancel a running job
            long_id = c.post("/v1/training-jobs", json=LONG).json()["id"]
            _wait(srv, long_id, {"running"})
            deadline = time.monotonic() + 60
            while not c.get(f"/v1/training-jobs/{long_id}").json()["events"]:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            r = c.post(f"/v1/training-jobs/{long_id}/cancel")
            assert r.status_code == 200, r.text
            assert _wait(srv, long_id, {"cancelled", "failed", "succeeded"})["state"] == "cancelled"
            # whatever it saved before stopping is gone: not promotable by its directory's name
            assert not (work / "models" / long_id).exists()
            r = c.post("/v1/models/promote", json={"model": long_id})
            assert r.status_code == 404, r.text
            # the gauge is refreshed just after the state is stored: allow it that moment
            _until(lambda: srv.metric("vge_training_jobs", state="cancelled") == 1)
            assert srv.metric("vge_training_jobs", state="succeeded") == 1

            # a job running when the server dies is marked interrupted at the next start
            dying_id = c.post("/v1/training-jobs", json=LONG).json()["id"]
            _wait(srv, dying_id, {"running"})
        srv.stop(signal.SIGKILL)

        srv = start_server(work, tiny_model, api_key=API_KEY)
        with srv.client(headers=H) as c:
            jobs = {j["id"]: j for j in c.get("/v1/training-jobs").json()["jobs"]}
        assert jobs[job_id]["state"] == "succeeded"
        assert jobs[long_id]["state"] == "cancelled"
        assert jobs[dying_id]["state"] == "interrupted"
        assert "server stopped" in jobs[dying_id]["error"]
        assert srv.metric("vge_training_jobs", state="interrupted") == 1
    finally:
        srv.stop()
