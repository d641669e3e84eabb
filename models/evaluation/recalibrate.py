"""Recalibrate a saved model's ``abstain_k`` on the served rule and refresh its card's metrics.

``python -m models.evaluation.recalibrate MODEL_DIR [--target-deferral 0.05]`` re-runs, for an
existing model directory, what training does at the end (:func:`models.training.train`): the
validation split calibrates ``abstain_k`` for VGMU on the answer's members (``q`` for VGN models,
:func:`models.evaluation.calibration.calibrate_served`), and the card's ``metrics.evaluation``
becomes the test split and the OOD suite under that rule at that ``k``. The weights (and their
sha256) are untouched. A model calibrated on a split carved out of its training digits too
(``calibration_split``) is refused: that split is not rebuilt here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from models.checkpoint import read_card, save_card
from models.evaluation.calibration import calibrate_served
from models.evaluation.evaluate import evaluate_predictions, forward_all, load_split
from models.evaluation.ood_suite import SUITE_PER_GROUP


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=float))


def recalibrate(
    model_dir: str | Path, target_deferral: float | None = None, target_risk: float | None = None
) -> dict[str, Any]:
    """Recalibrate ``model_dir`` in place; returns the new ``abstain_calibration``."""
    from models.predictor import Predictor

    model_dir = Path(model_dir)
    card = read_card(model_dir)
    recorded = card.training.get("config") if isinstance(card.training, dict) else None
    share = (recorded or {}).get("calibration_split") or 0.0
    if share:
        raise ValueError(
            f"{model_dir}: calibrated on the validation split and a calibration split of "
            f"{share:g} of its training digits carved before training; this tool calibrates on "
            "the validation split only: retrain the model to recalibrate it"
        )
    old = card.abstain_calibration or {}
    if target_deferral is None and target_risk is None:
        mode = old.get("mode", "deferral")
        target = float(old.get("target", 0.05))
        target_deferral, target_risk = (target, None) if mode == "deferral" else (None, target)
    predictor = Predictor.from_dir(model_dir, device="cpu")
    x_val, y_val, _ = load_split(predictor, "val", None)
    p_val, q_val = forward_all(predictor, x_val)
    calib = calibrate_served(p_val, q_val, y_val, target_deferral, target_risk)
    x_test, y_test, _ = load_split(predictor, "test", None)
    p_test, q_test = forward_all(predictor, x_test)
    evaluation = evaluate_predictions(p_test, q_test, y_test, abstain_k=calib["abstain_k"])
    per_group = (recorded or {}).get("ood_suite_per_group", SUITE_PER_GROUP)
    evaluation["ood_suite"] = (
        _suite(predictor, p_test, q_test, calib["abstain_k"], int(per_group)) if per_group else None
    )
    metrics = dict(card.metrics)
    metrics["evaluation"] = _jsonable(evaluation)
    metrics["test_accuracy"] = evaluation["classification"]["accuracy"]
    from models.evaluation.drift import served_reference

    update = {
        "metrics": metrics,
        "abstain_calibration": _jsonable(calib),
        "uncertainty_reference": served_reference(p_val, q_val, calib),
    }
    save_card(card.model_copy(update=update), model_dir)
    return calib


def _suite(
    predictor: Any, p: Any, q: Any, abstain_k: float, n_per_group: int
) -> dict[str, Any] | None:
    """The OOD suite's numbers at the new ``abstain_k``, as training stores them in the card
    (``metrics.evaluation.ood_suite``; None for a model the MNIST-shaped suite does not fit)."""
    card = predictor.card
    if int(card.in_channels) != 1 or tuple(card.input_size) != (28, 28):
        return None
    from models.data import normalise_uint8
    from models.evaluation.ood_suite import ood_suite_metrics, suite_members

    _, suite, no_digit, labels = suite_members(
        lambda b: forward_all(predictor, b),
        lambda u: normalise_uint8(u, card.mean, card.std),
        predictor.prepare_mode,
        n_per_group=n_per_group,
    )
    return _jsonable(ood_suite_metrics(p, q, suite, abstain_k, no_digit, labels))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.evaluation.recalibrate")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--target-deferral", type=float, default=None)
    parser.add_argument("--target-risk", type=float, default=None)
    args = parser.parse_args(argv)
    try:
        calib = recalibrate(args.model_dir, args.target_deferral, args.target_risk)
    except (ValueError, OSError) as exc:
        print(f"recalibrate: error: {exc}", file=sys.stderr)
        return 2
    shown = {k: v for k, v in calib.items() if k != "curve"}
    print(json.dumps(shown, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
