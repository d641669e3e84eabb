"""Side-by-side serving benchmark: vge serve vs LitServe (defaults and scaled out) vs PyTriton.

The same model (the shipped default) and the same real MNIST PNG answered by every server; one
load client for all: ``wrk`` (keep-alive, closed loop: one request in flight per connection),
loopback only, each run bounded in time. Levels 1/16/64/256 connections with one image per
request, and 64-image requests; targets and levels interleaved round by round, medians and the
spread (min–max) over rounds reported. Plus the in-process ceiling: decode + prepare + forward +
score of 64-image batches in one process, no HTTP.

    python -m benchmarks.serving                      # all targets, 3 rounds, 4 s per run
    python -m benchmarks.serving --targets vge litserve --rounds 1 --duration 2
    python -m benchmarks.serving --targets vge:lenet5-lle-vgn-mnist pytriton:lenet5-lle-vgn-mnist
                                      # <server>:<model>: any zoo model behind any server
    python -m benchmarks.serving --targets vge vge-overlap   # VGE_BATCHES_IN_FLIGHT 1 vs 2
    python -m benchmarks.serving --targets vge vge@MAX_BATCH_SIZE=1024  # any VGE_ settings
    python -m benchmarks.serving --targets vge:lenet5-lle-vgn-mnist@DEVICE=cuda:1

Peers are benchmark-only (never runtime dependencies): LitServe from PyPI in this venv
(``pip install litserve``); PyTriton 0.7 in its own Python 3.11 venv with ``numpy<2``, given by
``--pytriton-python`` (skipped when absent). Needs ``wrk`` (Debian package). Results are printed
and written to docs/benchmarks.md (section "Serving side by side").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
from torchvision.io import encode_png

REPO = Path(__file__).resolve().parents[1]
BOUNDARY = "vgebenchboundary"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pngs(n: int) -> list[bytes]:
    images = np.load(REPO / "models" / "data" / "mnist-8k.npz")["images"][-n:]
    return [encode_png(torch.from_numpy(im).unsqueeze(0)).numpy().tobytes() for im in images]


def multipart(pngs: list[bytes]) -> bytes:
    parts = [
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="images"; '
            f'filename="{i}.png"\r\nContent-Type: image/png\r\n\r\n'
        ).encode()
        + png
        + b"\r\n"
        for i, png in enumerate(pngs)
    ]
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def pytriton_body(pngs: list[bytes]) -> tuple[bytes, int]:
    """A V2 infer request with the PNGs as a BYTES tensor (binary extension); (body, header len)."""
    import json

    raw = b"".join(len(p).to_bytes(4, "little") + p for p in pngs)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "images",
                    "shape": [len(pngs), 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "result", "parameters": {"binary_data": False}}],
        }
    ).encode()
    return head + raw, len(head)


@dataclass
class Target:
    name: str
    cmd: list[str]
    env: dict[str, str]
    path: str
    ready_path: str
    body_kind: str = "multipart"  # or "pytriton"
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    extra_ports: list[int] = field(default_factory=list)
    log_path: Path | None = None  # the server's stdout and stderr
    cwd: Path = REPO  # the source tree it runs (benchmarks.ab points one at another build)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [a.format(port=self.port, p1=self.extra_ports[0] if self.extra_ports else 0,
                      p2=self.extra_ports[1] if len(self.extra_ports) > 1 else 0)
             for a in self.cmd],
            cwd=self.cwd, env=self.env, stdout=self.log_path.open("ab") if self.log_path else subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready in 180 s")

    def stop(self) -> None:
        """SIGTERM to the server's process group, then wait until every process of the group
        has exited, not only its leader: PyTriton's ``tritonserver`` and its Python backend
        stub outlive their parent by ~10 s of graceful shutdown, which the next server measured
        (vge's first level of the next round) used to share the 2 cores with."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # its own process group, started above (start_new_session)
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 30
        while group_alive(pgid):
            if time.monotonic() > deadline:
                os.killpg(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 10
            time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, which an init that does
    not reap may keep, do not count): read from ``/proc/<pid>/stat``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited while being read
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


def targets(
    names: list[str],
    pytriton_python: str | None,
    workdir: Path,
    vge_device: str = "cpu",
    litserve_scale: tuple[int, int] = (2, 2),
) -> list[Target]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    out: list[Target] = []
    for name in names:
        port = _free_port()
        # "<server>:<model>" puts a zoo model (or a model directory) behind that server, e.g.
        # "pytriton:lenet5-lle-vgn-mnist"; without it every server serves the shipped default.
        # "vge[:<model>]@KEY=VALUE,...": vge with VGE_ settings (values may hold ':', e.g. cuda:1)
        spec, _, overrides = name.partition("@")
        server, _, model = spec.partition(":")
        if name == "vge-lenet5":  # the paper's LeNet-5, for the model's share of the cost
            server, model = "vge", "lenet5-lle-vgn-mnist"
        model_env = {"VGE_MODEL_DIR": model} if model else {}
        if server == "vge-overlap":  # vge with two batches computing at once
            server, model_env = "vge", {**model_env, "VGE_BATCHES_IN_FLIGHT": "2"}
        if overrides:
            if server != "vge":
                raise SystemExit(f"target {name!r}: only vge takes @KEY=VALUE settings")
            for pair in filter(None, overrides.split(",")):
                key, eq, value = pair.partition("=")
                if not eq:
                    raise SystemExit(f"target {name!r}: settings are KEY=VALUE, got {pair!r}")
                model_env["VGE_" + key.upper().removeprefix("VGE_")] = value
        if server == "vge":
            env = {**base, "VGE_HOST": "127.0.0.1", "VGE_PORT": str(port), "VGE_DEVICE": vge_device,
                   "VGE_LOG_LEVEL": "warning", "VGE_JOBS_DB_URL": f"sqlite:///{workdir}/jobs.db",
                   "VGE_JOBS_DIR": str(workdir / "jobs"), "VGE_MAX_QUEUE_LENGTH": "8192",
                   **model_env}  # fmt: skip
            t = Target(name, [sys.executable, "-m", "service.cli.serve"], env, "/v1/predict",
                       "/readyz")  # fmt: skip
        elif server in ("litserve", "litserve-scaled"):
            w, a = litserve_scale
            args = (
                ["--workers", str(w), "--api-servers", str(a)]
                if server == "litserve-scaled"
                else []
            )
            t = Target(name, [sys.executable, "-m", "benchmarks.peers.litserve_app", "--port",
                              "{port}", *args], {**base, **model_env}, "/v1/predict",
                       "/health")  # fmt: skip
        elif server == "pytriton":
            if not pytriton_python or not Path(pytriton_python).exists():
                print(f"skipping pytriton: no interpreter at {pytriton_python}", file=sys.stderr)
                continue
            env = {**base, "PYTHONPATH": str(REPO), **model_env}
            t = Target(name, [pytriton_python, "-m", "benchmarks.peers.pytriton_app", "--http-port",
                              "{port}", "--grpc-port", "{p1}", "--metrics-port", "{p2}"], env,
                       "/v2/models/vge/infer", "/v2/models/vge/ready", body_kind="pytriton")  # fmt: skip
            t.extra_ports = [_free_port(), _free_port()]
        else:
            raise SystemExit(f"unknown target {name!r}")
        t.port = port
        t.log_path = workdir / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".log")
        out.append(t)
    return out


WRK_LUA = """
local f = io.open("{body}", "rb"); local body = f:read("*all"); f:close()
wrk.method = "POST"
wrk.body = body
wrk.headers["Content-Type"] = "{ctype}"
{extra}
"""


#: wrk's threads (at most one per connection); ``--wrk-threads``.
WRK_THREADS = 2


def wrk(url: str, body_file: Path, ctype: str, extra: str, conc: int, duration: float) -> dict:
    """One wrk run posting ``body_file`` (content type ``ctype``) to ``url``."""
    lua = body_file.with_suffix(".lua")
    lua.write_text(WRK_LUA.format(body=body_file, ctype=ctype, extra=extra))
    return run_lua(url, lua, conc, duration)


def run_lua(url: str, lua: Path, conc: int, duration: float) -> dict:
    """One wrk run driven by the Lua script ``lua``: req/s, p50/p99 ms and the error count."""
    threads = max(1, min(conc, WRK_THREADS))
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conc}", f"-d{max(1, round(duration))}s", "--latency", "--timeout", "30s",
         "-s", str(lua), url],
        capture_output=True, text=True, timeout=duration + 60,
    ).stdout  # fmt: skip
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if found is None:
        raise RuntimeError(f"wrk gave no result for {url}:\n{out}")
    rps = float(found.group(1))

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)", out, re.M)
        if not m:
            return float("nan")
        v, unit = float(m.group(1)), m.group(2)
        return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v

    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    n_err = int(bad.group(1)) if bad else 0
    if errors:
        n_err += sum(int(g) for g in errors.groups())
    return {"rps": rps, "p50": pct("50"), "p99": pct("99"), "errors": n_err,
            "non2xx": int(bad.group(1)) if bad else 0,
            "socket": errors.group(0) if errors else ""}  # fmt: skip


def metric(url: str, name: str) -> float:
    """``name`` on the server's ``/metrics``, summed over its label sets."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


def batch_totals(url: str) -> tuple[float, float]:
    """The server's ``vge_batch_size`` histogram so far: (images, forward passes)."""
    return metric(url, "vge_batch_size_sum"), metric(url, "vge_batch_size_count")


def mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Images per forward pass between two :func:`batch_totals` readings (0 without a pass)."""
    passes = after[1] - before[1]
    return (after[0] - before[0]) / passes if passes else 0.0


def connection_spread(t: Target, conc: int, into: dict[str, dict[str, float]]) -> None:
    """Established connections per process of ``t`` (``ss``), sampled during a run at ``conc``
    connections: whether the kernel spreads them over every front end."""
    if shutil.which("ss") is None:
        print("  (no `ss` here: connections per front end not sampled)", flush=True)
        return
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"( sport = :{t.port} )"],
                         capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    counts: dict[str, float] = {}
    for pid in re.findall(r"pid=(\d+)", out):
        counts[pid] = counts.get(pid, 0) + 1
    into.setdefault("connections", {}).update({f"c={conc} pid {k}": v for k, v in counts.items()})
    print(f"  {t.name} connections per process at c={conc}: "
          + "/".join(str(int(v)) for v in sorted(counts.values(), reverse=True)), flush=True)  # fmt: skip


def diagnose(t: Target) -> None:
    """After a target answered with errors: its HTTP status counts and restarts (vge's /metrics)
    and the tail of its log, so a failed run says why."""
    try:
        text = httpx.get(t.url + "/metrics", timeout=5).text
        counts: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r'(vge_request_duration_seconds_count|vge_process_restarts_total|vge_rejections_total)\{(.*)\} ([\d.e+]+)$', line)  # fmt: skip
            if m and float(m.group(3)):
                key = m.group(1) + "{" + ",".join(
                    kv for kv in m.group(2).split(",") if kv.split("=")[0] in ("status", "role", "reason", "endpoint")
                ) + "}"  # fmt: skip
                counts[key] = counts.get(key, 0) + float(m.group(3))
        for key, value in sorted(counts.items()):
            print(f"  {t.name} {key} {value:,.0f}", flush=True)
    except httpx.HTTPError as exc:
        print(f"  {t.name}: /metrics unavailable ({exc})", flush=True)
    if t.log_path and t.log_path.exists():
        tail = t.log_path.read_text(errors="replace").splitlines()[-25:]
        print(
            f"  {t.name} log (last {len(tail)} lines):",
            *("    " + x for x in tail),
            sep="\n",
            flush=True,
        )


def summarise(runs: list[dict]) -> tuple[float, str, float, float, int]:
    """Rounds of one level -> (median req/s, "median (min–max)" cell, median p50, median p99,
    total errors): the columns both serving tables report."""
    rps = [x["rps"] for x in runs]
    med = statistics.median(rps)
    return (
        med,
        f"{med:,.0f} ({min(rps):,.0f}–{max(rps):,.0f})",
        statistics.median(x["p50"] for x in runs),
        statistics.median(x["p99"] for x in runs),
        sum(x["errors"] for x in runs),
    )


def in_process_ceiling(
    pngs: list[bytes], seconds: float = 3.0, model: str | None = None, device: str = "cpu"
) -> float:
    """images/s for decode + conform + forward + score + JSON records of 64-image batches in one
    process (no HTTP, no IPC): the same library calls as the served path, at its best. ``model``:
    a zoo name or directory (default: the shipped default); ``device``: where the model runs."""
    from torchvision.io import ImageReadMode, decode_image

    from benchmarks.peers import model_dir
    from models.predictor import Predictor

    torch.set_num_threads(1)
    predictor = Predictor.from_dir(model_dir(model), device=device)
    batch = pngs[:64]
    options = predictor.options(top_k=5)
    names = list(predictor.card.class_names)

    def once() -> None:
        x = torch.stack([
            predictor.conform(decode_image(torch.frombuffer(bytearray(b), dtype=torch.uint8),
                                           mode=ImageReadMode.UNCHANGED)) for b in batch
        ])  # fmt: skip
        predictor.score_columns(predictor.run([x]), options).records(names, options.abstain_k)

    once()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        once()
        n += len(batch)
    return n / (time.perf_counter() - t0)


def pss_mb(pid: int) -> float:
    """Proportional set size of a process tree (MiB), from /proc/<pid>/smaps_rollup."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += int(re.search(r"^Pss:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
            pids += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


def tree_roles(pid: int, by_command_line: bool = True) -> list[tuple[str, int]]:
    """``vge serve``'s children as ``(role, pid)``: ``engine`` or ``front end``, in /proc's order,
    by the names they give themselves (:data:`service.common.process.ENGINE_NAME`,
    :data:`~service.common.process.FRONTEND_NAME`). A child without one is, with
    ``by_command_line`` (a build before the names, as ``--repo`` may serve), told by its command
    line (the engine spawned, front ends forked; multiprocessing's resource tracker left out),
    else left out (this build's child between its start and naming itself)."""
    from service.common.process import ENGINE_NAME, FRONTEND_NAME

    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            comm = Path(f"/proc/{child}/comm").read_text().strip()
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:  # exited meanwhile
            continue
        if comm in (ENGINE_NAME, FRONTEND_NAME):
            out.append(("engine" if comm == ENGINE_NAME else "front end", int(child)))
        elif by_command_line and b"resource_tracker" not in cmd:
            out.append(("engine" if b"spawn_main" in cmd else "front end", int(child)))
    return out


def pss_by_process(pid: int) -> dict[str, float]:
    """PSS and RSS (MiB) of a process and each of its children, by command line (vge's tree)."""
    out: dict[str, float] = {}

    def one(p: int) -> tuple[float, float]:
        text = Path(f"/proc/{p}/smaps_rollup").read_text()
        pss = int(re.search(r"^Pss:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
        rss = int(re.search(r"^Rss:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
        return pss / 1024, rss / 1024

    out["supervisor PSS"], out["supervisor RSS"] = one(pid)
    n = 0
    for role, child in tree_roles(pid):
        if role == "front end":
            role, n = f"front end {n}", n + 1
        out[f"{role} PSS"], out[f"{role} RSS"] = one(child)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving")
    parser.add_argument("--targets", nargs="+",
                        default=["vge", "vge-lenet5", "litserve", "litserve-scaled",
                                 "pytriton"])  # fmt: skip
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--batch-levels", nargs="+", type=int, default=[4, 16],
                        help="connections for 64-image requests")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--pytriton-python", default="/tmp/pytriton-venv/bin/python")
    parser.add_argument("--vge-device", default="cpu", help="VGE_DEVICE for the vge target")
    parser.add_argument("--litserve-scale", nargs=2, type=int, default=[2, 2],
                        metavar=("WORKERS", "API_SERVERS"),
                        help="litserve-scaled: workers per device and API servers")  # fmt: skip
    parser.add_argument("--wrk-threads", type=int, default=2, help="load-client threads")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--model", default=None,
                        help="zoo model (or directory) behind every target without its own "
                             "':<model>', and for the in-process ceiling; default: the shipped "
                             "default")  # fmt: skip
    parser.add_argument("--section", default="Serving side by side",
                        help="docs/benchmarks.md section to (re)write")  # fmt: skip
    args = parser.parse_args(argv)
    if args.model:
        args.targets = [t if ":" in t or t == "vge-lenet5" else f"{t}:{args.model}"
                        for t in args.targets]  # fmt: skip
    global WRK_THREADS
    WRK_THREADS = args.wrk_threads
    if shutil.which("wrk") is None:
        print("benchmarks.serving: error: needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="vge-bench-"))
    pngs = _pngs(64)
    bodies = {}
    for kind in ("multipart", "pytriton"):
        for n in (1, 64):
            path = workdir / f"{kind}-{n}.bin"
            if kind == "multipart":
                path.write_bytes(multipart(pngs[:n]))
                bodies[(kind, n)] = (path, f"multipart/form-data; boundary={BOUNDARY}", "")
            else:
                body, head_len = pytriton_body(pngs[:n])
                path.write_bytes(body)
                extra = f'wrk.headers["Inference-Header-Content-Length"] = "{head_len}"'
                bodies[(kind, n)] = (path, "application/octet-stream", extra)

    ceiling = in_process_ceiling(pngs, model=args.model, device=args.vge_device)
    print(f"in-process ceiling (64-image batches): {ceiling:,.0f} images/s", flush=True)
    runs = targets(args.targets, args.pytriton_python, workdir, args.vge_device,
                   tuple(args.litserve_scale))  # fmt: skip
    results: dict[tuple[str, int, int], list[dict]] = {}
    memory: dict[str, float] = {}
    breakdown: dict[str, dict[str, float]] = {}
    batches: dict[tuple[str, int, int], list[float]] = {}
    try:
        # Rounds interleave the targets; within a round one server runs at a time (peers that
        # poll while idle would otherwise take CPU from the one being measured on 2 cores).
        for r in range(args.rounds):
            for t in runs:
                t.start()
                diagnosed = False
                try:
                    memory.setdefault(t.name, pss_mb(t.proc.pid))  # type: ignore[union-attr]
                    if t.name.partition(":")[0] == "vge" and "vge-processes" not in breakdown:
                        breakdown["vge-processes"] = pss_by_process(t.proc.pid)  # type: ignore[union-attr]
                    for images, levels in ((1, args.levels), (64, args.batch_levels)):
                        body, ctype, extra = bodies[(t.body_kind, images)]
                        wrk(t.url + t.path, body, ctype, extra, 4, 1)  # warm-up, not recorded
                        for conc in levels:
                            spread = None
                            if (
                                t.name.partition(":")[0] == "vge"
                                and images == 1
                                and conc == max(levels)
                            ):
                                spread = threading.Timer(
                                    args.duration / 2, connection_spread, (t, conc, breakdown)
                                )
                                spread.start()  # fmt: skip
                            is_vge = t.name.partition(":")[0].startswith("vge")
                            before = batch_totals(t.url) if is_vge else (0.0, 0.0)
                            res = wrk(t.url + t.path, body, ctype, extra, conc, args.duration)
                            if spread is not None:
                                spread.join()
                            batch = ""
                            if is_vge:  # images per forward pass during this level
                                mean = mean_batch(before, batch_totals(t.url))
                                batches.setdefault((t.name, images, conc), []).append(mean)
                                batch = f", mean batch {mean:.1f}"
                            results.setdefault((t.name, images, conc), []).append(res)
                            print(f"round {r + 1} {t.name:16s} images={images:2d} c={conc:3d} "
                                  f"{res['rps']:8.1f} req/s p50 {res['p50']:.1f} ms "
                                  f"p99 {res['p99']:.1f} ms errors {res['errors']} "
                                  f"(non-2xx {res['non2xx']}; {res['socket'] or 'no socket errors'})"
                                  f"{batch}", flush=True)  # fmt: skip
                            if res["errors"] and not diagnosed:
                                diagnose(t)
                                diagnosed = True
                finally:
                    t.stop()
    finally:
        for t in runs:
            t.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    lines = [
        f"In-process ceiling (decode + prepare + forward + score, 64-image batches, one process, "
        f"no HTTP): **{ceiling:,.0f} images/s**.",
        "",
        "Memory after start-up (PSS of the whole process tree): "
        + ", ".join(f"{k} {v:,.0f} MiB" for k, v in memory.items())
        + ".",
        "",
        *(
            [
                "vge by process (MiB): "
                + ", ".join(f"{k} {v:,.0f}" for k, v in breakdown["vge-processes"].items())
                + ". Front ends are forked after torch is imported: their RSS counts pages they "
                "share with the supervisor, their PSS charges each only its share.",
                "",
            ]
            if "vge-processes" in breakdown
            else []
        ),
        *(
            [
                "vge connections per front end, sampled with `ss` mid-run at the highest "
                "single-image level: "
                + "/".join(
                    str(int(v)) for v in sorted(breakdown["connections"].values(), reverse=True)
                )
                + (" (several rounds pooled)" if args.rounds > 1 else "")
                + ".",
                "",
            ]
            if "connections" in breakdown
            else []
        ),
        *(
            [
                "vge's mean batch (images per forward pass, from its `vge_batch_size` histogram), "
                "median over rounds: "
                + ", ".join(
                    f"{name} {images}×c={conc}: {statistics.median(v):.1f}"
                    for (name, images, conc), v in batches.items()
                )
                + ".",
                "",
            ]
            if batches
            else []
        ),
        "| images/request | connections | server | req/s median (min–max) | images/s | p50 ms | "
        "p99 ms | errors |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (name, images, conc), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        med, cell, p50, p99, errs = summarise(rs)
        lines.append(
            f"| {images} | {conc} | {name} | {cell} | {med * images:,.0f} | {p50:.1f} | "
            f"{p99:.1f} | {errs} |"
        )
    table = "\n".join(lines)
    print(table)
    failed = sorted({name for (name, _, _), rs in results.items() if any(x["errors"] for x in rs)})
    if failed:
        # A target that answered errors measured how fast it fails, not how fast it serves: no
        # section is written and the run fails, so no ratio is read off it (benchmarks/gpu.sh).
        print(f"FAILED: {', '.join(failed)} answered errors (see the rounds above); nothing "
              "written", file=sys.stderr)  # fmt: skip
        return 1
    if not args.no_write:
        from benchmarks.report import write_section

        write_section(
            args.section + ("" if args.vge_device == "cpu" else f" (vge on {args.vge_device})"),
            f"python -m benchmarks.serving {' '.join(argv or sys.argv[1:])}".strip(),
            table,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
