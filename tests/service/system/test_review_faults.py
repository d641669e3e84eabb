"""The review queue fails on its own: a missing, corrupt, unwritable or unreachable store never
stops predictions, a front end's start-up or readiness, and recovers once fixed.

Real SQLite files (garbage, deleted, replaced, an image directory that cannot be written) and a
real PostgreSQL server stopped and started again, first on :class:`ReviewStore` itself, then on
running ``vge serve`` processes (a front end killed while the file is garbage used to fail its
start-up five times and stop the server).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from service.common.db import Database, DatabaseUnavailable, check_url, mask_url
from service.common.metrics import Metrics
from service.common.review_connection import ReviewStoreUnavailable
from service.common.review_store import ReviewStore
from service.frontend.review_queue import queue_answers
from tests import postgres
from tests.service.conftest import Server, children, start_server

CLASSES = [str(i) for i in range(10)]
PNG = b"\x89PNG\r\n\x1a\n" + b"pixels"
KEY = "fault-reviewer-key"
R = {"Authorization": f"Bearer {KEY}"}


def _answer() -> dict[str, object]:
    return {"prediction": 3, "label": "3", "vgmu": 0.5, "abstain": True, "abstain_k": 1.0}


def _queue(store: ReviewStore, data: bytes) -> dict[str, object]:
    """What a prediction's answer would say: queue_answers as the predict route calls it."""
    records: list[dict[str, object]] = [_answer()]
    queue_answers(store, Metrics(), model="m", model_version="1", classes=CLASSES,
                  policy="always", blobs=[data], records=records)  # fmt: skip
    return records[0]


def _until(cond: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (the store's retries back off up to service.common.review_connection.RETRY_MAX_S)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _store(url: str, tmp_path: Path) -> ReviewStore:
    return ReviewStore(url, tmp_path / "blobs", max_items=100, lease_s=60.0)


def _backup(path: Path, to: Path) -> None:
    """A consistent copy of a live SQLite file (the backup API, as an operator's backup)."""
    with sqlite3.connect(path) as src, sqlite3.connect(to) as dst:
        src.backup(dst)


# ---------------------------------------------------------------------------------- the store


def test_a_corrupt_file_makes_the_store_unavailable_until_replaced(tmp_path: Path) -> None:
    path = tmp_path / "reviews.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    store = _store(f"sqlite:///{path}", tmp_path)  # used to raise sqlite3.DatabaseError
    assert not store.up and str(path) in store.problem and "corrupt" in store.problem
    answer = _queue(store, PNG)
    assert answer["review_status"] == "unavailable" and answer["review_id"] is None
    with pytest.raises(ReviewStoreUnavailable, match=str(path)) as err:
        store.list()
    assert err.value.status_code == 503 and err.value.code == "review_store_unavailable"
    path.rename(tmp_path / "reviews.sqlite3.bad")  # as the message says: aside, and empty
    path.touch()
    _until(store.check, "the store to reopen")
    assert _queue(store, PNG)["review_status"] == "queued"
    assert store.pending_count() == 1


def test_a_deleted_file_is_noticed_not_written_into_the_void(tmp_path: Path) -> None:
    path = tmp_path / "reviews.sqlite3"
    store = _store(f"sqlite:///{path}", tmp_path)
    kept = _queue(store, PNG + b"1")
    assert kept["review_status"] == "queued"
    path.unlink()
    lost = _queue(store, PNG + b"2")  # written to the deleted file, it would be lost
    assert lost["review_status"] == "unavailable" and lost["review_id"] is None
    # Images are stored beside it: a new empty file is not created by itself (the volume may
    # be missing); the message says how to restore or restart the queue.
    assert not store.check() and not path.exists()
    assert "holds queued images" in store.problem and f"touch {path}" in store.problem
    path.touch()
    _until(store.check, "the store to reopen")
    again = _queue(store, PNG + b"3")
    assert again["review_status"] == "queued"
    # It is in the file at the path, for every process that opens it.
    other = _store(f"sqlite:///{path}", tmp_path)
    assert [r["id"] for r in other.list()[0]] == [again["review_id"]]


def test_a_file_replaced_by_a_backup_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "reviews.sqlite3"
    store = _store(f"sqlite:///{path}", tmp_path)
    first = _queue(store, PNG + b"1")["review_id"]
    _backup(path, tmp_path / "backup.sqlite3")
    second = _queue(store, PNG + b"2")["review_id"]
    os.replace(tmp_path / "backup.sqlite3", path)  # a restore: another file at the path
    # The next use notices and reads the restored file (without the item queued after it).
    _until(lambda: store.check() and store.pending_count() == 1, "the restored file")
    assert [r["id"] for r in store.list()[0]] == [first] and first != second
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(8192))
    os.replace(garbage, path)
    assert _queue(store, PNG + b"3")["review_status"] == "unavailable"
    assert "corrupt" in store.problem


def test_an_unwritable_image_directory_makes_the_store_unavailable(tmp_path: Path) -> None:
    store = _store(f"sqlite:///{tmp_path / 'reviews.sqlite3'}", tmp_path)
    assert _queue(store, PNG + b"1")["review_status"] == "queued"
    blobs = tmp_path / "blobs"
    blobs.rename(tmp_path / "blobs.moved")
    blobs.write_bytes(b"")  # a file where the directory was: no image can be written (as root too)
    answer = _queue(store, PNG + b"2")
    assert answer["review_status"] == "unavailable"
    assert not store.check() and "writable" in store.problem and str(blobs) in store.problem
    blobs.unlink()
    (tmp_path / "blobs.moved").rename(blobs)
    _until(store.check, "the store to reopen")
    assert _queue(store, PNG + b"2")["review_status"] == "queued"
    assert store.pending_count() == 2


def test_database_passwords_are_masked() -> None:
    url = "postgresql+psycopg://vge:S3cretPass@db/vge"
    with pytest.raises(ValueError) as err:
        check_url(url, "db_url")
    assert "S3cretPass" not in str(err.value) and "vge:***@db" in str(err.value)
    assert mask_url("postgresql://vge:S3cretPass@127.0.0.1:1/x") == (
        "postgresql://vge:***@127.0.0.1:1/x"
    )
    with pytest.raises(DatabaseUnavailable) as err2:  # nothing listens on port 1
        Database("postgresql://vge:S3cretPass@127.0.0.1:1/x", connect_timeout=2)
    assert "S3cretPass" not in err2.value.message and "vge:***@127.0.0.1:1" in err2.value.message
    store = ReviewStore("postgresql://vge:S3cretPass@127.0.0.1:1/x", Path("/nonexistent"),
                        max_items=1, lease_s=1.0)  # fmt: skip
    assert not store.up and "S3cretPass" not in store.problem and "***" in store.problem


#: Database URLs with a secret in every form people write: the authority (unencoded ``/ # ? @``
#: in it too, which a URL should percent-encode and people do not), percent-encoded, a query
#: ``password=`` (libpq's keyword) or ``sslpassword=``. Each secret contains "Hunter2".
SECRET_URLS = [
    "postgresql://vge:Hunter2pw@127.0.0.1:1/x",
    "postgresql://vge:Hunter2/pw@127.0.0.1:1/x",
    "postgresql://vge:Hunter2#pw@127.0.0.1:1/x",
    "postgresql://vge:Hunter2?pw@127.0.0.1:1/x",
    "postgresql://vge:Hunter2@pw@127.0.0.1:1/x",
    "postgresql://vge:Hunter2%2Fp%23w@127.0.0.1:1/x",
    "postgresql://vge@127.0.0.1:1/x?password=Hunter2pw",
    "postgresql://vge@127.0.0.1:1/x?sslmode=disable&password=Hunter2/p#w&connect_timeout=2",
    "postgres://127.0.0.1:1/x?sslpassword=Hunter2pw",
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_every_form_of_a_database_secret_is_masked(url: str) -> None:
    assert "Hunter2" not in mask_url(url) and "***" in mask_url(url)
    assert "127.0.0.1:1/x" in mask_url(url) or "127.0.0.1:1/x" not in url.split("@")[-1]
    with pytest.raises(ValueError) as err:
        check_url(url.replace("postgres", "mysql", 1), "db_url")
    assert "Hunter2" not in str(err.value)
    with pytest.raises(DatabaseUnavailable) as down:  # nothing listens on port 1
        Database(url, connect_timeout=2)
    assert "Hunter2" not in down.value.message, down.value.message
    store = ReviewStore(url, Path("/nonexistent"), max_items=1, lease_s=1.0)
    assert not store.up and "Hunter2" not in store.problem and "Hunter2" not in store.where


def test_vge_serve_never_prints_the_database_secret(tmp_path: Path) -> None:
    """A real ``vge serve`` whose database cannot be reached: it stops (exit 2) and says where,
    without the secret, in any form; ``--help`` calls the setting a secret."""
    import sys

    from tests.service.conftest import REPO

    for url in (SECRET_URLS[1], SECRET_URLS[5], SECRET_URLS[7]):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
        env.update(VGE_DB_URL=url, VGE_PORT="0", VGE_DEVICE="cpu", VGE_DRAIN_S="0",
                   VGE_REVIEW_DIR=str(tmp_path / "reviews"), VGE_REVIEW_QUEUE="on",
                   VGE_JOBS_DIR=str(tmp_path / "jobs"), VGE_MODELS_ROOT=str(tmp_path / "m"))  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "service.cli.serve"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 2, out[-3000:]
        assert "Hunter2" not in out and "127.0.0.1" in out, out[-3000:]
    helped = subprocess.run([sys.executable, "-m", "service.cli.serve", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "Secret: prefer VGE_DB_URL" in " ".join(helped.stdout.split())


# ------------------------------------------------------------------------ a stoppable PostgreSQL


class StoppablePostgres(postgres.PostgresServer):
    """The test cluster, stopped and started again on the same port and data directory."""

    def halt(self) -> None:
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGINT)  # fast shutdown: clients are disconnected
        self.proc.wait(30)

    def resume(self) -> None:
        bindir = postgres._bindir()
        assert bindir is not None
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*prefix, str(bindir / "postgres"), "-D", str(self.data), "-p", str(self.port),
                 "-k", str(self.data), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_ready()


@pytest.fixture(scope="module")
def stoppable_pg() -> Iterator[StoppablePostgres]:
    assert postgres.available(), "PostgreSQL or psycopg is missing: scripts/install-system-deps.sh"
    server = StoppablePostgres()
    try:
        yield server
    finally:
        server.stop()


# ----------------------------------------------------------------------------- running servers


def _predict(srv: Server, png: bytes) -> dict[str, object]:
    r = httpx.post(srv.url + "/v1/predict", params={"review": "always"}, headers=R,
                   files=[("images", ("x.png", png, "image/png"))], timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def _up(srv: Server) -> float:
    return srv.metric("vge_review_store_up")


def test_a_garbage_sqlite_file_never_stops_the_server(
    tmp_path: Path, tiny_model: Path, pngs: list[bytes]
) -> None:
    srv = start_server(tmp_path, tiny_model, review_queue="on", reviewer_key=KEY, workers=1)
    path = tmp_path / "reviews" / "reviews.sqlite3"
    try:
        kept = _predict(srv, pngs[0])
        assert kept["review_status"] == "queued"
        _until(lambda: _up(srv) == 1, "vge_review_store_up 1")
        _backup(path, tmp_path / "backup.sqlite3")
        (tmp_path / "garbage").write_bytes(b"garbage" * 1000)
        os.replace(tmp_path / "garbage", path)  # a bad restore, a disk error
        old = children(srv.proc.pid)["frontend"]
        os.kill(old[0], signal.SIGKILL)
        _until(lambda: (new := children(srv.proc.pid)["frontend"]) and new != old,
               "a new front end")  # fmt: skip
        _until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, "readiness")
        assert srv.proc.poll() is None
        answer = _predict(srv, pngs[1])
        assert answer["review_status"] == "unavailable" and "label" in answer
        listing = httpx.get(srv.url + "/v1/reviews", headers=R)
        assert listing.status_code == 503 and str(path) in listing.json()["error"]
        assert "corrupt" in listing.json()["error"] and "Retry-After" in listing.headers
        _until(lambda: _up(srv) == 0, "vge_review_store_up 0")
        assert str(path) in srv.log() and "corrupt" in srv.log()
        assert srv.metric("vge_review_enqueue_total", status="unavailable") == 1

        os.replace(tmp_path / "backup.sqlite3", path)  # restored: the queued item is there
        _until(lambda: _predict(srv, pngs[2])["review_status"] == "queued", "queueing again")
        _until(lambda: _up(srv) == 1, "vge_review_store_up 1 again")
        ids = [x["id"] for x in httpx.get(srv.url + "/v1/reviews", headers=R).json()["reviews"]]
        assert ids[0] == kept["review_id"] and len(ids) == 2

        path.unlink()  # deleted while serving: noticed at once, never answered "queued"
        gone = _predict(srv, pngs[3])
        assert gone["review_status"] == "unavailable" and gone["review_id"] is None
        _until(lambda: _up(srv) == 0, "vge_review_store_up 0 after the deletion")
        assert httpx.get(srv.url + "/readyz").status_code == 200
        path.touch()  # the operator starts an empty queue
        _until(lambda: _predict(srv, pngs[4])["review_status"] == "queued", "an empty queue")
        pending = httpx.get(srv.url + "/v1/reviews", headers=R).json()["reviews"]
        assert [x["sha256"] for x in pending] == [hashlib.sha256(pngs[4]).hexdigest()]
        _until(lambda: srv.metric("vge_review_queue_depth") == 1, "the depth of the new file")
    finally:
        srv.stop()


def test_postgres_stopped_then_started(
    tmp_path: Path, tiny_model: Path, pngs: list[bytes], stoppable_pg: StoppablePostgres
) -> None:
    # a password with / # ? percent-encoded (trust authentication ignores it): never shown
    url = stoppable_pg.create_database("faults").replace("vge@", "vge:Hunter2%2Fp%23w%3F@")
    srv = start_server(tmp_path, tiny_model, review_queue="on", reviewer_key=KEY, workers=1,
                       db_url=url, api_key="faults-api-key")  # fmt: skip
    try:
        assert _predict(srv, pngs[0])["review_status"] == "queued"
        stoppable_pg.halt()
        answers = [_predict(srv, png) for png in pngs[1:3]]  # still 200
        assert [a["review_status"] for a in answers] == ["unavailable"] * 2
        assert httpx.get(srv.url + "/readyz").status_code == 200
        _until(lambda: _up(srv) == 0, "vge_review_store_up 0")
        down = httpx.get(srv.url + "/v1/reviews/stats", headers=R)
        assert down.status_code == 503 and f"127.0.0.1:{stoppable_pg.port}" in down.json()["error"]
        history = httpx.get(srv.url + "/v1/models/history",
                            headers={"Authorization": "Bearer faults-api-key"})  # fmt: skip
        assert history.status_code == 503, history.text  # the model history's database too
        for text in (down.text, history.text, srv.log()):
            assert "Hunter2" not in text and "p/w?" not in text, text[-2000:]
        stoppable_pg.resume()
        _until(lambda: _predict(srv, pngs[3])["review_status"] == "queued", "queueing again")
        _until(lambda: _up(srv) == 1, "vge_review_store_up 1")
        stats = httpx.get(srv.url + "/v1/reviews/stats", headers=R).json()
        assert stats["counts"]["pending"] == 2
    finally:
        srv.stop()
