"""The promote gate (models.evaluation.promote_gate): its comparison, verdict, skip rule and the
evaluation on its digits, with real numbers (a stand-in predictor whose accuracy is known from the
labels, and the shipped default model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from models.checkpoint import ModelCard, read_card
from models.evaluation.promote_gate import (
    GATE_DATA,
    GateTolerances,
    compare_for_gate,
    evaluate_for_gate,
    gate_data,
    gate_skip_reason,
    gate_verdict,
    rates,
)
from models.serving import ScoreOptions
from models.zoo import default_model_dir

torch.set_num_threads(1)
TOL = GateTolerances(accuracy_drop=0.01, accepted_accuracy_drop=0.005, deferral_rise=0.02)


def _result(accuracy: float, accepted: float | None, deferral: float) -> dict[str, Any]:
    return {"accuracy": accuracy, "accepted_accuracy": accepted, "deferral": deferral}


def test_a_candidate_within_every_tolerance_passes_with_its_deltas() -> None:
    served, candidate = _result(0.96, 0.985, 0.05), _result(0.955, 0.982, 0.065)
    c = compare_for_gate(served, candidate, TOL)
    assert c["failures"] == [] and gate_verdict(c["failures"], force=False) == "passed"
    assert c["deltas"] == {"accuracy": -0.005, "accepted_accuracy": -0.003, "deferral": 0.015}
    assert c["data"] == GATE_DATA and c["served"] is served and c["candidate"] is candidate
    assert c["tolerances"] == {
        "accuracy_drop": 0.01,
        "accepted_accuracy_drop": 0.005,
        "deferral_rise": 0.02,
    }


def test_exactly_at_each_tolerance_passes_and_just_beyond_fails() -> None:
    served = _result(0.96, 0.985, 0.05)
    at = compare_for_gate(served, _result(0.95, 0.98, 0.07), TOL)  # 0.96 - 0.01 in floats
    assert at["failures"] == [], at["failures"]
    beyond = compare_for_gate(served, _result(0.9499, 0.9799, 0.0701), TOL)
    assert beyond["failures"] == [
        "accuracy 0.9499 is 0.0101 below the served model's 0.9600 (tolerance 0.01)",
        "accepted-answer accuracy 0.9799 is 0.0051 below the served model's 0.9850 "
        "(tolerance 0.005)",
        "deferral rate 0.0701 is 0.0201 above the served model's 0.0500 (tolerance 0.02)",
    ]
    assert gate_verdict(beyond["failures"], force=False) == "refused"
    assert gate_verdict(beyond["failures"], force=True) == "forced"


def test_deferring_more_to_look_more_accurate_is_still_refused() -> None:
    """Higher accepted-answer accuracy does not buy a deferral rate far above the served one."""
    c = compare_for_gate(_result(0.96, 0.97, 0.02), _result(0.96, 0.999, 0.30), TOL)
    assert len(c["failures"]) == 1 and c["failures"][0].startswith("deferral rate 0.3000")
    assert c["deltas"]["accepted_accuracy"] == pytest.approx(0.029)


def test_a_candidate_accepting_nothing_fails_and_a_served_one_accepting_nothing_is_no_bar() -> None:
    c = compare_for_gate(_result(0.96, 0.98, 0.05), _result(0.96, None, 1.0), TOL)
    assert c["deltas"]["accepted_accuracy"] is None
    assert (
        "the candidate accepts no answer (deferral 1.0); the served model's accepted-answer "
        "accuracy is 0.9800" in c["failures"]
    )
    c = compare_for_gate(_result(0.5, None, 1.0), _result(0.5, 0.7, 0.6), TOL)
    assert c["failures"] == [] and c["deltas"]["accepted_accuracy"] is None
    assert c["deltas"]["deferral"] == -0.4


def test_rates_counts_accepted_answers_only_for_accepted_accuracy() -> None:
    correct = np.array([True, True, False, False, True])
    abstain = np.array([False, False, False, True, True])
    assert rates(correct, abstain) == {
        "n": 5,
        "accuracy": 0.6,
        "accepted_accuracy": round(2 / 3, 5),
        "deferral": 0.4,
    }
    assert rates(correct, np.ones(5, bool))["accepted_accuracy"] is None


def _card(class_names: list[str], **more: Any) -> ModelCard:
    base = read_card(default_model_dir()).model_dump()
    return ModelCard(**{**base, "class_names": class_names, **more})


def test_the_gate_skips_models_that_do_not_answer_digits() -> None:
    assert gate_skip_reason(_card([str(i) for i in range(10)])) is None
    assert gate_skip_reason(_card([str(i) for i in reversed(range(10))])) is None  # any order
    reason = gate_skip_reason(_card(list("abcdefghij"), name="letters", version="1.2.3"))
    assert reason == (
        "letters 1.2.3's classes (a, b, c, d, …) are not the ten digits '0'…'9' of the gate's "
        "evaluation data"
    )


class _Constant:
    """A stand-in predictor that answers class index 0 for every image and defers every second
    batch row: its accuracy is the share of the digit its class 0 names."""

    def __init__(self, card: ModelCard) -> None:
        self.card = card

    def conform(self, image: torch.Tensor) -> torch.Tensor:
        return image

    def run(self, parts: Sequence[Any]) -> np.ndarray:
        return np.asarray(parts[0])

    def options(self, *, top_k: int = 5) -> ScoreOptions:
        return ScoreOptions(abstain_k=0.75, members="q", top_k=top_k)

    def score_columns(self, out: np.ndarray, options: ScoreOptions) -> Any:
        n = out.shape[0]

        class Columns:
            def column(self, name: str) -> np.ndarray:
                if name == "prediction":
                    return np.zeros(n, np.int64)
                return np.arange(n) % 2 == 1

        return Columns()


def test_evaluate_for_gate_scores_the_digits_each_class_index_names() -> None:
    labels = np.concatenate([labels for _, labels in gate_data().values()])
    assert labels.size == 3600 and [v[1].size for v in gate_data().values()] == [1600, 2000]
    for names, digit in (([str(i) for i in range(10)], 0), ([str(9 - i) for i in range(10)], 9)):
        result = evaluate_for_gate(_Constant(_card(names)), batch=64)  # type: ignore[arg-type]
        assert result["n"] == 3600 and result["abstain_k"] == 0.75 and result["members"] == "q"
        assert result["accuracy"] == round(float((labels == digit).mean()), 5)
        assert 0.08 < result["accuracy"] < 0.12  # a tenth of the digits, not 0 or 1
        assert result["deferral"] == 0.5  # odd rows of every 64-row batch (1600, 2000 even)
        assert set(result["by_part"]) == {"test", "holdout"}
        assert result["by_part"]["test"]["n"] == 1600


def test_the_shipped_default_model_passes_against_itself_and_a_worse_one_is_refused() -> None:
    from models.predictor import Predictor

    predictor = Predictor.from_dir(default_model_dir(), device="cpu")
    served = evaluate_for_gate(predictor, batch=256)
    assert served["n"] == 3600 and served["model"] == predictor.card.name
    assert served["accuracy"] > 0.95, served  # a real model on real digits
    assert served["accepted_accuracy"] >= served["accuracy"]
    assert 0.0 < served["deferral"] < 0.2, served
    same = compare_for_gate(served, served, TOL)
    assert same["failures"] == [] and set(same["deltas"].values()) == {0.0}
    worse = _result(served["accuracy"] - 0.05, served["accepted_accuracy"], served["deferral"])
    refused = compare_for_gate(served, worse, TOL)
    assert len(refused["failures"]) == 1 and refused["failures"][0].startswith("accuracy ")
    assert gate_verdict(refused["failures"], force=False) == "refused"
