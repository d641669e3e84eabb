"""The paper-reproduction document (benchmarks/paper.py) built from synthetic member probabilities.

No training: members are drawn so that the in-distribution set is mostly confident and right, and
each OOD set is uncertain; the tables must then hold exactly the shipped evaluation functions'
values, in the expected rows and columns, next to the paper's constants.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from benchmarks import paper
from models.evaluation.classification import accuracy, expected_calibration_error
from models.evaluation.ood import ood_auroc
from models.evaluation.selective import aurc, excess_aurc
from models.uncertainty.scoring import score_members
from models.uncertainty.vgn import vgn

N, M, C = 240, 5, 10
SPECS = {s.key: s for s in paper.SPECS}


def _id_members(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Confident, mostly correct members with varied disagreement; labels (N,)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (N,), generator=g)
    signal = torch.nn.functional.one_hot(y, C).double() * 4.0
    spread = 0.3 + 2.0 * torch.rand(N, 1, 1, generator=g, dtype=torch.float64)
    logits = signal[:, None, :] + spread * torch.randn(N, M, C, generator=g, dtype=torch.float64)
    # errors where the members disagree most (as a trained ensemble's would): relabel those digits
    flip = torch.rand(N, generator=g) < torch.where(spread[:, 0, 0] > 1.9, 0.5, 0.02)
    y = torch.where(flip, (y + 1) % C, y)
    return logits.softmax(-1), y


def _ood_members(n: int, seed: int) -> torch.Tensor:
    """Uncertain members that disagree: small, noisy logits."""
    g = torch.Generator().manual_seed(seed)
    return (1.5 * torch.randn(n, M, C, generator=g, dtype=torch.float64)).softmax(-1)


def _result(key: str, seed: int) -> paper.ConfigResult:
    spec = SPECS[key]
    p, y = _id_members(seed)
    gate = (lambda x: vgn(x, 0.693)) if spec.vgn else (lambda x: None)
    ood = {}
    for i, name in enumerate(paper.OOD_SETS):
        p_ood = _ood_members(120, seed + 10 + i)
        ood[name] = (p_ood, gate(p_ood))
    return paper.evaluate_members(spec, p, gate(p), y, ood, abstain_k=1.0)


@pytest.fixture(scope="module")
def results() -> list[paper.ConfigResult]:
    return [_result(key, seed) for seed, key in enumerate(("lle", "lle-vgn", "mcd-lle"))]


def _cells(table: paper.Table, label: str) -> dict[str, str]:
    """The first row whose first cell starts with ``label``, as header -> cell (first wins)."""
    for row in table.rows:
        if row[0].startswith(label):
            out: dict[str, str] = {}
            for h, v in zip(table.header, row, strict=True):
                out.setdefault(h, v)
            return out
    raise AssertionError(f"no row {label!r}")


def test_performance_table_matches_evaluation_and_paper(results: list[paper.ConfigResult]) -> None:
    t = paper.performance_table(results)
    assert t.header[:3] == ["configuration", "accuracy", "paper"]
    assert [r[0] for r in t.rows] == [
        "LLE (M = 10)",
        "LLE-VGN (M = 10)",
        "MCD-LLE (M = 100 (10 H × 10 S))",
    ]
    assert all(len(r) == len(t.header) for r in t.rows)
    for r in results:
        p, y = _id_members(results.index(r))
        q = vgn(p, 0.693) if r.spec.vgn else None
        served = (q if q is not None else p).mean(1)
        row = _cells(t, r.spec.label + " (")
        assert row["accuracy"] == f"{accuracy(served, y):.4f}"
        assert row["ECE"] == f"{expected_calibration_error(served, y):.4f}"
        assert 0.8 < float(row["accuracy"]) <= 1.0
    lle = _cells(t, "LLE (")
    assert lle["paper"] == "0.972 ± 0.001"  # SI Table S-MNIST, LLE M = 10
    assert lle["paper's M"] == "M = 10"
    assert _cells(t, "MCD-LLE")["paper's M"] == "M = 100"


def test_selective_and_error_detection_match_shipped_functions(
    results: list[paper.ConfigResult],
) -> None:
    sel = paper.selective_table(results)
    cov = paper.coverage_table(results)
    assert sel.header[:3] == ["configuration", "error rate", "AURC VGMU"]
    assert len(sel.header) == 2 + 2 * len(paper.SCORES)
    for i, r in enumerate(results):
        p, y = _id_members(i)
        q = vgn(p, 0.693) if r.spec.vgn else None
        sc = score_members(p, q, abstain_k=1.0)
        errors = (sc.prediction != y).numpy()
        row = _cells(sel, r.spec.label)
        assert row["AURC VGMU"] == f"{100 * aurc(sc.vgmu, errors):.3f}"
        assert row["E-AURC EPJS"] == f"{100 * excess_aurc(sc.epjs, errors):.3f}"
        # error-detection AUROC: errors positive, the score the detector
        expected = roc_auc_score(errors, sc.vgmu.numpy())
        assert r.error_auroc["vgmu"] == pytest.approx(expected, abs=1e-12)
        assert _cells(cov, r.spec.label)["error AUROC VGMU"] == f"{expected:.3f}"
        assert all(0.0 <= v <= 1.0 for v in r.error_auroc.values() if v is not None)
        # confident-and-right synthetic members: the scores find the errors
        assert r.error_auroc["vgmu"] > 0.6


def test_aucc_and_rank_tables(results: list[paper.ConfigResult]) -> None:
    a = paper.aucc_table(results)
    assert a.header[1:6] == ["AUCc VGMU", "AUCc EU", "AUCc MI", "AUCc EPKL", "AUCc EPJS"]
    for r in results:
        row = _cells(a, r.spec.label)
        for s in paper.SCORES:
            v = float(row[f"AUCc {paper.SCORE_LABELS[s]}"])
            assert 0.5 <= v < 1.0
            assert row[f"AUCc {paper.SCORE_LABELS[s]}"] == f"{r.metrics['aucc'][s]:.3f}"
    assert _cells(a, "LLE-VGN")["paper VGMU"] == "0.885 ± 0.009"  # Table 3, CIFAR-10 M = 10
    assert _cells(a, "MCD-LLE")["paper's setting"] == "CIFAR-10, M = 100"

    t = paper.rank_table(results)
    assert t.header == ["configuration", "vs", "ρ (ours)", "paper ρ", "τ (ours)", "paper τ"]
    assert len(t.rows) == len(results) * len(paper.RANK_SCORES)
    assert [r[1] for r in t.rows[:3]] == ["EPJS", "EPKL", "EU"]
    p, y = _id_members(0)
    sc = score_members(p, None)
    rho = spearmanr(sc.vgmu.numpy(), sc.epjs.numpy()).statistic
    assert t.rows[0][:4] == ["LLE", "EPJS", f"{rho:.3f}", "0.992 ± 0.002"]
    assert t.rows[0][5] == "0.939 ± 0.009"  # SI Kendall table, LLE M = 10
    assert all(-1.0 <= float(r[2]) <= 1.0 for r in t.rows)
    mcd_rows = [r for r in t.rows if r[0] == "MCD-LLE"]
    assert all(r[5] == "—" for r in mcd_rows)  # the paper prints no τ for MCD-LLE


def test_ood_tables(results: list[paper.ConfigResult]) -> None:
    for name in paper.OOD_SETS:
        t = paper.ood_table(results, name)
        assert len(t.header) == 2 + 2 * len(paper.SCORES)
        assert [r[0] for r in t.rows] == ["LLE", "LLE-VGN", "MCD-LLE"]
        for r in results:
            row = _cells(t, r.spec.label)
            auroc = float(row["AUROC VGMU"])
            assert row["AUROC VGMU"] == f"{r.ood[name]['scores']['vgmu']['auroc']:.3f}"
            assert auroc > 0.8  # uncertain, disagreeing members vs confident ones
            assert 0.0 <= float(row["FPR@95 EPKL"]) <= 1.0
    # the numbers are those of the shipped ood_auroc on the same scores
    p, y = _id_members(0)
    p_ood = _ood_members(120, 10)
    expected = ood_auroc(score_members(p, None).vgmu, score_members(p_ood, None).vgmu)
    assert results[0].ood["patches"]["scores"]["vgmu"]["auroc"] == pytest.approx(expected)
    for r in results:  # share missed by VGMU at the ID 95th percentile, and caught by EPKL
        assert set(r.vgmu_missed) == set(paper.OOD_SETS)
        for missed, caught in r.vgmu_missed.values():
            assert 0.0 <= missed <= 1.0 and (caught is None or 0.0 <= caught <= 1.0)
    assert paper.vgmu_missed(
        {"vgmu": np.arange(100.0), "epkl": np.arange(100.0)},
        type("S", (), {"vgmu": torch.tensor([0.0, 200.0]), "epkl": torch.tensor([200.0, 0.0])}),
    ) == (0.5, 1.0)
    pt = paper.paper_ood_table(results)
    assert _cells(pt, "LLE-VGN")["paper AUROC VGMU"] == "0.942 ± 0.006"
    assert _cells(pt, "MCD-LLE")["paper FPR@95 VGMU"] == "0.216"


def test_render_document(results: list[paper.ConfigResult]) -> None:
    results[1].learned_k = [0.7 + 0.1 * i for i in range(C)]
    results[0].figures = {"reliability.png": "paper/lle/reliability.png"}
    context = {
        "command": "python -m benchmarks.paper",
        "machine": "2-core CPU, no GPU",
        "date": "2026-01-01",
        "wall_s": 900.0,
        "train_s": 700.0,
        "eval_s": 200.0,
        "train_total_s": 690.0,
        "epochs": 60,
        "quick": False,
    }
    doc = paper.render(results, context)
    for heading in (
        "## 1. Predictive performance and calibration",
        "## 2. Error detection",
        "## 3. Uncertainty mass concentration",
        "## 4. Rank consistency",
        "## 5. Out-of-distribution detection",
        "## 6. Learned k per class",
        "## How this differs from the paper",
    ):
        assert heading in doc
    assert "`python -m benchmarks.paper`" in doc and "2-core CPU, no GPU" in doc
    assert "15.0 min" in doc  # wall time
    assert "![LLE: Reliability diagram (§4.4)](paper/lle/reliability.png)" in doc
    # every markdown table is rectangular
    for block in re.findall(r"((?:^\|.*\|\n)+)", doc, flags=re.M):
        widths = {line.count("|") for line in block.strip().splitlines()}
        assert len(widths) == 1, block
    kt = paper.learned_k_table(results)
    assert kt is not None and kt.rows[0][0] == "LLE-VGN" and kt.rows[0][-1] == "1.15"


def test_shifted_digits_and_formatting() -> None:
    x = torch.arange(2 * 28 * 28, dtype=torch.uint8).reshape(2, 1, 28, 28)
    rot = paper.shifted_digits(x, "rotated")
    assert torch.equal(rot[0, 0, 0], x[0, 0, :, -1])  # first row = last column (90° CCW)
    assert not torch.equal(rot, x)
    r4 = x
    for _ in range(4):
        r4 = paper.shifted_digits(r4, "rotated")
    assert torch.equal(r4, x)
    inv = paper.shifted_digits(x, "inverted")
    assert inv.dtype == torch.uint8 and int(inv[0, 0, 0, 0]) == 255 - int(x[0, 0, 0, 0])
    with pytest.raises(ValueError, match="unknown shift"):
        paper.shifted_digits(x, "blurred")
    assert paper.fmt(None) == "—" and paper.fmt(float("nan")) == "—"
    assert paper.fmt(0.12345, 4) == "0.1235"
    assert paper.fmt_paper((7.6e-4, 0.9e-4)) == "(7.6 ± 0.9)e-4"
    assert paper.fmt_paper((0.238, float("nan"))) == "0.238"
    assert paper.fmt_paper(None) == "—"


def test_train_config_is_the_same_protocol_for_all() -> None:
    configs = {s.key: paper.train_config(s, 60) for s in paper.SPECS}
    assert {c.backbone for c in configs.values()} == {"lenet5"}
    assert {(c.epochs, c.lr, c.lr_schedule, c.augment, c.seed) for c in configs.values()} == {
        (60, 3e-3, "onecycle", True, paper.SEED)
    }
    assert configs["de-vgn"].ensemble == "de" and configs["de-vgn"].vgn
    assert configs["de"].members == 10 and not configs["de"].vgn
    assert paper.SPECS[-1].m_total == 100 and configs["mcd-lle"].mc_samples == 10
