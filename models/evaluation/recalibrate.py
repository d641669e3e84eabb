"""Recalibrate a saved model's ``abstain_k`` on the served rule and refresh its card's metrics.

``python -m models.evaluation.recalibrate MODEL_DIR [--target-deferral 0.05]`` re-runs, for an
existing model directory, what training does at the end (:func:`models.training.train`): the
validation split calibrates ``abstain_k`` for VGMU on the answer's members (``q`` for VGN models,
:func:`models.evaluation.calibration.calibrate_served`), and the card's ``metrics.evaluation``
becomes the test split under that rule at that ``k``. The weights (and their sha256) are untouched.
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


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=float))


def recalibrate(
    model_dir: str | Path, target_deferral: float | None = None, target_risk: float | None = None
) -> dict[str, Any]:
    """Recalibrate ``model_dir`` in place; returns the new ``abstain_calibration``."""
    from models.predictor import Predictor

    model_dir = Path(model_dir)
    card = read_card(model_dir)
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
