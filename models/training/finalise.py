"""The end of a run (rank 0): evaluate the restored best model, calibrate ``abstain_k`` and write
the checkpoint — weights and a model card written once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from models.checkpoint import ModelCard, save_checkpoint
from models.data import DataBundle

from .config import DEFAULT_TARGET_DEFERRAL, TrainConfig
from .runtime import Runtime
from .validate import basic_metrics, collect_predictions

__all__ = ["TrainResult", "finalise"]


@dataclass(frozen=True)
class TrainResult:
    """What the loop hands over: per-epoch history and how the run ended."""

    history: list[dict[str, float]]
    best_epoch: int
    best_loss: float
    epochs_run: int
    train_seconds: float
    cancelled: bool
    init: dict[str, Any] | None = None  # the model whose weights started the run, if any


def _jsonable(obj: Any) -> Any:
    """Convert tensors/numpy/NaN into JSON-ready Python values (NaN/inf -> None)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Tensor):
        return _jsonable(obj.detach().cpu().tolist() if obj.ndim else obj.item())
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)


def _card(
    config: TrainConfig, bundle: DataBundle, rt: Runtime, result: TrainResult, metrics: dict
) -> ModelCard:
    return ModelCard(
        **config.architecture().model_dump(),
        name=config.model_name(),
        version=config.version,
        description=config.description,
        class_names=bundle.class_names,
        in_channels=bundle.in_channels,
        input_size=bundle.input_size,
        mean=list(bundle.mean),
        std=list(bundle.std),
        dataset=bundle.name,
        data_fingerprint=bundle.fingerprint,
        # JSON-ready (NaN/inf -> None): a card holds finite numbers only (ModelCard), and a
        # diverged run's losses must not keep its card from being written
        metrics=_jsonable(metrics),
        training=_jsonable(
            {
                "config": config.model_dump(mode="json"),
                "epochs_run": result.epochs_run,
                "best_epoch": result.best_epoch,
                "train_seconds": round(result.train_seconds, 1),
                "device": str(rt.device),
                "world_size": rt.world,
                "torch": torch.__version__,
                "cancelled": result.cancelled,
                "init": result.init,
                "history": result.history,
            }
        ),
    )


def finalise(
    config: TrainConfig,
    model: nn.Module,
    bundle: DataBundle,
    out_dir: Path,
    rt: Runtime,
    result: TrainResult,
) -> ModelCard:
    """Evaluate ``model`` (the restored best weights) on the test and validation splits,
    calibrate ``abstain_k`` on the served rule, write weights + card; returns the card written.

    Should calibration or evaluation fail, the weights and a card with the basic metrics are
    written all the same before the error propagates: a finished run is never lost.
    """
    from models.evaluation.calibration import calibrate_served
    from models.evaluation.drift import served_reference
    from models.evaluation.evaluate import evaluate_predictions
    from models.evaluation.ood_suite import card_ood_suite

    bs = config.eval_batch_size
    p_test, q_test, y_test = collect_predictions(model, bundle.test, rt.device, bs)
    p_val, q_val, y_val = collect_predictions(model, bundle.val, rt.device, bs)
    test = basic_metrics(p_test, q_test, y_test)
    metrics: dict[str, Any] = {
        "split": "test",
        "n_test": len(y_test),
        "test_accuracy": test["accuracy"],
        "test_nll": test["nll"],
        "val_accuracy": basic_metrics(p_val, q_val, y_val)["accuracy"],
        "best_val_loss": result.best_loss,
    }
    card = _card(config, bundle, rt, result, metrics)
    try:
        target_deferral = config.target_deferral
        if target_deferral is None and config.target_risk is None:
            target_deferral = DEFAULT_TARGET_DEFERRAL
        # Calibrate on exactly the served rule (VGMU on q̄ for VGN models), then report the test
        # split under that rule at that k: the card describes what the service does.
        # Calibrate on digits never trained on: the validation split, and the calibration
        # split carved out of train before training when the config asks for one
        # (TrainConfig.calibration_split: a quantile of 1,600 digits, not 800).
        p_cal, q_cal, y_cal = p_val, q_val, y_val
        if bundle.calib is not None:
            p_c, q_c, y_c = collect_predictions(model, bundle.calib, rt.device, bs)
            p_cal, y_cal = torch.cat([p_val, p_c]), torch.cat([y_val, y_c])
            q_cal = None if q_val is None or q_c is None else torch.cat([q_val, q_c])
            metrics["n_calibration"] = len(y_cal)
        calib = calibrate_served(
            p_cal, q_cal, y_cal, target_deferral=target_deferral, target_risk=config.target_risk
        )
        evaluation = evaluate_predictions(p_test, q_test, y_test, abstain_k=calib["abstain_k"])
        evaluation["ood_suite"] = card_ood_suite(  # docs/ood-suite.md, per group
            model,
            bundle.mean,
            bundle.std,
            bundle.input_size,
            p_test,
            q_test,
            calib["abstain_k"],
            rt.device,
            n_per_group=config.ood_suite_per_group,
        )
        card = card.model_copy(
            update={
                "metrics": {**card.metrics, "evaluation": _jsonable(evaluation)},
                "abstain_calibration": _jsonable(dict(calib)),
                "uncertainty_reference": served_reference(p_cal, q_cal, calib),
            }
        )
    except Exception:
        save_checkpoint(model, card, out_dir)
        raise
    return save_checkpoint(model, card, out_dir)
