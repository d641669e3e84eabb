"""The served decision (``models.serving.decide``: VGMU, SNR, abstain, TU/AU/EU, top-k) per sample.

    python -m benchmarks.decision [--device cuda] [--compile]

B = 128 and 4096, M = 100, C = 1000, float32, eager and (with ``--compile``) compiled as a served
engine compiles it (:func:`models.serving.compile_decide`); on CUDA also the fused Triton kernel a
GPU engine serves (:func:`models.kernels.decision.fused_decide`), with its launch configuration
chosen from the shape, the best of a small sweep of tile heights and warps, and its host time per
call (the launch alone: is it launch- or GPU-bound?);
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
SWEEP = ((16, 16), (16, 8), (8, 8), (8, 4), (32, 16))


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


def _host_us_per_call(fn, x: torch.Tensor, calls: int = 200) -> float:  # noqa: ANN001
    """Host µs per call of ``fn(x)`` with no synchronisation: the launch cost alone, as long as
    the GPU's queue does not fill (compare with the synchronised time per call)."""
    import time

    fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host * 1e6 / calls


def _fused_row(x: torch.Tensor, want: torch.Tensor) -> tuple[float, str, str, str, int | None]:
    """The fused kernel on ``x``: µs/sample with its own launch configuration, the best of
    :data:`SWEEP`, host µs per call, the same through Triton's JIT launch (no direct launch of
    the compiled kernel), GPU operations; every configuration checked against ``want``."""
    b = x.shape[0]
    fused = _us_per_sample(lambda t: kernel.fused_decide(t, 1.0, 5), x)
    host = _host_us_per_call(lambda t: kernel.fused_decide(t, 1.0, 5), x)
    ops = _gpu_ops(lambda t: kernel.fused_decide(t, 1.0, 5), x)
    jit = _us_per_sample(lambda t: kernel.fused_decide(t, 1.0, 5, direct=False), x)
    jit_host = _host_us_per_call(lambda t: kernel.fused_decide(t, 1.0, 5, direct=False), x)
    launch = "direct" if kernel._DIRECT else "Triton's JIT (no direct launch fits this Triton)"
    print(f"  fused B={b} default ({launch}): {fused:.3f} µs/sample, host {host:.1f} µs/call "
          f"(synchronised {fused * b:.1f}); Triton's JIT launch: {jit:.3f} µs/sample, host "
          f"{jit_host:.1f} µs/call", flush=True)  # fmt: skip
    via_jit = f"{jit:.3f}; host {jit_host:.1f}"
    timed = {}
    for tile, warps in SWEEP:
        run = lambda t, c=(tile, warps): kernel.fused_decide(  # noqa: E731
            t, 1.0, 5, block_m=c[0], num_warps=c[1]
        )
        try:
            torch.testing.assert_close(run(x), want, rtol=1e-5, atol=1e-6)
        except AssertionError as exc:  # report, keep measuring the others
            print(f"  fused B={b} {(tile, warps)}: WRONG ANSWER {exc}", flush=True)
            continue
        timed[(tile, warps)] = t = _us_per_sample(run, x)
        print(f"  fused B={b} tile={tile} warps={warps}: {t:.3f}", flush=True)
    if not timed:
        return fused, "every configuration wrong", f"{host:.1f}", via_jit, ops
    (tile, warps), t_best = min(timed.items(), key=lambda kv: kv[1])
    return fused, f"{t_best:.3f} ({tile}, {warps})", f"{host:.1f}", via_jit, ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decision")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    rows = ["| B | M | C | read floor µs/sample | decide eager | decide compiled | compiled, one CUDA graph "
            "| fused kernel | fused, best of sweep (tile, warps) | fused host µs/call "
            "| fused via Triton's JIT launch (µs/sample; host µs/call) | fused / floor "
            "| GPU ops eager / compiled / fused |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
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
        fused, best, host, via_jit, ops_f = nan, "–", "–", "–", None
        if kernel.supports(x):
            want = decide(x, 1.0, 5)
            torch.testing.assert_close(kernel.fused_decide(x, 1.0, 5), want, rtol=1e-5, atol=1e-6)
            fused, best, host, via_jit, ops_f = _fused_row(x, want)
        rows.append(f"| {b} | {m} | {c} | {floor:.3f} | {eager:.3f} | {comp:.3f} | {graph:.3f} | "
                    f"{fused:.3f} | {best} | {host} | {via_jit} | {fused / floor:.1f}× "
                    f"| {ops_e} / {ops_c} / {ops_f} |")  # fmt: skip
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
