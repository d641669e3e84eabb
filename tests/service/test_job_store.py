"""The training-job store on SQLite and on a real PostgreSQL: records, events, and ownership.

With one shared database, each replica owns the jobs it accepted: restarting one replica must not
mark another replica's running jobs interrupted (``in_state`` sees only its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.common.db import Database
from service.engine.jobs import JobStore


def test_records_events_and_owners(db_url: str) -> None:
    a = JobStore(Database(db_url), owner="a")
    b = JobStore(Database(db_url), owner="b")
    a.create("job-a", {"epochs": 1})
    b.create("job-b", {"epochs": 2})
    a.update("job-a", state="running", started_at=1.0, metrics={"acc": 0.5})
    a.add_event("job-a", {"type": "epoch", "epoch": 1})
    a.add_event("job-a", {"type": "done"})
    job = b.get("job-a")  # every replica reads every job
    assert job is not None and job["config"] == {"epochs": 1} and job["metrics"] == {"acc": 0.5}
    assert job["progress"] == {"type": "done"} and job["cancel_requested"] is False
    assert [e["type"] for e in a.events("job-a")] == ["epoch", "done"]
    assert {j["id"] for j in b.list()} == {"job-a", "job-b"}
    assert [j["id"] for j in a.in_state("queued", "running")] == ["job-a"]
    assert [j["id"] for j in b.in_state("queued", "running")] == ["job-b"]
    assert a.counts() == {"running": 1, "queued": 1}


def test_an_old_table_without_owner_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE jobs (id TEXT PRIMARY KEY, state TEXT NOT NULL, config TEXT NOT NULL, "
            "created_at REAL NOT NULL, started_at REAL, finished_at REAL, model_dir TEXT, "
            "error TEXT, progress TEXT, metrics TEXT, cancel_requested INTEGER NOT NULL DEFAULT 0)"
        )
        conn.execute(
            "INSERT INTO jobs (id, state, config, created_at) VALUES ('old', 'running', '{}', 1)"
        )
    store = JobStore(Database(f"sqlite:///{path}"), owner="me")
    assert [j["id"] for j in store.in_state("running")] == ["old"]  # no owner: counts as ours
    assert store.get("old")["owner"] is None


def test_imagefolder_datasets_are_confined_to_the_data_root(tmp_path: Path) -> None:
    from service.common.errors import InvalidValue
    from service.common.metrics import Metrics
    from service.common.settings import Settings
    from service.engine.jobs import JobManager

    root = tmp_path / "data"
    (root / "digits").mkdir(parents=True)
    settings = Settings(jobs_db_url=f"sqlite:///{tmp_path}/jobs.sqlite3", data_root=root)
    jobs = JobManager(settings, Metrics())
    mixed = jobs._place_data({"dataset": "imagefolder:digits+mnist-bundled"}, "job-1")
    assert mixed["dataset"] == f"imagefolder:{root.resolve() / 'digits'}+mnist-bundled"
    assert jobs._place_data({"dataset": "imagefolder:digits"}, "job-1")["dataset"].endswith(
        "/digits"
    )
    with pytest.raises(InvalidValue, match="outside the data root"):
        jobs._place_data({"dataset": "imagefolder:../elsewhere+mnist-bundled"}, "job-1")
    with pytest.raises(InvalidValue, match="needs the review queue"):
        jobs._place_data({"dataset": "reviews"}, "job-1")
