"""The training jobs' records and progress events, in the service database.

:class:`JobStore` keeps each job's row (state, config, times, outcome) and its progress events
in the service database (SQLite, or the shared PostgreSQL of ``VGE_DB_URL``;
:mod:`service.common.db`), so a restart loses no history. It is the storage half of training
jobs, kept apart from their scheduling (:class:`service.engine.jobs.JobManager`, the only writer)
so that the SQL and its schema can be read, and tested, on their own. Each row names the replica
that runs it (``owner``): replicas sharing one database see every job but act on their own.

Records: :class:`~service.common.job_record.JobRow`; states:
:class:`~service.common.job_record.JobState`.
"""

from __future__ import annotations

import builtins
import json
import math
import time
from typing import Any, cast

from service.common.db import Database
from service.common.job_record import TERMINAL, JobRow, JobState

__all__ = ["MAX_STORED_EVENTS", "JobStore"]

#: Step events stored per job at most (epoch, done and other events are always stored).
MAX_STORED_EVENTS = 5000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    config TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    model_dir TEXT,
    error TEXT,
    progress TEXT,
    metrics TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS job_events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""


class JobStore:
    """Job records and their progress events in a :class:`service.common.db.Database` (thread-safe)."""

    def __init__(self, db: Database, owner: str) -> None:
        self.db = db
        self.owner = owner  # the replica that runs this store's jobs (VGE_REPLICA_NAME)
        db.script(_SCHEMA)
        db.add_column("jobs", "owner", "TEXT")

    def close(self) -> None:
        self.db.close()

    def create(self, job_id: str, config: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO jobs (id, state, config, created_at, owner) VALUES (?, ?, ?, ?, ?)",
            (job_id, JobState.QUEUED.value, json.dumps(config), time.time(), self.owner),
        )

    def update(self, job_id: str, **fields: Any) -> None:
        if "state" in fields:  # a JobState (a bad string raises here, not in a reader)
            fields["state"] = JobState(fields["state"]).value
        for key in ("progress", "metrics"):
            if key in fields and not isinstance(fields[key], str | None):
                fields[key] = _dumps(fields[key])
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))

    def start_running(self, job_id: str, now: float) -> bool:
        """Mark a queued job running, unless it was cancelled (by any replica) meanwhile: one
        conditional write, so a cancel and a launch never both win. Whether it was marked."""
        changed = self.db.execute(
            "UPDATE jobs SET state = ?, started_at = ? WHERE id = ? AND state = ? "
            "AND cancel_requested = 0",
            (JobState.RUNNING.value, now, job_id, JobState.QUEUED.value),
        )
        return changed == 1

    def cancel_queued(self, job_id: str, now: float) -> bool:
        """Mark a job cancelled if it is still queued (one conditional write: a replica starting
        it at the same moment and this never both win). Whether it was marked."""
        changed = self.db.execute(
            "UPDATE jobs SET state = ?, finished_at = ? WHERE id = ? AND state = ?",
            (JobState.CANCELLED.value, now, job_id, JobState.QUEUED.value),
        )
        return changed == 1

    def add_event(self, job_id: str, event: dict[str, Any]) -> None:
        with self.db.transaction() as db:
            n = int(db.scalar("SELECT COUNT(*) AS n FROM job_events WHERE job_id = ?", (job_id,)))
            if n < MAX_STORED_EVENTS or event.get("type") != "step":
                db.execute(
                    "INSERT INTO job_events (job_id, seq, ts, event) VALUES (?, ?, ?, ?)",
                    (job_id, n, time.time(), _dumps(event)),
                )
            db.execute("UPDATE jobs SET progress = ? WHERE id = ?", (_dumps(event), job_id))

    def get(self, job_id: str) -> JobRow | None:
        row = self.db.fetchone("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _row(row) if row else None

    def list(self, limit: int = 100) -> list[JobRow]:
        rows = self.db.fetchall("SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,))
        return [_row(r) for r in rows]

    def events(self, job_id: str, steps: int = 200) -> builtins.list[dict[str, Any]]:
        """The job's events in order: every one but its ``step`` events (start, each epoch,
        calibration, done, ...), and the newest ``steps`` of those (a long job stores thousands:
        :data:`MAX_STORED_EVENTS`; its log has them all)."""
        rows = self.db.fetchall(
            "SELECT ts, event FROM job_events WHERE job_id = ? ORDER BY seq", (job_id,)
        )
        events = [{"ts": r["ts"], **json.loads(r["event"])} for r in rows]
        at = [i for i, e in enumerate(events) if e.get("type") == "step"]
        dropped = set(at[: max(0, len(at) - steps)])
        return [e for i, e in enumerate(events) if i not in dropped]

    def in_state(self, *states: JobState) -> builtins.list[JobRow]:
        """This replica's jobs in ``states`` (jobs of older versions, without owner, count too)."""
        marks = ",".join("?" * len(states))
        rows = self.db.fetchall(
            f"SELECT * FROM jobs WHERE state IN ({marks}) AND (owner = ? OR owner IS NULL) "
            "ORDER BY created_at",
            (*(JobState(s).value for s in states), self.owner),
        )
        return [_row(r) for r in rows]

    def finished_before(self, cutoff: float) -> builtins.list[str]:
        """Ids of this replica's jobs that ended before ``cutoff`` (a time.time())."""
        marks = ",".join("?" * len(TERMINAL))
        rows = self.db.fetchall(
            f"SELECT id FROM jobs WHERE state IN ({marks}) AND finished_at < ? "
            "AND (owner = ? OR owner IS NULL)",
            (*sorted(s.value for s in TERMINAL), cutoff, self.owner),
        )
        return [r["id"] for r in rows]

    def counts(self) -> dict[JobState, int]:
        rows = self.db.fetchall("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        return {JobState(r["state"]): int(r["n"]) for r in rows}


def _row(row: dict[str, Any]) -> JobRow:
    d = dict(row)
    for key in ("config", "progress", "metrics"):
        d[key] = json.loads(d[key]) if d[key] else None
    d["cancel_requested"] = bool(d["cancel_requested"])
    d["state"] = JobState(d["state"])
    d.setdefault("owner", None)
    return cast(JobRow, d)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None, in nested dicts and lists: a run that
    diverged reports ``train_loss`` NaN (or ``best_val_loss`` inf), which JSON has no number for
    (the job's answer would fail to encode: a 500)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    """JSON of a job's event, progress or metrics, non-finite numbers as null (:func:`_finite`)."""
    return json.dumps(_finite(value), allow_nan=False)
