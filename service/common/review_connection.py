"""The review queue's database connection as a state machine: up, unavailable, reopened.

Why apart from the queue's queries (:mod:`service.common.review_store`): failures stay in the
queue (predictions do not need it), and keeping them there is one job of its own, the same for
every query. A store that is missing, corrupt, unwritable or unreachable (PostgreSQL down) makes
:class:`ReviewConnection` *unavailable*, never its process: opening it never raises, predictions
answer ``review_status: "unavailable"``, the review API answers 503
(:class:`ReviewStoreUnavailable`) naming the file or URL (password masked) and what to do, the
log says the same once per outage, and ``vge_review_store_up`` reads 0. It is retried lazily, on
use and by each process's watcher (:func:`watch`), with a backoff from 0 to :data:`RETRY_MAX_S`,
and serves again once fixed.

The SQLite file's identity (device, inode) is compared on every use and after every write: a file
deleted or replaced under the server is noticed, and what was written to the old file is not
answered ``queued`` (an answer says ``queued`` only once its row is committed to the file at the
queue's path, fsynced: ``synchronous=FULL``, with a rollback journal rather than a WAL that would
outlive a deleted file, see :class:`service.common.db.Database`). A missing file is created only
for a new queue (no stored images yet); beside stored images, a missing file means the database
was deleted or its volume is not mounted, and the queue stays unavailable until the file is
restored (or ``touch``-ed, for an empty queue), instead of queueing into a fresh file that the
lost one's images no longer match. The image directory is part of the store's health too: one
that cannot be written makes the store unavailable as a failed database does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from service.common.db import Database, check_url, mask_url, scrub, sqlite_path
from service.common.errors import DatabaseUnavailable

if TYPE_CHECKING:  # imported by the metrics only (prometheus-client's multiprocess mode)
    from prometheus_client import Gauge

log = logging.getLogger("vge.reviews")

#: The longest wait between two attempts to reopen an unavailable store (the first is at once).
RETRY_MAX_S = 5.0
#: How often each process's watcher checks its store (file identity; a retry when one is due).
WATCH_INTERVAL_S = 2.0


class ReviewStoreUnavailable(DatabaseUnavailable):
    """The review queue's store cannot be used now (503 with Retry-After); the message names the
    file or URL and what to do."""

    code = "review_store_unavailable"


def _faults() -> tuple[type[BaseException], ...]:
    """What makes the store unavailable: its database's and its files' failures."""
    faults: tuple[type[BaseException], ...] = (DatabaseUnavailable, sqlite3.Error, OSError)
    try:
        import psycopg
    except ImportError:  # pragma: no cover - without the postgres extra
        return faults
    return (*faults, psycopg.Error)


class ReviewConnection:
    """The review queue's database connection and whether it can be used (thread-safe).

    ``db`` is the database URL (the connection opens, and when it fails reopens, its own
    :class:`Database`) or an open :class:`Database` (used for the first opening). ``blob_root``
    is the directory of the queue's images: an opening checks that it can be written. ``prepare``
    creates or migrates the queue's tables on each opened database (its failure fails the
    opening). Constructing never raises: a connection that cannot be opened is unavailable
    (:attr:`up` False, :attr:`problem` says why) and every use raises
    :class:`ReviewStoreUnavailable` until a retry succeeds.
    """

    def __init__(
        self, db: Database | str, blob_root: Path, prepare: Callable[[Database], None]
    ) -> None:
        self._given = db if isinstance(db, Database) else None
        self.url = db.url if isinstance(db, Database) else check_url(db, "review database URL")
        self.postgres = self.url.startswith(("postgresql://", "postgres://"))
        self.path = None if self.postgres else sqlite_path(self.url)
        self.blob_root = blob_root
        self._prepare = prepare
        self._db: Database | None = None
        self._identity: tuple[int, int] | None = None  # the SQLite file's (st_dev, st_ino)
        self._lock = threading.Lock()  # one (re)opening at a time; users never wait for it
        self._failures = 0  # consecutive failed openings: the backoff's exponent
        self._retry_at = 0.0  # time.monotonic() of the next opening attempt
        self.problem: str | None = None  # why the store is unavailable (None: it is up)
        self._faults = _faults()
        with contextlib.suppress(ReviewStoreUnavailable):
            self._connection()

    @property
    def where(self) -> str:
        """The store for messages: its SQLite file, or its URL with the password masked."""
        return str(self.path) if self.path is not None else mask_url(self.url)

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql`` (the ``vge_review_store_up`` label)."""
        return "postgresql" if self.postgres else "sqlite"

    @property
    def up(self) -> bool:
        """Whether the last use (or attempt to open) succeeded."""
        return self.problem is None

    @property
    def db(self) -> Database:
        """The open database (opened, or reopened, if it has to be)."""
        return self._connection()

    def check(self) -> bool:
        """Notice a deleted or replaced file, retry an unavailable store when a retry is due;
        whether it is up. What each process's watcher calls every :data:`WATCH_INTERVAL_S`."""
        with contextlib.suppress(ReviewStoreUnavailable):
            self._connection()
        return self.up

    @contextlib.contextmanager
    def use(self, *, writes: bool = False) -> Iterator[Database]:
        """The database for one operation; its failure makes the store unavailable. With
        ``writes``, the file is checked again afterwards: a write that went to a file deleted or
        replaced meanwhile is reported unavailable, not done."""
        db = self._connection()
        try:
            yield db
        except self._faults as exc:
            if self._db is db:
                self.fail(exc)
            raise self.unavailable() from None
        if writes and not self._same_file():
            if self._db is db:
                self._lose(
                    f"the SQLite file {self.where} was deleted or replaced while the server "
                    "wrote to it; what it held is only in a backup now",
                    at_once=True,
                )
            raise self.unavailable()

    def fail(self, exc: BaseException) -> None:
        """Go unavailable for ``exc`` (a failure of the database or of the image files)."""
        self._lose(self._describe(exc))

    def unavailable(self) -> ReviewStoreUnavailable:
        """The error a use of the unavailable store raises (it says why and when to retry)."""
        return ReviewStoreUnavailable(
            f"the review queue is unavailable: {self.problem}",
            headers={"Retry-After": str(max(1, round(RETRY_MAX_S)))},
        )

    def close(self) -> None:
        """Close the connection (the process ends)."""
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def _same_file(self) -> bool:
        """Whether the SQLite file at the queue's path is still the one this store opened."""
        if self.path is None:
            return True
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def _connection(self) -> Database:
        db = self._db
        if db is not None and self._same_file():
            return db
        if not self._lock.acquire(blocking=False):  # another thread (re)opens: do not wait on it
            raise ReviewStoreUnavailable(
                f"the review queue is unavailable: {self.problem or self.where + ' is reopened'}"
                "; retry shortly",
                headers={"Retry-After": "1"},
            )
        try:
            if self._db is not None:
                if self._same_file():
                    return self._db
                self._lose(
                    f"the SQLite file {self.where} was deleted or replaced while the server used "
                    "it; what it held is only in a backup now",
                    at_once=True,
                )
            if time.monotonic() < self._retry_at:
                raise self.unavailable()
            try:
                self._db = self._open()
            except self._faults as exc:
                self.fail(exc)
                raise self.unavailable() from None
            if self.problem is not None:
                log.warning("review queue: %s is available again; queueing resumes", self.where)
            self.problem, self._failures, self._retry_at = None, 0, 0.0
            return self._db
        finally:
            self._lock.release()

    def _open(self) -> Database:
        """Open the database, create or migrate its tables, check that images can be written."""
        given, self._given = self._given, None
        if self.path is None:
            db = given or Database(self.url, synchronous="FULL", connect_timeout=3)
        else:
            db = given or self._open_sqlite(self.path)
        try:
            self._prepare(db)
            self.blob_root.mkdir(parents=True, exist_ok=True)
            probe = self.blob_root / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")  # unwritable (read-only volume, full disk, ...) fails here
            probe.unlink()
            if self.path is not None:
                st = os.stat(self.path)
                self._identity = (st.st_dev, st.st_ino)
        except BaseException:
            with contextlib.suppress(Exception):
                db.close()
            raise
        return db

    def _open_sqlite(self, path: Path) -> Database:
        """Open the SQLite file; create it only for a new queue (see the module's docstring).

        A rollback journal, not a WAL (:class:`Database`), and a missing file beside a journal or
        WAL left from the deleted one is not created: that journal would be applied to it.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            for suffix in ("-journal", "-wal", "-shm"):
                if (stale := Path(f"{path}{suffix}")).exists():
                    raise FileNotFoundError(
                        f"{path} is missing but {stale} is left from the deleted file: remove "
                        f"{stale.name}, then restore {path.name} from a backup or `touch {path}` "
                        "to start an empty queue"
                    )
            if self._holds_images():
                raise FileNotFoundError(
                    f"{path} is missing but {self.blob_root} holds queued images: the queue's "
                    "database was deleted, or its volume is not mounted. Restore the file from a "
                    f"backup (or mount the volume), or `touch {path}` to start an empty queue"
                )
        return Database(self.url, synchronous="FULL", journal="DELETE")

    def _holds_images(self) -> bool:
        try:
            return any(p.is_file() for p in self.blob_root.rglob("*"))
        except OSError:
            return False

    def _lose(self, problem: str, *, at_once: bool = False) -> None:
        """Drop the connection and go unavailable (log once per outage)."""
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(Exception):
                db.close()
        if self.problem is None:
            log.error(
                "review queue: %s. Predictions are still answered (review_status "
                '"unavailable"); the store is retried by itself', problem,
            )  # fmt: skip
        elif problem != self.problem:
            log.warning("review queue still unavailable: %s", problem)
        self.problem = problem
        if at_once:
            self._failures, self._retry_at = 0, 0.0
            return
        delay = 0.0 if self._failures == 0 else min(RETRY_MAX_S, 0.5 * 2 ** (self._failures - 1))
        self._failures += 1
        self._retry_at = time.monotonic() + delay

    def _describe(self, exc: BaseException) -> str:
        """What failed and what to do, naming the file or URL (never its password)."""
        detail = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else "", self.url)
        what = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        where = self.where
        if self.postgres:
            fix = (
                f"check that the PostgreSQL server of {where} runs and accepts this replica "
                "(VGE_DB_URL)"
            )
        elif isinstance(exc, FileNotFoundError) and str(self.path) in detail:
            return detail
        elif isinstance(exc, sqlite3.DatabaseError) and (
            "not a database" in detail or "malformed" in detail
        ):
            fix = (
                f"{where} is corrupt: move it aside and restore a backup, or move it aside and "
                f"`touch {where}` to start an empty queue"
            )
        elif isinstance(exc, OSError) or "readonly" in detail or "unable to open" in detail:
            fix = (
                f"make {where} and {self.blob_root} writable by the server (VGE_REVIEW_DIR: "
                "free space, permissions, a mounted volume)"
            )
        else:
            fix = f"check {where} (VGE_REVIEW_DIR / VGE_DB_URL)"
        return f"{where} failed ({what}); {fix}; retry shortly"


async def watch(connection: ReviewConnection, gauge: Gauge) -> None:
    """Each process's watcher: every :data:`WATCH_INTERVAL_S`, notice a deleted or replaced file,
    retry an unavailable store when due, and set ``gauge`` (``vge_review_store_up``, labelled with
    the store's backend) to 1 or 0.

    Without it a process that saw the store fail would say so until its next review request, and
    one holding a deleted SQLite file would keep it (and its WAL) open; the check is a ``stat``
    while the store is up.
    """
    child = gauge.labels(backend=connection.backend)
    while True:
        child.set(1 if await asyncio.to_thread(connection.check) else 0)
        await asyncio.sleep(WATCH_INTERVAL_S)
