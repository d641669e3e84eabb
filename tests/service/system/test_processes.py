"""The process tree of ``vge serve``: front ends + engine, faults (kill -9), drain under keep-alive
load, and metrics that describe the whole server whichever front end answers ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import REPO, Server, children, engine_pid, start_server

ESTABLISHED, LISTEN = "01", "0A"  # TCP states as /proc/net/tcp writes them


def _wait_until(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _ready(server: Server) -> bool:
    try:
        return httpx.get(server.url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Server:
    """Two front ends; batches wait up to 2.5 s (so requests are caught queued in the engine)."""
    srv = start_server(
        tmp_path_factory.mktemp("tree"), tiny_model,
        workers=2, max_batch_size=64, max_queue_delay_ms=2500, batch_wait="always",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


def _predict(server: Server, png: bytes, **kw: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/predict", files=[("images", ("a.png", png))],
                      timeout=30, **kw)  # fmt: skip


def test_tree_has_two_front_ends_and_one_engine(tree: Server) -> None:
    roles = children(tree.proc.pid)
    assert len(roles["frontend"]) == 2 and len(roles["engine"]) == 1


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_the_engine_spawned_or_forked_serves_and_holds_no_listener(
    tmp_path: Path, tiny_model: Path, pngs: list[bytes], start: str
) -> None:
    """``engine_start``: spawned, the engine is a fresh interpreter (multiprocessing's spawn
    command line); forked, it is the supervisor's image. Either way it answers, names itself,
    and holds none of the port's listeners (a forked one closes those it inherited, or
    connections would queue on them after the drain closed them)."""
    srv = start_server(tmp_path, tiny_model, engine_start=start)
    try:
        engine = engine_pid(srv)
        assert engine is not None, children(srv.proc.pid)
        cmd = Path(f"/proc/{engine}/cmdline").read_bytes()
        assert (b"spawn_main" in cmd) == (start == "spawn"), cmd
        assert _predict(srv, pngs[0]).status_code == 200
        port = int(srv.url.rsplit(":", 1)[1])
        held = _connections_by_pid(port, [srv.proc.pid, engine], LISTEN)
        assert held[srv.proc.pid] >= 1 and held[engine] == 0, held  # the supervisor keeps its own
    finally:
        assert srv.stop() == 0, srv.log()


def test_metrics_describe_every_process(tree: Server, pngs: list[bytes]) -> None:
    """Each scrape may land on either front end; every one shows all requests of both."""
    from concurrent.futures import ThreadPoolExecutor

    before = tree.metric("vge_request_duration_seconds_count", endpoint="/v1/predict")
    with ThreadPoolExecutor(10) as pool:  # ten connections: the kernel spreads them
        codes = list(pool.map(lambda i: _predict(tree, pngs[i]).status_code, range(10)))
    assert codes == [200] * 10
    # a request is counted after its response is written: wait for the last one, then every
    # scrape (whichever front end answers it) must show the same total
    _wait_until(
        lambda: (
            tree.metric("vge_request_duration_seconds_count", endpoint="/v1/predict") == before + 10
        ),
        10,
        "all ten requests to be counted",
    )
    seen = {tree.metric("vge_request_duration_seconds_count", endpoint="/v1/predict")
            for _ in range(6)}  # fmt: skip
    assert seen == {before + 10}
    assert tree.metric("vge_predictions_total") >= 10
    assert tree.metric("vge_batch_size_count") >= 1  # written by the engine process
    assert tree.metric("vge_engine_ready") == 1


def test_engine_killed_requests_in_flight_get_503_then_it_is_back(
    tree: Server, pngs: list[bytes]
) -> None:
    results: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(_predict(tree, pngs[i])))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    _wait_until(lambda: tree.metric("vge_queue_depth") >= 4, 10, "requests queued in the engine")
    engine = children(tree.proc.pid)["engine"][0]
    t0 = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 5  # answered at once, not left hanging
    assert sorted(r.status_code for r in results) == [503] * 4
    assert all("restart" in r.json()["error"] and r.headers["retry-after"] for r in results)
    # not ready until the engine is back, then serving again
    r = httpx.get(tree.url + "/readyz", timeout=5)
    assert r.status_code == 503
    assert _predict(tree, pngs[0]).status_code == 503
    # every front end relinked (new connections are spread over both: ask several times)
    _wait_until(lambda: all(_ready(tree) for _ in range(8)), 60, "the engine to come back")
    assert children(tree.proc.pid)["engine"] != [engine]
    assert _predict(tree, pngs[0]).status_code == 200
    assert tree.metric("vge_process_restarts_total", role="engine") == 1


def test_front_end_killed_is_restarted_and_others_keep_serving(
    tree: Server, pngs: list[bytes]
) -> None:
    victim = children(tree.proc.pid)["frontend"][0]
    os.kill(victim, signal.SIGKILL)
    # answered meanwhile: by the other front end, or, if the kernel queues the connection on the
    # victim's listener (the supervisor keeps it open), by the victim's replacement
    assert _predict(tree, pngs[1]).status_code == 200
    _wait_until(
        lambda: (
            len(children(tree.proc.pid)["frontend"]) == 2
            and victim not in children(tree.proc.pid)["frontend"]
        ),
        30,
        "the front end to be replaced",
    )
    codes = Counter(_predict(tree, pngs[i]).status_code for i in range(6))
    assert codes == {200: 6}
    assert tree.metric("vge_process_restarts_total", role="frontend") == 1


def test_a_request_written_late_on_a_connection_accepted_before_the_drain_ended_is_answered(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes]
) -> None:
    """A client that connected while the front end still accepted, and writes its request only
    after the drain ended (a starved client process), gets an answer, not a reset: the stopping
    front end waits for requests on their way (FrontendServer.shutdown, at most REQUEST_WAIT_S).
    Fails with the fixed 0.2 s wait it replaced: the connection was closed as idle under the
    request. A connection that never sends anything holds the exit at most that long."""
    from service.frontend.server import REQUEST_WAIT_S

    drain_s = 0.3
    srv = start_server(tmp_path_factory.mktemp("late-request"), tiny_model, workers=1,
                       drain_s=drain_s, shutdown_grace_s=5)  # fmt: skip
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    boundary = "vge-late-request"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="images"; filename="a.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + pngs[0]
        + f"\r\n--{boundary}--\r\n".encode()
    )
    head = (
        f"POST /v1/predict HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
    ).encode()
    late = socket.create_connection((host, int(port)), timeout=10)
    silent = socket.create_connection((host, int(port)), timeout=10)
    try:
        assert _ready(srv)  # both connections accepted by the front end meanwhile
        srv.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        time.sleep(0.2 + drain_s + 0.7)  # the forwarding, the drain, and past the old 0.2 s
        late.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = late.recv(65536)
            assert chunk, f"connection closed without an answer after {answer!r}:\n{srv.log()}"
            answer += chunk
        status = answer.split(b" ", 2)[1]
        assert status in (b"200", b"503"), answer
        assert b"connection: close" in answer.lower(), answer
        assert srv.proc.wait(30) == 0, srv.log()
        # the silent connection held the exit, but no longer than the bound allows
        assert time.monotonic() - sigterm_at < 0.5 + drain_s + REQUEST_WAIT_S + 3
    finally:
        late.close()
        silent.close()
        srv.stop()


def test_sigterm_under_keep_alive_load_answers_every_request(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes]
) -> None:
    """Every request written to the server gets an HTTP answer (200, or 503 while draining);
    readiness turns false at once; responses during the drain say Connection: close; exit 0."""
    srv = start_server(tmp_path_factory.mktemp("drain-load"), tiny_model,
                       workers=2, drain_s=1.5, shutdown_grace_s=10)  # fmt: skip
    outcomes: Counter[str] = Counter()
    closes: list[tuple[float, bool]] = []  # (seconds after SIGTERM, Connection: close)
    readiness: list[int] = []
    sigterm_at: list[float] = []

    async def client(i: int, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:  # keep-alive pool
            while True:
                try:
                    r = await c.post("/v1/predict", files=[("images", ("a.png", pngs[i % 64]))])
                except httpx.ConnectError:  # the listener is gone: the request never reached it
                    outcomes["refused"] += 1
                    return
                except httpx.TransportError as exc:  # written but unanswered: the bug we forbid
                    outcomes[f"lost: {type(exc).__name__}"] += 1
                    return
                outcomes[str(r.status_code)] += 1
                if stop.is_set():
                    closes.append((time.monotonic() - sigterm_at[0],
                                   r.headers.get("connection") == "close"))  # fmt: skip

    async def main() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(client(i, stop)) for i in range(16)]
        await asyncio.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        sigterm_at.append(time.monotonic())
        stop.set()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=5) as probe:
            readiness.append((await probe.get(srv.url + "/readyz")).status_code)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    asyncio.run(main())
    assert srv.proc.wait(30) == 0, srv.log()
    lost = {k: v for k, v in outcomes.items() if k.startswith("lost")}
    assert not lost, (outcomes, srv.log())
    assert set(outcomes) <= {"200", "503", "refused"}, outcomes
    assert outcomes["200"] > 50
    assert readiness == [503]
    late = [closed for t, closed in closes if t > 0.5]  # the supervisor forwards within 0.2 s
    assert late and all(late)


def _connections_by_pid(port: int, pids: list[int], state: str = ESTABLISHED) -> dict[int, int]:
    """TCP sockets on the server's ``port`` in ``state`` (established connections by default)
    held by each of ``pids`` (/proc)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                inodes.add(fields[9])
    out = {}
    for pid in pids:
        held = 0
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                held += target.startswith("socket:[") and target[8:-1] in inodes
        out[pid] = held
    return out


def test_connections_spread_over_every_front_end(tree: Server, pngs: list[bytes]) -> None:
    """A burst of 32 keep-alive connections lands on both front ends (each has its own listener;
    with one shared listener the first front end to wake took nearly all of a burst)."""
    port = int(tree.url.rsplit(":", 1)[1])
    clients = [httpx.Client(base_url=tree.url, timeout=30) for _ in range(32)]
    try:
        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(lambda c: c.get("/healthz").status_code, clients))
        assert codes == [200] * 32
        held = _connections_by_pid(port, children(tree.proc.pid)["frontend"])
    finally:
        for c in clients:
            c.close()
    assert sum(held.values()) == 32, held
    # hashing 32 connections over 2 listeners: fewer than 4 on one has probability ~3e-6
    assert min(held.values()) >= 4, held


def test_a_port_in_use_is_refused_with_exit_code_2(tmp_path: Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
        proc = subprocess.run(
            [sys.executable, "-m", "service.cli.serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"vge serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def _arriving(server: Server) -> int:
    """The front ends' arrival counts (their arenas' headers), as the engine's batcher reads them."""
    from service.common.shm import shm_dir

    return sum(
        int.from_bytes(p.read_bytes()[:8], "little", signed=True)
        for p in shm_dir().glob(f"vge-{server.proc.pid}-*.arena")
    )


def test_an_uploading_or_refused_request_never_counts_as_arriving(
    server: Server, pngs: list[bytes]
) -> None:
    """What adaptive batching reads: a body still uploading is not counted (a slow client must not
    hold batches), and refused requests (400, 413, 422) leave the count where it was. The count
    while a whole request is decoded is tested in process (tests/service/frontend/test_middleware.py)."""
    boundary = "vgeboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="images"; filename="a.png"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        + pngs[0]
        + f"\r\n--{boundary}--\r\n".encode()
    )
    head = (
        f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
    ).encode()
    assert _arriving(server) == 0
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body[:40])  # headers and the start of the body
        time.sleep(0.5)
        assert _arriving(server) == 0
        s.sendall(body[40:])
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    _wait_until(lambda: _arriving(server) == 0, 10, "the count to be back at zero")
    with server.client() as c:
        refused = [
            c.post("/v1/predict", files=[("images", ("a.png", b"not an image"))]).status_code,
            c.post("/v1/predict", content=b"x", headers={"content-type": "text/plain"}).status_code,
            c.post(
                "/v1/predict", files=[("images", ("a.png", pngs[0]))], params={"top_k": 0}
            ).status_code,  # fmt: skip
            c.post("/v1/predict", content=b"x" * 500_000).status_code,
            c.post("/v2/models/tiny/infer", json={"inputs": []}).status_code,
        ]
        assert c.post("/v1/predict", files=[("images", ("a.png", pngs[1]))]).status_code == 200
    assert refused == [400, 400, 422, 413, 400]
    assert _arriving(server) == 0


def test_a_replaced_front_end_clears_the_arrival_count_its_predecessor_left(
    tree: Server, pngs: list[bytes]
) -> None:
    """A front end killed while it holds requests leaves them counted in its arena (the engine
    would then hold every batch for the full delay); its replacement starts from zero."""
    from service.common.shm import shm_dir

    old = children(tree.proc.pid)["frontend"]
    for pid in old:
        os.kill(pid, signal.SIGSTOP)  # frozen mid-flight, then its arena says 3 requests arriving
    for path in shm_dir().glob(f"vge-{tree.proc.pid}-*.arena"):
        with open(path, "r+b") as f:
            f.write((3).to_bytes(8, "little", signed=True))
    assert _arriving(tree) == 3 * len(old)
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    _wait_until(
        lambda: len(set(children(tree.proc.pid)["frontend"]) - set(old)) == 2,
        30,
        "both front ends to be replaced",
    )
    _wait_until(lambda: _ready(tree), 30, "readiness")
    _wait_until(lambda: _arriving(tree) == 0, 10, "the replacements to clear their arena counts")
    assert _predict(tree, pngs[0]).status_code == 200


def _serve(*args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, "-m", "service.cli.serve", "--host", "127.0.0.1", "--port", "0", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_grpc_port_in_use_is_refused_with_exit_code_2() -> None:
    """Checked before any process starts: the front ends failed to start gRPC in their start-up
    and were restarted twice a second for good (4,253 log lines in 45 s)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = _serve(VGE_GRPC_PORT=str(port))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"vge serve: error: cannot listen on 127.0.0.1:{port} for gRPC (VGE_GRPC_PORT): "
        "Address already in use"
    )


def test_grpc_on_the_http_port_is_refused() -> None:
    proc = _serve("--port", "8123", VGE_GRPC_PORT="8123")
    assert proc.returncode == 2, proc.stderr
    assert "gRPC needs its own port" in proc.stderr.strip().splitlines()[-1]


def test_a_model_that_does_not_load_is_exit_code_2(tmp_path: Path) -> None:
    """A configuration error like any other: the engine's start-up fails, nothing is served."""
    bad = tmp_path / "model"
    shutil.copytree(REPO / "models" / "zoo" / "lenet5-lle-vgn-mnist", bad)
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-16])  # truncated: its sha256 no longer matches
    proc = _serve("--model-dir", str(bad))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "vge serve: error: the engine failed to start (see the log above)"
    )


def test_a_front_end_that_keeps_failing_at_start_up_stops_the_server(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A front end that fails its start-up (an error status within FRONTEND_SETTLE_S of its start)
    five times in a row stops the server with status 1, instead of being restarted twice a second
    for good. Here another process takes the gRPC port while a front end restarts, so every
    restarted front end fails to serve gRPC. Front ends killed by a signal (kill -9 here; the
    OOM killer in life) are restarted however often it happens: a request that kills one must
    not stop the server."""
    from service.supervisor import MAX_FRONTEND_FAILURES

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_port = probe.getsockname()[1]
    srv = start_server(tmp_path, tiny_model, workers=1, grpc_port=grpc_port)
    killed: list[int] = []

    def kill_the_front_end() -> None:
        _wait_until(lambda: any(p not in killed for p in children(srv.proc.pid)["frontend"]),
                    30, "a front end")  # fmt: skip
        victim = next(p for p in children(srv.proc.pid)["frontend"] if p not in killed)
        os.kill(victim, signal.SIGKILL)  # at once: it has not settled
        killed.append(victim)

    thief: socket.socket | None = None
    try:
        for _ in range(MAX_FRONTEND_FAILURES + 1):
            kill_the_front_end()
        _wait_until(lambda: any(p not in killed for p in children(srv.proc.pid)["frontend"]),
                    30, "the front end killed six times to be restarted")  # fmt: skip
        assert srv.proc.poll() is None
        while thief is None:  # take the port between a front end's death and its replacement's
            kill_the_front_end()
            deadline = time.monotonic() + 2
            while thief is None and time.monotonic() < deadline:
                s = socket.socket()
                try:
                    s.bind(("127.0.0.1", grpc_port))
                    s.listen()
                    thief = s
                except OSError:
                    s.close()
                    time.sleep(0.005)
        assert srv.proc.wait(120) == 1, srv.log()
    finally:
        if thief is not None:
            thief.close()
        srv.stop()
    assert "front end 0 keeps failing at start-up" in srv.log()


def test_a_database_the_engine_cannot_open_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Found by review (2026-11-29): the engine built itself outside its error handling, so a
    jobs database it cannot open printed two tracebacks before the exit-2 line."""
    proc = _serve("--jobs-db-url", "sqlite:////proc/no-such-dir/jobs.sqlite3")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "engine failed: FileNotFoundError" in proc.stderr and "/proc/no-such-dir" in proc.stderr


def test_sigterm_while_the_server_starts_is_a_clean_exit(tmp_path: Path) -> None:
    """Found by review (2026-11-29): a SIGTERM in the first seconds (while binding imports torch
    and the app) killed the supervisor (-15) and left its work directory behind. The signals
    are held from the start now and end the start-up cleanly: 0, nothing left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli.serve", "--host", "127.0.0.1", "--port", "0",
         "--device", "cpu", "--model-dir", "lenet5-lle-vgn-mnist"],
        cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("vge-serve-*")):  # the work directory: the start has begun
        assert time.monotonic() < deadline and proc.poll() is None, "no work directory"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not list(tmp_path.glob("vge-serve-*")), "work directory left behind"


def test_what_a_killed_server_left_is_removed_by_the_next(tmp_path: Path) -> None:
    """SIGKILL of the supervisor leaves its arenas in /dev/shm and its work directory (no cleanup
    runs); on Kubernetes the /dev/shm emptyDir outlives the container, and filled up. A server
    starting removes those no live server holds (their locks, not their pids: a container's
    supervisor is pid 1 at every start, and pids of another namespace mean nothing here), and
    nothing just made or of an older version (a work directory without its lock file)."""
    from service.common.process import LOCK_NAME, hold, remove_stale
    from service.common.shm import ARENA_PATTERN
    from service.supervisor import WORKDIR_PATTERN

    old = time.time() - 3600
    left = tmp_path / f"vge-1-0-{'a' * 16}.arena"  # a killed pid-1 supervisor's
    live = tmp_path / f"vge-1-1-{'b' * 16}.arena"  # a live server's (the same pid, elsewhere)
    fresh = tmp_path / f"vge-7-0-{'d' * 16}.arena"  # just made, not locked yet
    other = tmp_path / f"vge-t-{'c' * 16}.arena"  # a test's arena: not the supervisor's
    for path in (left, live, fresh, other):
        path.write_bytes(b"\0" * 64)
    held = hold(live)
    dead_dir, live_dir, older_dir = (tmp_path / f"vge-serve-{n}" for n in ("x1", "y2", "z3"))
    for d in (dead_dir, live_dir, older_dir):
        (d / "metrics").mkdir(parents=True)
    for d in (dead_dir, live_dir):
        (d / LOCK_NAME).touch()
    held_dir = hold(live_dir / LOCK_NAME)
    for path in (left, live, other, dead_dir, live_dir, older_dir):
        os.utime(path, (old, old))
    try:
        assert remove_stale(tmp_path, ARENA_PATTERN) == [left]
        assert remove_stale(tmp_path, WORKDIR_PATTERN) == [dead_dir]
        assert live.exists() and fresh.exists() and other.exists() and not left.exists()
        assert live_dir.exists() and older_dir.exists() and not dead_dir.exists()
    finally:
        os.close(held)
        os.close(held_dir)
