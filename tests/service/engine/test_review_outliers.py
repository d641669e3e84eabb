"""Images a reviewer marks *not a digit* feed the next training job as outliers (issue 33, item 5).

A real SQLite review queue and a real :class:`JobManager`: a ``reviews+mnist-bundled`` job's own
data folder holds the marked images under ``outliers/`` (no class), its data load puts them in
``extra["outliers"]`` and not among the training digits, outlier exposure (switched on because
the recipe had it off) draws a quarter of every outlier batch from them, and the job's training
process reports them in its ``start`` event.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from service.common.review_images import OUTLIER_FOLDER
from service.common.review_store import ReviewStore

CLASSES = [str(i) for i in range(10)]
#: A small architecture, trained for one epoch on 256 bundled digits (as tests/service/system/test_jobs.py).
JOB = {"dataset": "reviews+mnist-bundled", "name": "oe-job", "version": "1.0.0", "epochs": 1,
       "max_train_samples": 256, "members": 2, "ensemble": "lle", "batch_size": 64,
       "device": "cpu", "seed": 1, "outlier_pool": 64, "outlier_batch_size": 16}  # fmt: skip


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _smiley() -> bytes:
    im = Image.new("L", (64, 64), 255)
    d = ImageDraw.Draw(im)
    d.ellipse((8, 8, 56, 56), outline=0, width=3)
    d.ellipse((20, 22, 26, 28), fill=0)
    d.ellipse((38, 22, 44, 28), fill=0)
    d.arc((18, 24, 46, 48), 20, 160, fill=0, width=3)
    return _png(np.asarray(im))


def _letter() -> bytes:
    from models.data_ood import render
    from models.data_ood.outliers import OUTLIER_FONTS

    return _png(render.glyph(np.random.default_rng(0), "AKW", OUTLIER_FONTS))


def _queue(store: ReviewStore, png: bytes) -> str:
    (out,) = store.enqueue(model="m", model_version="1", classes=CLASSES, images=[png],
                           answers=[{"label": "8", "vgmu": 0.9}])  # fmt: skip
    assert out.review_id is not None
    return out.review_id


def _dihedral(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` (1, H, W) and its mirror, each as is and transposed: what OutlierExposure.batch
    may make of an image."""
    return [v for m in (x, x.flip(-1)) for v in (m, m.transpose(-1, -2))]


def _canonical(png: bytes) -> torch.Tensor:
    """The image as the server and the job read it (models.prepare), uint8 (1, 28, 28)."""
    from torchvision.io import ImageReadMode, decode_image

    from models.prepare import Finding, canonicalise

    data = torch.frombuffer(bytearray(png), dtype=torch.uint8)
    found = canonicalise(decode_image(data, mode=ImageReadMode.UNCHANGED))
    assert found.finding == Finding.ok
    return found.image


def _wait(jobs: object, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = jobs.get(job_id)  # type: ignore[attr-defined]
        if job["state"] in ("succeeded", "failed", "cancelled", "interrupted"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish: {jobs.get(job_id)}")  # type: ignore[attr-defined]


def test_not_a_digit_reviews_are_the_next_jobs_outliers(
    tmp_path: Path, pngs: list[bytes], mnist: tuple[np.ndarray, np.ndarray]
) -> None:
    from models.data import load_dataset
    from models.training import TrainConfig
    from models.training.outliers import OutlierExposure
    from service.common.metrics import Metrics
    from service.common.settings import Settings
    from service.engine.jobs import REVIEW_OUTLIER_EXPOSURE, JobManager

    store = ReviewStore(f"sqlite:///{tmp_path}/reviews.sqlite3", tmp_path / "blobs",
                        max_items=100, lease_s=60.0)  # fmt: skip
    # Two digits labelled as classes; a letter and a smiley marked not a digit; a noise picture
    # marked too (the reading finds no digit in it: the server defers without the model, so the
    # job leaves it out); a digit marked by mistake, then corrected to its class.
    truth = [str(int(y)) for y in mnist[1][-64:][:3]]
    seven, three, fixed = (_queue(store, p) for p in pngs[:3])
    store.label(seven, truth[0], "ann")
    store.label(three, truth[1], "ann")
    store.mark_not_a_digit(fixed, "ann")
    store.label(fixed, truth[2], "ann")
    letter, smiley = _letter(), _smiley()
    noise = _png(np.random.default_rng(1).integers(0, 256, (28, 28), dtype=np.uint8))
    for png in (letter, smiley, noise):
        store.mark_not_a_digit(_queue(store, png), "ann")
    assert store.stats()["not_a_digit"]["count"] == 3

    jobs = JobManager(
        Settings(jobs_db_url=f"sqlite:///{tmp_path}/jobs.sqlite3", jobs_dir=tmp_path / "jobs",
                 data_root=tmp_path / "data", models_root=tmp_path / "models"),
        Metrics(),
    )  # fmt: skip
    jobs.reviews = store
    jobs.start()
    try:
        # The job's own data folder, written as a submission writes it: classes, and outliers/
        folder = tmp_path / "export"
        jobs._export_reviews(folder, outliers=True)
        written = sorted(p.relative_to(folder).parts[0] for p in folder.rglob("*.png"))
        assert written == sorted([*truth, OUTLIER_FOLDER, OUTLIER_FOLDER, OUTLIER_FOLDER])

        # The job: outlier exposure switched on (the recipe had it off), the data its folder.
        job = jobs.submit(dict(JOB))
        cfg = job["config"]
        assert cfg["outlier_exposure"] == REVIEW_OUTLIER_EXPOSURE
        assert cfg["dataset"] == f"imagefolder:{jobs._export_dir(job['id'])}+mnist-bundled"

        # What the job's data load and its outlier exposure make of that folder.
        bundle = load_dataset(f"imagefolder:{folder}+mnist-bundled", max_train_samples=256)
        assert len(bundle.train) == 256 + 3  # the labelled digits only: no "outliers" class
        assert bundle.class_names == CLASSES and bundle.extra["added_train"] == 3
        assert bundle.extra["outliers_unread"] == 1  # the noise
        got = {bytes(x.numpy()) for x in bundle.extra["outliers"]}
        assert got == {bytes(_canonical(p).numpy()) for p in (letter, smiley)}
        config = TrainConfig.model_validate(cfg)
        oe = OutlierExposure.for_run(config, bundle)
        assert oe.reviewed is not None and oe.reviewed.shape == (2, 1, 28, 28)
        want = torch.stack([_canonical(p) for p in (letter, smiley)]).float() / 255.0
        want = (want - bundle.mean[0]) / bundle.std[0]
        assert all(any(torch.allclose(r, w) for r in oe.reviewed) for w in want)  # any order
        batch = oe.batch(torch.device("cpu"))
        n = oe.reviewed_per_batch
        assert batch.shape[0] == JOB["outlier_batch_size"] and n == 4
        variants = [v for r in oe.reviewed for v in _dihedral(r)]
        for row in batch[:n]:  # drawn from the reviewed outliers, mirrored/turned at random
            assert any(torch.equal(row, v) for v in variants)

        # The training process itself: it saw them as outliers, and finished.
        done = _wait(jobs, job["id"])
        assert done["state"] == "succeeded", done
        start = next(e for e in done["events"] if e["type"] == "start")
        assert start["reviewed_outliers"] == 2 and start["train_size"] == 256 + 3
        assert not jobs._export_dir(job["id"]).exists()  # removed with the job
    finally:
        jobs.shutdown()
