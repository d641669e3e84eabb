"""Deferral threshold calibration (abstain k) against the paper's margin rule."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from models.evaluation.calibration import MAX_CURVE_POINTS, calibrate_abstain_k, critical_k
from models.uncertainty.margin import margin_score


def _members(
    n: int = 200, m: int = 5, c: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, 1, c, generator=g) + torch.randn(n, m, c, generator=g)
    p = logits.softmax(-1).double()
    pred = p.mean(1).argmax(-1)
    noisy = torch.randint(0, c, (n,), generator=g)
    labels = torch.where(torch.rand(n, generator=g) < 0.8, pred, noisy)
    return p, labels


def _rule(p: torch.Tensor, labels: torch.Tensor, k: float) -> tuple[float, float | None]:
    ms = margin_score(p, abstain_k=k)
    acc = ~ms.abstain
    risk = float((ms.prediction[acc] != labels[acc]).double().mean()) if acc.any() else None
    return float(ms.abstain.double().mean()), risk


def test_critical_k_hand_computed() -> None:
    # Two members [0.7+d, 0.3−d], [0.7−d, 0.3+d] with d = 0.1: p̄ = [0.7, 0.3],
    # unbiased std per class = |0.2|/√2 → s1 + s2 = 0.4/√2 → κ = 0.4/(0.4/√2) = √2.
    p = torch.tensor([[[0.8, 0.2], [0.6, 0.4]]], dtype=torch.float64)
    assert float(critical_k(p)[0]) == pytest.approx(math.sqrt(2), rel=1e-6)
    assert _rule(p, torch.tensor([0]), 1.41)[0] == 0.0  # k < κ: predict
    assert _rule(p, torch.tensor([0]), 1.42)[0] == 1.0  # k > κ: abstain


@pytest.mark.parametrize("target", [0.0, 0.1, 0.25, 0.333, 0.5, 0.9, 1.0])
def test_target_deferral_is_hit_within_one_sample(target: float) -> None:
    p, y = _members()
    out = calibrate_abstain_k(p, y, target_deferral=target)
    assert out["mode"] == "deferral" and out["target"] == target
    assert abs(out["achieved_deferral"] - target) <= 1 / p.shape[0]
    # the reported numbers are those of the paper's rule at the returned k
    assert (out["achieved_deferral"], out["achieved_risk"]) == _rule(p, y, out["abstain_k"])


def test_target_risk_gives_the_smallest_feasible_deferral() -> None:
    p, y = _members(n=120, seed=3)
    target = 0.08
    out = calibrate_abstain_k(p, y, target_risk=target)
    assert out["achieved_risk"] is not None and out["achieved_risk"] <= target
    # brute force over every operating point of the rule (k between consecutive critical values)
    kappa = np.unique(critical_k(p).numpy())
    ks = np.concatenate([[kappa[0] / 2], (kappa[:-1] + kappa[1:]) / 2])
    feasible = [d for d, r in (_rule(p, y, float(k)) for k in ks) if r is not None and r <= target]
    assert out["achieved_deferral"] == pytest.approx(min(feasible))


def test_target_risk_zero_with_errors_everywhere_defers_everything() -> None:
    p, _ = _members(n=50)
    wrong = (p.mean(1).argmax(-1) + 1) % p.shape[-1]
    out = calibrate_abstain_k(p, wrong, target_risk=0.0)
    assert out["achieved_deferral"] == 1.0 and out["achieved_risk"] is None


def test_curve_is_compact_monotone_json_and_consistent_with_the_rule() -> None:
    p, y = _members(n=300)
    out = calibrate_abstain_k(p, y, target_deferral=0.2)
    curve = out["curve"]
    assert 2 <= len(curve) <= MAX_CURVE_POINTS
    ks = [c["abstain_k"] for c in curve]
    assert ks == sorted(ks) and any(c["abstain_k"] == out["abstain_k"] for c in curve)
    deferrals = [c["deferral"] for c in curve]
    assert deferrals == sorted(deferrals) and deferrals[0] == 0.0 and deferrals[-1] == 1.0
    for c in curve[::7]:
        assert (c["deferral"], c["risk"]) == pytest.approx(_rule(p, y, c["abstain_k"]))
    json.dumps(out, allow_nan=False)


def test_user_grid() -> None:
    p, y = _members()
    out = calibrate_abstain_k(p, y, target_deferral=0.5, grid=[0.0, 0.5, 1.0, 2.0])
    assert out["abstain_k"] in (0.0, 0.5, 1.0, 2.0) and len(out["curve"]) == 4
    best = min((abs(_rule(p, y, k)[0] - 0.5), k) for k in (0.0, 0.5, 1.0, 2.0))
    assert out["abstain_k"] == best[1]


def test_argument_errors() -> None:
    p, y = _members(n=10)
    with pytest.raises(ValueError, match="exactly one"):
        calibrate_abstain_k(p, y)
    with pytest.raises(ValueError, match="exactly one"):
        calibrate_abstain_k(p, y, target_deferral=0.1, target_risk=0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        calibrate_abstain_k(p, y, target_deferral=1.5)
    with pytest.raises(ValueError, match="labels"):
        calibrate_abstain_k(p, y[:5], target_deferral=0.1)
    with pytest.raises(ValueError, match="grid"):
        calibrate_abstain_k(p, y, target_deferral=0.1, grid=[-1.0])
    with pytest.raises(ValueError, match="sum to 1"):
        calibrate_abstain_k(p * 2, y, target_deferral=0.1)
