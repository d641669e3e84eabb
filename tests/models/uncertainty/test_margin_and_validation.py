"""VGMU + abstain rule, and input validation."""

import math

import pytest
import torch

from models.uncertainty import check_probs, margin_score, score_ensemble
from models.uncertainty.validation import sum_tolerance


def test_vgmu_by_hand() -> None:
    p = torch.tensor([[[0.8, 0.15, 0.05], [0.7, 0.2, 0.1], [0.6, 0.25, 0.15]]], dtype=torch.float64)
    ms = margin_score(p, abstain_k=1.0)
    snr = 0.5 / (0.1 + 0.05 + 1e-8 + 1e-8 + 1e-8)
    assert float(ms.snr) == pytest.approx(snr, rel=1e-9)
    assert float(ms.vgmu) == pytest.approx(1 - (1 - math.exp(-snr)) * 0.7, rel=1e-9)
    assert int(ms.prediction) == 0
    # predict iff p̄1 − k s1 > p̄2 + k s2: 0.7 − 0.1k > 0.2 + 0.05k  ⇔  k < 3.333…
    assert not bool(margin_score(p, abstain_k=3.3).abstain)
    assert bool(margin_score(p, abstain_k=3.4).abstain)


def test_ties_break_to_lowest_index_and_abstain() -> None:
    p = torch.tensor([[[0.1, 0.45, 0.45]] * 2], dtype=torch.float64)
    ms = margin_score(p, abstain_k=0.0)
    assert int(ms.prediction) == 1
    assert bool(ms.abstain)  # zero margin never passes the strict inequality
    assert float(ms.vgmu) == pytest.approx(1.0)


def test_negative_abstain_k_rejected() -> None:
    with pytest.raises(ValueError, match="abstain_k"):
        margin_score(torch.full((1, 2, 2), 0.5), abstain_k=-1.0)


@pytest.mark.parametrize(
    ("probs", "message"),
    [
        (torch.ones(2, 3), "shape \\(B, M, C\\)"),
        (torch.ones(2, 0, 3), "M >= [12]"),
        (torch.ones(2, 3, 1), "C >= 2"),
        (torch.tensor([[[0.5, 0.5], [0.5, float("nan")]]]), "NaN or Inf"),
        (torch.tensor([[[0.5, 0.5], [1.5, -0.5]]]), "non-negative"),
        (torch.tensor([[[0.5, 0.5], [0.2, 0.2]]]), "sum to 1"),
    ],
)
def test_bad_input_is_a_clear_value_error(probs: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_probs(probs)
    with pytest.raises(ValueError, match=message):
        score_ensemble(probs)


def test_half_input_computed_in_float32() -> None:
    p = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]], dtype=torch.float16)
    s = score_ensemble(p, gate_k=1.0)
    assert s.tu.dtype == torch.float32


def test_vgmu_on_q_needs_gate() -> None:
    with pytest.raises(ValueError, match="gate_k"):
        score_ensemble(torch.full((1, 2, 2), 0.5), vgmu_on="q")


@pytest.mark.parametrize("gate_k", [1e-4, 2e4, float("nan"), float("inf")])
def test_gate_k_outside_its_range_rejected(gate_k: float) -> None:
    with pytest.raises(ValueError, match=r"gate_k must be in \[0.001, 10000\]"):
        score_ensemble(torch.full((1, 2, 2), 0.5), gate_k=gate_k)


def test_gating_grows_with_k_up_to_the_largest_k_accepted() -> None:
    """EU falls as k grows over the whole accepted range (SI: uncertainty reduces progressively
    with increasing k). Past it, Γ's ε floor would take every class and the scores would snap back
    to the ungated ones (at k = 1e9 EU is the ungated 0.0704 again)."""
    from models.uncertainty.gate import GATE_K_MAX

    p = torch.tensor([[[0.9, 0.1, 0.0], [0.6, 0.3, 0.1], [0.6, 0.2, 0.2]]], dtype=torch.float64)
    ungated = float(score_ensemble(p).eu[0])
    ks = [1.0, 2.0, 10.0, 100.0, 1e3, GATE_K_MAX]
    eus = [float(score_ensemble(p, gate_k=k).eu[0]) for k in ks]
    assert all(b <= a + 1e-12 for a, b in zip(eus, eus[1:], strict=False)), eus
    assert eus[-1] < ungated - 0.03, (eus, ungated)


def test_decision_scores_match_score_members() -> None:
    """The serving hot path returns exactly what the full scorer returns for the same fields."""
    from models.uncertainty import decision_scores, score_members, vgn

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(3 * torch.randn(5, 4, 6, generator=g, dtype=torch.float64), -1)
    q = vgn(p, 0.7)
    for vgmu_on in ("p", "q"):
        full = score_members(p, q, abstain_k=0.5, vgmu_on=vgmu_on)
        margin, dec = decision_scores(p, q, abstain_k=0.5, vgmu_on=vgmu_on)
        for name in ("prediction", "abstain", "vgmu", "snr"):
            assert torch.equal(getattr(margin, name), getattr(full, name)), name
        for name in ("tu", "au", "eu"):
            assert torch.equal(getattr(dec, name), getattr(full, name)), name


def test_single_member_is_not_an_ensemble() -> None:
    """M = 1 has no spread (VGMU would never abstain, EU ≡ 0): ensemble scores refuse it."""
    one = torch.full((2, 1, 3), 1 / 3)
    check_probs(one)  # valid probabilities ...
    with pytest.raises(ValueError, match=r"at least 2 members \(M >= 2\).*got M = 1"):
        score_ensemble(one)  # ... but not an ensemble


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_softmax_rows_are_accepted(dtype: torch.dtype) -> None:
    """Softmax rows rounded to bf16/fp16 miss 1 by up to a few ε; the tolerance scales with ε."""
    g = torch.Generator().manual_seed(0)
    for c in (10, 100, 1000):
        logits = 4 * torch.randn(256, 5, c, generator=g)
        p = torch.softmax(logits.to(dtype), dim=-1)
        worst = float((p.float().sum(-1) - 1).abs().max())
        assert worst > 1e-3 or dtype == torch.float16  # the old fixed 1e-3 refused bf16 rows
        score_ensemble(p)  # accepted


def test_tolerance_still_catches_unnormalised_half_rows() -> None:
    assert sum_tolerance(torch.float32) == 1e-3 and sum_tolerance(torch.float64) == 1e-3
    assert sum_tolerance(torch.bfloat16) == pytest.approx(4 * 2**-7)
    assert sum_tolerance(torch.float16) == pytest.approx(4 * 2**-10)
    bad = torch.tensor([[[0.6, 0.5], [0.5, 0.5]]], dtype=torch.bfloat16)  # sums to 1.1
    with pytest.raises(ValueError, match="sum to 1"):
        score_ensemble(bad)
    with pytest.raises(ValueError, match="sum to 1"):
        score_ensemble(torch.tensor([[[0.5, 0.505], [0.5, 0.5]]]))  # float32: 5e-3 off


def test_one_distribution_per_answer_issue_case() -> None:
    """The issue's case: p̄ = [.25, .40, .35] but q̄ = [.193, .358, .450] → the answer is class 2."""
    from models.uncertainty import vgn

    p = torch.tensor([[[0.5, 0.0, 0.5], [0.0, 0.8, 0.2]]], dtype=torch.float64)
    q = vgn(p, 1.0)
    torch.testing.assert_close(q.mean(1), torch.tensor([[0.193, 0.358, 0.450]], dtype=torch.float64),
                               atol=1e-3, rtol=0)  # fmt: skip
    s = score_ensemble(p, gate_k=1.0)
    assert int(s.prediction[0]) == 2 == int(q.mean(1).argmax())
    assert int(score_ensemble(p, gate_k=1.0, vgmu_on="p").prediction[0]) == 1


def test_vgmu_on_q_without_gated_members_is_an_error() -> None:
    from models.uncertainty import decision_scores

    with pytest.raises(ValueError, match="no variance gate"):
        decision_scores(torch.full((1, 2, 2), 0.5), None, vgmu_on="q")
