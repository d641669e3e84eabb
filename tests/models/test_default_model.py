"""The shipped default model: loads, verifies, reproduces its card's test accuracy, is deterministic."""

from __future__ import annotations

import json

import numpy as np
import torch

from models.data import bundled_split, load_bundled_mnist, load_dataset
from models.predictor import Predictor
from models.zoo import default_model_dir

torch.set_num_threads(1)


def _prepared(pred: Predictor, images: np.ndarray) -> torch.Tensor:
    """uint8 digits ``(N, 28, 28)`` read as served: ``(N, 1, 28, 28)`` model inputs."""
    return torch.stack([pred.prepare(torch.from_numpy(img).unsqueeze(0)) for img in images])


def _test_inputs(pred: Predictor) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_bundled_mnist()
    idx = bundled_split()["test"]
    return _prepared(pred, images[idx]), torch.from_numpy(labels[idx])


def test_default_model_card_and_files():
    d = default_model_dir()
    card = json.loads((d / "model_card.json").read_text())
    assert (card["backbone"], card["ensemble"], card["members"], card["vgn"]) == (
        "cnn4",
        "lle",
        10,
        True,
    )
    assert len(card["learned_k"]) == 10 and all(k > 0 for k in card["learned_k"])
    assert card["data_fingerprint"] == load_dataset("mnist-bundled").fingerprint
    assert card["abstain_calibration"]["abstain_k"] > 0
    # small package data: 3.6 MB, most of it the 3136 -> 256 feature layer (4.0.0's width)
    assert (d / "model.safetensors").stat().st_size < 4_000_000
    assert (d / "README.md").is_file()


def test_default_model_reproduces_recorded_test_accuracy_and_is_deterministic():
    pred = Predictor.from_dir(default_model_dir(), device="cpu")  # verifies sha256
    x, y = _test_inputs(pred)
    outs = [pred.forward(x[i : i + 512]) for i in range(0, len(x), 512)]  # training's eval batches
    q = torch.cat([o.q for o in outs])
    correct = int((q.mean(1).argmax(1) == y).sum())
    recorded = pred.card.metrics["test_accuracy"]
    assert correct == round(recorded * len(y))  # exactly the card's number
    assert recorded >= 0.99  # the target for the shipped default
    again = pred.forward(x[:512])
    assert torch.equal(again.p, outs[0].p) and torch.equal(again.q, outs[0].q)
    rows1 = pred.score(outs[0])
    rows2 = pred.score(again)
    assert rows1 == rows2
    assert rows1[0]["abstain_k"] == pred.card.abstain_calibration["abstain_k"]


def test_shipped_default_meets_its_targets_on_the_test_split():
    """Accepted answers ≥ 0.998 correct at ≤ 5 % deferral with the calibrated k; ECE ≤ 0.01 —
    under the served rule (VGMU on q̄), as the card reports them."""
    card = json.loads((default_model_dir() / "model_card.json").read_text())
    ev = card["metrics"]["evaluation"]
    assert ev["predictive"] == "q" and card["abstain_calibration"]["members"] == "q"
    assert ev["abstention"]["abstain_k"] == card["abstain_calibration"]["abstain_k"]
    assert ev["abstention"]["deferral"] <= 0.05
    assert 1 - ev["abstention"]["accepted_risk"] >= 0.998
    assert ev["classification"]["ece"] <= 0.01
    assert card["uncertainty_reference"]["fractions"].keys() == {"vgmu", "eu"}


def test_paper_lenet5_is_a_second_zoo_entry():
    from models.zoo import zoo_model_dir, zoo_models

    # the old default stays beside the new one
    assert {"cnn4-lle-vgn-mnist", "lenet5-lle-vgn-mnist"} <= set(zoo_models())
    pred = Predictor.from_dir(zoo_model_dir("lenet5-lle-vgn-mnist"), device="cpu")
    assert pred.card.backbone == "lenet5" and pred.card.metrics["test_accuracy"] >= 0.955


def test_shipped_default_meets_every_target_on_the_held_out_digits_and_pooled():
    """On the 2,000 MNIST digits outside the bundle (never used for any choice), through the
    served path: accuracy ≥ 0.99, accepted ≥ 0.998 correct at the calibrated k, ECE ≤ 0.01, VGMU
    error-detection AUROC ≥ 0.97; and issue 33's deferral rule, ≤ 5.5 % on the test split and
    the held-out digits pooled (a 4.5 % target on 800 validation digits lands on 4.4 % of the
    test split and 5.5 % of the held-out digits: see the model's README)."""
    from models.data import load_holdout_mnist
    from models.evaluation.evaluate import evaluate_predictions, forward_all

    pred = Predictor.from_dir(default_model_dir(), device="cpu")
    k = pred.card.abstain_calibration["abstain_k"]
    images, labels = load_holdout_mnist()
    held_out = forward_all(pred, _prepared(pred, images), 512)  # the training's eval batches
    y_held_out = torch.from_numpy(labels)
    ev = evaluate_predictions(*held_out, y_held_out, abstain_k=k)
    assert ev["classification"]["accuracy"] >= 0.99
    assert 1 - ev["abstention"]["accepted_risk"] >= 0.998
    assert ev["classification"]["ece"] <= 0.01
    assert ev["selective"]["vgmu"]["error_auroc"] >= 0.97
    x_test, y_test = _test_inputs(pred)
    test = forward_all(pred, x_test, 512)
    pooled = evaluate_predictions(
        *(torch.cat(pair) for pair in zip(held_out, test, strict=True)),
        torch.cat([y_held_out, y_test]),
        abstain_k=k,
    )
    assert pooled["classification"]["accuracy"] >= 0.99
    assert 1 - pooled["abstention"]["accepted_risk"] >= 0.998
    assert pooled["abstention"]["deferral"] <= 0.055
