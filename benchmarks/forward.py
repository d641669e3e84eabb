"""The model's forward pass on CPU, per image: NCHW weights against channels_last (NHWC) weights.

    python -m benchmarks.forward [--model NAME] [--threads 1 2] [--batches 1 8 32 64]

The served model is loaded with :class:`models.predictor.Predictor` (which puts convolution
weights in channels_last on CPU) and compared with a copy of its module in NCHW. Same inputs,
same intra-op threads; the median of ``torch.utils.benchmark``'s blocked autorange. Writes the
section "Forward pass on CPU" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.utils import benchmark

from benchmarks.peers import model_dir
from benchmarks.report import write_section
from models.predictor import Predictor


def _us_per_image(module: torch.nn.Module, x: torch.Tensor, threads: int) -> float:
    with torch.inference_mode():
        t = benchmark.Timer(
            "m(x)", globals={"m": module, "x": x}, num_threads=threads
        ).blocked_autorange(min_run_time=1.0)
    return t.median * 1e6 / x.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="zoo model (default: the served default)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    args = parser.parse_args()
    predictor = Predictor.from_dir(model_dir(args.model), "cpu")
    served = predictor.module  # channels_last convolution weights
    nchw = copy.deepcopy(served).to(memory_format=torch.contiguous_format)
    cin, (h, w) = predictor.card.in_channels, predictor.card.input_size
    gen = torch.Generator().manual_seed(0)
    rows = [
        "| threads | batch | NCHW µs/image | channels_last µs/image | speed-up |",
        "|---|---|---|---|---|",
    ]
    for threads in args.threads:
        for b in args.batches:
            x = torch.randn(b, cin, h, w, generator=gen)
            base = _us_per_image(nchw, x, threads)
            fast = _us_per_image(served, x, threads)
            rows.append(f"| {threads} | {b} | {base:.0f} | {fast:.0f} | {base / fast:.2f}× |")
            print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        f"\n\nModel: `{predictor.card.name}`. The served forward pass (channels_last weights, "
        "`Predictor.from_dir` on CPU) against the same module with NCHW weights; both give the "
        "same answers to float32 round-off."
    )
    cmd = "python -m benchmarks.forward" + (f" --model {args.model}" if args.model else "")
    write_section("Forward pass on CPU", cmd, body)


if __name__ == "__main__":
    main()
