"""Training jobs: lifecycle on a tiny config, cancel, promote, and restart persistence."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.common.job_record import TERMINAL
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


def _running_with_events(server: Server, client: httpx.Client) -> str:
    """Submit a long job; its id once it runs and has reported its first event."""
    job_id = str(client.post("/v1/training-jobs", json=LONG).json()["id"])
    _wait(server, job_id, {"running"})
    deadline = time.monotonic() + 60
    while not client.get(f"/v1/training-jobs/{job_id}").json()["events"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return job_id


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
            long_id = _running_with_events(srv, c)
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


def _on_disk(work: Path) -> list[Path]:
    """Every image a job submission wrote: under the data root (where exports used to go) and
    the jobs folder (each job's own export)."""
    return sorted(p for d in ("data", "jobs") for p in (work / d).rglob("*.png"))


def test_retrain_the_served_model_with_bounded_validated_jobs(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    pngs: list[bytes],
    mnist: tuple[np.ndarray, np.ndarray],
) -> None:
    """A job that names no architecture retrains the served model: its card's architecture and
    recipe, from its weights, under its name with a new version, so V2 URLs keep working.
    Submissions are validated before reviewed images are exported (a rejected one writes
    nothing), every size is bounded, the queue is capped, and a job's export is its own folder,
    removed when the job ends (cancelled while queued, succeeded; the same step for any end)."""
    from models.checkpoint import read_card

    work = tmp_path_factory.mktemp("retrain")
    served = read_card(tiny_model)
    srv = start_server(
        work, tiny_model, api_key=API_KEY, review_queue="on", max_queued_jobs=1, drain_s=0
    )
    try:
        with srv.client(headers=H) as c:
            files = [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs[:4])]
            results = c.post("/v1/predict", params={"abstain_k": 100}, files=files).json()
            truth = [str(int(y)) for y in mnist[1][-64:][:4]]
            for r, label in zip(results["results"], truth, strict=True):
                c.post(f"/v1/reviews/{r['review_id']}", json={"label": label, "reviewer": "ann"}
                       ).raise_for_status()  # fmt: skip

            # rejected submissions: a 422 naming the problem, and nothing written to disk
            for body, words in (
                ({"dataset": "reviews", "epochs": 0}, "epochs: Input should be greater than"),
                ({"dataset": "reviews", "epochs": 1001}, "epochs: Input should be less than or "
                 "equal to 1000"),
                ({"dataset": "reviews", "members": 101}, "members: must be at most 100"),
                ({"dataset": "reviews", "batch_size": 4097}, "batch_size: Input should be less "
                 "than or equal to 4096"),
                ({"dataset": "reviews", "image_size": 513}, "image_size: Input should be less "
                 "than or equal to 512"),
                ({"dataset": "reviews", "backbone_kwargs": {"hidden": 10**6}},
                 "backbone_kwargs: hidden: 1000000 is out of range"),
                ({"dataset": "reviews", "backbone_kwargs": {f"k{i}": 1 for i in range(17)}},
                 "at most 16 keyword arguments"),
                ({"dataset": "reviews+mnist-bundled", "members": 4, "init": "served"},
                 "do not fit this architecture (members 4 != 3)"),
                ({"dataset": "reviews", "init": "served"}, "are not those of dataset"),
                ({"dataset": "reviews", "init": "warm"}, "init must be one of 'served'"),
                ({"dataset": "reviews", "init_from": str(tiny_model)}, "init_from is set by"),
            ):  # fmt: skip
                r = c.post("/v1/training-jobs", json=body)
                assert r.status_code == 422 and words in r.json()["error"], (body, r.text)
            assert _on_disk(work) == [] and c.get("/v1/training-jobs").json()["jobs"] == []

            # the served model's configuration and weights, its name, a new version
            short = {"dataset": "reviews+mnist-bundled", "epochs": 1, "max_train_samples": 128}
            first = c.post("/v1/training-jobs", json=short)
            assert first.status_code == 202, first.text
            cfg, job_id = first.json()["config"], first.json()["id"]
            assert (cfg["name"], cfg["version"]) == ("tiny", f"1.0.0-{job_id}")
            arch = ("backbone", "backbone_kwargs", "ensemble", "members", "vgn", "k")
            assert {f: cfg[f] for f in arch} == {f: getattr(served, f) for f in arch}
            recipe = served.training["config"]
            for f in ("loss", "lr_schedule", "batch_size", "augment", "seed", "patience"):
                assert cfg[f] == recipe[f], f
            assert cfg["lr"] == pytest.approx(recipe["lr"] / 10)  # a fine-tune: a tenth of it
            assert cfg["init_from"] == str(tiny_model) and cfg["epochs"] == 1
            export = work / "jobs" / job_id / "reviews"
            assert cfg["dataset"] == f"imagefolder:{export}+mnist-bundled"

            # one more may wait (VGE_MAX_QUEUED_JOBS=1), the next is refused and writes nothing
            second = c.post("/v1/training-jobs", json={**short, "epochs": 200})
            assert second.status_code == 202 and second.json()["state"] == "queued", second.text
            second_id = second.json()["id"]
            full = c.post("/v1/training-jobs", json=short)
            assert full.status_code == 409, full.text
            assert "VGE_MAX_QUEUED_JOBS=1" in full.json()["error"]
            assert {p.parent.parent.parent.name for p in _on_disk(work)} == {job_id, second_id}
            assert len(_on_disk(work)) == 8  # each job's own copy of the 4 labelled images
            # a job's export goes with it: cancelled while queued, or ended (here: succeeded)
            assert c.post(f"/v1/training-jobs/{second_id}/cancel").status_code == 200
            assert not (work / "jobs" / second_id / "reviews").exists()
            done = _wait(srv, job_id, TERMINAL)
            assert done["state"] == "succeeded", done
            assert _on_disk(work) == [] and "training" in c.get(
                f"/v1/training-jobs/{job_id}/logs").text  # fmt: skip
            card = read_card(done["model_dir"])
            assert (card.name, card.version) == ("tiny", f"1.0.0-{job_id}")
            assert card.architecture() == served.architecture()
            assert card.training["init"]["weights_sha256"] == served.weights_sha256
            assert card.dataset.endswith("+mnist-bundled")

            # served under the same name: V2 URLs keep working
            promoted = c.post("/v1/models/promote", json={"job_id": job_id, "force": True})
            assert promoted.status_code == 200, promoted.text
            info = c.get("/v1/models").json()["models"][0]
            assert (info["name"], info["version"]) == ("tiny", f"1.0.0-{job_id}")
            v2 = c.get(f"/v2/models/tiny/versions/1.0.0-{job_id}")
            assert v2.status_code == 200 and v2.json()["name"] == "tiny", v2.text

            # retraining the retrained model: its name, the version's job part replaced, its
            # weights; an explicit architecture change starts from scratch (the weights differ)
            again = c.post("/v1/training-jobs", json={"epochs": 1, "max_train_samples": 64})
            assert again.status_code == 202, again.text
            assert again.json()["config"]["version"] == f"1.0.0-{again.json()['id']}"
            assert Path(again.json()["config"]["init_from"]) == Path(done["model_dir"])
            other = c.post("/v1/training-jobs", json={"members": 4, "epochs": 1})
            assert other.status_code == 202, other.text
            assert other.json()["config"]["init_from"] is None
            assert other.json()["config"]["members"] == 4 and other.json()["config"]["vgn"]
    finally:
        srv.stop(signal.SIGKILL)  # the last two jobs may be starting: no need to wait for them


def test_a_cancel_through_another_replica_stops_the_job(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> None:
    """Replicas sharing a jobs database: a cancel that reaches the replica not running the job
    can only mark it. The owner never looked at the mark: the job trained to its end, then was
    recorded cancelled and its model deleted (found by review, 2026-11-29). The owner's monitor
    now looks every second and stops it."""
    from service.common.metrics import Metrics
    from service.common.settings import Settings
    from service.engine.jobs import JobManager

    work = tmp_path_factory.mktemp("jobs-replicas")
    srv = start_server(work / "a", tiny_model, api_key=API_KEY, replica_name="a")
    try:
        with srv.client(headers=H) as c:
            job_id = _running_with_events(srv, c)
        other = JobManager(  # replica b: the same jobs database, its own folders, not started
            Settings(jobs_db_url=f"sqlite:///{work / 'a' / 'jobs.sqlite3'}", replica_name="b",
                     jobs_dir=work / "b" / "jobs", models_root=work / "b" / "models"),
            Metrics(),
        )  # fmt: skip
        asked = time.monotonic()
        assert other.cancel(job_id)["state"] == "running"  # marked; the owner stops it
        done = _wait(srv, job_id, {"cancelled", "failed", "succeeded"}, timeout=60)
        took = time.monotonic() - asked
        assert done["state"] == "cancelled", done
        assert took < 15, f"stopped {took:.1f} s after the cancel"  # 1 s poll, 10 s grace at most
        epochs = [e for e in done["events"] if e["type"] == "epoch"]
        assert len(epochs) < LONG["epochs"], "the job trained to its end"
    finally:
        srv.stop()
