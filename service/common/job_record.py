"""A training job's state and record, as the engine stores them and the wire carries them.

:class:`JobState` is a ``StrEnum``: each member *is* its string (``JobState.QUEUED == "queued"``,
same hash, ``json.dumps`` writes ``"queued"``, SQLite and psycopg store ``'queued'``), so the
stored values, the HTTP answers and the ``vge_training_jobs{state=...}`` labels are the strings
they always were; code compares and sets members, never spelt strings.

States: ``queued`` → ``running`` → ``succeeded`` | ``failed`` | ``cancelled`` | ``interrupted``
(a queued job may also be ``cancelled``, or ``interrupted`` by a restart).
"""

from __future__ import annotations

import enum
from typing import Any, TypedDict

__all__ = ["ACTIVE", "TERMINAL", "Job", "JobRow", "JobState"]


class JobState(enum.StrEnum):
    """Where a training job is in its life."""

    QUEUED = "queued"  # accepted, waiting for a free slot (max_concurrent_jobs)
    RUNNING = "running"  # its training process runs
    SUCCEEDED = "succeeded"  # trained; its model can be promoted
    FAILED = "failed"  # the training process failed (error says why)
    CANCELLED = "cancelled"  # cancelled while queued or running
    INTERRUPTED = "interrupted"  # the server stopped while it was queued or running

    @property
    def terminal(self) -> bool:
        """Whether the job has ended (no state follows)."""
        return self in TERMINAL


#: States a job ends in.
TERMINAL = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.INTERRUPTED}
)
#: States of a job that has not ended (marked interrupted when the server stops or restarts).
ACTIVE = (JobState.QUEUED, JobState.RUNNING)


class JobRow(TypedDict):
    """One row of the ``jobs`` table as :class:`service.engine.job_store.JobStore` reads it."""

    id: str
    state: JobState
    config: dict[str, Any]  # the validated TrainConfig, as JSON
    created_at: float
    started_at: float | None
    finished_at: float | None
    model_dir: str | None  # a succeeded job's model
    error: str | None
    progress: dict[str, Any] | None  # the last event
    metrics: dict[str, Any] | None
    cancel_requested: bool
    owner: str | None  # the replica that runs it (None: written before owners were recorded)


class Job(JobRow, total=False):
    """A job as the API answers it: its row and its progress events, oldest first."""

    events: list[dict[str, Any]]
