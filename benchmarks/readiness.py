"""How long after SIGTERM ``vge serve`` stops calling itself ready.

    python -m benchmarks.readiness [--repo PATH] [--starts 5]

Starts the server in ``--repo`` (default: this checkout; a ``git worktree`` of another revision
compares builds) on a kernel-picked port with two front ends, waits until ``/readyz`` is 200,
sends SIGTERM and asks ``/readyz`` back to back (a new connection each time) until the answer is
not 200. Prints the milliseconds for each start and their median. A load balancer that probes
``/readyz`` keeps sending new work for this long.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    env.update(VGE_HOST="127.0.0.1", VGE_PORT="0", VGE_DEVICE="cpu", VGE_WORKERS="2",
               VGE_DRAIN_S="1", PYTHONPATH=str(repo))  # fmt: skip
    # its log goes to a file, not a pipe: nothing must stop the server's writes
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli.serve"], cwd=repo, env=env,
                                stderr=log)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            port = 0
            while not port:
                log.seek(0)
                if m := re.search(rb"listening on http://127\.0\.0\.1:(\d+)\n", log.read()):
                    port = int(m.group(1))
                elif proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server in {repo} did not start ({proc.poll()})")
                else:
                    time.sleep(0.05)
            while _readyz(port) != b"200":
                if time.monotonic() > deadline:
                    raise RuntimeError("the server never became ready")
                time.sleep(0.05)
            time.sleep(0.5)  # settled
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            while _readyz(port) == b"200":
                pass
            return time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout to serve")
    parser.add_argument("--starts", type=int, default=5, help="server starts to time")
    args = parser.parse_args(argv)
    ms = [time_to_not_ready(args.repo) * 1000 for _ in range(args.starts)]
    print(f"{args.repo}: SIGTERM to not ready, ms: {', '.join(f'{x:.1f}' for x in ms)}; "
          f"median {statistics.median(ms):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
