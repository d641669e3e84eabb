"""The model's forward pass on CPU, per image: NCHW against channels_last (NHWC) weights, and the
served module against the checkpoint's (BatchNorm not folded).

    python -m benchmarks.forward [--model NAME] [--threads 1 2] [--batches 1 8 32 64]
    python -m benchmarks.forward --compare NAME|DIR ... [--threads 1] [--batches 32] [--rounds 4]

The served model is loaded with :class:`models.predictor.Predictor` (which folds BatchNorm into
the layer before it and puts convolution weights in channels_last on CPU) and compared with a copy
of its module in NCHW, and with the checkpoint's module in channels_last without the fold. Same inputs,
same intra-op threads; the median of ``torch.utils.benchmark``'s blocked autorange. Writes the
section "Forward pass on CPU" of docs/benchmarks.md.

``--compare`` instead times the served forward pass of several models side by side (zoo names or
trained directories, the first the reference): the same held-out digits, the models taken in turn
within every round so that the box's drift hits them alike, the median over rounds and the ratio
to the first model. Printed only: how a model's README states its cost against another's (issue
33: "served forward ≤ 1.5× today's default").
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.utils import benchmark

from benchmarks.peers import model_dir
from benchmarks.report import write_section
from models.checkpoint import load_checkpoint
from models.predictor import Predictor


def _us_per_image(module: torch.nn.Module, x: torch.Tensor, threads: int) -> float:
    with torch.inference_mode():
        t = benchmark.Timer(
            "m(x)", globals={"m": module, "x": x}, num_threads=threads
        ).blocked_autorange(min_run_time=1.0)
    return t.median * 1e6 / x.shape[0]


def compare(names: list[str], threads: int, batch: int, rounds: int) -> list[float]:
    """Served µs per image of each model (median over ``rounds`` alternating rounds), printed as
    a table with the ratio to the first; returned in ``names``' order."""
    import statistics

    from models.data import load_holdout_mnist

    predictors = [Predictor.from_dir(model_dir(n), "cpu") for n in names]
    digits = load_holdout_mnist()[0][:batch]  # (B, 28, 28) uint8
    # each model's input as it serves it: (B, Cin, H', W'), prepared once
    inputs = [
        torch.stack([p.prepare(torch.from_numpy(d)[None]) for d in digits]) for p in predictors
    ]
    times: list[list[float]] = [[] for _ in names]
    for _ in range(rounds):
        for i, p in enumerate(predictors):
            times[i].append(_us_per_image(p.module, inputs[i], threads))
    medians = [statistics.median(t) for t in times]
    print(f"| model | served µs/image ({threads} thread(s), batch {batch}) | rounds | × first |")
    print("|---|---:|---|---:|")
    for name, t, med in zip(names, times, medians, strict=True):
        spread = ", ".join(f"{v:.0f}" for v in t)
        print(f"| {name} | {med:.0f} | {spread} | {med / medians[0]:.2f}× |")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="zoo model (default: the served default)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument(
        "--compare", nargs="+", metavar="MODEL", help="models to time side by side (no docs write)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="--compare: alternating rounds")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, args.threads[0], args.batches[0], args.rounds)
        return
    directory = model_dir(args.model)
    predictor = Predictor.from_dir(directory, "cpu")
    served = predictor.module  # BatchNorm folded, channels_last convolution weights
    nchw = copy.deepcopy(served).to(memory_format=torch.contiguous_format)
    unfolded, _ = load_checkpoint(directory, torch.device("cpu"))
    unfolded = unfolded.eval().to(memory_format=torch.channels_last)
    cin, (h, w) = predictor.card.in_channels, predictor.card.input_size
    gen = torch.Generator().manual_seed(0)
    rows = [
        "| threads | batch | NCHW µs/image | channels_last, not folded | served µs/image "
        "| channels_last | fold |",
        "|---|---|---|---|---|---|---|",
    ]
    for threads in args.threads:
        for b in args.batches:
            x = torch.randn(b, cin, h, w, generator=gen)
            base = _us_per_image(nchw, x, threads)
            plain = _us_per_image(unfolded, x, threads)
            fast = _us_per_image(served, x, threads)
            rows.append(
                f"| {threads} | {b} | {base:.0f} | {plain:.0f} | {fast:.0f} | "
                f"{base / fast:.2f}× | {plain / fast:.2f}× |"
            )
            print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        f"\n\nModel: `{predictor.card.name}`. The served forward pass (`Predictor.from_dir` on "
        "CPU: BatchNorm folded, channels_last weights) against the same module with NCHW weights "
        "(column *channels_last*: the speed-up of the layout) and against the checkpoint's module "
        "in channels_last without the fold (column *fold*). All give the same answers to float32 "
        "round-off. Compare columns within a row: this box's speed drifts between runs."
    )
    cmd = "python -m benchmarks.forward" + (f" --model {args.model}" if args.model else "")
    write_section("Forward pass on CPU", cmd, body)


if __name__ == "__main__":
    main()
