"""The human review queue: abstained (or chosen) predictions stored durably for a person to label.

Why: the abstain flag (VGMU below ``abstain_k``, paper §3.2) routes a decision to a human; this is
where it goes. Every front-end process queues directly into one shared store, so the queue needs
no extra hop through the engine:

* metadata in :class:`service.db.Database` (table ``reviews``: SQLite by default, PostgreSQL when
  several replicas share one queue), the full answer as JSON (model, version, prediction, top-k
  probabilities, VGMU, SNR, TU/AU/EU, abstain_k) and the model's class names (to check labels even
  after another model is promoted);
* image bytes on disk, content-addressed by sha256 (``<review_dir>/blobs/ab/abcdef…``): the same
  image queued twice is stored once, and while it is pending for the same model it is one item
  (``already_queued`` returns the existing id, so reviewers never label the same image twice).

States: ``pending`` → ``reviewed`` (a label from the model's classes) | ``skipped``; a skipped item
can still be labelled later. Claiming (:meth:`ReviewStore.claim`) hands the next pending item to
one reviewer for a lease; until it expires no other reviewer is handed that item (PostgreSQL:
``FOR UPDATE SKIP LOCKED``; SQLite: one writer at a time, so the ``UPDATE … RETURNING`` is atomic).
Bounded: at most ``max_items`` pending items and ``max_bytes`` of their images (checked before
each insert, so front ends racing at the limit may pass it by the few images in flight); a full
queue refuses to queue (the answer says ``queue_full``) and writes nothing to disk, and never
fails the prediction. Without the byte bound, anonymous clients could fill the disk within the
item bound: a PNG padded with a 7 MiB text chunk is a valid image, stored as sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.db import Database
from service.errors import Conflict, InvalidValue, NotFound

log = logging.getLogger("vge.reviews")

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
    size BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS reviews_state_created ON reviews (state, created_at, id);
CREATE INDEX IF NOT EXISTS reviews_state_vgmu ON reviews (state, vgmu, id);
CREATE INDEX IF NOT EXISTS reviews_sha ON reviews (sha256);
CREATE UNIQUE INDEX IF NOT EXISTS reviews_one_pending ON reviews (sha256, model)
    WHERE state = 'pending'
"""

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"BM", "image/bmp"),
)


def sniff_content_type(data: bytes) -> str:
    """The image type from its first bytes (clients' declared types are not trusted)."""
    for magic, ctype in _MAGIC:
        if data.startswith(magic):
            return ctype
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


@dataclass(frozen=True)
class Enqueued:
    """What one image's answer says about its review: the item id (or None) and why."""

    review_id: str | None
    status: Literal["queued", "already_queued", "queue_full", "error"]


class BlobStore:
    """Image bytes on disk by sha256, written atomically (temp file + rename), stored once."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def put(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.path(sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{sha}.{uuid.uuid4().hex}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def get(self, sha: str) -> bytes:
        return self.path(sha).read_bytes()

    def delete(self, sha: str) -> None:
        self.path(sha).unlink(missing_ok=True)


def _encode_cursor(key: float, item_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([key, item_id]).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key, item_id = json.loads(raw)
        return float(key), str(item_id)
    except (ValueError, TypeError, UnicodeDecodeError):
        raise InvalidValue(
            f"cursor {cursor!r} is not valid: pass the next_cursor of a previous page"
        ) from None


class ReviewStore:
    """The review queue over a :class:`Database` and a :class:`BlobStore` (thread-safe)."""

    def __init__(
        self,
        db: Database,
        blob_root: Path,
        *,
        max_items: int,
        lease_s: float,
        max_bytes: int = 2**62,
    ) -> None:
        self.db = db
        self.blobs = BlobStore(blob_root)
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.lease_s = lease_s
        db.script(SCHEMA)
        db.add_column("reviews", "size", "BIGINT NOT NULL DEFAULT 0")  # queues before 0.3
        self._fill_sizes()

    def _fill_sizes(self) -> None:
        """Pending items of a queue from before the byte bound have size 0: count them at their
        images' sizes, so the bound sees what they hold (once; then no row has size 0)."""
        rows = self.db.fetchall(
            "SELECT id, sha256 FROM reviews WHERE state = 'pending' AND size = 0"
        )
        for r in rows:
            try:
                size = self.blobs.path(r["sha256"]).stat().st_size
            except OSError:
                continue
            self.db.execute("UPDATE reviews SET size = ? WHERE id = ?", (size, r["id"]))

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
        for i, (data, answer) in enumerate(zip(images, answers, strict=True)):
            sha = hashlib.sha256(data).hexdigest()
            # A microsecond apart: "oldest first" keeps a request's images in their order.
            at = now + i * 1e-6
            out.append(self._insert(model, model_version, classes_json, sha, data, answer, at))
        return out

    def _insert(
        self,
        model: str,
        version: str,
        classes_json: str,
        sha: str,
        data: bytes,
        answer: dict[str, Any],
        now: float,
    ) -> Enqueued:
        existing = self.db.scalar(
            "SELECT id FROM reviews WHERE sha256 = ? AND model = ? AND state = 'pending'",
            (sha, model),
        )
        if existing is not None:
            return Enqueued(existing, "already_queued")
        row = self.db.fetchall(
            "SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS b FROM reviews WHERE state = 'pending'"
        )[0]
        if row["n"] >= self.max_items or row["b"] + len(data) > self.max_bytes:
            return Enqueued(None, "queue_full")  # before the image is written: nothing on disk
        self.blobs.put(data)
        item_id = uuid.uuid4().hex
        stored = {"model": model, "model_version": version, **answer}
        changed = self.db.execute(
            "INSERT INTO reviews (id, created_at, model, model_version, sha256, content_type, "
            "prediction, vgmu, answer, classes, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            (
                item_id, now, model, version, sha, sniff_content_type(data),
                str(answer["label"]), float(answer["vgmu"]), json.dumps(stored), classes_json,
                len(data),
            ),
        )  # fmt: skip
        if changed == 0:  # another process queued the same image for this model just now
            existing = self.db.scalar(
                "SELECT id FROM reviews WHERE sha256 = ? AND model = ? AND state = 'pending'",
                (sha, model),
            )
            return Enqueued(existing, "already_queued")
        return Enqueued(item_id, "queued")

    def pending_count(self, model: str | None = None) -> int:
        if model is None:
            return int(self.db.scalar("SELECT COUNT(*) AS n FROM reviews WHERE state = 'pending'"))
        return int(
            self.db.scalar(
                "SELECT COUNT(*) AS n FROM reviews WHERE state = 'pending' AND model = ?", (model,)
            )
        )

    def depth_by_model(self) -> dict[str, int]:
        """Pending items per model (the ``vge_review_queue_depth`` gauge)."""
        rows = self.db.fetchall(
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
        """One page of items in ``state``: oldest first, or ``order="vgmu"`` most uncertain
        (lowest VGMU) first; keyset pagination by ``cursor``."""
        key = "created_at" if order == "oldest" else "vgmu"
        where, params = ["state = ?"], [state]
        if model:
            where.append("model = ?")
            params.append(model)
        if cursor:
            after_key, after_id = _decode_cursor(cursor)
            where.append(f"({key} > ? OR ({key} = ? AND id > ?))")
            params += [after_key, after_key, after_id]
        rows = self.db.fetchall(
            f"SELECT * FROM reviews WHERE {' AND '.join(where)} ORDER BY {key}, id LIMIT ?",
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

    def _row(self, item_id: str) -> dict[str, Any]:
        row = self.db.fetchone("SELECT * FROM reviews WHERE id = ?", (item_id,))
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
            "reviewer": row["reviewer"],
            "reviewed_at": row["reviewed_at"],
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
    ) -> dict[str, Any] | None:
        """Hand the next pending item that nobody else holds to ``reviewer`` for ``lease_s``.

        An item this reviewer already holds comes first (a reloaded page gets its item back).
        Two reviewers — in one process or in two replicas on one PostgreSQL — never hold the same
        item at once.
        """
        now = time.time() if now is None else now
        key = "created_at" if order == "oldest" else "vgmu"
        filt = "state = 'pending' AND (claimed_by IS NULL OR claim_expires < ? OR claimed_by = ?)"
        params: list[Any] = [now, reviewer]
        if model:
            filt += " AND model = ?"
            params.append(model)
        with self.db.transaction() as db:
            row = db.fetchone(
                "UPDATE reviews SET claimed_by = ?, claim_expires = ? WHERE id = ("
                f"SELECT id FROM reviews WHERE {filt} "
                f"ORDER BY CASE WHEN claimed_by = ? THEN 0 ELSE 1 END, {key}, id LIMIT 1{db.skip_locked}) "
                "AND state = 'pending' RETURNING *",
                (reviewer, now + self.lease_s, *params, reviewer),
            )
        return self._public(row) if row else None

    def label(
        self, item_id: str, label: str, reviewer: str, now: float | None = None
    ) -> dict[str, Any]:
        """Record a human label (one of the item's model classes, else 422) → ``reviewed``."""
        return self._close(item_id, "reviewed", reviewer, label, now)

    def skip(self, item_id: str, reviewer: str, now: float | None = None) -> dict[str, Any]:
        """Take a pending item out of the queue without a label → ``skipped``."""
        return self._close(item_id, "skipped", reviewer, None, now)

    def _close(
        self, item_id: str, state: str, reviewer: str, label: str | None, now: float | None
    ) -> dict[str, Any]:
        now = time.time() if now is None else now
        with self.db.transaction() as db:
            row = db.fetchone(f"SELECT * FROM reviews WHERE id = ?{db.for_update}", (item_id,))
            if row is None:
                raise NotFound(f"no review {item_id!r}")
            if label is not None and label not in json.loads(row["classes"]):
                raise InvalidValue(
                    f"label {label!r} is not a class of model {row['model']!r}: use one of "
                    f"{', '.join(json.loads(row['classes']))}"
                )
            if row["state"] == "reviewed" or (state == "skipped" and row["state"] != "pending"):
                raise Conflict(f"review {item_id} is already {row['state']}")
            holder = row["claimed_by"]
            if holder and holder != reviewer and (row["claim_expires"] or 0) > now:
                raise Conflict(
                    f"review {item_id} is claimed by {holder!r} until their lease ends; "
                    "claim another item"
                )
            db.execute(
                "UPDATE reviews SET state = ?, label = ?, reviewer = ?, reviewed_at = ?, "
                "claimed_by = NULL, claim_expires = NULL WHERE id = ?",
                (state, label, reviewer, now, item_id),
            )
            row.update(state=state, label=label, reviewer=reviewer, reviewed_at=now)
            row.update(claimed_by=None, claim_expires=None)
        return self._public(row)

    # ------------------------------------------------------------------ statistics, export
    def stats(self, model: str | None = None) -> dict[str, Any]:
        """Counts by state, agreement of human labels with the model (overall and per predicted
        class), and the median time from queueing to a label."""
        where, params = ("WHERE model = ?", (model,)) if model else ("", ())
        counts = {s: 0 for s in STATES}
        for r in self.db.fetchall(
            f"SELECT state, COUNT(*) AS n FROM reviews {where} GROUP BY state", params
        ):
            counts[r["state"]] = int(r["n"])
        and_model = "AND model = ?" if model else ""
        rows = self.db.fetchall(
            "SELECT prediction, label, reviewed_at - created_at AS wait FROM reviews "
            f"WHERE state = 'reviewed' {and_model}",
            params,
        )
        per_class: dict[str, list[int]] = {}
        for r in rows:
            agree, n = per_class.setdefault(r["prediction"], [0, 0])
            per_class[r["prediction"]] = [agree + (r["label"] == r["prediction"]), n + 1]
        agreed = sum(a for a, _ in per_class.values())
        return {
            "counts": counts,
            "agreement": agreed / len(rows) if rows else None,
            "agreement_by_class": {
                c: {"agreement": a / n, "reviewed": n} for c, (a, n) in sorted(per_class.items())
            },
            "median_time_to_review_s": statistics.median(r["wait"] for r in rows) if rows else None,
        }

    def reviewed(self, model: str | None = None) -> Iterator[tuple[str, str, bytes, str]]:
        """``(label, sha256, image bytes, content type)`` of every reviewed item whose image is
        still stored, oldest first; one image once per label."""
        and_model = "AND model = ?" if model else ""
        rows = self.db.fetchall(
            "SELECT label, sha256, content_type, MIN(created_at) AS first_at FROM reviews "
            f"WHERE state = 'reviewed' {and_model} GROUP BY label, sha256, content_type "
            "ORDER BY first_at",
            (model,) if model else (),
        )
        for r in rows:
            try:
                data = self.blobs.get(r["sha256"])
            except FileNotFoundError:
                continue
            yield r["label"], r["sha256"], data, r["content_type"]

    # ------------------------------------------------------------------ retention
    def sweep(self, retention_days: float, now: float | None = None) -> int:
        """Delete reviewed and skipped items closed more than ``retention_days`` ago, and the
        images no remaining item refers to. Pending items are never deleted. Returns rows deleted."""
        now = time.time() if now is None else now
        cutoff = now - retention_days * 86400.0
        old = self.db.fetchall(
            "SELECT DISTINCT sha256 FROM reviews WHERE state <> 'pending' AND reviewed_at < ?",
            (cutoff,),
        )
        deleted = self.db.execute(
            "DELETE FROM reviews WHERE state <> 'pending' AND reviewed_at < ?", (cutoff,)
        )
        for r in old:
            still = self.db.scalar(
                "SELECT COUNT(*) AS n FROM reviews WHERE sha256 = ?", (r["sha256"],)
            )
            if not still:
                self.blobs.delete(r["sha256"])
        return deleted


ReviewPolicy = Literal["auto", "always", "never"]


def chosen_for_review(policy: ReviewPolicy, records: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the answers to queue: ``auto`` the abstained ones, ``always`` all, ``never``
    none."""
    if policy == "always":
        return list(range(len(records)))
    if policy == "auto":
        return [i for i, r in enumerate(records) if r["abstain"]]
    return []


def queue_answers(
    store: ReviewStore,
    metrics: Any,
    *,
    model: str,
    model_version: str,
    classes: Sequence[str],
    policy: ReviewPolicy,
    blobs: Sequence[bytes],
    records: list[dict[str, Any]],
) -> None:
    """Queue the chosen images and mark their answers with ``review_id`` and ``review_status``.

    Runs in a thread (file and database writes). A failure to store never fails the prediction:
    the answer says ``review_status: "error"`` and the failure is logged and counted.
    """
    chosen = chosen_for_review(policy, records)
    if not chosen:
        return
    try:
        results = store.enqueue(
            model=model,
            model_version=model_version,
            classes=classes,
            images=[blobs[i] for i in chosen],
            answers=[records[i] for i in chosen],
        )
    except Exception:  # noqa: BLE001 - the prediction itself succeeded; say so, keep serving
        log.exception("review queue: storing %d images failed", len(chosen))
        results = [Enqueued(None, "error")] * len(chosen)
    for i, res in zip(chosen, results, strict=True):
        records[i]["review_id"] = res.review_id
        records[i]["review_status"] = res.status
        metrics.review_enqueued.labels(model=model, status=res.status).inc()
