"""Fixtures for the service tests: a tiny trained model and real uvicorn servers on loopback.

Servers run as subprocesses (``python -m service.cli.serve``) on a free port and are stopped by
their own PID. The model is trained once per session with ``models.training`` on the bundled MNIST
split (a few seconds), so the tests never depend on the shipped default model.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx
import numpy as np
import pytest
import torch
from torchvision.io import encode_png

from tests.service.inprocess import InProcessServer, sample_sum

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Forked:
    """A ``vge serve`` supervisor forked by this worker's zygote (:mod:`tests.service.zygote`),
    with the part of :class:`subprocess.Popen` the tests use: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``kill`` and ``returncode`` (the zygote reaps it and says its status)."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.exit_code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"vge serve (pid {self.pid})", timeout or 0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """This worker's zygote process and the exit codes it reports (a reader thread)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.service.zygote"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
        )  # fmt: skip
        self.lock = threading.Condition()
        self.pids: dict[int, int] = {}  # request number -> the pid forked for it
        self.requests = itertools.count()
        self.codes: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.lock:
                if "pid" in message:
                    self.pids[message["request"]] = message["pid"]
                else:
                    self.codes[message["exit"]] = message["code"]
                self.lock.notify_all()

    def fork(self, argv: Sequence[str], env: dict[str, str], log: Path) -> Forked:
        assert self.proc.stdin is not None and self.proc.poll() is None, "the zygote is gone"
        with self.lock:  # servers may be started from several threads (the fleet's replicas)
            number = next(self.requests)
            request = {"request": number, "argv": list(argv), "env": env, "cwd": str(REPO),
                       "log": str(log)}  # fmt: skip
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            if not self.lock.wait_for(lambda: number in self.pids, 60):
                raise RuntimeError("the zygote did not fork a server in 60 s")
            return Forked(self, self.pids.pop(number))

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.lock:
            self.lock.wait_for(lambda: pid in self.codes, timeout)
            return self.codes.get(pid)


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote | None:
    """This worker's zygote (started at its first server), or None with ``VGE_TEST_ZYGOTE=0``."""
    global _ZYGOTE
    if os.environ.get("VGE_TEST_ZYGOTE", "1") == "0":
        return None
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


@dataclass
class Server:
    """A running ``vge serve``: a subprocess, or a supervisor forked by the zygote."""

    proc: subprocess.Popen[bytes] | Forked
    url: str
    log_path: Path

    def client(self, **kw: object) -> httpx.Client:
        """A client whose idle connections expire in 2 s, before the server's keep-alive (5 s)
        closes them: a POST sent on a connection the server is closing at that moment is not
        retried by httpx ("Server disconnected without sending a response", seen once when a
        slow step left a client idle past the server's keep-alive)."""
        kw.setdefault("limits", httpx.Limits(keepalive_expiry=2.0))
        return httpx.Client(base_url=self.url, timeout=30, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` matching ``labels`` in /metrics."""
        return sample_sum(httpx.get(self.url + "/metrics", timeout=10).text, name, **labels)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def server_settings(workdir: Path, model_dir: Path | None) -> dict[str, object]:
    """The settings every test server starts with (a tree's or an in-process one's)."""
    return {
        "host": "127.0.0.1",
        "port": 0,
        "device": "cpu",
        "jobs_db_url": f"sqlite:///{workdir / 'jobs.sqlite3'}",
        "jobs_dir": workdir / "jobs",
        "models_root": workdir / "models",
        "data_root": workdir / "data",
        "review_dir": workdir / "reviews",
        "torch_threads": 1,
        "decode_workers": 2,
        "log_level": "warning",
        # Stopping a server waits out VGE_DRAIN_S (5 s by default, for load balancers) with
        # no balancer to wait for: 0 unless a test of the drain sets its own.
        "drain_s": 0,
        "model_dir": model_dir,
    }


def start_in_process(workdir: Path, model_dir: Path | None, **settings: object) -> InProcessServer:
    """An in-process server (:mod:`tests.service.inprocess`) with :func:`start_server`'s
    defaults and ``settings``, ready: for tests of what requests do, not of processes."""
    from service.common.settings import Settings

    workdir.mkdir(parents=True, exist_ok=True)
    values = {**server_settings(workdir, model_dir), **settings}
    fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=workdir)
    os.close(fd)
    # Only these values: a tree's environment has no VGE_* but its own (start_server), and
    # Settings would read the ones this process has for every field not given
    own = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    with mock.patch.dict(os.environ, own, clear=True):
        config = Settings(**{k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]
    return InProcessServer(config, Path(name)).start()


def start_server(
    workdir: Path, model_dir: Path | None, *, args: Sequence[str] = (), **settings: object
) -> Server:
    """Start ``vge serve [args]`` with ``settings`` (as VGE_* env vars) and wait until it is ready.

    Forked by this worker's zygote (:mod:`tests.service.zygote`: the server's imports done once),
    or run as ``python -m service.cli.serve`` with ``VGE_TEST_ZYGOTE=0``.

    It listens on a port the kernel picks (``VGE_PORT=0``), read from its "listening on" line, so
    no other socket can take the port between choosing it and binding it.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    env["PYTHONUNBUFFERED"] = "1"
    values = {**server_settings(workdir, model_dir), **settings}
    env.update({f"VGE_{k.upper()}": str(v) for k, v in values.items() if v is not None})
    workdir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=workdir)
    os.close(fd)
    log_path = Path(name)
    zygote = _zygote()
    proc: subprocess.Popen[bytes] | Forked
    if zygote is not None:
        # The engine forked from the zygote's imports (~2 s less per server than a fresh
        # interpreter); the trees started as `python -m service.cli.serve` spawn it, as the
        # default does, and tests/service/system/test_processes.py checks both.
        env.setdefault("VGE_ENGINE_START", "fork")
        proc = zygote.fork(args, env, log_path)
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli.serve", *args],
            cwd=REPO,
            env=env,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
        )
    server = Server(proc, "", log_path)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        if not server.url and (m := re.search(r"listening on (http://\S+)\n", server.log())):
            server.url = m.group(1)
        try:
            if server.url and httpx.get(server.url + "/readyz", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not ready in 90 s:\n{server.log()}")


@pytest.fixture(scope="session")
def mnist() -> tuple[np.ndarray, np.ndarray]:
    d = np.load(REPO / "models" / "data" / "mnist-8k.npz")
    return d["images"], d["labels"]


@pytest.fixture(scope="session")
def pngs(mnist: tuple[np.ndarray, np.ndarray]) -> list[bytes]:
    """64 PNG-encoded MNIST test digits."""
    images = mnist[0][-64:]
    return [encode_png(torch.from_numpy(im).unsqueeze(0)).numpy().tobytes() for im in images]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LeNet-5 LLE-VGN (M=3) trained for one epoch on 512 bundled MNIST images.

    Its card's OOD suite has 25 images a group (``ood_suite_per_group``), and the training jobs
    of a server that serves it inherit that (``served_config``): each job's process reads 225
    suite images instead of 4,500 (~4 s of CPU less a job)."""
    from models.training import TrainConfig, train

    out = tmp_path_factory.mktemp("model") / "tiny"
    config = TrainConfig(
        name="tiny", version="1.0.0", epochs=1, max_train_samples=512, members=3,
        ensemble="lle", vgn=True, batch_size=64, device="cpu", ood_suite_per_group=25,
    )  # fmt: skip
    return Path(train(config, out))


def copy_model(src: Path, dst: Path, version: str) -> Path:
    """A copy of ``src`` with another card version (weights and their sha256 unchanged)."""
    shutil.copytree(src, dst)
    card_path = next(dst.glob("*.json"))
    card = json.loads(card_path.read_text())
    card["version"] = version
    card_path.write_text(json.dumps(card))
    return dst


@pytest.fixture(scope="session")
def library(tiny_model: Path) -> Callable[..., list[dict[str, object]]]:
    """The library's own result for decoded images, one at a time (no batching)."""
    from torchvision.io import decode_image

    from models.predictor import Predictor

    predictor = Predictor.from_dir(tiny_model, device="cpu")

    def run(png: bytes, **opts: object) -> dict[str, object]:
        img = decode_image(torch.frombuffer(bytearray(png), dtype=torch.uint8))
        out = predictor.forward(predictor.prepare(img).unsqueeze(0))
        return predictor.score(out, **opts)[0]  # type: ignore[arg-type]

    return run  # type: ignore[return-value]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Server]:
    """The main test server: batching on (max batch 32, 20 ms, two batches in flight), API key,
    small payload limits. Every end-to-end test on it runs through two compute threads; the
    servers of the lifecycle and process tests keep the default of one.

    Serves ``models_root/tiny-v1`` (version 1.0.0); ``tiny-v2`` (2.0.0) is there for promotion.
    """
    work = tmp_path_factory.mktemp("main")
    v1 = copy_model(tiny_model, work / "models" / "tiny-v1", "1.0.0")
    copy_model(tiny_model, work / "models" / "tiny-v2", "2.0.0")
    srv = start_server(
        work, v1,
        max_batch_size=32, max_queue_delay_ms=20, max_queue_length=512, batches_in_flight=2,
        api_key=API_KEY,
        max_images=16, max_image_bytes=20_000, max_payload_bytes=400_000,
        max_image_pixels=512 * 512, max_score_bytes=200_000,
    )  # fmt: skip
    yield srv
    srv.stop()


def approx_result(got: dict[str, object], want: dict[str, object]) -> None:
    """Service result equals the library's (floats to 1e-5); the library's images are MNIST
    digits, which prepare=mnist finds ("input_check": "ok") and serves as sent."""
    got = dict(got)
    assert got.pop("input_check") == "ok"
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key == "probabilities":
            assert [p["label"] for p in got[key]] == [p["label"] for p in value]  # type: ignore[index,union-attr]
            for g, w in zip(got[key], value, strict=True):  # type: ignore[arg-type]
                assert g["probability"] == pytest.approx(w["probability"], abs=1e-5)
        elif isinstance(value, float):
            # The engine runs the forward pass with other thread counts than this process: float32
            # reductions in another order. SNR divides by small spreads, so compare relatively too.
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        else:
            assert got[key] == value, key


def children(pid: int) -> dict[str, list[int]]:
    """A supervisor's children by role (``engine``, ``frontend``), by the names they give
    themselves, spawned or forked alike (:func:`benchmarks.serving.tree_roles`)."""
    from benchmarks.serving import tree_roles

    roles: dict[str, list[int]] = {"engine": [], "frontend": []}
    for role, child in tree_roles(pid, by_command_line=False):
        roles["engine" if role == "engine" else "frontend"].append(child)
    return roles


def engine_pid(srv: Server) -> int | None:
    """The engine among the supervisor's children, or None."""
    engines = children(srv.proc.pid)["engine"]
    return engines[0] if engines else None


def until(cond: Callable[[], bool], what: str, srv: Server, timeout: float = 120) -> None:
    """Poll ``cond`` (connection errors count as not yet) until it holds; else fail with the log."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{srv.log()}"
        time.sleep(0.2)


def kill_engine(srv: Server) -> dict[str, object]:
    """``kill -9`` the engine, wait for the supervisor's new one to be ready with a restored
    model; that model's ``/v1/models`` entry."""
    engine = engine_pid(srv)
    assert engine is not None, f"no engine process under {srv.proc.pid}:\n{srv.log()}"
    os.kill(engine, signal.SIGKILL)
    until(lambda: engine_pid(srv) not in (None, engine), "a new engine", srv)

    def served() -> dict[str, object]:
        return httpx.get(srv.url + "/v1/models", timeout=10).json()["models"][0]

    until(
        lambda: (
            httpx.get(srv.url + "/readyz", timeout=5).status_code == 200
            and served()["served_because"] == "restored"
        ),
        "the new engine's model",
        srv,
    )
    assert srv.metric("vge_process_restarts_total", role="engine") >= 1
    return served()
