"""Two builds of ``vge serve`` side by side: a git revision against the working tree.

    python -m benchmarks.ab --base HEAD~1 [--model lenet5-lle-vgn-mnist] [--conc 64] [--rounds 3]

Checks ``--base`` out into a temporary git worktree and serves it and the working tree in turn
(interleaved rounds, same model, same client: ``wrk`` with one real MNIST PNG per request,
keep-alive, loopback only, bounded in time). For each round it reports req/s, p99, the mean batch
(from ``/metrics``) and where a request's CPU went, read from ``/proc`` for every thread of the
tree: the engine's event loop (its main thread), the rest of the engine (the compute thread) and
the front ends. This is how a change to the request path is measured on a noisy box: same
client, same minute, several rounds, and CPU per request next to throughput.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.profile_serve import thread_cpu, us_per_request
from benchmarks.serving import (
    BOUNDARY,
    REPO,
    _pngs,
    batch_totals,
    mean_batch,
    multipart,
    targets,
    wrk,
)


def cpu_split(
    before: dict[tuple[str, int], float], after: dict[tuple[str, int], float], requests: float
) -> dict[str, float]:
    """µs of CPU per request: engine loop (the engine's main thread), engine other threads, and
    all front ends, between two :func:`benchmarks.profile_serve.thread_cpu` snapshots."""
    out = {"engine loop": 0.0, "engine compute": 0.0, "front ends": 0.0}
    for (process, tid), used in us_per_request(before, after, requests).items():
        role, pid = process.rsplit(" ", 1)
        if role == "engine":
            out["engine loop" if int(pid) == tid else "engine compute"] += used
        elif role.startswith("front end"):
            out["front ends"] += used
    return out


def _range(values: list[float], fmt: str = ",.0f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ab", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--model", default=None, help="zoo model; default: the shipped default")
    parser.add_argument("--conc", type=int, default=64, help="wrk connections")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="vge-ab-"))
    base_tree = workdir / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base_tree),
                    args.base], check=True)  # fmt: skip
    body = workdir / "one.bin"
    body.write_bytes(multipart(_pngs(1)))
    ctype = f"multipart/form-data; boundary={BOUNDARY}"
    name = f"vge:{args.model}" if args.model else "vge"
    results: dict[str, list[dict[str, float]]] = {args.base: [], "working tree": []}
    failed: set[str] = set()  # builds that answered errors: their numbers measure failing
    try:
        for r in range(args.rounds):
            for build, tree in ((args.base, base_tree), ("working tree", REPO)):
                (t,) = targets([name], None, workdir)
                t.cwd = tree
                t.start()
                try:
                    url = t.url + t.path
                    wrk(url, body, ctype, "", args.conc, 2)  # warm-up
                    pid = t.proc.pid  # type: ignore[union-attr]
                    totals = batch_totals(t.url)
                    before = thread_cpu(pid)
                    load = wrk(url, body, ctype, "", args.conc, args.seconds)
                    after = thread_cpu(pid)
                    batch = mean_batch(totals, batch_totals(t.url))
                    if load["errors"]:
                        failed.add(build)
                    row = {"req/s": load["rps"], "p99": load["p99"], "batch": batch}
                    row |= cpu_split(before, after, load["rps"] * args.seconds)
                finally:
                    t.stop()
                results[build].append(row)
                print(f"round {r} {build}: " + ", ".join(f"{k} {v:,.1f}" for k, v in row.items()),
                      flush=True)  # fmt: skip
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                       check=False)  # fmt: skip
    if failed:
        print(f"FAILED: {', '.join(sorted(failed))} answered errors (see the rounds above); no "
              "comparison", file=sys.stderr)  # fmt: skip
        return 1
    cols = ["req/s", "p99", "batch", "engine loop", "engine compute", "front ends"]
    print(f"\n{name}, c={args.conc}, {args.rounds} interleaved rounds of {args.seconds:g} s: "
          "median (min–max); CPU in µs per request\n")  # fmt: skip
    print("| build | req/s | p99 ms | mean batch | engine loop | engine compute | front ends |")
    print("|---|---|---|---|---|---|---|")
    for build, rows in results.items():
        cells = [_range([row[c] for row in rows], ".1f" if c in ("p99", "batch") else ",.0f")
                 for c in cols]  # fmt: skip
        print(f"| {build} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
