"""The review store on both databases it supports: SQLite (one host) and a real PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import pytest

from service.common.db import Database
from service.common.errors import Conflict, InvalidValue, NotFound
from service.common.review_images import sniff_content_type
from service.common.review_store import ReviewStore

CLASSES = [str(i) for i in range(10)]
PNG = b"\x89PNG\r\n\x1a\n" + b"pixels"


def answer(label: str = "3", vgmu: float = 0.5) -> dict[str, object]:
    return {
        "prediction": int(label), "label": label, "vgmu": vgmu, "snr": 1.0, "tu": 0.5,
        "au": 0.3, "eu": 0.2, "abstain": True, "abstain_k": 1.0,
        "probabilities": [{"label": label, "probability": 0.6}],
    }  # fmt: skip


def make_store(
    url: str, tmp_path: Path, max_items: int = 100, lease_s: float = 60.0
) -> ReviewStore:
    return ReviewStore(Database(url), tmp_path / "blobs", max_items=max_items, lease_s=lease_s)


def queue(
    store: ReviewStore, data: bytes, label: str = "3", vgmu: float = 0.5, now: float = 1000.0
):
    (out,) = store.enqueue(
        model="m",
        model_version="1",
        classes=CLASSES,
        images=[data],
        answers=[answer(label, vgmu)],
        now=now,
    )
    return out


def test_queue_stores_answer_and_image_once(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path)
    first = queue(store, PNG + b"a")
    again = queue(store, PNG + b"a")
    other = queue(store, PNG + b"b")
    assert first.status == "queued" and again.status == "already_queued"
    assert again.review_id == first.review_id and other.review_id != first.review_id
    assert len(list((tmp_path / "blobs").rglob("*"))) == 2 + 2  # 2 shard dirs + 2 files
    item = store.get(first.review_id)
    assert item["state"] == "pending" and item["answer"]["model"] == "m"
    assert item["answer"]["eu"] == 0.2 and item["classes"] == CLASSES
    assert store.image(first.review_id) == (PNG + b"a", "image/png")
    # Labelled, the same image queued again is a new item whose bytes are still stored once.
    store.label(first.review_id, "3", "ann")
    assert queue(store, PNG + b"a").status == "queued"
    assert len([p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]) == 2


def test_full_queue_refuses_without_failing(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path, max_items=2)
    assert [queue(store, PNG + bytes([i])).status for i in range(3)] == [
        "queued",
        "queued",
        "queue_full",
    ]
    assert queue(store, PNG + bytes([3])).review_id is None
    assert store.pending_count() == 2
    # what a full queue refused is not on disk (it used to be written, then never referenced)
    assert len([p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]) == 2


def test_the_queue_is_bounded_in_bytes_too(db_url: str, tmp_path: Path) -> None:
    """Within the item bound, images padded with text chunks could fill the disk: the pending
    images' bytes are bounded as well, and a label frees its item's share."""
    store = ReviewStore(Database(db_url), tmp_path / "blobs", max_items=100, lease_s=60.0,
                        max_bytes=3000)  # fmt: skip
    big = [PNG + bytes([i]) * 1000 for i in range(4)]  # 1,014 bytes each
    statuses = [queue(store, b, now=1000.0 + i).status for i, b in enumerate(big[:3])]
    assert statuses == ["queued", "queued", "queue_full"]
    assert len([p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]) == 2
    assert queue(store, PNG + b"small", now=1010.0).status == "queued"  # fits what is left
    oldest = store.list(limit=1)[0][0]  # big[0]
    store.label(oldest["id"], "3", "ann")
    assert queue(store, big[3], now=1020.0).status == "queued"


def test_a_queue_from_before_the_byte_bound_gets_its_size_column(tmp_path: Path) -> None:
    """An older queue's table has no size column: it is added (0 for its items)."""
    import sqlite3

    from service.common.review_store import SCHEMA

    path = tmp_path / "old.sqlite3"
    old_schema = SCHEMA.replace(",\n    size BIGINT NOT NULL DEFAULT 0", "")
    old_schema = old_schema.replace(
        ",\n    reviewer_via TEXT,\n    history TEXT NOT NULL DEFAULT '[]',\n    history_dropped "
        "INTEGER NOT NULL DEFAULT 0,\n    claimed_via TEXT",
        "",
    )
    assert "size" not in old_schema and "history" not in old_schema
    with sqlite3.connect(path) as conn:
        conn.executescript(old_schema)
        conn.execute(
            "INSERT INTO reviews (id, created_at, model, model_version, sha256, content_type, "
            "prediction, vgmu, answer, classes) VALUES ('a', 1, 'm', '1', 'x', 'image/png', '3', "
            "0.5, '{}', '[\"3\", \"5\"]')"
        )
    (tmp_path / "blobs" / "ab").mkdir(parents=True)
    (tmp_path / "blobs" / "ab" / "abcd").write_bytes(b"\0" * 2500)  # item a's image
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE reviews SET sha256 = 'abcd' WHERE id = 'a'")
    store = ReviewStore(Database(f"sqlite:///{path}"), tmp_path / "blobs", max_items=100,
                        lease_s=60.0, max_bytes=3000)  # fmt: skip
    assert store.pending_count() == 1
    assert queue(store, PNG + b"new").status == "queued"  # 2,500 + 17 bytes
    assert queue(store, PNG + b"x" * 600).status == "queue_full"  # item a's image counts
    store.label("a", "3", "ann")  # the label-history columns were added too: relabel works
    assert store.label("a", "5", "bob")["history"][0]["label"] == "3"
    assert store.get("a")["history_dropped"] == 0  # and the later ones: its count, claims
    assert store.claim("cid", via="key")["id"] != "a"


def test_list_orders_and_paginates(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path)
    ids = [queue(store, PNG + bytes([i]), vgmu=v, now=1000.0 + i).review_id
           for i, v in enumerate([0.9, 0.1, 0.5, 0.3, 0.7])]  # fmt: skip
    page, cursor = store.list(limit=2)
    assert [r["id"] for r in page] == ids[:2] and cursor
    rest, end = store.list(limit=10, cursor=cursor)
    assert [r["id"] for r in rest] == ids[2:] and end is None
    # VGMU is an uncertainty (higher = less sure): the most uncertain first, page after page.
    by_vgmu, more = store.list(order="vgmu", limit=2)
    rest_vgmu, done = store.list(order="vgmu", limit=10, cursor=more)
    assert [r["answer"]["vgmu"] for r in by_vgmu + rest_vgmu] == [0.9, 0.7, 0.5, 0.3, 0.1]
    assert done is None
    assert store.claim("ann", order="vgmu", now=2000.0)["id"] == ids[0]  # vgmu 0.9
    assert store.claim("bob", order="vgmu", now=2000.0)["id"] == ids[4]  # vgmu 0.7
    with pytest.raises(InvalidValue, match="cursor"):
        store.list(cursor="not-a-cursor")
    import base64

    huge = base64.urlsafe_b64encode(b"[" + b"9" * 310 + b', "a"]').decode()  # over a float
    with pytest.raises(InvalidValue, match="cursor"):
        store.list(cursor=huge)
    # A NaN or infinite key (NaN ordered differently by SQLite and PostgreSQL: no item, or every
    # item) and a NUL in the id (PostgreSQL's text cannot hold it) are not cursors either.
    for key, item_id in ((float("nan"), ids[0]), (float("inf"), ids[0]), (0.5, "a\x00b")):
        bad = base64.urlsafe_b64encode(json.dumps([key, item_id]).encode()).decode()
        with pytest.raises(InvalidValue, match="cursor"):
            store.list(order="vgmu", cursor=bad)
    assert store.list(state="reviewed")[0] == []
    assert store.connection.up


def test_a_nul_in_a_value_is_the_clients_error_and_the_store_stays_up(
    db_url: str, tmp_path: Path
) -> None:
    """PostgreSQL's text cannot hold NUL: a value with one was a driver DataError, taken for an
    outage (503, the shared connection closed, the store down for every request). It is a 422
    now, and the store stays up; SQLite stores NUL, so there the id is simply not found."""
    store = make_store(db_url, tmp_path)
    item = queue(store, PNG + b"n").review_id
    postgres = db_url.startswith("postgresql")
    for call in (
        lambda: store.get("a\x00b"),
        lambda: store.stats("m\x00"),
        lambda: store.label(item, "3", "ann\x00"),
    ):
        if postgres:
            with pytest.raises(InvalidValue, match="cannot be stored"):
                call()
        else:
            with contextlib.suppress(NotFound):
                call()
        assert store.connection.up
    assert store.get(item)["id"] == item  # the connection still answers


def test_a_sweep_racing_an_enqueue_never_leaves_a_queued_item_without_its_image(
    db_url: str, tmp_path: Path
) -> None:
    """The image of an old closed item is queued again while the retention sweep deletes that
    item: the sweep found no other reference (the new row was not in yet) and deleted the file,
    and the new item was answered queued with no image (404 on its image, a reviewer page
    stuck). The enqueue now writes the image again once its row is in."""
    store = make_store(db_url, tmp_path)
    old = queue(store, PNG + b"race", now=0.0).review_id
    store.label(old, "3", "x", now=10.0)
    put = store.blobs.put
    swept: list[int] = []

    def put_then_sweep(data: bytes) -> str:  # the sweep runs between the write and the INSERT
        sha = put(data)
        if not swept:
            swept.append(store.sweep(retention_days=2, now=5 * 86400.0))
        return sha

    store.blobs.put = put_then_sweep  # type: ignore[method-assign]
    new = queue(store, PNG + b"race", now=5 * 86400.0)
    store.blobs.put = put  # type: ignore[method-assign]
    assert swept == [1] and new.status == "queued"
    assert store.image(new.review_id) == (PNG + b"race", "image/png")


def test_a_blob_is_deleted_only_while_nothing_refers_to_it(tmp_path: Path) -> None:
    """The sweep's second look (BlobStore.delete_unless): the file is set aside, the references
    counted again, and it is put back when an item appeared meanwhile, or left as an enqueue
    wrote it anew (ensure) in the same window."""
    from service.common.review_images import BlobStore

    blobs = BlobStore(tmp_path / "b")
    sha = blobs.put(b"img")
    assert blobs.delete_unless(sha, lambda: True) is False and blobs.get(sha) == b"img"

    def enqueued_meanwhile() -> bool:
        blobs.ensure(b"img", sha)  # the file is aside: written anew
        return True

    assert blobs.delete_unless(sha, enqueued_meanwhile) is False and blobs.get(sha) == b"img"
    assert blobs.delete_unless(sha, lambda: False) is True
    assert not blobs.path(sha).exists() and not list((tmp_path / "b").rglob(".*"))
    assert blobs.delete_unless(sha, lambda: False) is False  # already gone


def test_the_export_reads_its_items_when_asked(tmp_path: Path) -> None:
    """export_items reads the items when called, so an unavailable store raises there (the
    route then answers 503; it answered 200 with an empty tar), not once the response began."""
    from service.common.review_connection import ReviewStoreUnavailable

    url = f"sqlite:///{tmp_path}/q.sqlite3"
    store = make_store(url, tmp_path)
    item = queue(store, PNG + b"e").review_id
    store.label(item, "3", "ann")
    outlier = queue(store, PNG + b"o").review_id
    store.mark_not_a_digit(outlier, "ann")
    items = store.export_items()
    (tmp_path / "q.sqlite3").unlink()
    paths = [path for path, _ in items]  # read before the file went: every item
    assert [p.split("/")[0] for p in paths] == ["3", "outliers"]
    with pytest.raises(ReviewStoreUnavailable):
        store.export_items()


def test_label_validation_and_state_changes(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path)
    rid = queue(store, PNG).review_id
    with pytest.raises(InvalidValue, match="'cat' is not a class"):
        store.label(rid, "cat", "ann")
    with pytest.raises(NotFound):
        store.label("nope", "3", "ann")
    skipped = store.skip(rid, "ann")
    assert skipped["state"] == "skipped"
    reviewed = store.label(rid, "8", "bob", now=10.0)  # a skipped item can still be labelled
    assert (reviewed["state"], reviewed["label"], reviewed["reviewer"]) == ("reviewed", "8", "bob")
    assert not reviewed["relabelled"]
    with pytest.raises(Conflict, match="already reviewed"):
        store.skip(rid, "ann")
    # A mistaken label is corrected; every earlier label (and the skip) stays, with who and when.
    fixed = store.label(rid, "3", "ann", now=20.0, via="key")
    assert (fixed["label"], fixed["reviewer"], fixed["reviewer_via"]) == ("3", "ann", "key")
    assert fixed["relabelled"]
    assert [(h["state"], h["label"], h["reviewer"], h["at"]) for h in fixed["history"]] == [
        ("skipped", None, "ann", skipped["reviewed_at"]),
        ("reviewed", "8", "bob", 10.0),
    ]
    assert store.get(rid)["history"] == fixed["history"]
    assert [lab for lab, *_ in store.reviewed()] == ["3"]  # training sees the current label


def test_claim_leases_and_expiry(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path, lease_s=10.0)
    a = queue(store, PNG + b"1", now=1.0).review_id
    b = queue(store, PNG + b"2", now=2.0).review_id
    assert store.claim("ann", now=100.0)["id"] == a
    assert store.claim("ann", now=101.0)["id"] == a  # her own item comes back
    assert store.claim("bob", now=101.0)["id"] == b
    assert store.claim("cid", now=101.0) is None
    with pytest.raises(Conflict, match="claimed by 'ann'"):
        store.label(a, "3", "bob", now=105.0)
    assert store.claim("cid", now=111.5)["id"] == a  # ann's lease (101 + 10 s) ran out
    store.label(a, "3", "cid", now=112.0)
    stats = store.stats()
    assert stats["counts"] == {"pending": 1, "reviewed": 1, "skipped": 0}


def test_concurrent_claims_never_share_an_item(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path)
    for i in range(40):
        queue(store, PNG + bytes([i]), now=float(i))
    # Separate connections, like separate processes or replicas.
    stores = [make_store(db_url, tmp_path) for _ in range(4)]
    got: list[str] = []
    lock = threading.Lock()

    def reviewer(n: int) -> None:
        s = stores[n]
        while (item := s.claim(f"r{n}")) is not None:
            with lock:
                got.append(item["id"])
            s.label(item["id"], "3", f"r{n}")

    threads = [threading.Thread(target=reviewer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 40 and len(set(got)) == 40


def test_stats_agreement_and_median_wait(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path)
    r1 = queue(store, PNG + b"1", label="3", now=0.0).review_id
    r2 = queue(store, PNG + b"2", label="3", now=0.0).review_id
    r3 = queue(store, PNG + b"3", label="7", now=0.0).review_id
    queue(store, PNG + b"4", label="7", now=0.0)
    store.label(r1, "3", "x", now=10.0)
    store.label(r2, "5", "x", now=20.0)
    store.label(r3, "7", "x", now=60.0)
    s = store.stats()
    assert s["counts"] == {"pending": 1, "reviewed": 3, "skipped": 0}
    assert s["agreement"] == pytest.approx(2 / 3)
    assert s["agreement_by_class"] == {
        "3": {"agreement": 0.5, "reviewed": 2},
        "7": {"agreement": 1.0, "reviewed": 1},
    }
    assert s["median_time_to_review_s"] == pytest.approx(20.0)
    assert sorted((lab, data) for lab, _, data, _ in store.reviewed()) == [
        ("3", PNG + b"1"),
        ("5", PNG + b"2"),
        ("7", PNG + b"3"),
    ]


def test_retention_deletes_old_closed_items_and_their_images(db_url: str, tmp_path: Path) -> None:
    store = make_store(db_url, tmp_path)
    old = queue(store, PNG + b"old", now=0.0).review_id
    shared = queue(store, PNG + b"shared", now=0.0).review_id
    pending = queue(store, PNG + b"pending", now=0.0).review_id
    store.label(old, "3", "x", now=10.0)
    store.label(shared, "3", "x", now=10.0)
    again = queue(store, PNG + b"shared", now=5 * 86400.0).review_id  # pending, same bytes
    assert store.sweep(retention_days=2, now=5 * 86400.0) == 2
    with pytest.raises(NotFound):
        store.get(old)
    assert store.get(pending)["state"] == "pending" and store.get(again)["state"] == "pending"
    files = {p.name for p in (tmp_path / "blobs").rglob("*") if p.is_file()}
    import hashlib

    assert hashlib.sha256(PNG + b"old").hexdigest() not in files
    assert hashlib.sha256(PNG + b"shared").hexdigest() in files  # still referenced


def test_sniffs_image_types() -> None:
    assert sniff_content_type(b"\xff\xd8\xff\xe0") == "image/jpeg"
    assert sniff_content_type(b"RIFF1234WEBPVP8 ") == "image/webp"
    assert sniff_content_type(b"hello") == "application/octet-stream"


def test_a_lost_postgres_connection_is_a_503_then_reconnects(pg_database, tmp_path: Path) -> None:
    import psycopg

    from service.common.db import DatabaseUnavailable

    url = pg_database()
    store = make_store(url, tmp_path)
    rid = queue(store, PNG).review_id
    pid = store.db.scalar("SELECT pg_backend_pid() AS pid")
    with psycopg.connect(url, autocommit=True) as admin:  # the server drops our connection
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(DatabaseUnavailable, match="retry shortly") as err:
        store.get(rid)
    assert err.value.status_code == 503
    assert store.get(rid)["state"] == "pending"  # the next call reconnected
    assert store.db.scalar("SELECT pg_backend_pid() AS pid") != pid


# ------------------------------------------------------------------ untrusted class names, bounds
#: Class names a card may hold (the card schema refuses them; the store must be safe whatever a
#: card said): a relative escape, an absolute path, the directory names, an empty-looking name.
PATHS = ["../x", "/abs/olute", "..", ".", "a/../../b", "-rf", "x" * 300, "ünï", "0"]


def test_class_names_never_become_paths(db_url: str, tmp_path: Path) -> None:
    from pathlib import PurePosixPath

    from service.common.review_images import class_folder

    folders = [class_folder(c) for c in PATHS]
    assert folders[:4] == ["%2E%2E%2Fx", "%2Fabs%2Folute", "%2E%2E", "%2E"]
    assert folders[-1] == "0" and class_folder("cat.v2+b_c-d") == "cat.v2+b_c-d"  # safe: kept
    assert folders[6].startswith("%sha256-") and len(folders[6]) < 100  # too long encoded
    assert len(set(folders)) == len(PATHS)  # one folder per class
    for f in folders:
        assert len(PurePosixPath(f).parts) == 1 and f not in (".", "..") and "/" not in f

    store = ReviewStore(Database(db_url), tmp_path / "blobs", max_items=100, lease_s=60.0)
    for i, label in enumerate(PATHS):
        (item,) = store.enqueue(model="evil", model_version="1", classes=PATHS,
                                images=[PNG + bytes([i])], answers=[answer("0")])  # fmt: skip
        store.label(item.review_id, label, "ann")
    items = dict(store.export_items())
    assert len(items) == len(PATHS)
    for path in items:
        parts = PurePosixPath(path).parts
        assert len(parts) == 2 and parts[0] in folders and parts[1].endswith(".png"), path
        assert not PurePosixPath(path).is_absolute() and ".." not in parts


def test_label_history_is_bounded_and_counts_the_rest(db_url: str, tmp_path: Path) -> None:
    store = ReviewStore(Database(db_url), tmp_path / "blobs", max_items=10, lease_s=60.0,
                        max_history=3)  # fmt: skip
    item = queue(store, PNG + b"h").review_id
    for n in range(8):  # 8 labels: 7 earlier ones, the newest 3 kept
        last = store.label(item, str(n), f"r{n}", now=2000.0 + n)
    assert last["label"] == "7" and last["history_dropped"] == 4
    assert [h["label"] for h in last["history"]] == ["4", "5", "6"]
    assert store.get(item)["history_dropped"] == 4 and len(store.get(item)["history"]) == 3


def test_one_key_holds_a_bounded_number_of_claims(db_url: str, tmp_path: Path) -> None:
    """Made-up names with the shared key share one bound; a personal key has its own; getting
    one's own item back is never refused."""
    store = ReviewStore(Database(db_url), tmp_path / "blobs", max_items=100, lease_s=10.0,
                        max_claims=2)  # fmt: skip
    for i in range(6):
        queue(store, PNG + bytes([i]), now=float(i))
    first = store.claim("made-up-1", now=100.0)
    store.claim("made-up-2", now=100.0)
    with pytest.raises(Conflict, match="shared reviewer key .* holds 2 claimed item.*"
                       "VGE_REVIEW_MAX_CLAIMS=2"):  # fmt: skip
        store.claim("made-up-3", now=100.0)
    assert store.claim("made-up-1", now=101.0)["id"] == first["id"]  # a reloaded page
    assert store.claim("alice", now=101.0, via="key") is not None  # her own bound
    store.label(first["id"], "3", "made-up-1", now=102.0)  # one claim fewer
    assert store.claim("made-up-3", now=102.0) is not None
    assert store.claim("made-up-4", now=111.0) is not None  # leases from 100 s ran out


def test_not_a_digit_is_no_class(db_url: str, tmp_path: Path) -> None:
    """*Not a digit* is a reviewed item without a label: no class, counted apart from the
    human–model agreement, exported under ``outliers/`` (never a class's folder), and it can be
    corrected either way with the history kept."""
    from service.common.review_images import OUTLIER_FOLDER, class_folder

    store = make_store(db_url, tmp_path)
    digit = queue(store, PNG + b"d", label="3", now=0.0).review_id
    wrong = queue(store, PNG + b"w", label="3", now=0.0).review_id
    noise = queue(store, PNG + b"n", label="8", now=0.0).review_id
    face = queue(store, PNG + b"f", label="8", now=0.0).review_id
    store.label(digit, "3", "ann", now=10.0)
    store.label(wrong, "5", "ann", now=10.0)
    marked = store.mark_not_a_digit(noise, "ann", now=30.0, via="key")
    assert (marked["state"], marked["label"], marked["not_a_digit"]) == ("reviewed", None, True)
    assert marked["reviewer_via"] == "key" and not marked["relabelled"]
    # a face first labelled 0 by mistake, then corrected to not a digit (and the history says so)
    store.label(face, "0", "bob", now=20.0)
    fixed = store.mark_not_a_digit(face, "ann", now=40.0)
    assert fixed["relabelled"] and fixed["not_a_digit"]
    assert [(h["label"], h["not_a_digit"]) for h in fixed["history"]] == [("0", False)]
    assert store.get(digit)["not_a_digit"] is False

    s = store.stats()
    assert s["counts"] == {"pending": 0, "reviewed": 4, "skipped": 0}
    assert s["labelled"] == 2 and s["agreement"] == pytest.approx(0.5)  # not-a-digit apart
    assert s["not_a_digit"] == {"count": 2, "by_prediction": {"8": 2}}
    assert "8" not in s["agreement_by_class"]
    assert s["median_time_to_review_s"] == pytest.approx(20.0)  # every reviewed item waited
    assert store.not_a_digit_count() == 2 and store.not_a_digit_count("other") == 0

    assert sorted(lab for lab, *_ in store.reviewed()) == ["3", "5"]  # classes only
    items = dict(store.export_items())
    assert sorted(items) == sorted([
        f"3/{store.get(digit)['sha256']}.png", f"5/{store.get(wrong)['sha256']}.png",
        f"{OUTLIER_FOLDER}/{marked['sha256']}.png", f"{OUTLIER_FOLDER}/{fixed['sha256']}.png",
    ])  # fmt: skip
    assert not any(p.startswith(OUTLIER_FOLDER) for p, _ in store.export_items(outliers=False))
    # a class literally named "outliers" never shares the outliers' folder
    assert class_folder("outliers") == "%6Futliers" and class_folder("outlier") == "outlier"

    # back to a class: no longer an outlier
    again = store.label(noise, "8", "ann", now=50.0)
    assert not again["not_a_digit"] and again["history"][-1]["not_a_digit"] is True
    assert store.not_a_digit_count() == 1


def test_a_transparent_png_is_exported_as_the_reading_sees_it(db_url: str, tmp_path: Path) -> None:
    """A black digit on a transparent page: the export flattens it onto white (the ImageFolder
    loader would drop the alpha: black on black, nothing to learn), as the default reading does;
    an opaque PNG is exported byte for byte as stored."""
    import io

    import numpy as np
    import torch
    from PIL import Image
    from torchvision.io import decode_image

    def png(img: Image.Image) -> bytes:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue()

    page = np.zeros((12, 10, 4), np.uint8)  # transparent black
    page[2:10, 4:6] = (0, 0, 0, 255)  # an opaque black stroke
    transparent = png(Image.fromarray(page, "RGBA"))
    opaque = png(Image.fromarray(np.full((12, 10), 200, np.uint8), "L"))
    store = ReviewStore(Database(db_url), tmp_path / "blobs", max_items=10, lease_s=60.0)
    shas = []
    for data in (transparent, opaque):
        (item,) = store.enqueue(model="m", model_version="1", classes=["0", "1"],
                                images=[data], answers=[answer("1")])  # fmt: skip
        store.label(item.review_id, "1", "ann")
        shas.append(store.get(item.review_id)["sha256"])
    items = dict(store.export_items())
    flat = decode_image(torch.frombuffer(bytearray(items[f"1/{shas[0]}.png"]), dtype=torch.uint8))
    assert flat.shape == (3, 12, 10)
    assert int(flat[:, 0, 0].min()) == 255 and int(flat[:, 5, 4].max()) == 0
    assert items[f"1/{shas[1]}.png"] == opaque


def test_a_sweep_whose_second_look_fails_puts_the_image_back(tmp_path: Path) -> None:
    """The database failing at the sweep's second look left the image set aside for good: an
    item queued in that window had none. It goes back before the error is raised."""
    from service.common.review_images import BlobStore

    blobs = BlobStore(tmp_path / "b")
    sha = blobs.put(b"img")

    def database_down() -> bool:
        raise OSError("the database went away")

    with pytest.raises(OSError, match="went away"):
        blobs.delete_unless(sha, database_down)
    assert blobs.get(sha) == b"img" and not list((tmp_path / "b").rglob(".*"))
