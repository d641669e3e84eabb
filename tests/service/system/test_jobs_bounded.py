"""Training jobs and the files the server writes, against a real ``vge serve`` (issue 36):

* a job whose estimated memory is over the budget is refused (422 saying by how much), writing
  nothing;
* class names never become paths: labels ``../x`` and an absolute path give percent-encoded
  folders in the review export's tar and in a job's training data, nothing outside them;
* a job's log is capped (rotated), read from its end, readable by a person (``format=text``),
  and deleted after its retention;
* what the server creates (review images, SQLite databases, job folders and logs, trained
  models' folders) is private: 0600 files, 0700 directories (``VGE_UMASK`` 0077 by default).
"""

from __future__ import annotations

import io
import json
import re
import stat
import tarfile
import time
import uuid
from pathlib import Path, PurePosixPath

import httpx
import pytest

from service.common.review_store import ReviewStore
from tests.service.conftest import API_KEY, Server, start_server
from tests.service.system.test_jobs import LONG, TINY, _wait

H = {"Authorization": f"Bearer {API_KEY}"}
#: The issue's example: 987 M parameters (under the 10⁹ bound) and a batch of 4,096.
HUGE = {"backbone": "cnn4", "backbone_kwargs": {"width": 2048, "hidden": 3600}, "members": 2,
        "vgn": False, "batch_size": 4096, "ensemble": "lle", "epochs": 1}  # fmt: skip
LOG_CAP = 8192
#: A job's log is deleted 13 s after the job ended (swept every 1.3 s): time enough for the checks
#: between its end and its deletion, a few requests.
RETENTION_DAYS = 13 / 86400


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _private(root: Path) -> list[str]:
    """Everything under ``root`` that is not private (files 0600, directories 0700)."""
    loose = []
    for p in [root, *root.rglob("*")]:
        want = 0o700 if p.is_dir() else 0o600
        if not p.is_symlink() and _mode(p) & ~want:
            loose.append(f"{p} {oct(_mode(p))}")
    return loose


def _until(cond: object, what: str, srv: Server, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{srv.log()[-3000:]}"
        time.sleep(0.3)


def test_jobs_bounded_names_safe_logs_capped_files_private(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes]
) -> None:
    work = tmp_path_factory.mktemp("bounded")
    srv = start_server(
        work, tiny_model, api_key=API_KEY, review_queue="on", workers=1,
        job_log_max_bytes=LOG_CAP, job_log_retention_days=RETENTION_DAYS,
    )  # fmt: skip
    outside = Path(f"/tmp/vge-outside-{uuid.uuid4().hex}")
    try:
        c = httpx.Client(base_url=srv.url, headers=H, timeout=60)

        # --- a job over the memory budget: 422 by how much, nothing recorded or written
        r = c.post("/v1/training-jobs", json=HUGE)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "986,897,780 parameters" in error and "over the job memory budget" in error
        need, over = (float(x.replace(",", "")) for x in re.findall(r"([\d,.]+) GiB", error)[:2])
        assert need > 100 and 0 < over < need, error  # ~220 GiB, most of it activations
        assert c.get("/v1/training-jobs").json()["jobs"] == []

        # --- review images and databases are private
        files = [("images", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs[:2])]
        assert c.post("/v1/predict?review=always", files=files).status_code == 200
        reviews = work / "reviews"
        assert _private(reviews) == []
        assert len([p for p in (reviews / "blobs").rglob("*") if p.is_file()]) == 2
        assert _mode(reviews / "reviews.sqlite3") == 0o600
        assert _mode(work / "jobs.sqlite3") == 0o600

        # --- class names that are paths: items of a model whose classes are "../x" and an
        # absolute path, labelled, in the store the server shares (the card schema may refuse
        # such a model; the store, the export and the jobs must be safe whatever a card said)
        store = ReviewStore(f"sqlite:///{reviews / 'reviews.sqlite3'}", reviews / "blobs",
                            max_items=100, lease_s=60.0)  # fmt: skip
        classes = ["../x", str(outside), "7"]
        queued = store.enqueue(
            model="evil", model_version="1", classes=classes, images=pngs[10:13],
            answers=[{"label": "7", "vgmu": 0.5}] * 3,
        )  # fmt: skip
        for item, label in zip(queued, classes, strict=True):
            store.label(item.review_id, label, "ann")
        store.close()
        with tarfile.open(fileobj=io.BytesIO(c.get("/v1/reviews/export").content)) as tar:
            folders = {PurePosixPath(n).parts[0] for n in tar.getnames()}
            assert all(len(PurePosixPath(n).parts) == 2 for n in tar.getnames())
        encoded = {"%2E%2E%2Fx", outside.as_posix().replace("/", "%2F").replace("-", "%2D")}
        assert folders == {"7"} | encoded

        # a job on the reviewed images: its data is its own folder, one folder per class
        long_id = c.post("/v1/training-jobs", json=LONG).json()["id"]  # holds the one slot
        job = c.post("/v1/training-jobs", json={"dataset": "reviews", "epochs": 1})
        assert job.status_code == 202 and job.json()["state"] == "queued", job.text
        export = work / "jobs" / job.json()["id"] / "reviews"
        assert {p.name for p in export.iterdir()} == {"7"} | encoded
        assert len(list(export.rglob("*.png"))) == 3 and not outside.exists()
        assert not (work / "jobs" / job.json()["id"] / "x").exists()
        assert c.post(f"/v1/training-jobs/{job.json()['id']}/cancel").status_code == 200
        assert c.post(f"/v1/training-jobs/{long_id}/cancel").status_code == 200
        _wait(srv, long_id, {"cancelled", "failed", "succeeded"})

        # --- a job's log: capped, read from its end, for a person with format=text
        small = {**TINY, "batch_size": 8}  # 32 steps: a progress line each, past the cap's half
        job_id = c.post("/v1/training-jobs", json=small).json()["id"]
        done = _wait(srv, job_id, {"succeeded", "failed"}, timeout=180)
        assert done["state"] == "succeeded", done
        folder = work / "jobs" / job_id
        sizes = {p.name: p.stat().st_size for p in folder.glob("train.log*")}
        assert set(sizes) == {"train.log", "train.log.1"}, sizes  # rotated
        assert sum(sizes.values()) <= LOG_CAP, sizes
        raw = c.get(f"/v1/training-jobs/{job_id}/logs", params={"tail": 3})
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/plain")
        last = raw.text.splitlines()
        assert len(last) == 3 and json.loads(last[-1])["type"] == "done", raw.text
        text = c.get(f"/v1/training-jobs/{job_id}/logs", params={"format": "text"}).text
        assert not [x for x in text.splitlines() if x.startswith("{")], text  # no JSON left
        assert re.search(r"^epoch 1  step \d+/32  train_loss \d\.\d{4}  eta ", text, re.M), text
        assert re.search(r"^epoch 1  step 32/32  train_loss .* val_accuracy 0\.\d{4}", text, re.M)
        assert re.search(r"^done  epoch 1 .*test_accuracy 0\.\d{4}", text, re.M), text
        bad = c.get(f"/v1/training-jobs/{job_id}/logs", params={"format": "html"})
        assert bad.status_code == 422 and "format" in bad.json()["error"], bad.text
        assert _private(folder) == []
        # the trained model's folder too (models.checkpoint makes its weights file 0644 for
        # packaging; inside a 0700 folder no other user reaches it)
        assert _mode(work / "models" / job_id) == 0o700

        # --- deleted after its retention (13 s after the job ended); the job record stays
        _until(lambda: not folder.exists(), "the log's deletion", srv)
        assert c.get(f"/v1/training-jobs/{job_id}/logs").text == ""
        assert c.get(f"/v1/training-jobs/{job_id}").json()["state"] == "succeeded"
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        srv.stop()
