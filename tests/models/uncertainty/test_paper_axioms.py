"""The SI's illustrative ensembles (Table "axiom ensembles", Section S-VG behaviour across axioms).

Every TU/AU/EU/VGMU value the SI text prints for A2–A5, ungated (the SI's "k = 0") and at gate
k = 1 and 2, reproduced to the printed precision.
"""

import pytest
import torch

from models.uncertainty import score_ensemble

ENSEMBLES = {
    "A2_P0": [[1, 0, 0], [0, 1, 0], [0, 0, 1]],
    "A2_Q0": [[1 / 3] * 3] * 3,
    "A3_P0": [[0.7, 0.2, 0.1]] * 3,
    "A3_Q0": [[0.9, 0.1, 0.0], [0.6, 0.3, 0.1], [0.6, 0.2, 0.2]],
    "A45_P0": [[0.8, 0.15, 0.05], [0.7, 0.2, 0.1], [0.6, 0.25, 0.15]],
    "A4_Q0": [[0.5, 0.3, 0.2], [0.4, 0.35, 0.25], [0.3, 0.4, 0.3]],
    "A5_Q0": [[1.0, 0.0, 0.0], [0.9, 0.05, 0.05], [0.8, 0.1, 0.1]],
}


def scores(name: str, gate_k: float | None) -> dict:
    probs = torch.tensor([ENSEMBLES[name]], dtype=torch.float64)
    return score_ensemble(probs, gate_k=gate_k).to_records()[0]


# (ensemble, gate k, key, printed value, printed decimals)
PRINTED = [
    # A2: vertex-spanning members → EU = 1 (maximal); identical uniform members → TU = AU = 1, EU = 0,
    # invariant to gating.
    *[("A2_P0", k, "eu", 1.0, 3) for k in (None, 1.0, 2.0)],
    *[
        ("A2_Q0", k, key, v, 3)
        for k in (None, 1.0, 2.0)
        for key, v in (("tu", 1.0), ("au", 1.0), ("eu", 0.0))
    ],
    # A3: EU 0.000 → 0.070 (k=0), 0.055 (k=1), 0.045 (k=2); TU 0.730 → 0.592 at k=2; VGMU 0.300 → 0.412.
    ("A3_P0", None, "eu", 0.000, 3),
    ("A3_Q0", None, "eu", 0.070, 3),
    ("A3_Q0", 1.0, "eu", 0.055, 3),
    ("A3_Q0", 2.0, "eu", 0.045, 3),
    ("A3_P0", 2.0, "tu", 0.730, 3),
    ("A3_Q0", 2.0, "tu", 0.592, 3),
    ("A3_P0", None, "vgmu", 0.300, 3),
    ("A3_Q0", None, "vgmu", 0.412, 3),
    # A4: TU 0.730 → 0.984, AU 0.714 → 0.971, EU 0.016 → 0.013, VGMU 0.325 → 0.887 (k=0).
    ("A45_P0", None, "tu", 0.730, 3),
    ("A4_Q0", None, "tu", 0.984, 3),
    ("A45_P0", None, "au", 0.714, 3),
    ("A4_Q0", None, "au", 0.971, 3),
    ("A45_P0", None, "eu", 0.016, 3),
    ("A4_Q0", None, "eu", 0.013, 3),
    ("A45_P0", None, "vgmu", 0.325, 3),
    ("A4_Q0", None, "vgmu", 0.887, 3),
    # A5: TU 0.730 → 0.359, AU 0.714 → 0.314, EU 0.016 → 0.045 (k=0), VGMU 0.325 → 0.103.
    ("A5_Q0", None, "tu", 0.359, 3),
    ("A5_Q0", None, "au", 0.314, 3),
    ("A5_Q0", None, "eu", 0.045, 3),
    ("A5_Q0", None, "vgmu", 0.103, 3),
]


@pytest.mark.parametrize(("name", "gate_k", "key", "value", "decimals"), PRINTED)
def test_printed_value(
    name: str, gate_k: float | None, key: str, value: float, decimals: int
) -> None:
    assert round(scores(name, gate_k)[key], decimals) == pytest.approx(value, abs=1e-12)


@pytest.mark.parametrize(("gate_k", "gap"), [(None, 0.029), (1.0, 0.015), (2.0, 0.006)])
def test_a5_eu_gap_narrows_with_k(gate_k: float | None, gap: float) -> None:
    """SI: the P0→Q0 EU gap under a spread-preserving shift is 0.029, 0.015, 0.006 at k = 0, 1, 2."""
    got = scores("A5_Q0", gate_k)["eu"] - scores("A45_P0", gate_k)["eu"]
    assert round(got, 3) == pytest.approx(gap, abs=1e-12)


def test_gated_answer_is_one_distribution() -> None:
    """With a gate the whole answer comes from q (default); ``vgmu_on="p"`` keeps the raw members."""
    probs = torch.tensor([ENSEMBLES["A3_Q0"]], dtype=torch.float64)
    raw = score_ensemble(probs, gate_k=None).to_records()[0]
    on_p = score_ensemble(probs, gate_k=2.0, vgmu_on="p").to_records()[0]
    on_q = score_ensemble(probs, gate_k=2.0).to_records()[0]
    assert on_p["vgmu"] == pytest.approx(raw["vgmu"]) and on_p["eu"] == pytest.approx(raw["eu"])
    gated = score_ensemble(torch.tensor([ENSEMBLES["A3_Q0"]], dtype=torch.float64), gate_k=2.0)
    assert on_q["vgmu"] == pytest.approx(float(gated.vgmu[0])) and on_q["vgmu"] != raw["vgmu"]
