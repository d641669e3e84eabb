"""The whole human-in-the-loop cycle over HTTP, and reversible promotions under load.

predict → abstain → queued → labelled → export → training job on the reviews (+ bundled MNIST)
→ promote → served → roll back (under load, no request fails) → promote a shipped model by name
→ roll back to any earlier entry of the history.
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

from tests.service.conftest import API_KEY, Server, start_server

A = {"Authorization": f"Bearer {API_KEY}"}
JOB = {"name": "reviewed-model", "version": "1.1.0", "epochs": 1, "max_train_samples": 256,
       "members": 2, "ensemble": "lle", "batch_size": 64, "device": "cpu", "seed": 3,
       "dataset": "reviews+mnist-bundled"}  # fmt: skip


def _served(srv: Server) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]["name"]


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
    tiny_model: Path,
    pngs: list[bytes],
    mnist: tuple[np.ndarray, np.ndarray],
) -> None:
    work = tmp_path_factory.mktemp("review-loop")
    srv = start_server(work, tiny_model, review_queue="on", api_key=API_KEY, workers=2)
    try:
        c = httpx.Client(base_url=srv.url, headers=A, timeout=60)
        nothing = c.post("/v1/training-jobs", json=JOB)
        assert nothing.status_code == 422 and "no review item is labelled" in nothing.text

        # predict → abstain (a demanding abstain_k) → queued
        files = [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs[:8])]
        results = c.post("/v1/predict", params={"abstain_k": 100}, files=files).json()["results"]
        assert all(r["abstain"] and r["review_status"] == "queued" for r in results)

        # labelled by a person (the true digits)
        truth = [str(int(y)) for y in mnist[1][-64:][:8]]
        for r, label in zip(results, truth, strict=True):
            c.post(f"/v1/reviews/{r['review_id']}", json={"label": label, "reviewer": "ann"}
                   ).raise_for_status()  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(c.get("/v1/reviews/export").content)) as tar:
            assert sorted(n.split("/")[0] for n in tar.getnames()) == sorted(truth)

        # a training job on the reviewed images mixed into the bundled data
        job = c.post("/v1/training-jobs", json=JOB)
        assert job.status_code == 202, job.text
        assert job.json()["config"]["dataset"].endswith("+mnist-bundled")
        exported = Path(job.json()["config"]["dataset"].removeprefix("imagefolder:")
                        .removesuffix("+mnist-bundled"))  # fmt: skip
        assert sorted(p.parent.name for p in exported.rglob("*.png")) == sorted(truth)
        done = _wait_job(srv, job.json()["id"])
        assert done["state"] == "succeeded", done

        # promote → served
        r = c.post("/v1/models/promote", json={"job_id": done["id"]})
        assert r.status_code == 200, r.text
        assert _served(srv) == "reviewed-model"

        # roll back under load: the previous model again, no request fails
        with Load(srv, pngs[0]) as load:
            rolled = c.post("/v1/models/rollback")
            assert rolled.status_code == 200, rolled.text
        assert rolled.json()["model"]["name"] == "tiny" and _served(srv) == "tiny"
        assert load.codes and set(load.codes) == {200}, load.codes
        assert load.models == {"reviewed-model", "tiny"}

        # a shipped model by name, then back to any earlier entry (the job's model)
        shipped = c.post("/v1/models/promote", json={"model": "lenet5-lle-vgn-mnist"})
        assert shipped.status_code == 200 and _served(srv) == "lenet5-lle-vgn-mnist"
        history = c.get("/v1/models/history").json()["history"]
        assert [(h["action"], h["model"]) for h in history] == [
            ("promote", "lenet5-lle-vgn-mnist"), ("rollback", "tiny"),
            ("promote_job", "reviewed-model"), ("start", "tiny"),
        ]  # fmt: skip
        with Load(srv, pngs[1]) as load:
            back = c.post("/v1/models/rollback", json={"to": history[2]["id"]})
            assert back.status_code == 200, back.text
        assert _served(srv) == "reviewed-model" and set(load.codes) == {200}
        # Models swapped out stop exporting their windows (an alert on them resolves); the
        # served one exports numbers.
        for gone in ("tiny", "lenet5-lle-vgn-mnist"):
            assert math.isnan(srv.metric("vge_abstain_ratio_window", model=gone)), gone
        assert not math.isnan(srv.metric("vge_abstain_ratio_window", model="reviewed-model"))
        assert srv.metric("vge_queue_depth", model="tiny") == 0
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
