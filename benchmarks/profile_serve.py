"""Where ``vge serve``'s CPU goes under load: py-spy over the whole process tree, per process.

    python -m benchmarks.profile_serve [--device cuda] [--model lenet5-lle-vgn-mnist] [--conc 256]
                                       [--native]

Starts ``vge serve`` (its defaults), drives it with ``wrk`` (single-image requests, keep-alive,
loopback only, bounded in time), samples every process with ``py-spy record --subprocesses`` for a
few seconds mid-run, and prints, per process, the cores it kept busy and its hottest frames. Before
sampling it reads every thread's CPU time from ``/proc`` over the same number of seconds and prints
each thread's CPU µs per request (no profiler running then). This is the measurement that says
whether the front ends, the engine's event loop or its forward pass limit a host.
Needs ``py-spy`` (PyPI) and ``wrk``; writes nothing unless ``--raw`` names a file for the samples.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from benchmarks.engine import process_thread_cpu
from benchmarks.serving import BOUNDARY, _pngs, multipart, targets, tree_roles, wrk

#: Frames every sample of a process passes through (start-up, thread and loop plumbing): left out
#: of the hottest-frames list, which would otherwise show only them.
_PLUMBING = ("spawn_main", "<frozen runpy>", "multiprocessing/", "threading.py", "concurrent/futures",
             "asyncio/runners", "asyncio/base_events", "uvicorn/server.py", "uvicorn/_compat",
             "service/cli/", "service/supervisor.py", "frontend_main", "engine_main", "<module>")  # fmt: skip


def thread_cpu(root: int) -> dict[tuple[str, int], float]:
    """CPU seconds used so far by every thread of ``root``'s children, from ``/proc``.

    Keys are ``(process, tid)``: the process named by role (``engine PID``, ``front end PID``), as
    in :func:`summarise`; a process's main thread is the one whose tid is its pid.
    """
    out: dict[tuple[str, int], float] = {}
    for role, child in tree_roles(root):
        try:
            for tid, seconds in process_thread_cpu(child).items():
                out[(f"{role} {child}", tid)] = seconds
        except FileNotFoundError:  # exited meanwhile
            continue
    return out


def us_per_request(
    before: dict[tuple[str, int], float], after: dict[tuple[str, int], float], requests: float
) -> dict[tuple[str, int], float]:
    """Per ``(process, tid)``, CPU µs per request between two :func:`thread_cpu` snapshots."""
    return {key: (t1 - before.get(key, 0.0)) / requests * 1e6 for key, t1 in after.items()}


def cpu_per_request(
    before: dict[tuple[str, int], float], after: dict[tuple[str, int], float], requests: float
) -> str:
    """Per process and thread, CPU µs per request between two :func:`thread_cpu` snapshots
    (threads under 1 µs/request left out): where a request's CPU goes, without a profiler."""
    lines = []
    for (role, tid), used in sorted(us_per_request(before, after, requests).items()):
        if used >= 1:
            what = "main thread" if role.endswith(f" {tid}") else f"thread {tid}"
            lines.append(f"{role} {what}: {used:,.0f} µs of CPU per request")
    return "\n".join(lines)


def _samples(raw: Path) -> Iterator[tuple[str, list[str], int]]:
    """py-spy's raw samples as ``(process, frames outermost first, count)``; the process named by
    role (``engine PID``, ``front end PID``); samples waiting in select/epoll, and multiprocessing's
    resource tracker (blocked in ``read``, which ``--native`` shows as a C frame), left out."""
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        procs = [p for p in parts if p.startswith("process ")]
        proc = procs[-1] if procs else "?"  # the innermost: py-spy prefixes the parent chain
        if "resource_tracker" in proc:  # multiprocessing's helper, not a role (as tree_roles)
            continue
        if "spawn_main" in proc:
            proc = "engine " + proc.split(":", 1)[0].removeprefix("process ")
        elif len(procs) > 1:
            proc = "front end " + proc.split(":", 1)[0].removeprefix("process ")
        if "select" in parts[-1] or "epoll" in parts[-1]:  # waiting, not working
            continue
        yield proc, parts, int(count)


#: The parts of a front end's request path, each named by substrings of its frames (py-spy's
#: ``function (file:line)``, or a C function's name with ``--native``). A sample belongs to the
#: part of its innermost frame that names one: JSON encoded inside the route is "JSON", the
#: route's own lines are "request path".
FRONT_END_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cyclic GC", ("gc_collect",)),
    ("response send (syscall; loopback delivers to the client)", ("_Transport.write",)),
    ("reading the digit (models.prepare)", ("models/prepare.py",)),
    ("PNG decoding (torchvision)", ("torch/_ops.py", "service/common/decode.py")),
    ("multipart parsing", ("python_multipart/", "service/frontend/multipart.py")),
    ("JSON encoding", ("json/encoder.py",)),
    ("Prometheus metrics", ("prometheus_client/", "service/common/metrics.py")),
    ("engine round trip (arena, record, socket, answer)",
     ("engine_client.py", "service/common/wire.py", "service/common/shm.py")),
    ("answer rows (models.serving)", ("models/serving.py",)),
    ("request path (route, pipeline, options)",
     ("service/frontend/routes/", "service/frontend/pipeline.py", "service/frontend/review_queue.py",
      "service/common/model_info.py", "service/frontend/deps.py")),
    ("HTTP and ASGI (uvicorn, Starlette, the service's middleware)",
     ("uvicorn/", "starlette/", "service/frontend/middleware.py", "service/frontend/http_protocol.py")),
    ("event loop (asyncio, uvloop)", ("asyncio/", "uvloop")),
)  # fmt: skip


def front_end_parts(raw: Path, cpu_us: dict[str, float] | None = None) -> str:
    """Per front end: the share of its samples in each of :data:`FRONT_END_PARTS` (and "other"),
    largest first; with ``cpu_us`` (per process, as named here: its CPU µs per request, measured
    unprofiled) each share in µs as well."""
    shares: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for proc, parts, count in _samples(raw):
        if not proc.startswith("front end "):
            continue
        part = next(
            (name for frame in reversed(parts) for name, marks in FRONT_END_PARTS
             if any(mark in frame for mark in marks)),
            "other",
        )  # fmt: skip
        shares[proc][part] += count
    lines = []
    for proc, counter in shares.items():
        total = sum(counter.values())
        cpu = (cpu_us or {}).get(proc)
        lines.append(f"{proc}: samples by part of the request path")
        for part, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            us = f"  ~{n / total * cpu:,.0f} µs" if cpu else ""
            lines.append(f"    {100 * n / total:5.1f}%{us}  {part}")
    return "\n".join(lines)


def summarise(raw: Path, seconds: float, rate: int, top: int = 12) -> str:
    """py-spy's raw samples -> per process: busy cores, the ``top`` frames by inclusive share, and
    the ``top`` innermost frames (where the time was actually spent)."""
    busy: collections.Counter[str] = collections.Counter()
    frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for proc, parts, count in _samples(raw):
        busy[proc] += count
        leaves[proc][parts[-1]] += count
        for frame in set(parts):
            if not frame.startswith("process ") and not any(g in frame for g in _PLUMBING):
                frames[proc][frame] += count
    lines = []
    for proc, n in busy.most_common():
        lines.append(f"{proc[:90]}: {n / (seconds * rate):.2f} cores busy")
        for frame, m in sorted(frames[proc].items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
            lines.append(f"    {100 * m / n:5.1f}%  {frame[:120]}")
        lines.append("  where the samples were (innermost frame):")
        for frame, m in sorted(leaves[proc].items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
            lines.append(f"    {100 * m / n:5.1f}%  {frame[:120]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_serve")
    parser.add_argument("--device", default="cpu", help="VGE_DEVICE")
    parser.add_argument("--model", default=None, help="zoo model; default: the shipped default")
    parser.add_argument("--conc", type=int, default=64, help="wrk connections")
    parser.add_argument("--seconds", type=float, default=5.0, help="sampling time")
    parser.add_argument("--rate", type=int, default=200, help="samples per second")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw samples here")
    parser.add_argument(
        "--native", action="store_true",
        help="sample C frames too (py-spy --native: libpng, the send syscall, the GC); py-spy "
        "then pauses each process to sample it, so the req/s printed is lower than unprofiled",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for tool in ("wrk", "py-spy"):
        if shutil.which(tool) is None:
            print(f"benchmarks.profile_serve: error: needs {tool}", file=sys.stderr)
            return 2
    workdir = Path(tempfile.mkdtemp(prefix="vge-profile-"))
    body = workdir / "one.bin"
    body.write_bytes(multipart(_pngs(1)))
    ctype = f"multipart/form-data; boundary={BOUNDARY}"
    name = f"vge:{args.model}" if args.model else "vge"
    (t,) = targets([name], None, workdir, args.device)
    raw = args.raw or workdir / "samples.txt"
    t.start()
    try:
        wrk(t.url + t.path, body, ctype, "", 4, 1)  # warm-up
        load: dict[str, dict] = {}
        run = threading.Thread(
            target=lambda: load.update(
                r=wrk(t.url + t.path, body, ctype, "", args.conc, 2 * args.seconds + 4)
            )
        )
        run.start()
        threading.Event().wait(2.0)
        before = thread_cpu(t.proc.pid)  # type: ignore[union-attr]
        threading.Event().wait(args.seconds)  # CPU per request measured without py-spy running
        after = thread_cpu(t.proc.pid)  # type: ignore[union-attr]
        subprocess.run(
            ["py-spy", "record", "--pid", str(t.proc.pid), "--subprocesses",  # type: ignore[union-attr]
             "--native" if args.native else "--nonblocking",
             "--rate", str(args.rate), "--duration", str(round(args.seconds)), "--format", "raw",
             "--output", str(raw)],
            check=True, capture_output=True, timeout=args.seconds + 60,
        )  # fmt: skip
        run.join()
    finally:
        t.stop()
    r = load.get("r", {})
    print(f"{name} on {args.device}, c={args.conc}: {r.get('rps', float('nan')):,.0f} req/s, "
          f"p99 {r.get('p99', float('nan')):.1f} ms")  # fmt: skip
    requests = r.get("rps", float("nan")) * args.seconds
    print(cpu_per_request(before, after, requests))
    print(summarise(raw, round(args.seconds), args.rate))
    per_process: dict[str, float] = collections.Counter()
    for (proc, _), used in us_per_request(before, after, requests).items():
        per_process[proc] += used
    print(front_end_parts(raw, per_process))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
