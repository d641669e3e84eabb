"""A fleet on loopback: three ``vge serve`` replicas (one front end each) on one real PostgreSQL
(``VGE_DB_URL``) and one shared models root, behind a real HAProxy running the project's own
deploy/haproxy/haproxy.cfg (its ``bind`` and servers rewritten to this test's ports).

What issue 34 asks of a fleet, measured: a promote or rollback through any replica is served by
every replica within 5 s; under a closed-loop load through HAProxy a rolling restart and a kill -9
of one replica fail no request, and the replica that comes back serves the fleet's model (not
its start model); a training job accepted by one replica and promoted through another is served
by all; a model one replica cannot load leaves it serving what it had, saying so; two replicas
claiming from the shared review queue never get the same item. Everything is stopped by its own
process id.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.postgres import PostgresServer
from tests.service.conftest import API_KEY, REPO, Server, copy_model, free_port, start_server

H = {"Authorization": f"Bearer {API_KEY}"}
REVIEWER_KEY = "reviewer-key-0123"
R = {"Authorization": f"Bearer {REVIEWER_KEY}"}
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
#: The issue's bound: a change through one replica is served by every replica within this long.
CONVERGE_S = 5.0
TINY_JOB = {"name": "fleet-job", "version": "3.0.0", "epochs": 1, "max_train_samples": 128,
            "members": 2, "ensemble": "lle", "batch_size": 64, "device": "cpu", "seed": 1}  # fmt: skip


def _haproxy() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("haproxy not found; install it with: bash scripts/install-system-deps.sh")
    return found


def haproxy_config(port: int, servers: list[int]) -> str:
    """deploy/haproxy/haproxy.cfg for loopback: ``bind`` on ``port``, one ``server`` per replica
    port in place of the compose DNS template, the Docker resolver section dropped, every request
    logged; every check, retry and timeout as shipped."""
    # Every request logged (info), so a failure under load can be read in its log.
    text = HAPROXY_CFG.read_text().replace("local0 notice", "local0 info")
    text = re.sub(r"^resolvers docker\n(?:[ \t]+.*\n|\s*\n)*", "", text, flags=re.M)
    text, n = re.subn(r"^(\s*)bind :8000\s*$", rf"\1bind 127.0.0.1:{port}", text, flags=re.M)
    assert n == 1, "haproxy.cfg: no `bind :8000` to rewrite"
    lines = "\n".join(f"    server vge{i} 127.0.0.1:{p} check" for i, p in enumerate(servers, 1))
    text, n = re.subn(r"^\s*server-template .*$", lines, text, flags=re.M)
    assert n == 1, "haproxy.cfg: no server-template to rewrite"
    assert "127.0.0.11" not in text
    return text


@dataclass
class Fleet:
    """Three replicas, their PostgreSQL, their balancer."""

    work: Path
    db_url: str
    models_root: Path
    start_model: Path
    ports: list[int]
    replicas: list[Server]
    lb_url: str = ""
    lb: subprocess.Popen[bytes] | None = None
    env: dict[str, Any] = field(default_factory=dict)

    def start(self, i: int) -> Server:
        """Start replica ``i`` (0-based) on its own port, as it was started the first time."""
        srv = start_server(self.work / f"r{i + 1}", self.start_model, replica_name=f"r{i + 1}",
                           port=self.ports[i], **self.env)  # fmt: skip
        self.replicas[i] = srv
        return srv


def _served(srv: Server) -> dict[str, Any]:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]


def _until_all_serve(fleet: Fleet, version: str, since: float) -> list[float]:
    """Seconds from ``since`` until each replica's /v1/models says ``version`` (fails after
    twice the bound, with what each serves)."""
    took: list[float | None] = [None] * len(fleet.replicas)
    deadline = since + 2 * CONVERGE_S
    while time.monotonic() < deadline and None in took:
        for i, srv in enumerate(fleet.replicas):
            if took[i] is None and _served(srv)["version"] == version:
                took[i] = time.monotonic() - since
        time.sleep(0.05)
    assert None not in took, [
        (_served(s)["version"], _served(s).get("fleet")) for s in fleet.replicas
    ]
    return [t for t in took if t is not None]


def _predict_version(url: str, png: bytes) -> str:
    r = httpx.post(url + "/v1/predict", files={"images": ("d.png", png, "image/png")}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["model_version"]


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pg_server: PostgresServer
) -> Iterator[Fleet]:
    import uuid

    work = tmp_path_factory.mktemp("fleet")
    db_url = pg_server.create_database(f"fleet_{uuid.uuid4().hex[:8]}")
    models_root = work / "models"
    models_root.mkdir()
    copy_model(tiny_model, models_root / "tiny-v2", "2.0.0")  # same weights, another version
    ports = [free_port() for _ in range(3)]
    fleet = Fleet(work, db_url, models_root, tiny_model, ports, [None] * 3)  # type: ignore[list-item]
    fleet.env = {
        "db_url": db_url, "api_key": API_KEY, "workers": 1, "models_root": models_root,
        "review_queue": "on", "reviewer_key": REVIEWER_KEY, "review_dir": work / "reviews",
        # SIGTERM: not ready at once (HAProxy sees it within ~1 s), answering meanwhile
        "drain_s": 2,
    }  # fmt: skip
    lb_port = free_port()
    cfg = work / "haproxy.cfg"
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(fleet.start, range(3)))
        cfg.write_text(haproxy_config(lb_port, ports))
        check = subprocess.run([_haproxy(), "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(work / "haproxy.log", "wb") as log:
            fleet.lb = subprocess.Popen([_haproxy(), "-db", "-f", str(cfg)], stdout=log,
                                        stderr=subprocess.STDOUT)  # fmt: skip
        fleet.lb_url = f"http://127.0.0.1:{lb_port}"
        deadline = time.monotonic() + 30
        while True:  # every replica up in HAProxy: three answers from three replicas
            try:
                if httpx.get(fleet.lb_url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and fleet.lb.poll() is None, "HAProxy not up"
            time.sleep(0.2)
        time.sleep(2.5)  # rise 2 x inter 1 s: all servers marked up
        yield fleet
    finally:
        if fleet.lb is not None and fleet.lb.poll() is None:
            fleet.lb.send_signal(signal.SIGTERM)
            fleet.lb.wait(10)
        for srv in fleet.replicas:
            if srv is not None:
                srv.stop()


class Load:
    """A closed loop of predictions through the balancer (``threads`` clients, each sending
    its next request when the last one is answered); every failure is kept."""

    def __init__(self, url: str, png: bytes, threads: int = 2) -> None:
        self.url, self.png = url, png
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                try:
                    r = c.post("/v1/predict", files={"images": ("d.png", self.png, "image/png")})
                    failure = None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if failure is None:
                        self.ok += 1
                    else:
                        self.failures.append(failure)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _until(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.1)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_promote_and_rollback_through_any_replica_reach_every_replica(
    fleet: Fleet, pngs: list[bytes]
) -> None:
    r1, r2, r3 = fleet.replicas
    assert {_served(s)["version"] for s in fleet.replicas} == {"1.0.0"}
    t0 = time.monotonic()
    r = httpx.post(r1.url + "/v1/models/promote", json={"model": "tiny-v2"}, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    took = _until_all_serve(fleet, "2.0.0", time.monotonic())
    print(f"promote through r1 ({time.monotonic() - t0:.2f} s incl. the gate): replicas serve "
          f"it {', '.join(f'{t:.2f}' for t in took)} s after its answer")  # fmt: skip
    assert max(took) <= CONVERGE_S
    for srv in fleet.replicas:
        assert _predict_version(srv.url, pngs[0]) == "2.0.0"
        assert _served(srv)["fleet"]["converged"] is True
    history = httpx.get(r2.url + "/v1/models/history", headers=H, timeout=10).json()
    top = history["history"][0]
    assert (top["action"], top["replica"], top["version"]) == ("promote", "r1", "2.0.0")
    _until(lambda: all(x["converged"] and x["fleet_history_id"] == top["id"] for x in
                       httpx.get(r2.url + "/v1/models/history", headers=H).json()["replicas"]),
           "every replica reports the promoted entry")  # fmt: skip
    replicas = httpx.get(r2.url + "/v1/models/history", headers=H).json()["replicas"]
    assert {x["replica"]: x["version"] for x in replicas} == {"r1": "2.0.0", "r2": "2.0.0",
                                                              "r3": "2.0.0"}  # fmt: skip

    r = httpx.post(r2.url + "/v1/models/rollback", headers=H, timeout=60)
    assert r.status_code == 200, r.text
    took = _until_all_serve(fleet, "1.0.0", time.monotonic())
    print(f"rollback through r2: replicas serve it {', '.join(f'{t:.2f}' for t in took)} s after")
    assert max(took) <= CONVERGE_S
    top = httpx.get(r3.url + "/v1/models/history", headers=H).json()["history"][0]
    assert (top["action"], top["replica"], top["version"]) == ("rollback", "r2", "1.0.0")


def test_the_replica_that_promotes_never_serves_the_old_model_after_its_answer(
    fleet: Fleet, pngs: list[bytes]
) -> None:
    """The fleet loop's read of the newest entry is made under the model lock: a read that
    waited while this replica's own promote held the lock used to act on the entry before it
    and swap the old model back in for a poll interval right after the promote answered 200."""
    r1 = fleet.replicas[0]
    if not (fleet.models_root / "tiny-v1").exists():
        copy_model(fleet.start_model, fleet.models_root / "tiny-v1", "1.0.0")
    steps = [("tiny-v2", "2.0.0"), ("tiny-v1", "1.0.0")]
    if _served(r1)["version"] == "2.0.0":
        steps.reverse()
    for target, want in steps:  # one promote towards each version
        r = httpx.post(r1.url + "/v1/models/promote", json={"model": target, "force": True},
                       headers=H, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        seen = []
        deadline = time.monotonic() + 2 * 2.0 + 0.5  # two fleet polls (FLEET_POLL_S), and some
        while time.monotonic() < deadline:
            model = _served(r1)
            seen.append((model["version"], model["served_because"]))
            assert _predict_version(r1.url, pngs[0]) == want
            time.sleep(0.1)
        assert set(seen) == {(want, "promote")}, seen
        _until_all_serve(fleet, want, time.monotonic())


def test_a_reload_of_a_card_rewritten_in_place_reaches_every_replica(fleet: Fleet) -> None:
    """Same directory, same weights, a new card (version and abstain_k): a reload through one
    replica is served by every replica (they used to adopt the entry as the model they already
    served, keeping the old card, and report themselves converged)."""
    r1, r2, _ = fleet.replicas
    model_dir = copy_model(fleet.start_model, fleet.models_root / "tiny-rewritten", "5.0.0")
    r = httpx.post(r1.url + "/v1/models/promote", json={"model": "tiny-rewritten", "force": True},
                   headers=H, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    _until_all_serve(fleet, "5.0.0", time.monotonic())
    card_path = next(model_dir.glob("*.json"))
    card = json.loads(card_path.read_text())
    card["version"] = "5.1.0"
    card_path.write_text(json.dumps(card))
    r = httpx.post(r2.url + "/v1/models/reload", headers=H, timeout=120)
    assert r.status_code == 200, r.text
    took = _until_all_serve(fleet, "5.1.0", time.monotonic())
    assert max(took) <= CONVERGE_S
    for srv in fleet.replicas:
        _until(lambda s=srv: _served(s)["fleet"]["converged"] is True, "converged", 10)


def test_rolling_restart_and_kill_fail_no_request_and_rejoin_on_the_fleet_model(
    fleet: Fleet, pngs: list[bytes]
) -> None:
    r = httpx.post(fleet.replicas[2].url + "/v1/models/promote", json={"model": "tiny-v2"},
                   headers=H, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    _until_all_serve(fleet, "2.0.0", time.monotonic())  # the fleet's model is not the start model
    with Load(fleet.lb_url, pngs[1]) as load:
        time.sleep(1.0)
        # Rolling restart of r2: SIGTERM, wait for it to exit, start it again.
        before = load.ok
        assert fleet.replicas[1].stop(signal.SIGTERM) == 0
        restarted = fleet.start(1)
        served = _served(restarted)
        assert served["version"] == "2.0.0", served  # the fleet's model, not its start model 1.0.0
        assert served["served_because"] == "restored" and served["fleet"]["converged"] is True
        _until(lambda: restarted.metric("vge_request_duration_seconds_count") > 0,
               "HAProxy sends the restarted replica traffic again", 30)  # fmt: skip
        print(f"rolling restart of r2: {load.ok - before} requests answered meanwhile, "
              f"{len(load.failures)} failed")  # fmt: skip

        # kill -9 of r3 (its front end and engine die with it): the balancer retries elsewhere.
        before = load.ok
        victim = fleet.replicas[2]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        _until(lambda: _port_free(fleet.ports[2]), "r3's port is released", 30)
        time.sleep(1.0)  # under load without r3
        rejoined = fleet.start(2)
        assert _served(rejoined)["version"] == "2.0.0"
        _until(lambda: rejoined.metric("vge_request_duration_seconds_count") > 0,
               "HAProxy sends the rejoined replica traffic again", 30)  # fmt: skip
        print(f"kill -9 of r3: {load.ok - before} requests answered meanwhile, "
              f"{len(load.failures)} failed")  # fmt: skip
    log = (fleet.work / "haproxy.log").read_text(errors="replace").splitlines()
    odd = [ln for ln in log if "/v1/predict" in ln and " 200 " not in ln]
    assert load.ok > 50 and load.failures == [], (load.failures[:5], odd[-10:])


def test_a_job_accepted_by_one_replica_promoted_through_another_is_served_by_all(
    fleet: Fleet,
) -> None:
    r1, _, r3 = fleet.replicas
    r = httpx.post(r3.url + "/v1/training-jobs", json=TINY_JOB, headers=H, timeout=30)
    assert r.status_code in (200, 201, 202), r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 120
    while (job := httpx.get(f"{r1.url}/v1/training-jobs/{job_id}", headers=H).json())["state"] \
            not in ("succeeded", "failed", "cancelled", "interrupted"):  # fmt: skip
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["state"] == "succeeded", job
    r = httpx.post(r1.url + "/v1/models/promote", json={"job_id": job_id, "force": True},
                   headers=H, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    took = _until_all_serve(fleet, "3.0.0", time.monotonic())
    print(f"job of r3 promoted through r1: served {', '.join(f'{t:.2f}' for t in took)} s after")
    assert max(took) <= CONVERGE_S
    top = httpx.get(r3.url + "/v1/models/history", headers=H).json()["history"][0]
    assert (top["action"], top["replica"], top["model"]) == ("promote_job", "r1", "fleet-job")


def test_a_replica_that_cannot_load_the_fleet_model_keeps_serving_and_says_so(
    fleet: Fleet, pngs: list[bytes]
) -> None:
    """The fleet's model recorded with weights that are not on disk (as when a replica's volume
    lacks them): every replica keeps serving what it had, reports it, and follows again once
    the fleet's model is one it can load."""
    r1 = fleet.replicas[0]
    import psycopg

    served = _served(r1)
    with psycopg.connect(fleet.db_url, autocommit=True) as conn:
        bogus = "f" * 64
        conn.execute(
            "INSERT INTO model_history (id, at, replica, action, model, version, model_dir, "
            "weights_sha256) VALUES (%s, %s, 'operator', 'promote', 'gone', '9.9.9', %s, %s)",
            ("bogus0000000000a", time.time(), str(fleet.models_root / "gone"), bogus),
        )
        conn.execute("SELECT pg_notify('vge_fleet_model', 'bogus0000000000a')")
    for srv in fleet.replicas:
        _until(lambda s=srv: _served(s)["fleet"]["converged"] is False, "lag reported", 15)
        model = _served(srv)
        assert model["version"] == served["version"]  # kept what it had
        assert "does not exist" in model["fleet"]["error"]
        assert model["fleet"]["fleet_model"]["id"] == "bogus0000000000a"
        assert srv.metric("vge_fleet_converged") == 0
        assert _predict_version(srv.url, pngs[2]) == served["version"]
    r = httpx.post(r1.url + "/v1/models/promote", json={"model": "tiny-v2"}, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    _until_all_serve(fleet, "2.0.0", time.monotonic())
    for srv in fleet.replicas:
        _until(lambda s=srv: s.metric("vge_fleet_converged") == 1, "converged again", 10)


def test_the_review_queue_never_hands_one_item_to_two_replicas(
    fleet: Fleet, pngs: list[bytes]
) -> None:
    for png in pngs[:16]:
        r = httpx.post(fleet.lb_url + "/v1/predict?review=always",
                       files={"images": ("d.png", png, "image/png")}, headers=R, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["review_status"] in ("queued", "already_queued"), r.text
    handed: list[str] = []
    lock = threading.Lock()

    def reviewer(name: str, srv: Server) -> None:
        with httpx.Client(base_url=srv.url, headers=R, timeout=30) as c:
            while item := c.post("/v1/reviews/claim", json={"reviewer": name}).json()["review"]:
                with lock:
                    handed.append(item["id"])
                c.post(f"/v1/reviews/{item['id']}/skip", json={"reviewer": name}).raise_for_status()

    threads = [threading.Thread(target=reviewer, args=(n, s))
               for n, s in (("ann", fleet.replicas[0]), ("bob", fleet.replicas[1]))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(handed) == len(set(handed)) >= 16


def test_replicas_whose_database_connections_drop_reconnect_and_follow(fleet: Fleet) -> None:
    """PostgreSQL ends every connection of the fleet (as a database restart or failover does):
    each replica reconnects (its LISTEN connection within a second, its queries on their next
    use) and serves what is promoted next, within the same bound. Last in this file: the review
    store backs off after an outage (service.common.review_connection), which the test above would
    see."""
    import psycopg

    with psycopg.connect(fleet.db_url, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()) AS t"
        ).fetchone()
    assert ended is not None and ended[0] >= 3  # at least each replica's LISTEN connection
    r1 = fleet.replicas[0]
    version = _served(r1)["version"]
    target, want = ("tiny-v2", "2.0.0") if version != "2.0.0" else ("tiny", "1.0.0")
    copy = fleet.models_root / "tiny"
    if not copy.exists():
        copy_model(fleet.start_model, copy, "1.0.0")
    for _ in range(3):  # a connection the server ended answers 503 once, then reconnects
        r = httpx.post(
            r1.url + "/v1/models/promote", json={"model": target}, headers=H, timeout=120
        )
        if r.status_code != 503:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    took = _until_all_serve(fleet, want, time.monotonic())
    print(
        f"after PostgreSQL ended every connection: served {', '.join(f'{t:.2f}' for t in took)} s"
    )
    assert max(took) <= CONVERGE_S
