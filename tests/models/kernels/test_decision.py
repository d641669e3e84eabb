"""The fused decision kernel (models/kernels/decision.py) against models.serving.decide.

CI has no GPU: the kernel runs under Triton's interpreter in a child process
(``interpret_decision.py``); tests/gpu/test_fused_decision.py runs it compiled on a CUDA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.kernels import decision as kernel
from models.serving import FIXED_COLUMNS, decide
from tests.models.kernels.interpret_decision import cases

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("kernel") / "fused.npz"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.models.kernels.interpret_decision", str(out)],
        cwd=ROOT, env=env, check=True, timeout=300,
    )  # fmt: skip
    with np.load(out) as saved:
        return dict(saved)


@pytest.mark.parametrize("i", range(len(cases())), ids=[c[0] for c in cases()])
def test_fused_kernel_matches_decide(interpreted: dict[str, np.ndarray], i: int) -> None:
    name, members, k, top_k, _ = cases()[i]
    want = decide(members.float(), k, top_k).numpy()
    got = interpreted[f"case{i}"]
    assert got.shape == want.shape
    f = len(FIXED_COLUMNS)
    n = (want.shape[1] - f) // 2
    # Classes and decisions exactly (prediction, abstain, the top-k order with ties to the
    # lowest class); scores to float32 round-off.
    np.testing.assert_array_equal(got[:, :2], want[:, :2], err_msg=name)
    np.testing.assert_array_equal(got[:, f : f + n], want[:, f : f + n], err_msg=name)
    # Near-uniform members: SNR's p̄1 − p̄2 and EU = TU − AU cancel, so float32 round-off in the
    # means (summed in another order) shows at ~1e-5 relative there.
    rtol, atol = (1e-3, 1e-5) if name == "flat members" else (1e-5, 1e-6)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("name", ["ties", "ties, tiles of two"])
def test_ties_list_the_lowest_class_first(interpreted: dict[str, np.ndarray], name: str) -> None:
    i = [c[0] for c in cases()].index(name)
    got = interpreted[f"case{i}"]
    f = len(FIXED_COLUMNS)
    assert (got[:, 0] == 1).all()  # classes 1 and 3 tie for the top: predict 1
    assert (got[:, f : f + 2] == [1, 3]).all()


@pytest.mark.parametrize("name", ["one-hot", "one-hot, one member per tile"])
def test_one_hot_members_give_full_epistemic_uncertainty(
    interpreted: dict[str, np.ndarray], name: str
) -> None:
    """The SI's example: three one-hot members over three classes give TU = EU = 1, AU = 0."""
    i = [c[0] for c in cases()].index(name)
    tu, au, eu = (interpreted[f"case{i}"][:, FIXED_COLUMNS.index(c)] for c in ("tu", "au", "eu"))
    np.testing.assert_allclose(tu, 1.0, rtol=1e-6)
    np.testing.assert_allclose(au, 0.0, atol=1e-7)
    np.testing.assert_allclose(eu, 1.0, rtol=1e-6)


def test_nan_members_abstain_with_nan_scores(interpreted: dict[str, np.ndarray]) -> None:
    """A model that outputs NaN must never look confident: the rows with NaN abstain."""
    i = [c[0] for c in cases()].index("NaN members")
    got = interpreted[f"case{i}"]
    assert (got[1:, 1] == 1.0).all() and np.isnan(got[1:, 2:7]).all()
    assert np.isfinite(got[0, 2:7]).all()
    assert got[1, 0] == 3 and got[2, 0] == 1  # the first NaN class, as torch's argmax
    f = len(FIXED_COLUMNS)
    assert got[2, f : f + 2].tolist() == [1, 4]  # NaN classes first, lowest first


def test_the_start_up_probe_agrees_with_a_correct_kernel(
    interpreted: dict[str, np.ndarray],
) -> None:
    """``Predictor`` serves the kernel only if it agrees with ``decide`` on this probe: a correct
    kernel must pass (no near-ties), and a wrong class or score must fail."""
    from models.predictor import decision_probe, decisions_agree

    i = [c[0] for c in cases()].index("start-up probe, C=1000")
    got = torch.from_numpy(interpreted[f"case{i}"])
    want = decide(decision_probe(1000, 5), 1.0, 5)
    assert decisions_agree(got, want, 5)
    wrong = got.clone()
    wrong[0, 8] = wrong[0, 9]  # the second class listed twice
    assert not decisions_agree(wrong, want, 5)
    off = got.clone()
    off[3, 2] += 1e-3  # VGMU off by more than round-off
    assert not decisions_agree(off, want, 5)


def test_shapes_the_kernel_does_not_serve_are_refused() -> None:
    x = torch.ones(2, 3, 1)
    assert not kernel.supports(x)  # CPU tensor, and one class
    with pytest.raises(ValueError, match="2 <= C"):
        kernel.fused_decide(x, 1.0, 1)
    with pytest.raises(ValueError, match="2 <= C"):
        kernel.fused_decide(torch.ones(2, 3, kernel.MAX_CLASSES + 1), 1.0, 1)
    with pytest.raises(ValueError, match="abstain_k"):
        kernel.fused_decide(torch.ones(2, 3, 4) / 4, -1.0, 1)


def test_predictor_off_cuda_uses_the_torch_decision() -> None:
    from models.predictor import fused_decision

    assert fused_decision(torch.device("cpu"), 10, 5) is None


class _Compiled:
    """A stand-in for Triton's compiled kernel (``kernel[grid](*args)``; no GPU here), computing
    the packed block with ``models.serving.decide``. ``constexprs``: whether its launch takes the
    constexpr arguments too (Triton >= 3.3) or refuses them; ``wrong``: it writes other values."""

    function = object()  # what a compiled kernel has and the interpreter's result lacks

    def __init__(self, constexprs: bool, wrong: bool = False) -> None:
        self.constexprs, self.wrong, self.launches = constexprs, wrong, 0

    def __getitem__(self, grid: tuple[int, int, int]):  # noqa: ANN204
        def run(x, out, m, c, sb, sm, n, k, eps, inv_log_c, *extra):  # noqa: ANN001, ANN202
            if bool(extra) != self.constexprs:
                raise TypeError(f"function takes {10 + 2 * self.constexprs} arguments")
            self.launches += 1
            out.copy_(decide(x, k, n) + (1.0 if self.wrong else 0.0))

        return run


@pytest.mark.parametrize("constexprs", [True, False])
def test_a_direct_launch_is_kept_only_when_it_writes_what_tritons_launch_wrote(
    constexprs: bool,
) -> None:
    x = torch.softmax(torch.randn((4, 3, 10), generator=torch.Generator().manual_seed(0)), -1)
    want = decide(x, 1.0, 2)
    out = torch.empty_like(want)
    args = (x, out, 3, 10, x.stride(0), x.stride(1), 2, 1.0, 1e-8, 0.4)
    compiled = _Compiled(constexprs)
    launch = kernel._direct_launch(compiled, (4, 1, 1), args, (4, 16), want)
    assert launch is not None  # whichever convention this Triton's launch takes
    launch((4, 1, 1), args)
    assert torch.equal(out, want)
    # Triton's interpreter returns no compiled kernel; a kernel writing other values is refused.
    assert kernel._direct_launch(None, (4, 1, 1), args, (4, 16), want) is None
    wrong = _Compiled(constexprs, wrong=True)
    assert kernel._direct_launch(wrong, (4, 1, 1), args, (4, 16), want) is None
