"""Loopback load test for ``vge serve``: dynamic batching on vs off.

Starts the server itself as a subprocess (on 127.0.0.1, a free port), drives it with closed-loop
clients at each concurrency level for a bounded time, and reports throughput and p50/p95/p99
latency, plus the mean batch size read from ``vge_batch_size``. Batching on uses
``--max-batch`` / ``--delay-ms``; off is ``max_batch_size=1``. Results are printed and appended to
``docs/benchmarks.md`` (its own section, replaced on rerun) with the machine, date and command.

    python -m benchmarks.load                                   # shipped default model
    python -m benchmarks.load --model-dir path/to/model --concurrency 1 4 16 64 --duration 5

Bounded by design: loopback only, ``--duration`` seconds and at most ``--max-requests`` requests
per level.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from torchvision.io import encode_png

from benchmarks.serving import metric

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pngs(n: int = 256) -> list[bytes]:
    images = np.load(REPO / "models" / "data" / "mnist-8k.npz")["images"][-n:]
    return [encode_png(torch.from_numpy(im).unsqueeze(0)).numpy().tobytes() for im in images]


class ServerProcess:
    """``vge serve`` in a subprocess, stopped by its own PID."""

    def __init__(self, model_dir: Path | None, device: str, max_batch: int, delay_ms: float,
                 threads: int) -> None:  # fmt: skip
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
        env.update(
            VGE_HOST="127.0.0.1", VGE_PORT=str(self.port), VGE_DEVICE=device,
            VGE_MAX_BATCH_SIZE=str(max_batch), VGE_MAX_QUEUE_DELAY_MS=str(delay_ms),
            VGE_MAX_QUEUE_LENGTH="4096", VGE_LOG_LEVEL="warning", VGE_TORCH_THREADS=str(threads),
            VGE_JOBS_DB_URL="sqlite:////tmp/vge-bench-jobs.sqlite3",
            VGE_JOBS_DIR="/tmp/vge-bench-jobs", VGE_MODELS_ROOT="/tmp/vge-bench-models",
        )  # fmt: skip
        if model_dir is not None:
            env["VGE_MODEL_DIR"] = str(model_dir)
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli.serve"], cwd=REPO,
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server not ready within 120 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _requests(pngs: list[bytes], port: int) -> list[bytes]:
    """Pre-built HTTP/1.1 keep-alive requests, one multipart /v1/predict per image."""
    out = []
    for i, png in enumerate(pngs):
        boundary = f"vgebench{i:08d}"
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="images"; filename="{i}.png"'
            f"\r\nContent-Type: image/png\r\n\r\n".encode()
            + png
            + f"\r\n--{boundary}--\r\n".encode()
        )
        head = (
            f"POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        out.append(head + body)
    return out


async def _roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    """Send one request on a keep-alive connection; return the status code."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)
    return status


async def _level(port: int, requests: list[bytes], concurrency: int, duration: float,
                 max_requests: int) -> dict[str, float]:  # fmt: skip
    """Closed loop: ``concurrency`` connections each send a request as soon as the last returns.

    The client is a minimal HTTP/1.1 keep-alive loop over asyncio streams (pre-built requests),
    so that on a small machine the server, not the load generator, is what gets measured.
    """
    url = f"http://127.0.0.1:{port}"
    latencies: list[float] = []
    errors = 0
    sent = 0

    async def worker(w: int, stop_at: float, record: bool) -> None:
        nonlocal errors, sent
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = w
        try:
            while time.perf_counter() < stop_at and sent < max_requests:
                sent += 1
                t0 = time.perf_counter()
                status = await _roundtrip(reader, writer, requests[i % len(requests)])
                if not record:
                    pass
                elif status == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
                i += concurrency
        finally:
            writer.close()

    await asyncio.gather(*(worker(w, time.perf_counter() + 0.5, False) for w in range(concurrency)))
    sent = 0
    batches0, images0 = metric(url, "vge_batch_size_count"), metric(url, "vge_batch_size_sum")
    dur0 = metric(url, "vge_request_duration_seconds_sum")
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w, t0 + duration, True) for w in range(concurrency)))
    elapsed = time.perf_counter() - t0
    batches = metric(url, "vge_batch_size_count") - batches0
    images = metric(url, "vge_batch_size_sum") - images0
    server_s = metric(url, "vge_request_duration_seconds_sum") - dur0
    q = (
        statistics.quantiles(latencies, n=100, method="inclusive")
        if len(latencies) > 1
        else [0] * 99
    )
    return {
        "requests": len(latencies),
        "errors": errors,
        "throughput": len(latencies) / elapsed,
        "p50_ms": q[49] * 1000,
        "p95_ms": q[94] * 1000,
        "p99_ms": q[98] * 1000,
        "mean_batch": images / batches if batches else 0.0,
        "server_ms": 1000 * server_s / max(1, len(latencies) + errors),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None, help="default: shipped model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    ap.add_argument("--max-requests", type=int, default=20_000, help="cap per level")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--torch-threads", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    pngs = _pngs()
    modes = [("on", args.max_batch, args.delay_ms), ("off", 1, 0.0)]
    rows: list[tuple[str, int, dict[str, float]]] = []
    model_name = "?"
    servers: dict[str, ServerProcess] = {}
    try:  # both servers up at once; levels alternate between them, so drift hits both alike
        for mode, max_batch, delay in modes:
            servers[mode] = ServerProcess(
                args.model_dir, args.device, max_batch, delay, args.torch_threads
            )
        reqs = {m: _requests(pngs, srv.port) for m, srv in servers.items()}
        info = httpx.get(servers["on"].url + "/v1/models", timeout=10).json()["models"][0]
        model_name = f"{info['name']} {info['version']}"
        for c in args.concurrency:
            for mode, max_batch, delay in modes:
                srv = servers[mode]
                res = asyncio.run(_level(srv.port, reqs[mode], c, args.duration, args.max_requests))
                rows.append((mode, c, res))
                print(f"batching {mode:3s} (max {max_batch:3d}, {delay:g} ms) conc {c:3d}: "
                      f"{res['throughput']:8.1f} req/s  p50 {res['p50_ms']:7.1f}  "
                      f"p95 {res['p95_ms']:7.1f}  p99 {res['p99_ms']:7.1f} ms  "
                      f"batch {res['mean_batch']:5.1f}  server {res['server_ms']:6.1f} ms  errors {res['errors']:.0f}", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    rows.sort(key=lambda r: (r[0] != "on", r[1]))

    from benchmarks.report import write_section

    cmd = "python -m benchmarks.load " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    lines = [
        f"Model {model_name} on {args.device}; one 28×28 PNG per request (multipart "
        f"/v1/predict); closed-loop clients on the same host over loopback, "
        f"{args.duration:g} s per level. Batching on: max batch {args.max_batch}, max delay "
        f"{args.delay_ms:g} ms; off: max batch 1. Server torch threads: "
        f"{args.torch_threads or 'auto (half the logical CPUs on CPU)'}; the client is a minimal "
        "keep-alive HTTP/1.1 loop sharing the same CPUs. Mean batch from `vge_batch_size`; server time: mean `vge_request_duration_seconds` (request in the app, excluding the socket and HTTP parsing in uvicorn).\n",
        "| batching | concurrency | throughput (req/s) | p50 (ms) | p95 (ms) | p99 (ms) "
        "| mean batch | server time (ms) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, c, r in rows:
        lines.append(f"| {mode} | {c} | {r['throughput']:.1f} | {r['p50_ms']:.1f} | "
                     f"{r['p95_ms']:.1f} | {r['p99_ms']:.1f} | {r['mean_batch']:.1f} | "
                     f"{r['server_ms']:.1f} | "
                     f"{r['errors']:.0f} |")  # fmt: skip
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        write_section("Dynamic batching (service)", cmd.strip(), body)
        print("wrote the 'Dynamic batching (service)' section of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
