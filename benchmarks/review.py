"""Does queueing for human review slow predictions? ``vge serve`` with the review queue off vs on.

Three configurations of the same server and model (the shipped default, CPU), driven by ``wrk``
on loopback with one image per request, each request a *different* real MNIST digit (a Lua
script cycles through distinct bodies per wrk thread), so queued images are mostly new inserts,
not duplicates:

* ``off``      — VGE_REVIEW_QUEUE=off (the baseline);
* ``auto``     — on, the default policy: only abstaining answers are stored;
* ``always``   — on, ``?review=always``: every image written to disk and the database (worst case).

Targets interleaved round by round; medians over rounds. Results go to docs/benchmarks.md
(section "Review queue overhead").

    python -m benchmarks.review --rounds 3 --duration 4 --concurrency 16
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.report import write_section
from benchmarks.serving import BOUNDARY, Target, _free_port, _pngs, multipart, run_lua, targets

CONFIGS = ("off", "auto", "always")
N_BODIES = 2000  # distinct images per wrk thread

WRK_LUA = """
local n, dir = {n}, "{dir}"
local counter = 0
function setup(thread)
  thread:set("tid", counter)
  counter = counter + 1
end
function init(args)
  bodies = {{}}
  for i = 1, n do
    local f = io.open(dir .. "/" .. (tid * n + i) .. ".bin", "rb")
    bodies[i] = f:read("*all")
    f:close()
  end
  i = 0
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "multipart/form-data; boundary={boundary}"
end
function request()
  i = i % n + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
"""


def _target(config: str, workdir: Path) -> Target:
    (t,) = targets(["vge"], None, workdir / config)
    t.name = f"review-{config}"
    t.env = {**t.env, "VGE_REVIEW_QUEUE": "off" if config == "off" else "on",
             "VGE_REVIEW_DIR": str(workdir / config / "reviews"),
             "VGE_REVIEW_MAX_ITEMS": "1000000", "VGE_REVIEWER_KEY": "bench-reviewer"}  # fmt: skip
    if config == "always":
        t.path = "/v1/predict?review=always"
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="vge-review-bench-"))
    bodies = work / "bodies"
    bodies.mkdir()
    pngs = _pngs(2 * N_BODIES)
    for k, png in enumerate(pngs, start=1):
        (bodies / f"{k}.bin").write_bytes(multipart([png]))
    lua = work / "cycle.lua"
    lua.write_text(WRK_LUA.format(n=N_BODIES, dir=bodies, boundary=BOUNDARY))

    results: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    queued: dict[str, int] = {}
    for r in range(args.rounds):
        for config in CONFIGS if r % 2 == 0 else reversed(CONFIGS):
            t = _target(config, work / f"round{r}")
            t.port = _free_port()
            t.env["VGE_PORT"] = str(t.port)
            t.start()
            try:
                run_lua(t.url + t.path, lua, args.concurrency, 1.0)  # warm-up
                res = run_lua(t.url + t.path, lua, args.concurrency, args.duration)
                if config != "off":
                    stats = httpx.get(t.url + "/v1/reviews/stats", timeout=10,
                                      headers={"Authorization": "Bearer bench-reviewer"}).json()  # fmt: skip
                    queued[config] = stats["counts"]["pending"]
            finally:
                t.stop()
            results[config].append(res)
            print(f"round {r} {config:7s} {res['rps']:8.1f} req/s  p50 {res['p50']:6.1f} ms  "
                  f"p99 {res['p99']:6.1f} ms  errors {res['errors']}", flush=True)  # fmt: skip
            time.sleep(1.0)

    base = statistics.median(x["rps"] for x in results["off"])
    lines = [
        f"{args.rounds} rounds × {args.duration:g} s at {args.concurrency} connections, one image "
        "per request, each a different MNIST digit (2 × 2000 distinct), default model on the CPU. "
        "Medians over rounds (min–max of req/s).",
        "",
        "| review queue | req/s | vs off | p50 ms | p99 ms | non-2xx | items queued (last round) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        rs = results[config]
        rps = statistics.median(x["rps"] for x in rs)
        lines.append(
            f"| {config} | {rps:.0f} ({min(x['rps'] for x in rs):.0f}–"
            f"{max(x['rps'] for x in rs):.0f}) | {rps / base:.2f}× | "
            f"{statistics.median(x['p50'] for x in rs):.1f} | "
            f"{statistics.median(x['p99'] for x in rs):.1f} | "
            f"{sum(int(x['errors']) for x in rs)} | {queued.get(config, 0)} |"
        )
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        cmd = "python -m benchmarks.review " + shlex.join(sys.argv[1:] if argv is None else argv)
        write_section("Review queue overhead", cmd.strip(), body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
