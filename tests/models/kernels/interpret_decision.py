"""Run the fused decision kernel under Triton's interpreter on the CPU and save what it returns.

    TRITON_INTERPRET=1 python -m tests.models.kernels.interpret_decision OUT.npz

Triton reads ``TRITON_INTERPRET`` when it is imported, so the kernel runs in this child process;
``test_decision.py`` builds the same inputs (:func:`cases`) and compares against
:func:`models.serving.decide` in the test process.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch


def _softmax(shape: tuple[int, int, int], seed: int, sharp: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(shape, generator=g), dim=-1)


def cases() -> list[tuple[str, torch.Tensor, float, int, dict[str, Any]]]:
    """``(name, members (B, M, C), abstain_k, top_k, launch overrides)``: shapes around every tile
    edge, one member, two classes, top-k beyond C, ties, one-hot members, strided inputs."""
    out: list[tuple[str, torch.Tensor, float, int, dict[str, Any]]] = [
        ("small", _softmax((4, 3, 7), 0), 1.0, 3, {}),
        ("one member", _softmax((3, 1, 5), 1), 0.5, 5, {}),
        ("two classes", _softmax((5, 20, 2), 2), 1.0, 2, {}),
        ("mnist-like", _softmax((6, 10, 10), 3), 2.0, 1, {}),
        ("top-k is C", _softmax((2, 5, 10), 4), 0.0, 10, {}),
        ("top-k beyond C", _softmax((2, 5, 6), 5), 1.0, 50, {}),
        ("paper size, partial last tile", _softmax((2, 100, 1000), 6), 1.0, 5, {}),
        ("one member per tile", _softmax((3, 9, 12), 7), 1.5, 3, {"block_m": 1}),
        ("tiles of two, odd M", _softmax((3, 7, 12), 8), 0.3, 3, {"block_m": 2}),
        ("flat members", _softmax((4, 8, 16), 9, sharp=0.01), 1.0, 4, {}),
        ("huge k", _softmax((3, 4, 9), 10), 1e9, 2, {}),
        ("empty batch", _softmax((0, 4, 9), 11), 1.0, 2, {}),
    ]
    # Exact ties: classes 1 and 3 equal in every member, and the largest mean.
    tie = _softmax((3, 4, 6), 12)
    tie[:, :, 1] = tie[:, :, 3] = 2.0
    tie = tie / tie.sum(-1, keepdim=True)
    out.append(("ties", tie, 1.0, 6, {}))
    # One-hot members (0 log 0 = 0): the SI's three members over three classes give EU = 1.
    out.append(("one-hot", torch.eye(3).unsqueeze(0).repeat(2, 1, 1), 1.0, 3, {}))
    out.append(("one-hot, one member per tile", torch.eye(3).unsqueeze(0).repeat(2, 1, 1), 1.0, 3,
                {"block_m": 1}))  # fmt: skip
    out.append(("ties, tiles of two", tie, 1.0, 6, {"block_m": 2}))
    # NaN members (a broken model): NaN scores, abstain, NaN classes ranked first, as decide().
    broken = _softmax((3, 4, 6), 19)
    broken[1, 2, 3] = float("nan")
    broken[2, 0, 4] = broken[2, 3, 1] = float("nan")
    out.append(("NaN members", broken, 1.0, 6, {}))
    out.append(("no top-k", _softmax((2, 3, 5), 20), 1.0, 0, {}))
    # The predictor's start-up probe at a shape where plain random members tie by rounding.
    from models.predictor import decision_probe

    out.append(("start-up probe, C=1000", decision_probe(1000, 5), 1.0, 5, {}))
    # A strided view (every second member) and float64 members.
    out.append(("strided members", _softmax((3, 10, 11), 13)[:, ::2, :], 1.0, 3, {}))
    out.append(("float64", _softmax((3, 6, 8), 14).double(), 1.0, 3, {}))
    return out


def main(path: str) -> None:
    import warnings

    from models.kernels.decision import fused_decide

    results = {}
    for i, (_, members, k, top_k, launch) in enumerate(cases()):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # numpy evaluates log(0) in the masked lanes
            results[f"case{i}"] = fused_decide(members, k, top_k, **launch).numpy()
    np.savez(path, **results)


if __name__ == "__main__":
    main(sys.argv[1])
