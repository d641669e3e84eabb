"""``models.serving``: the served decision, eager and compiled, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch._dynamo

from models.serving import FIXED_COLUMNS, ScoreColumns, compile_decide, decide

EPS = 1e-8

# Two members over three classes: mean (0.6, 0.25, 0.15); spreads of the top two classes
# |0.7 − 0.5|/√2 and |0.2 − 0.3|/√2 (sample std of two values is |a − b|/√2).
MEMBERS = torch.tensor([[[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]]], dtype=torch.float64)


def _entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def test_decide_matches_the_hand_computed_margin_and_decomposition() -> None:
    s1, s2 = 0.2 / math.sqrt(2) + EPS, 0.1 / math.sqrt(2) + EPS
    snr = (0.6 - 0.25) / (s1 + s2 + EPS)  # 1.6499…: the critical k of this sample
    vgmu = 1 - (1 - math.exp(-snr)) * 0.6
    tu = _entropy([0.6, 0.25, 0.15]) / math.log(3)
    au = (_entropy([0.7, 0.2, 0.1]) + _entropy([0.5, 0.3, 0.2])) / 2 / math.log(3)
    cols = ScoreColumns.from_tensor(decide(MEMBERS, 1.0, 2))
    assert cols.column("prediction").tolist() == [0]
    assert cols.column("abstain").tolist() == [False]  # k = 1 < 1.65: answered
    for name, want in (("snr", snr), ("vgmu", vgmu), ("tu", tu), ("au", au), ("eu", tu - au)):
        assert cols.column(name)[0] == pytest.approx(want, rel=1e-9), name
    assert cols.top_indices.tolist() == [[0, 1]]
    np.testing.assert_allclose(cols.top_probabilities, [[0.6, 0.25]], rtol=1e-12)
    # k = 2 > 1.65: 0.6 − 2 s1 < 0.25 + 2 s2, so the same sample is deferred
    assert ScoreColumns.from_tensor(decide(MEMBERS, 2.0, 1)).column("abstain").tolist() == [True]


def test_decide_refuses_a_negative_or_nan_k() -> None:
    for k in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="abstain_k must be a number in \\[0, 1e\\+09\\]"):
            decide(MEMBERS, k, 1)


def _members(b: int, m: int = 4, c: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(b)
    return torch.softmax(3 * torch.randn(b, m, c, generator=g), dim=-1)


def test_compiled_decide_matches_eager_and_never_recompiles_for_request_options() -> None:
    """Batches of 5 and 7 share the padded 8-row bucket; new ``abstain_k`` and ``top_k`` values
    (what any request may send) reuse the compiled code instead of compiling again."""
    compiled = compile_decide(bucketed=True)
    x5, x7 = _members(5), _members(7)
    np.testing.assert_allclose(compiled(x5, 1.0, 3), decide(x5, 1.0, 3), rtol=1e-6, atol=1e-7)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for x in (x5, x7):
            for k, top_k in ((0.0, 1), (0.37, 10), (12.5, 4)):
                got = compiled(x, k, top_k)
                assert got.shape == (x.shape[0], len(FIXED_COLUMNS) + 2 * top_k)
                np.testing.assert_allclose(got, decide(x, k, top_k), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="abstain_k"):
        compiled(x5, -1.0, 1)


def test_score_columns_cross_processes_as_raw_bytes() -> None:
    """What the engine sends a front end: the rows' float64 bytes, shaped again by ``top_k``."""
    members = torch.softmax(torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(1)), -1)
    block = ScoreColumns.from_tensor(decide(members, 1.0, 2))
    back = ScoreColumns.from_bytes(block.rows(1, 4).data.tobytes(), top_k=2)
    np.testing.assert_array_equal(back.data, block.data[1:4])
    assert (
        back.top_k == 2
        and back.column("prediction").tolist() == block.column("prediction")[1:4].tolist()
    )
    assert len(ScoreColumns.from_bytes(b"", top_k=2)) == 0
