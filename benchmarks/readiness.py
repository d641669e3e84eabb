"""How long after SIGTERM ``vge serve`` stops calling itself ready.

    python -m benchmarks.readiness [--repo PATH] [--starts 5]

Starts the server in ``--repo`` (default: this checkout; a ``git worktree`` of another revision
compares builds) as the serving benchmark starts it (:func:`benchmarks.serving.targets`), with two
front ends and a 1 s drain, waits until ``/readyz`` is 200, sends SIGTERM and asks ``/readyz``
back to back (a new connection each time) until the answer is not 200. Prints the milliseconds for each start and their median. A load balancer that probes
``/readyz`` keeps sending new work for this long.
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.serving import REPO, targets


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
