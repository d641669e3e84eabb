"""The served decision (``models.serving.decide``: VGMU, SNR, abstain, TU/AU/EU, top-k) per sample.

    python -m benchmarks.decision [--device cuda] [--compile]

B = 128 and 4096, M = 100, C = 1000, float32, eager and (with ``--compile``) compiled as a served
engine compiles it (:func:`models.serving.compile_decide`); on CUDA also the fused Triton kernel a
GPU engine serves (:func:`models.kernels.decision.fused_decide`), with its launch configuration
chosen from the shape and the best of a small sweep of tile heights and warps;
beside it the memory-read floor: the time to read the ``(B, M, C)`` members once (``sum``).
Writes the section "Served decision" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils import benchmark

from benchmarks.report import write_section
from models.kernels import decision as kernel
from models.serving import compile_decide, decide

#: (members per tile, warps) tried for the fused kernel, beside the configuration it picks itself.
SWEEP = ((4, 4), (8, 4), (8, 8), (16, 8), (16, 16), (32, 16))


def _us_per_sample(fn, x: torch.Tensor) -> float:  # noqa: ANN001
    t = benchmark.Timer("fn(x)", globals={"fn": fn, "x": x}).blocked_autorange(min_run_time=1.0)
    return t.median * 1e6 / x.shape[0]


def _gpu_ops(fn, x: torch.Tensor) -> int | None:  # noqa: ANN001
    """GPU operations (kernels, copies) one call launches, by the profiler; None off CUDA."""
    if x.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _graph_us_per_sample(fn, x: torch.Tensor) -> float:  # noqa: ANN001
    """µs/sample of ``fn(x)`` captured once in a CUDA graph and replayed: the decision's GPU time
    without the per-kernel launch cost, as when it is captured together with the forward pass."""
    if x.device.type != "cuda":
        return float("nan")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)
    except Exception as exc:  # noqa: BLE001 - report, do not stop the benchmark
        print(f"CUDA graph capture failed: {exc}", flush=True)
        return float("nan")
    return _us_per_sample(lambda _: graph.replay(), x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decision")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    rows = ["| B | M | C | read floor µs/sample | decide eager | decide compiled | compiled, one CUDA graph "
            "| fused kernel | fused, best of sweep (tile, warps) | fused / floor | GPU ops eager / compiled / fused |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    compiled = compile_decide() if args.compile else None  # what a compiled engine runs
    for b in (128, 4096):
        m, c = 100, 1000
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.softmax(3 * torch.randn(b, m, c, generator=g, device=dev), dim=-1)
        floor = _us_per_sample(lambda t: t.sum(), x)
        eager = _us_per_sample(lambda t: decide(t, 1.0, 5), x)
        nan = float("nan")
        comp = _us_per_sample(lambda t: compiled(t, 1.0, 5), x) if compiled else nan
        graph = _graph_us_per_sample(lambda t: compiled(t, 1.0, 5), x) if compiled else nan
        ops_e = _gpu_ops(lambda t: decide(t, 1.0, 5), x)
        ops_c = _gpu_ops(lambda t: compiled(t, 1.0, 5), x) if compiled else None
        fused, best, ops_f = nan, "–", None
        if kernel.supports(x):
            want = decide(x, 1.0, 5)
            torch.testing.assert_close(kernel.fused_decide(x, 1.0, 5), want, rtol=1e-5, atol=1e-6)
            fused = _us_per_sample(lambda t: kernel.fused_decide(t, 1.0, 5), x)
            ops_f = _gpu_ops(lambda t: kernel.fused_decide(t, 1.0, 5), x)
            timed = {}
            for tile, warps in SWEEP:
                run = lambda t, tile=tile, warps=warps: kernel.fused_decide(  # noqa: E731
                    t, 1.0, 5, block_m=tile, num_warps=warps
                )
                torch.testing.assert_close(run(x), want, rtol=1e-5, atol=1e-6)
                timed[(tile, warps)] = _us_per_sample(run, x)
                print(
                    f"  fused B={b} tile={tile} warps={warps}: {timed[(tile, warps)]:.3f}",
                    flush=True,
                )
            (tile, warps), t_best = min(timed.items(), key=lambda kv: kv[1])
            best = f"{t_best:.3f} ({tile}, {warps})"
        rows.append(f"| {b} | {m} | {c} | {floor:.3f} | {eager:.3f} | {comp:.3f} | {graph:.3f} | "
                    f"{fused:.3f} | {best} | {fused / floor:.1f}× | {ops_e} / {ops_c} / {ops_f} |")  # fmt: skip
        print(rows[-1], flush=True)
    if not args.no_write:
        write_section(
            f"Served decision ({dev.type})",
            f"python -m benchmarks.decision --device {args.device}"
            + (" --compile" if args.compile else ""),
            "\n".join(rows),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
