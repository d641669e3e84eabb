"""evaluate_predictions (the dict the training code stores in the model card), plots and report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.evaluation import plots
from models.evaluation.classification import reliability_bins
from models.evaluation.evaluate import evaluate_predictions
from models.evaluation.ranking import aucc_curve
from models.evaluation.report import render_report, write_report
from models.evaluation.scores import UNCERTAINTY_SCORES
from models.evaluation.selective import risk_coverage_curve
from models.uncertainty.vgn import vgn


def _members(n: int, m: int = 4, c: int = 5, spread: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (
        3 * torch.randn(n, 1, c, generator=g) + spread * torch.randn(n, m, c, generator=g)
    ).softmax(-1)


@pytest.fixture(scope="module")
def data() -> dict:
    p = _members(300)
    labels = p.mean(1).argmax(-1).clone()
    labels[::5] = (labels[::5] + 1) % 5  # 20 % errors
    p_ood = _members(100, spread=4.0, seed=1)
    return {"p": p, "q": vgn(p, 1.0), "labels": labels, "p_ood": p_ood, "q_ood": vgn(p_ood, 1.0)}


def test_metrics_of_a_gated_model_are_complete_and_json_ready(data: dict) -> None:
    m = evaluate_predictions(data["p"], data["q"], data["labels"], data["p_ood"], data["q_ood"])
    json.dumps(m, allow_nan=False)
    assert (m["n_samples"], m["n_classes"], m["n_members"], m["gated"], m["predictive"]) == (
        300,
        5,
        4,
        True,
        "q",
    )
    assert set(m["classification"]) == {"accuracy", "macro_f1", "ece", "nll", "brier"}
    # accuracy of q̄ on labels with every 5th flipped away from argmax p̄
    q_pred = data["q"].mean(1).argmax(-1)
    assert m["classification"]["accuracy"] == pytest.approx(
        float((q_pred == data["labels"]).double().mean())
    )
    assert m["classification_raw"]["accuracy"] == pytest.approx(0.8)
    assert set(m["diversity"]) == {"p", "q"} and m["diversity"]["p"] > 0
    assert set(m["aucc"]) == set(UNCERTAINTY_SCORES) == set(m["selective"])
    assert set(m["rank_consistency"]) == {"eu", "epkl", "epjs"}
    assert all(0.5 <= v < 1 for v in m["aucc"].values())
    assert set(m["ood"]["scores"]) == set(UNCERTAINTY_SCORES)
    # OOD members disagree 4× more: VGMU must detect them well above chance
    assert m["ood"]["scores"]["vgmu"]["auroc"] > 0.8
    ab = m["abstention"]
    assert ab["n_accepted"] == round((1 - ab["deferral"]) * 300)


def test_metrics_of_a_plain_ensemble(data: dict) -> None:
    m = evaluate_predictions(data["p"], None, data["labels"], abstain_k=0.0)
    assert m["gated"] is False and m["predictive"] == "p" and m["classification_raw"] is None
    assert m["ood"] is None and set(m["diversity"]) == {"p"}
    assert m["classification"]["accuracy"] == pytest.approx(0.8)
    # k = 0: the rule only abstains on exact top-2 ties → nothing deferred, risk = error rate
    assert m["abstention"]["deferral"] == 0.0
    assert m["abstention"]["accepted_risk"] == pytest.approx(0.2)


def test_single_member_ensemble_is_refused() -> None:
    """M = 1 has no spread: VGMU would never abstain and EU ≡ 0, so ensemble scores refuse it."""
    p = _members(20, m=1)
    with pytest.raises(ValueError, match=r"at least 2 members \(M >= 2\).*got M = 1"):
        evaluate_predictions(p, None, p.mean(1).argmax(-1))


def test_input_errors(data: dict) -> None:
    with pytest.raises(ValueError, match="labels"):
        evaluate_predictions(data["p"], None, data["labels"][:10])
    with pytest.raises(ValueError, match="q_ood"):
        evaluate_predictions(data["p"], data["q"], data["labels"], data["p_ood"], None)


def test_plots_and_report_are_written(tmp_path: Path, data: dict) -> None:
    p, labels = data["p"], data["labels"]
    m = evaluate_predictions(p, data["q"], labels, data["p_ood"], data["q_ood"])
    from models.uncertainty.scoring import score_members

    s = score_members(p, data["q"])
    errors = (s.prediction != labels).numpy()
    vg = s.vgmu.numpy()
    written = [
        plots.reliability_diagram(reliability_bins(p.mean(1), labels), tmp_path / "rel.png"),
        plots.margin_variance_geometry(p, vg, tmp_path / "mv.png", abstain_k=1.0),
        plots.risk_coverage_plot({"vgmu": risk_coverage_curve(vg, errors)}, tmp_path / "rc.png"),
        plots.aucc_plot({"vgmu": aucc_curve(vg)}, tmp_path / "aucc.png", values={"vgmu": 0.7}),
        plots.learned_k_plot([0.7, 0.8, 0.65, 0.9, 1.1], tmp_path / "k.png"),
        plots.ood_roc_plot({"vgmu": vg}, {"vgmu": np.ones(5)}, tmp_path / "roc.png"),
    ]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    report = write_report(
        m, tmp_path / "report.md", plots={"Reliability": "rel.png"}, context={"split": "test"}
    )
    text = report.read_text(encoding="utf-8")
    for heading in (
        "Predictive performance",
        "Abstention",
        "Rank consistency",
        "Out-of-distribution",
    ):
        assert f"## {heading}" in text
    assert "![Reliability](rel.png)" in text and "| VGMU |" in text
    assert f"{m['classification']['accuracy']:.4f}" in text


def test_margin_variance_coordinates_hand_computed() -> None:
    # members [0.8, 0.2] and [0.6, 0.4]: margin 0.7 − 0.3 = 0.4; s1 + s2 = 2·0.2/√2
    margin, spread = plots.margin_variance(torch.tensor([[[0.8, 0.2], [0.6, 0.4]]]))
    assert margin[0] == pytest.approx(0.4) and spread[0] == pytest.approx(0.4 / 2**0.5, rel=1e-6)


def test_report_renders_without_optional_sections() -> None:
    p = _members(30)
    text = render_report(evaluate_predictions(p, None, p.mean(1).argmax(-1)))
    assert "Out-of-distribution" not in text and "Figures" not in text
