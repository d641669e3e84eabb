"""How many HTTP front ends per core: ``vge serve`` with ``VGE_WORKERS`` = 1, 2, … side by side.

The same load client and request as :mod:`benchmarks.serving` (``wrk``, keep-alive, one real MNIST
PNG per request, loopback only, bounded in time); rounds interleave the worker counts, medians
and the spread over rounds are reported. This is the measurement behind the default
``VGE_WORKERS=0`` (one front end per CPU less one for the engine).

    python -m benchmarks.workers                                  # default model, 1/2/3 front ends
    python -m benchmarks.workers --model lenet5-lle-vgn-mnist --workers 1 2

Results are printed and written to docs/benchmarks.md (section "Front ends per core").
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.serving import BOUNDARY, _pngs, multipart, summarise, targets, wrk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.workers")
    parser.add_argument("--model", action="append", default=None,
                        help="zoo model (repeatable); default: the shipped default")  # fmt: skip
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--levels", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("benchmarks.workers: error: needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="vge-workers-"))
    body = workdir / "one.bin"
    body.write_bytes(multipart(_pngs(1)))
    ctype = f"multipart/form-data; boundary={BOUNDARY}"
    models = args.model or [""]
    results: dict[tuple[str, int, int], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for model in models:
                for n in args.workers:
                    name = f"vge:{model}" if model else "vge"
                    t = targets([name], None, workdir)[0]
                    t.env["VGE_WORKERS"] = str(n)
                    t.start()
                    try:
                        wrk(t.url + t.path, body, ctype, "", 4, 1)  # warm-up, not recorded
                        for conc in args.levels:
                            res = wrk(t.url + t.path, body, ctype, "", conc, args.duration)
                            results.setdefault((model or "default", n, conc), []).append(res)
                            print(f"round {r + 1} {model or 'default'} workers={n} c={conc} "
                                  f"{res['rps']:.0f} req/s p99 {res['p99']:.1f} ms", flush=True)  # fmt: skip
                    finally:
                        t.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    lines = [
        "| model | front ends | connections | req/s median (min–max) | p50 ms | p99 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (model, n, conc), rs in sorted(results.items()):
        _, cell, p50, p99, errs = summarise(rs)
        lines.append(f"| {model} | {n} | {conc} | {cell} | {p50:.1f} | {p99:.1f} | {errs} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section(
            "Front ends per core",
            f"python -m benchmarks.workers {' '.join(argv or sys.argv[1:])}".strip(),
            table,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
