"""The fused decision kernel compiled for a CUDA device, against models.serving.decide there.

Skipped without a GPU (run by benchmarks/gpu.sh); tests/models/kernels/test_decision.py checks the
same kernel under Triton's interpreter on every CI run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.kernels import decision as kernel
from models.predictor import Predictor
from models.serving import FIXED_COLUMNS, decide

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("b", "m", "c", "k", "top_k"),
    [(1, 5, 10, 1.0, 3), (7, 1, 10, 0.5, 10), (300, 3, 2, 2.0, 2), (128, 100, 1000, 1.0, 5),
     (33, 17, 4097, 1.0, 7)],
)  # fmt: skip
def test_fused_matches_decide_on_cuda(b: int, m: int, c: int, k: float, top_k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(b + m + c)
    x = torch.softmax(3 * torch.randn((b, m, c), generator=g, device="cuda"), dim=-1)
    assert kernel.supports(x)
    got = kernel.fused_decide(x, k, top_k).cpu()
    want = decide(x, k, top_k).cpu()
    f = len(FIXED_COLUMNS)
    n = (want.shape[1] - f) // 2
    assert torch.equal(got[:, :2], want[:, :2])
    assert torch.equal(got[:, f : f + n], want[:, f : f + n])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_strided_members_on_cuda() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.softmax(torch.randn((16, 20, 10), generator=g, device="cuda"), dim=-1)[:, ::3]
    torch.testing.assert_close(
        kernel.fused_decide(x, 1.0, 3), decide(x, 1.0, 3), rtol=1e-5, atol=1e-6
    )


def test_cuda_predictor_serves_the_fused_decision(tiny_model: Path) -> None:
    gpu = Predictor.from_dir(tiny_model, device="cuda")
    assert gpu._fused and gpu._decide is kernel.fused_decide
    x = torch.randint(0, 256, (9, 1, 28, 28), dtype=torch.uint8)
    out = gpu.run([x])
    opts = gpu.options(top_k=4)
    members = out.q if opts.members == "q" else out.p
    torch.testing.assert_close(
        torch.from_numpy(gpu.score_columns(out, opts).data),
        decide(members.float(), opts.abstain_k, opts.top_k).cpu(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_compiled_kernel_is_launched_directly_after_its_first_launch() -> None:
    """After one launch through Triton's JIT, a configuration goes straight to its compiled kernel
    (verified against the JIT launch then); answers stay those of decide."""
    g = torch.Generator(device="cuda").manual_seed(5)
    first, second = (
        torch.softmax(3 * torch.randn((128, 100, 1000), generator=g, device="cuda"), dim=-1)
        for _ in range(2)
    )
    kernel.fused_decide(first, 1.0, 5)
    assert kernel._DIRECT and not kernel._direct_off  # this Triton's launch convention fits
    got = kernel.fused_decide(second, 1.0, 5)
    torch.testing.assert_close(got, decide(second, 1.0, 5), rtol=1e-5, atol=1e-6)
    assert torch.equal(got, kernel.fused_decide(second, 1.0, 5, direct=False))
