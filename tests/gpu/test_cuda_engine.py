"""The engine's CUDA path: same answers as the CPU. Skipped where no GPU is present (run by
benchmarks/gpu.sh on a GPU host); the CPU fallback of every step runs in the rest of the suite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.predictor import Predictor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pair(tiny_model: Path) -> tuple[Predictor, Predictor]:
    return Predictor.from_dir(tiny_model, device="cpu"), Predictor.from_dir(
        tiny_model, device="cuda"
    )


def _pixels(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_cuda_run_and_decision_match_cpu(pair: tuple[Predictor, Predictor], n: int) -> None:
    cpu, gpu = pair
    x = _pixels(n)
    for members in ("p", "q"):
        opts = cpu.options(vgmu_on=members, top_k=5)
        want = cpu.score_columns(cpu.run([x]), opts).data
        got = gpu.score_columns(gpu.run([x[: n // 2], x[n // 2 :]]), opts).data
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_cuda_graphs_bucketed_match_eager(tiny_model: Path) -> None:
    eager = Predictor.from_dir(tiny_model, device="cuda")
    compiled = Predictor.from_dir(tiny_model, device="cuda")
    assert compiled.compile(warm_up=(8, 64))
    for n in (5, 8, 33):
        x = _pixels(n)
        opts = eager.options(top_k=3)
        np.testing.assert_allclose(
            compiled.score_columns(compiled.run([x]), opts).data,
            eager.score_columns(eager.run([x]), opts).data,
            rtol=1e-4,
            atol=1e-5,
        )
