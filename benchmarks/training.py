"""Training and inference benchmarks for the ensembles (not a test).

Measures, on this machine's CPU (or ``--device``):

* training step time (forward + backward + Adam, batch 128, LeNet-5 on 28x28) of an LLE with vs
  without VGN (M = 10), and with M = 100 heads vs M = 1 head;
* deep-ensemble step and inference time, vectorised (``torch.func.vmap``) vs a Python loop over
  members (M = 10);
* inference throughput (images/s) of the shipped default model at batch 1, 8, 32, 128.

Usage::

    python -m benchmarks.training [--threads 2] [--repeats 30] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.report import write_section
from models.ensembles import EnsembleOutput, build_ensemble
from models.predictor import Predictor
from models.training import mixture_nll
from models.zoo import default_model_dir


def _time(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _paired(
    fa: Callable[[], object], fb: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median ms of ``fa`` and ``fb``, timed alternately so background load hits both alike."""
    for _ in range(3):
        fa()
        fb()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(repeats):
        for f, ts in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3


def make_train_step(
    kind: str, members: int, vgn: bool, device: str, sequential: bool = False
) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build_ensemble(kind, "lenet5", 10, members, vgn, 1).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (128,), device=device)

    def step() -> None:
        if sequential:
            log_p = torch.log_softmax(model.forward_sequential(x), -1)
            p = log_p.exp()
            out = EnsembleOutput(p, model.vgn(p) if model.vgn is not None else None)
        else:
            out, log_p = model(x, return_log_p=True)
        loss = mixture_nll(out, log_p, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def make_de_inference(members: int, sequential: bool, device: str) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build_ensemble("de", "lenet5", 10, members, False, 1).to(device).eval()
    x = torch.randn(128, 1, 28, 28, device=device)

    def run() -> None:
        with torch.inference_mode():
            model.forward_sequential(x) if sequential else model.member_logits(x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return run


def default_model_throughput(batch: int, repeats: int, device: str) -> float:
    pred = Predictor.from_dir(default_model_dir(), device=device)
    x = torch.randn(batch, 1, 28, 28)
    ms = _time(lambda: pred.forward(x), repeats)
    return batch / (ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--write", action="store_true", help="write the section into docs/benchmarks.md"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = args.repeats
    dev = args.device
    rows: list[tuple[str, str]] = []

    def add(label: str, value: str) -> None:
        rows.append((label, value))
        print(f"{label:<58} {value}", flush=True)

    no_vgn, with_vgn = _paired(
        make_train_step("lle", 10, False, dev), make_train_step("lle", 10, True, dev), r
    )
    add("LLE M=10 train step, no VGN (ms)", f"{no_vgn:.2f}")
    add("LLE M=10 train step, VGN learned k (ms)", f"{with_vgn:.2f} ({with_vgn / no_vgn:.2f}x)")
    m1, m100 = _paired(
        make_train_step("lle", 1, False, dev), make_train_step("lle", 100, False, dev), r
    )
    add("LLE M=1 head train step (ms)", f"{m1:.2f}")
    add("LLE M=100 heads train step (ms)", f"{m100:.2f} ({m100 / m1:.2f}x)")
    de_vec, de_seq = _paired(
        make_train_step("de", 10, False, dev),
        make_train_step("de", 10, False, dev, sequential=True),
        r,
    )
    add("DE M=10 train step, vmap (ms)", f"{de_vec:.2f}")
    add("DE M=10 train step, Python loop (ms)", f"{de_seq:.2f} ({de_seq / de_vec:.2f}x vmap)")
    inf_vec, inf_seq = _paired(
        make_de_inference(10, False, dev), make_de_inference(10, True, dev), r
    )
    add("DE M=10 inference batch 128, vmap (ms)", f"{inf_vec:.2f}")
    add(
        "DE M=10 inference batch 128, Python loop (ms)",
        f"{inf_seq:.2f} ({inf_seq / inf_vec:.2f}x vmap)",
    )
    for b in (1, 8, 32, 128):
        add(
            f"default model inference, batch {b} (images/s)",
            f"{default_model_throughput(b, max(r, 50 if b < 32 else r), dev):,.0f}",
        )

    print("\n".join(f"{a}: {b}" for a, b in rows))
    if args.write:
        body = "\n".join(
            [
                f"LeNet-5, batch 128 (train steps: forward + backward + Adam), device {dev}, "
                f"{args.threads} thread(s); medians of {r} repeats.",
                "",
                "| measurement | value |",
                "|---|---|",
                *[f"| {a} | {b} |" for a, b in rows],
            ]
        )
        cmd = "python -m benchmarks.training " + " ".join(sys.argv[1:])
        write_section("Training and inference", cmd.strip(), body)


if __name__ == "__main__":
    main()
