"""The human review queue's store: its SQL table and every query on it.

Why: the abstain flag (VGMU below ``abstain_k``, paper §3.2) routes a decision to a human; this is
where it goes. Every front-end process queues directly into one shared store, so the queue needs
no extra hop through the engine. This module is the queue's meaning (states, bounds, claims,
labels, statistics, export, retention); the connection that keeps it available is
:mod:`service.common.review_connection`, and its images on disk :mod:`service.common.review_images`.

* metadata in :class:`service.common.db.Database` (table ``reviews``: SQLite by default, PostgreSQL when
  several replicas share one queue), the full answer as JSON (model, version, prediction, top-k
  probabilities, VGMU, SNR, TU/AU/EU, abstain_k) and the model's class names (to check labels even
  after another model is promoted);
* image bytes on disk, content-addressed by sha256 (:class:`~service.common.review_images.BlobStore`):
  the same image queued twice is stored once, and while it is pending for the same model it is one
  item (``already_queued`` returns the existing id, so reviewers never label the same image twice).

States: ``pending`` → ``reviewed`` (a label from the model's classes, or *not a digit*) |
``skipped``; a skipped item can still be labelled later, and a reviewed one relabelled: every earlier label stays in the item's
``history`` (label, reviewer, how the reviewer was identified, time), oldest first. *Not a
digit* (:meth:`ReviewStore.mark_not_a_digit`; ``"not_a_digit": true`` in the API) says the image
is none of the model's classes: it is no class and never becomes one. It is stored as a reviewed
item without a label (a reviewed item with a class always has one), counted apart from the
human–model agreement in :meth:`ReviewStore.stats`, exported under
:data:`~service.common.review_images.OUTLIER_FOLDER`, and trains as an outlier of outlier
exposure (service.engine.jobs, models.data). Claiming (:meth:`ReviewStore.claim`) hands the next pending item to
one reviewer for a lease; until it expires no other reviewer is handed that item (PostgreSQL:
``FOR UPDATE SKIP LOCKED``; SQLite: one writer at a time, so the ``UPDATE … RETURNING`` is atomic).
Bounded: at most ``max_items`` pending items and ``max_bytes`` of their images (checked before
each insert, so front ends racing at the limit may pass it by the few images in flight); a full
queue refuses to queue (the answer says ``queue_full``) and writes nothing to disk, and never
fails the prediction. Without the byte bound, anonymous clients could fill the disk within the
item bound: a PNG padded with a 7 MiB text chunk is a valid image, stored as sent.

Failures stay in the queue (predictions do not need it): every query goes through the store's
:class:`~service.common.review_connection.ReviewConnection`, so a store that is missing, corrupt,
unwritable or unreachable makes :class:`ReviewStore` unavailable
(:class:`~service.common.review_connection.ReviewStoreUnavailable`), never its process.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import math
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.common.db import Database
from service.common.errors import Conflict, InvalidValue, NotFound
from service.common.review_connection import ReviewConnection
from service.common.review_images import OUTLIER_FOLDER, BlobStore, class_folder, sniff_content_type
from service.common.settings import Settings

State = Literal["pending", "reviewed", "skipped"]
Order = Literal["oldest", "vgmu"]
STATES: tuple[str, ...] = ("pending", "reviewed", "skipped")

SCHEMA = """
CREATE TABLE IF NOT EXISTS reviews (
    id TEXT PRIMARY KEY,
    created_at DOUBLE PRECISION NOT NULL,
    model TEXT NOT NULL,
    model_version TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    content_type TEXT NOT NULL,
    prediction TEXT NOT NULL,
    vgmu DOUBLE PRECISION NOT NULL,
    answer TEXT NOT NULL,
    classes TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    label TEXT,
    reviewer TEXT,
    reviewed_at DOUBLE PRECISION,
    claimed_by TEXT,
    claim_expires DOUBLE PRECISION,
    size BIGINT NOT NULL DEFAULT 0,
    reviewer_via TEXT,
    history TEXT NOT NULL DEFAULT '[]',
    history_dropped INTEGER NOT NULL DEFAULT 0,
    claimed_via TEXT
);
CREATE INDEX IF NOT EXISTS reviews_state_created ON reviews (state, created_at, id);
CREATE INDEX IF NOT EXISTS reviews_state_vgmu ON reviews (state, vgmu, id);
CREATE INDEX IF NOT EXISTS reviews_sha ON reviews (sha256);
CREATE UNIQUE INDEX IF NOT EXISTS reviews_one_pending ON reviews (sha256, model)
    WHERE state = 'pending'
"""


@dataclass(frozen=True)
class Enqueued:
    """What one image's answer says about its review: the item id (or None) and why."""

    review_id: str | None
    status: Literal["queued", "already_queued", "queue_full", "unavailable", "error"]
    # (V2 answers may also say "unsupported_input": FP32 input is not stored; see
    # queue_tensor_answers)


#: The advisory lock key of claiming on PostgreSQL ("vgec"): a key's claim count and its new
#: claim are one step, so replicas racing at the bound cannot pass it.
_CLAIM_LOCK = 0x76676563


#: Per order: the sort key, and the ORDER BY (the id breaks ties, so pages never overlap).
_ORDER: dict[str, tuple[str, str]] = {
    "oldest": ("created_at", "created_at, id"),
    "vgmu": ("vgmu", "vgmu DESC, id"),  # VGMU: higher = less sure; the most uncertain first
}


def _encode_cursor(key: float, item_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([key, item_id]).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key, item_id = json.loads(raw)
        if not math.isfinite(key := float(key)):  # NaN orders differently in each database
            raise ValueError("not finite")
        if "\x00" in (item_id := str(item_id)):  # PostgreSQL's text cannot hold it
            raise ValueError("NUL")
        return key, item_id
    except (ValueError, TypeError, UnicodeDecodeError, OverflowError):
        raise InvalidValue(
            f"cursor {cursor!r} is not valid: pass the next_cursor of a previous page"
        ) from None


class ReviewStore:
    """The review queue over a :class:`Database` and a :class:`BlobStore` (thread-safe).

    ``db`` is the database URL (the store opens, and when it fails reopens, its own connection)
    or an open :class:`Database` (used for the first opening). Constructing never raises: a store
    that cannot be opened is unavailable (:attr:`up` False, :attr:`problem` says why) and every
    method raises :class:`~service.common.review_connection.ReviewStoreUnavailable` until a retry
    succeeds (:class:`~service.common.review_connection.ReviewConnection`, :attr:`connection`).
    """

    def __init__(
        self,
        db: Database | str,
        blob_root: Path,
        *,
        max_items: int,
        lease_s: float,
        max_bytes: int = 2**62,
        max_claims: int = 10,
        max_history: int = 50,
    ) -> None:
        self.blobs = BlobStore(blob_root)
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.lease_s = lease_s
        self.max_claims = max_claims
        self.max_history = max_history
        # the last: its first opening prepares the tables (_prepare reads the blobs' sizes)
        self.connection = ReviewConnection(db, blob_root, self._prepare)

    # ------------------------------------------------------------------ availability
    @property
    def url(self) -> str:
        """The database URL (as given: with its password)."""
        return self.connection.url

    @property
    def postgres(self) -> bool:
        """Whether the queue is on PostgreSQL (else SQLite)."""
        return self.connection.postgres

    @property
    def path(self) -> Path | None:
        """The SQLite file (None on PostgreSQL)."""
        return self.connection.path

    @property
    def where(self) -> str:
        """The store for messages: its SQLite file, or its URL with the password masked."""
        return self.connection.where

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql`` (the ``vge_review_store_up`` label)."""
        return self.connection.backend

    @property
    def up(self) -> bool:
        """Whether the last use (or attempt to open) succeeded."""
        return self.connection.up

    @property
    def problem(self) -> str | None:
        """Why the store is unavailable (None: it is up)."""
        return self.connection.problem

    @property
    def db(self) -> Database:
        """The open database (opened, or reopened, if it has to be)."""
        return self.connection.db

    def check(self) -> bool:
        """Notice a deleted or replaced file, retry an unavailable store when a retry is due;
        whether it is up (:meth:`ReviewConnection.check`)."""
        return self.connection.check()

    def close(self) -> None:
        """Close the connection (the process ends)."""
        self.connection.close()

    def _prepare(self, db: Database) -> None:
        """Create or migrate the queue's table on a newly opened database."""
        db.script(SCHEMA)
        db.add_column("reviews", "size", "BIGINT NOT NULL DEFAULT 0")  # queues before 0.3
        db.add_column("reviews", "reviewer_via", "TEXT")  # before reviewer identities
        db.add_column("reviews", "history", "TEXT NOT NULL DEFAULT '[]'")  # before relabels
        db.add_column("reviews", "history_dropped", "INTEGER NOT NULL DEFAULT 0")
        db.add_column("reviews", "claimed_via", "TEXT")  # before the per-key claim bound
        self._fill_sizes(db)

    def _fill_sizes(self, db: Database) -> None:
        """Pending items of a queue from before the byte bound have size 0: count them at their
        images' sizes, so the bound sees what they hold (once; then no row has size 0)."""
        rows = db.fetchall("SELECT id, sha256 FROM reviews WHERE state = 'pending' AND size = 0")
        for r in rows:
            try:
                size = self.blobs.path(r["sha256"]).stat().st_size
            except OSError:
                continue
            db.execute("UPDATE reviews SET size = ? WHERE id = ?", (size, r["id"]))

    # ------------------------------------------------------------------ queueing
    def enqueue(
        self,
        *,
        model: str,
        model_version: str,
        classes: Sequence[str],
        images: Sequence[bytes],
        answers: Sequence[dict[str, Any]],
        now: float | None = None,
    ) -> list[Enqueued]:
        """Queue ``images`` with their ``answers`` (one each); never raises for a full queue."""
        now = time.time() if now is None else now
        classes_json = json.dumps(list(classes))
        out = []
        # One check of the file after all writes: an item is answered queued only if its row is
        # in the file at the queue's path (ReviewStoreUnavailable otherwise: none is queued).
        with self.connection.use(writes=True) as db:
            for i, (data, answer) in enumerate(zip(images, answers, strict=True)):
                sha = hashlib.sha256(data).hexdigest()
                # A microsecond apart: "oldest first" keeps a request's images in their order.
                at = now + i * 1e-6
                out.append(self._insert(db, model, model_version, classes_json, sha, data, answer,
                                        at))  # fmt: skip
        return out

    def _insert(
        self,
        db: Database,
        model: str,
        version: str,
        classes_json: str,
        sha: str,
        data: bytes,
        answer: dict[str, Any],
        now: float,
    ) -> Enqueued:
        existing = db.scalar(
            "SELECT id FROM reviews WHERE sha256 = ? AND model = ? AND state = 'pending'",
            (sha, model),
        )
        if existing is not None:
            return Enqueued(existing, "already_queued")
        row = db.fetchall(
            "SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS b FROM reviews WHERE state = 'pending'"
        )[0]
        if row["n"] >= self.max_items or row["b"] + len(data) > self.max_bytes:
            return Enqueued(None, "queue_full")  # before the image is written: nothing on disk
        self.blobs.put(data)
        item_id = uuid.uuid4().hex
        stored = {"model": model, "model_version": version, **answer}
        changed = db.execute(
            "INSERT INTO reviews (id, created_at, model, model_version, sha256, content_type, "
            "prediction, vgmu, answer, classes, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            (
                item_id, now, model, version, sha, sniff_content_type(data),
                str(answer["label"]), float(answer["vgmu"]), json.dumps(stored), classes_json,
                len(data),
            ),
        )  # fmt: skip
        # The row is in: if a retention sweep took the image away since it was written above
        # (its last old item deleted just before this row appeared), it is written again.
        self.blobs.ensure(data, sha)
        if changed == 0:  # another process queued the same image for this model just now
            existing = db.scalar(
                "SELECT id FROM reviews WHERE sha256 = ? AND model = ? AND state = 'pending'",
                (sha, model),
            )
            return Enqueued(existing, "already_queued")
        return Enqueued(item_id, "queued")

    def pending_count(self, model: str | None = None) -> int:
        sql = "SELECT COUNT(*) AS n FROM reviews WHERE state = 'pending'"
        with self.connection.use() as db:
            if not model:  # None or "": every model, as claim, list, stats and export read it
                return int(db.scalar(sql))
            return int(db.scalar(sql + " AND model = ?", (model,)))

    def depth_by_model(self) -> dict[str, int]:
        """Pending items per model (the ``vge_review_queue_depth`` gauge)."""
        with self.connection.use() as db:
            rows = db.fetchall(
                "SELECT model, COUNT(*) AS n FROM reviews WHERE state = 'pending' GROUP BY model"
            )
        return {r["model"]: int(r["n"]) for r in rows}

    # ------------------------------------------------------------------ reading
    def list(
        self,
        *,
        state: str = "pending",
        model: str | None = None,
        order: Order = "oldest",
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of items in ``state``: oldest first, or ``order="vgmu"`` most uncertain first
        (VGMU is an uncertainty: the highest first); keyset pagination by ``cursor`` (the sort key
        and id of the page's last item: the next page continues after it in the same order)."""
        key, sort = _ORDER[order]
        where, params = ["state = ?"], list[str | float]([state])
        if model:
            where.append("model = ?")
            params.append(model)
        if cursor:
            after_key, after_id = _decode_cursor(cursor)
            past = ">" if order == "oldest" else "<"
            where.append(f"({key} {past} ? OR ({key} = ? AND id > ?))")
            params += [after_key, after_key, after_id]
        with self.connection.use() as db:
            rows = db.fetchall(
                f"SELECT * FROM reviews WHERE {' AND '.join(where)} ORDER BY {sort} LIMIT ?",
                (*params, limit + 1),
            )
        more = len(rows) > limit
        rows = rows[:limit]
        nxt = _encode_cursor(rows[-1][key], rows[-1]["id"]) if more and rows else None
        return [self._public(r) for r in rows], nxt

    def get(self, item_id: str) -> dict[str, Any]:
        return self._public(self._row(item_id))

    def image(self, item_id: str) -> tuple[bytes, str]:
        row = self._row(item_id)
        try:
            return self.blobs.get(row["sha256"]), row["content_type"]
        except FileNotFoundError:
            raise NotFound(f"the image of review {item_id} is no longer stored") from None
        except OSError as exc:
            self.connection.fail(exc)
            raise self.connection.unavailable() from None

    def _row(self, item_id: str) -> dict[str, Any]:
        with self.connection.use() as db:
            row = db.fetchone("SELECT * FROM reviews WHERE id = ?", (item_id,))
        if row is None:
            raise NotFound(f"no review {item_id!r}")
        return row

    @staticmethod
    def _public(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": row["id"],
            "state": row["state"],
            "created_at": row["created_at"],
            "model": row["model"],
            "model_version": row["model_version"],
            "sha256": row["sha256"],
            "content_type": row["content_type"],
            "classes": json.loads(row["classes"]),
            "answer": json.loads(row["answer"]),
            "label": row["label"],
            "not_a_digit": row["state"] == "reviewed" and row["label"] is None,
            "reviewer": row["reviewer"],
            "reviewed_at": row["reviewed_at"],
            "reviewer_via": row.get("reviewer_via"),
            "history": json.loads(row.get("history") or "[]"),
            "history_dropped": int(row.get("history_dropped") or 0),
            "claimed_by": row["claimed_by"],
            "claim_expires": row["claim_expires"],
        }

    # ------------------------------------------------------------------ reviewing
    def claim(
        self,
        reviewer: str,
        *,
        order: Order = "oldest",
        model: str | None = None,
        now: float | None = None,
        via: str = "shared_key",
    ) -> dict[str, Any] | None:
        """Hand the next pending item that nobody else holds to ``reviewer`` for ``lease_s``:
        the oldest, or with ``order="vgmu"`` the most uncertain (highest VGMU).

        An item this reviewer already holds comes first (a reloaded page gets its item back).
        Two reviewers — in one process or in two replicas on one PostgreSQL — never hold the same
        item at once. One key holds at most ``max_claims`` items: a personal key (``via
        "key"``) under its name, the shared key (``via "shared_key"``) under all the names its
        clients give together, so made-up names cannot hold the whole queue; past it a 409.
        """
        now = time.time() if now is None else now
        sort = _ORDER[order][1]
        filt = "state = 'pending' AND (claimed_by IS NULL OR claim_expires < ? OR claimed_by = ?)"
        params: list[Any] = [now, reviewer]
        if model:
            filt += " AND model = ?"
            params.append(model)
        with self.connection.use() as conn, conn.transaction() as db:
            if db.postgres:  # the count and the claim below as one step among replicas
                db.execute("SELECT pg_advisory_xact_lock(?)", (_CLAIM_LOCK,))
            self._check_claims(db, reviewer, via, model, now)
            row = db.fetchone(
                "UPDATE reviews SET claimed_by = ?, claim_expires = ?, claimed_via = ? WHERE id = ("
                f"SELECT id FROM reviews WHERE {filt} "
                f"ORDER BY CASE WHEN claimed_by = ? THEN 0 ELSE 1 END, {sort} LIMIT 1"
                f"{db.skip_locked}) "
                "AND state = 'pending' RETURNING *",
                (reviewer, now + self.lease_s, via, *params, reviewer),
            )
        return self._public(row) if row else None

    def _check_claims(
        self, db: Database, reviewer: str, via: str, model: str | None, now: float
    ) -> None:
        """Refuse (409) a new claim by a key that holds ``max_claims`` items already; getting
        back an item the reviewer holds (a reloaded page) is never refused."""
        live = "state = 'pending' AND claimed_by IS NOT NULL AND claim_expires >= ?"
        held_sql = f"SELECT COUNT(*) AS n FROM reviews WHERE {live} AND claimed_by = ?"
        held_params: list[Any] = [now, reviewer]
        if model:
            held_sql += " AND model = ?"
            held_params.append(model)
        if int(db.scalar(held_sql, held_params)):
            return
        if via == "key":
            n = db.scalar(f"SELECT COUNT(*) AS n FROM reviews WHERE {live} AND claimed_by = ? "
                          "AND claimed_via = 'key'", (now, reviewer))  # fmt: skip
            who = f"reviewer {reviewer!r}"
        else:
            n = db.scalar(f"SELECT COUNT(*) AS n FROM reviews WHERE {live} AND "
                          "(claimed_via IS NULL OR claimed_via <> 'key')", (now,))  # fmt: skip
            who = "the shared reviewer key (all the names its clients give)"
        if int(n) >= self.max_claims:
            raise Conflict(
                f"{who} holds {int(n)} claimed item(s), the most one key may hold "
                f"(VGE_REVIEW_MAX_CLAIMS={self.max_claims}): label or skip one, or wait for a "
                f"lease to end ({self.lease_s:g} s)"
            )

    def label(
        self,
        item_id: str,
        label: str,
        reviewer: str,
        now: float | None = None,
        *,
        via: str | None = None,
    ) -> dict[str, Any]:
        """Record a human label (one of the item's model classes, else 422) → ``reviewed``.

        A reviewed item is relabelled: its label, reviewer and time move to ``history`` (the
        answer says ``relabelled: true``). ``via`` says how the reviewer was identified (a
        personal key, or a name given with the shared key; :mod:`service.frontend.routes.reviews`).
        """
        return self._close(item_id, "reviewed", reviewer, label, now, via)

    def mark_not_a_digit(
        self, item_id: str, reviewer: str, now: float | None = None, *, via: str | None = None
    ) -> dict[str, Any]:
        """Record that the image is none of the model's classes (*not a digit*) → ``reviewed``
        with ``label`` None and ``not_a_digit`` true; relabels a reviewed item as
        :meth:`label` does. It is no class: it trains as an outlier (service.engine.jobs)."""
        return self._close(item_id, "reviewed", reviewer, None, now, via)

    def skip(
        self, item_id: str, reviewer: str, now: float | None = None, *, via: str | None = None
    ) -> dict[str, Any]:
        """Take a pending item out of the queue without a label → ``skipped``."""
        return self._close(item_id, "skipped", reviewer, None, now, via)

    def _close(
        self,
        item_id: str,
        state: str,
        reviewer: str,
        label: str | None,
        now: float | None,
        via: str | None,
    ) -> dict[str, Any]:
        now = time.time() if now is None else now
        with self.connection.use(writes=True) as conn, conn.transaction() as db:
            row = db.fetchone(f"SELECT * FROM reviews WHERE id = ?{db.for_update}", (item_id,))
            if row is None:
                raise NotFound(f"no review {item_id!r}")
            if label is not None and label not in json.loads(row["classes"]):
                raise InvalidValue(
                    f"label {label!r} is not a class of model {row['model']!r}: use one of "
                    f"{', '.join(json.loads(row['classes']))}"
                )
            if state == "skipped" and row["state"] != "pending":
                raise Conflict(f"review {item_id} is already {row['state']}")
            holder = row["claimed_by"]
            if holder and holder != reviewer and (row["claim_expires"] or 0) > now:
                raise Conflict(
                    f"review {item_id} is claimed by {holder!r} until their lease ends; "
                    "claim another item"
                )
            history = json.loads(row.get("history") or "[]")
            dropped = int(row.get("history_dropped") or 0)
            relabel = row["state"] == "reviewed"
            if row["state"] != "pending":  # what it said before (a skip, or an earlier label)
                history.append({
                    "state": row["state"], "label": row["label"],
                    "not_a_digit": row["state"] == "reviewed" and row["label"] is None,
                    "reviewer": row["reviewer"], "reviewer_via": row.get("reviewer_via"),
                    "at": row["reviewed_at"],
                })  # fmt: skip
            if len(history) > self.max_history:  # the newest kept, the rest only counted
                cut = len(history) - self.max_history
                history, dropped = history[cut:], dropped + cut
            db.execute(
                "UPDATE reviews SET state = ?, label = ?, reviewer = ?, reviewer_via = ?, "
                "reviewed_at = ?, history = ?, history_dropped = ?, claimed_by = NULL, "
                "claim_expires = NULL, claimed_via = NULL WHERE id = ?",
                (state, label, reviewer, via, now, json.dumps(history), dropped, item_id),
            )
            row.update(state=state, label=label, reviewer=reviewer, reviewed_at=now)
            row.update(reviewer_via=via, history=json.dumps(history), history_dropped=dropped)
            row.update(claimed_by=None, claim_expires=None, claimed_via=None)
        return {**self._public(row), "relabelled": relabel}

    # ------------------------------------------------------------------ statistics, export
    def stats(self, model: str | None = None) -> dict[str, Any]:
        """Counts by state, agreement of human labels with the model (overall and per predicted
        class), the items marked *not a digit* (counted apart: neither an agreement nor a
        disagreement, since the model had no right class to give), and the median time from
        queueing to a label (every reviewed item)."""
        where, params = ("WHERE model = ?", (model,)) if model else ("", ())
        counts = {s: 0 for s in STATES}
        and_model = "AND model = ?" if model else ""
        with self.connection.use() as db:
            for r in db.fetchall(
                f"SELECT state, COUNT(*) AS n FROM reviews {where} GROUP BY state", params
            ):
                counts[r["state"]] = int(r["n"])
            rows = db.fetchall(
                "SELECT prediction, label, reviewed_at - created_at AS wait FROM reviews "
                f"WHERE state = 'reviewed' {and_model}",
                params,
            )
        per_class: dict[str, list[int]] = {}
        outliers: dict[str, int] = {}
        for r in rows:
            if r["label"] is None:  # not a digit
                outliers[r["prediction"]] = outliers.get(r["prediction"], 0) + 1
                continue
            agree, n = per_class.setdefault(r["prediction"], [0, 0])
            per_class[r["prediction"]] = [agree + (r["label"] == r["prediction"]), n + 1]
        agreed = sum(a for a, _ in per_class.values())
        labelled = sum(n for _, n in per_class.values())
        return {
            "counts": counts,
            "labelled": labelled,
            "agreement": agreed / labelled if labelled else None,
            "agreement_by_class": {
                c: {"agreement": a / n, "reviewed": n} for c, (a, n) in sorted(per_class.items())
            },
            "not_a_digit": {
                "count": sum(outliers.values()),
                "by_prediction": dict(sorted(outliers.items())),
            },
            "median_time_to_review_s": statistics.median(r["wait"] for r in rows) if rows else None,
        }

    def reviewed(
        self, model: str | None = None, *, not_a_digit: bool = False
    ) -> Iterator[tuple[str | None, str, bytes, str]]:
        """``(label, sha256, image bytes, content type)`` of every reviewed item with a class
        label whose image is still stored, oldest first; one image once per label. With
        ``not_a_digit``: the items marked *not a digit* instead (``label`` None), each image once.
        The items are read when this is called (a store that is unavailable raises then); the
        images as the iterator is consumed."""
        rows = [r for r in self._reviewed_rows(model) if (r["label"] is None) == not_a_digit]
        return self._with_images(rows)

    def _reviewed_rows(self, model: str | None) -> builtins.list[dict[str, Any]]:
        """Every reviewed ``(label, sha256, content_type)`` once, in one read (one snapshot):
        the classes' oldest first, then the *not a digit* images' (``label`` None)."""
        and_model = "AND model = ?" if model else ""
        with self.connection.use() as db:
            return db.fetchall(
                "SELECT label, sha256, content_type, MIN(created_at) AS first_at FROM reviews "
                f"WHERE state = 'reviewed' {and_model} GROUP BY label, sha256, content_type "
                "ORDER BY CASE WHEN label IS NULL THEN 1 ELSE 0 END, first_at",
                (model,) if model else (),
            )

    def _with_images(
        self, rows: builtins.list[dict[str, Any]]
    ) -> Iterator[tuple[str | None, str, bytes, str]]:
        for r in rows:
            try:
                data = self.blobs.get(r["sha256"])
            except FileNotFoundError:
                continue
            yield r["label"], r["sha256"], data, r["content_type"]

    def export_items(
        self, model: str | None = None, *, outliers: bool = True
    ) -> Iterator[tuple[str, bytes]]:
        """``(path, PNG bytes)`` of every reviewed image as an ImageFolder member:
        ``<class folder>/<sha256>.png``, the folder :func:`class_folder` of its label, then (with
        ``outliers``) the images marked *not a digit* as ``outliers/<sha256>.png``
        (:data:`OUTLIER_FOLDER`, never a class's folder). What the review export's tar and a
        training job's data hold: a class name never becomes a path of its own (``../x`` or
        ``/abs`` would leave the folder they are written into).

        The items are read in one query when this is called, so a store that is unavailable
        raises here (the export then answers 503, not a 200 with an empty or cut tar), and the
        classes and the outliers are one snapshot (a relabel meanwhile cannot put an image in
        both or neither); the images are read as the iterator is consumed."""
        rows = self._reviewed_rows(model)
        if not outliers:
            rows = [r for r in rows if r["label"] is not None]
        return self._export(rows)

    def _export(self, rows: builtins.list[dict[str, Any]]) -> Iterator[tuple[str, bytes]]:
        from models.data import png_has_alpha
        from service.common.decode import to_png

        def png(data: bytes, ctype: str) -> bytes:
            # a PNG as stored unless it has transparency, which to_png flattens onto white
            return data if ctype == "image/png" and not png_has_alpha(data) else to_png(data)

        for label, sha, data, ctype in self._with_images(rows):
            folder = OUTLIER_FOLDER if label is None else class_folder(str(label))
            yield f"{folder}/{sha}.png", png(data, ctype)

    def not_a_digit_count(self, model: str | None = None) -> int:
        """How many distinct images are marked *not a digit* (what a job's outlier set gets)."""
        and_model = "AND model = ?" if model else ""
        with self.connection.use() as db:
            return int(db.scalar(
                "SELECT COUNT(DISTINCT sha256) AS n FROM reviews WHERE state = 'reviewed' "
                f"AND label IS NULL {and_model}", (model,) if model else (),
            ))  # fmt: skip

    # ------------------------------------------------------------------ retention
    def sweep(self, retention_days: float, now: float | None = None) -> int:
        """Delete reviewed and skipped items closed more than ``retention_days`` ago, and the
        images no remaining item refers to. Pending items are never deleted. Returns rows deleted."""
        now = time.time() if now is None else now
        cutoff = now - retention_days * 86400.0
        with self.connection.use(writes=True) as db:
            old = db.fetchall(
                "SELECT DISTINCT sha256 FROM reviews WHERE state <> 'pending' AND reviewed_at < ?",
                (cutoff,),
            )
            deleted = db.execute(
                "DELETE FROM reviews WHERE state <> 'pending' AND reviewed_at < ?", (cutoff,)
            )
            for r in old:
                sha = r["sha256"]

                def referenced(sha: str = sha) -> bool:
                    n = db.scalar("SELECT COUNT(*) AS n FROM reviews WHERE sha256 = ?", (sha,))
                    return bool(n)

                if not referenced():  # asked again once the file is aside (BlobStore.delete_unless)
                    self.blobs.delete_unless(sha, referenced)
        return deleted


def open_review_store(settings: Settings) -> ReviewStore:
    """The review queue this process writes to (front ends and the engine each open their own).

    Never raises: a store that is missing, corrupt, unwritable or unreachable is returned
    unavailable (logged, naming the file or URL and what to do) and retried by itself, so the
    queue, an add-on, cannot stop predictions or a process's start-up
    (service.common.review_connection).
    """
    return ReviewStore(
        settings.reviews_database_url,
        settings.review_dir / "blobs",
        max_items=settings.review_max_items,
        max_bytes=settings.review_max_bytes,
        lease_s=settings.review_lease_s,
        max_claims=settings.review_max_claims,
        max_history=settings.review_max_history,
    )
