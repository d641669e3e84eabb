"""How long after SIGTERM ``vge serve`` stops calling itself ready; with ``--start``, how long it
takes to start, and to answer again after its engine is killed.

    python -m benchmarks.readiness [--repo PATH] [--starts 5] [--start [--engine-start fork]]

Starts the server in ``--repo`` (default: this checkout; a ``git worktree`` of another revision
compares builds) as the serving benchmark starts it (:func:`benchmarks.serving.targets`), with two
front ends and a 1 s drain, waits until ``/readyz`` is 200, sends SIGTERM and asks ``/readyz``
back to back (a new connection each time) until the answer is not 200. Prints the milliseconds for each start and their median. A load balancer that probes
``/readyz`` keeps sending new work for this long.

``--start``: for each start, the seconds from launching ``vge serve`` (one front end, the shipped
model) to ``/readyz`` 200, then from ``kill -9`` of its engine to the next 200 of a
``/v1/predict`` (one MNIST PNG, asked back to back; 503 until the supervisor's new engine serves).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.serving import REPO, targets, tree_roles


def _readyz(port: int) -> bytes:
    """The status code of one ``GET /readyz`` (b"down" when nothing answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET /readyz HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
            return s.recv(64).split()[1]
    except (OSError, IndexError):
        return b"down"


def time_to_not_ready(repo: Path) -> float:
    """Seconds from SIGTERM to the first ``/readyz`` answer that is not 200, for one start."""
    with tempfile.TemporaryDirectory() as workdir:
        (target,) = targets(["vge@WORKERS=2,DRAIN_S=1"], None, Path(workdir))
        target.cwd = repo  # as benchmarks.ab serves another build
        target.start()  # returns once /readyz is 200
        try:
            time.sleep(0.5)  # settled
            assert target.proc is not None
            sent = time.monotonic()
            target.proc.send_signal(signal.SIGTERM)
            while _readyz(target.port) == b"200":
                pass
            return time.monotonic() - sent
        finally:
            target.stop()


def time_to_start_and_recover(repo: Path, engine_start: str = "spawn") -> tuple[float, float]:
    """Seconds to ``/readyz`` 200 from launch, and to a 200 ``/v1/predict`` after ``kill -9`` of
    the engine, for one start (the engine started as ``engine_start`` says: ``VGE_ENGINE_START``)."""
    import httpx

    from benchmarks.serving import _pngs

    png = _pngs(1)[0]
    with tempfile.TemporaryDirectory() as workdir:
        spec = "vge@WORKERS=1,DRAIN_S=0" + (",ENGINE_START=fork" if engine_start == "fork" else "")
        (target,) = targets([spec], None, Path(workdir))
        target.cwd = repo
        launched = time.monotonic()
        target.start()  # returns once /readyz is 200
        ready = time.monotonic() - launched
        try:
            assert target.proc is not None
            url = f"http://127.0.0.1:{target.port}/v1/predict"
            files = [("images", ("d.png", png, "image/png"))]
            assert httpx.post(url, files=files, timeout=30).status_code == 200
            killed = time.monotonic()
            (engine,) = [p for role, p in tree_roles(target.proc.pid) if role == "engine"]
            os.kill(engine, signal.SIGKILL)
            while True:
                try:
                    if httpx.post(url, files=files, timeout=30).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
            return ready, time.monotonic() - killed
        finally:
            target.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout to serve")
    parser.add_argument("--starts", type=int, default=5, help="server starts to time")
    parser.add_argument("--start", action="store_true",
                        help="time start-up and recovery from an engine kill instead")  # fmt: skip
    parser.add_argument("--engine-start", choices=["spawn", "fork"], default="spawn",
                        help="with --start: how the engine starts (VGE_ENGINE_START)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.start:
        runs = [time_to_start_and_recover(args.repo, args.engine_start) for _ in range(args.starts)]
        for what, values in (("to ready", [r[0] for r in runs]),
                             ("engine kill to answering", [r[1] for r in runs])):  # fmt: skip
            print(f"{args.repo}: {what}, s: {', '.join(f'{x:.2f}' for x in values)}; "
                  f"median {statistics.median(values):.2f}")  # fmt: skip
        return
    ms = [time_to_not_ready(args.repo) * 1000 for _ in range(args.starts)]
    print(f"{args.repo}: SIGTERM to not ready, ms: {', '.join(f'{x:.1f}' for x in ms)}; "
          f"median {statistics.median(ms):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
