"""µs per sample for the uncertainty scores on the paper's Table S5 grid (B = 128).

Run: ``python -m benchmarks.uncertainty [--quick]`` — writes the "Uncertainty scores" section of
docs/benchmarks.md. ``P.sum()`` is one plain pass over the tensor: the memory-bound floor.
VGN rows time forward + backward of the mixture NLL; the memory columns count the bytes autograd
keeps for the backward pass (saved tensors), measured with ``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.utils import benchmark

from benchmarks.report import write_section
from models.uncertainty import (
    entropy_decomposition,
    epjs,
    epkl,
    epkl_pairwise,
    margin_score,
    vgn,
    vgn_autograd,
)

B = 128
MS = (2, 5, 10, 20, 50, 100)
CS = (10, 100, 1000)


def members(m: int, c: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.softmax(3 * torch.randn(B, m, c, generator=g), dim=-1)


def vgn_step(fn: Callable, p: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    logit = torch.zeros(p.shape[-1], requires_grad=True)

    def step() -> None:
        x = p.detach().requires_grad_()
        q_bar = fn(x, torch.nn.functional.softplus(logit) + 1e-8).mean(dim=1)
        torch.nn.functional.nll_loss(q_bar.clamp_min(1e-12).log(), y).backward()

    return step


def saved_bytes(step_fn: Callable, p: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of tensors autograd saves for backward during one forward (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    logit = torch.zeros(p.shape[-1], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = p.detach().requires_grad_()
        q_bar = step_fn(x, torch.nn.functional.softplus(logit) + 1e-8).mean(dim=1)
        loss = torch.nn.functional.nll_loss(q_bar.clamp_min(1e-12).log(), y)
    loss.backward()
    return sum(seen.values())


def usec_per_sample(fn: Callable[[], object], min_run_time: float) -> float:
    t = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(
        min_run_time=min_run_time
    )
    return t.median / B * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="C ∈ {10, 100} only, shorter timing")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    cs = CS[:2] if args.quick else CS
    rt = 0.05 if args.quick else 0.2
    header = (
        "| M | C | P.sum() floor | VGMU | TU/AU/EU | VGN fwd+bwd analytic | VGN fwd+bwd autograd "
        "| VGN saved MiB analytic / autograd | EPKL closed form | EPKL pairwise | EPJS |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [header]
    print(header)
    for c in cs:
        for m in MS:
            p = members(m, c)
            y = torch.randint(0, c, (B,))
            t = {
                "floor": usec_per_sample(lambda p=p: p.sum(), rt),
                "vgmu": usec_per_sample(lambda p=p: margin_score(p, 1.0), rt),
                "dec": usec_per_sample(lambda p=p: entropy_decomposition(p), rt),
                "vgn_a": usec_per_sample(vgn_step(vgn, p, y), rt),
                "vgn_ag": usec_per_sample(vgn_step(vgn_autograd, p, y), rt),
                "epkl": usec_per_sample(lambda p=p: epkl(p), rt),
                "epkl_pw": usec_per_sample(lambda p=p: epkl_pairwise(p), rt),
                "epjs": usec_per_sample(lambda p=p: epjs(p), rt),
            }
            mib_a = saved_bytes(vgn, p, y) / 2**20
            mib_ag = saved_bytes(vgn_autograd, p, y) / 2**20
            row = (
                f"| {m} | {c} | {t['floor']:.2f} | {t['vgmu']:.2f} | {t['dec']:.2f} | {t['vgn_a']:.2f} "
                f"| {t['vgn_ag']:.2f} | {mib_a:.1f} / {mib_ag:.1f} | {t['epkl']:.2f} | {t['epkl_pw']:.2f} "
                f"| {t['epjs']:.1f} |"
            )
            rows.append(row)
            print(row, flush=True)
    body = (
        f"µs per sample (median of `torch.utils.benchmark` blocked runs, B = {B}, float32, CPU). "
        "VGN columns: forward + backward of the mixture NLL through the layer; saved MiB: tensors autograd "
        "keeps for the backward pass. "
        "Both VGN columns use the same forward (spread as an explicit sum of squares: "
        "`Tensor.std(dim=1)` is 10-20x slower on CPU for (B, M, C) tensors, which dominated the first "
        "run of this table).\n\n" + "\n".join(rows)
    )
    if not args.no_write:
        write_section("Uncertainty scores", "python -m benchmarks.uncertainty", body)


if __name__ == "__main__":
    main()
