"""The whole human-in-the-loop cycle over HTTP against one real server, and reversible promotions
under load (issue 24's "done when").

predict → abstain → queued → labelled through the API → a training job on the reviews + bundled
MNIST that retrains the *served* model's configuration from its weights → the promote gate's
comparison → promote → ``kill -9`` of the engine → the promoted model is still served → roll
back (under load, no request fails) → promote a shipped model by name → roll back to any earlier
entry of the history.

The served model is the shipped LeNet-5 LLE-VGN (not the session's one-epoch tiny model, which
is at chance level): the gate compares real accuracies, so its verdict means something.
"""

from __future__ import annotations

import io
import math
import tarfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from models.zoo import zoo_model_dir
from tests.service.conftest import API_KEY, Server, kill_engine, start_server

A = {"Authorization": f"Bearer {API_KEY}"}
# No architecture: the served model's own configuration, fine-tuned from its weights.
JOB = {"dataset": "reviews+mnist-bundled", "epochs": 1, "max_train_samples": 512, "device": "cpu"}
SERVED = "lenet5-lle-vgn-mnist"


def _served(srv: Server) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]["name"]


def _version(srv: Server) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]["version"]


def _wait_job(srv: Server, job_id: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{srv.url}/v1/training-jobs/{job_id}", headers=A, timeout=10).json()
        if job["state"] in ("succeeded", "failed", "cancelled", "interrupted"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish:\n{srv.log()}")


class Load:
    """Predictions sent back to back from a thread while models are swapped; all must be 200."""

    def __init__(self, srv: Server, png: bytes) -> None:
        self.srv, self.png = srv, png
        self.codes: list[int] = []
        self.models: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.srv.url, timeout=30) as c:
            while not self._stop.is_set():
                r = c.post("/v1/predict", files=[("images", ("x.png", self.png, "image/png"))])
                self.codes.append(r.status_code)
                if r.status_code == 200:
                    self.models.add(r.json()["model"])

    def answered(self, n: int, timeout: float = 30) -> None:
        """Wait until ``n`` answers have come back."""
        deadline = time.monotonic() + timeout
        while len(self.codes) < n:
            assert time.monotonic() < deadline, f"only {len(self.codes)} answers"
            time.sleep(0.02)

    def __enter__(self) -> Load:
        self._thread.start()
        self.answered(1)  # the model before the swap has answered
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:  # keep sending after the swap: one answer may have been in flight
            self.answered(len(self.codes) + 3)
        self._stop.set()
        self._thread.join(30)


def test_review_to_retrain_to_promote_and_roll_back(
    tmp_path_factory: pytest.TempPathFactory,
    pngs: list[bytes],
    mnist: tuple[np.ndarray, np.ndarray],
) -> None:
    work = tmp_path_factory.mktemp("review-loop")
    start = zoo_model_dir(SERVED)
    assert start is not None
    srv = start_server(work, start, review_queue="on", api_key=API_KEY, workers=2)
    try:
        c = httpx.Client(base_url=srv.url, headers=A, timeout=120)
        v0 = _version(srv)
        nothing = c.post("/v1/training-jobs", json=JOB)
        assert nothing.status_code == 422 and "no review item is labelled" in nothing.text

        # predict → abstain (a demanding abstain_k) → queued; LeNet-5 is certain of some digits
        # (p̄₁ = 1, s = 0: no k defers them), which review=always (keyed) queues as well
        files = [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs[:8])]
        auto = c.post("/v1/predict", params={"abstain_k": 100}, files=files).json()["results"]
        assert any(r["abstain"] for r in auto)
        assert all(r.get("review_status") == ("queued" if r["abstain"] else None)
                   for r in auto), auto  # fmt: skip
        opts = {"abstain_k": 100, "review": "always"}
        results = c.post("/v1/predict", params=opts, files=files).json()["results"]
        assert all(r["review_status"] in ("queued", "already_queued") for r in results)

        # labelled by a person through the API (the true digits; integer labels name classes)
        truth = [int(y) for y in mnist[1][-64:][:8]]
        for r, label in zip(results, truth, strict=True):
            c.post(f"/v1/reviews/{r['review_id']}", json={"label": label, "reviewer": "ann"}
                   ).raise_for_status()  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(c.get("/v1/reviews/export").content)) as tar:
            assert sorted(n.split("/")[0] for n in tar.getnames()) == sorted(map(str, truth))

        # a training job on the reviewed images mixed into the bundled data: the served model's
        # architecture and recipe, from its weights, under its name with a new version
        job = c.post("/v1/training-jobs", json=JOB)
        assert job.status_code == 202, job.text
        cfg, job_id = job.json()["config"], job.json()["id"]
        assert cfg["dataset"].endswith("+mnist-bundled")
        assert (cfg["name"], cfg["version"]) == (SERVED, f"{v0}-{job_id}")
        assert (cfg["backbone"], cfg["ensemble"], cfg["vgn"]) == ("lenet5", "lle", True)
        assert cfg["init_from"] == str(start)
        exported = Path(cfg["dataset"].removeprefix("imagefolder:").removesuffix("+mnist-bundled"))
        done = _wait_job(srv, job_id)
        assert done["state"] == "succeeded", done
        assert not exported.exists()  # the job's copy of the labelled images is gone with it

        # the gate compares candidate and served on the same digits, then promotes
        r = c.post("/v1/models/promote", json={"job_id": job_id})
        assert r.status_code == 200, r.text
        gate = r.json()["gate"]
        assert gate["verdict"] == "passed" and gate["failures"] == [], gate
        for side in ("served", "candidate"):
            assert gate[side]["accuracy"] > 0.95, gate  # real models, real numbers
        assert (_served(srv), _version(srv)) == (SERVED, cfg["version"])

        # kill -9 of the engine: the supervisor's new engine restores the promoted model, and
        # V2 clients keep their URL (the name did not change)
        restored = kill_engine(srv)
        assert (restored["name"], restored["version"]) == (SERVED, cfg["version"])
        assert httpx.get(f"{srv.url}/v2/models/{SERVED}/ready", timeout=10).status_code == 200

        # roll back under load: the previous model again, no request fails
        with Load(srv, pngs[0]) as load:
            rolled = c.post("/v1/models/rollback")
            assert rolled.status_code == 200, rolled.text
        assert rolled.json()["model"]["version"] == v0 and _version(srv) == v0
        assert load.codes and set(load.codes) == {200}, load.codes

        # a shipped model by name (gated: it is not worse), then back to any earlier entry
        shipped = c.post("/v1/models/promote", json={"model": "cnn4-lle-vgn-mnist"})
        assert shipped.status_code == 200, shipped.text
        assert _served(srv) == "cnn4-lle-vgn-mnist"
        history = c.get("/v1/models/history").json()["history"]
        assert [(h["action"], h["model"], h["version"]) for h in history] == [
            ("promote", "cnn4-lle-vgn-mnist", _version(srv)), ("rollback", SERVED, v0),
            ("promote_job", SERVED, cfg["version"]), ("start", SERVED, v0),
        ]  # fmt: skip
        with Load(srv, pngs[1]) as load:
            back = c.post("/v1/models/rollback", json={"to": history[2]["id"]})
            assert back.status_code == 200, back.text
        assert _version(srv) == cfg["version"] and set(load.codes) == {200}
        # Models swapped out stop exporting their windows (an alert on them resolves); the
        # served one exports numbers.
        assert math.isnan(srv.metric("vge_abstain_ratio_window", model="cnn4-lle-vgn-mnist"))
        assert not math.isnan(srv.metric("vge_abstain_ratio_window", model=SERVED))
        assert c.post("/v1/models/rollback", json={"to": "nope"}).status_code == 404
        assert httpx.post(srv.url + "/v1/models/rollback").status_code == 401  # admin only
    finally:
        srv.stop()


def test_rollback_with_one_model_is_a_conflict(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> None:
    srv = start_server(tmp_path_factory.mktemp("rollback"), tiny_model, api_key=API_KEY, workers=1)
    try:
        r = httpx.post(srv.url + "/v1/models/rollback", headers=A, timeout=30)
        assert r.status_code == 409 and "nothing to roll back to" in r.json()["error"]
    finally:
        srv.stop()
