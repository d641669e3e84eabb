"""The shipped default model: loads, verifies, reproduces its card's test accuracy, is deterministic."""

from __future__ import annotations

import json

import torch

from models.data import bundled_split, load_bundled_mnist, load_dataset
from models.predictor import Predictor
from models.zoo import default_model_dir

torch.set_num_threads(1)


def _test_inputs(pred: Predictor) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_bundled_mnist()
    idx = bundled_split()["test"]
    x = torch.stack([pred.prepare(torch.from_numpy(images[i]).unsqueeze(0)) for i in idx])
    return x, torch.from_numpy(labels[idx])


def test_default_model_card_and_files():
    d = default_model_dir()
    card = json.loads((d / "model_card.json").read_text())
    assert (card["backbone"], card["ensemble"], card["members"], card["vgn"]) == (
        "lenet5",
        "lle",
        10,
        True,
    )
    assert len(card["learned_k"]) == 10 and all(k > 0 for k in card["learned_k"])
    assert card["data_fingerprint"] == load_dataset("mnist-bundled").fingerprint
    assert card["abstain_calibration"]["abstain_k"] > 0
    assert (d / "model.safetensors").stat().st_size < 1_000_000  # small package data
    assert (d / "README.md").is_file()


def test_default_model_reproduces_recorded_test_accuracy_and_is_deterministic():
    pred = Predictor.from_dir(default_model_dir(), device="cpu")  # verifies sha256
    x, y = _test_inputs(pred)
    outs = [pred.forward(x[i : i + 512]) for i in range(0, len(x), 512)]  # training's eval batches
    q = torch.cat([o.q for o in outs])
    correct = int((q.mean(1).argmax(1) == y).sum())
    recorded = pred.card.metrics["test_accuracy"]
    assert correct == round(recorded * len(y))  # exactly the card's number
    # Honest floor: the exact SI S3.1 LeNet-5 (16-dim pooled features) trained on the 5,600-image
    # bundled split with training-time augmentation reaches 0.959 (0.957-0.962 over seeds 0-2),
    # below the paper's 0.973 on full MNIST (60k images); see README.md.
    assert recorded >= 0.955
    again = pred.forward(x[:512])
    assert torch.equal(again.p, outs[0].p) and torch.equal(again.q, outs[0].q)
    rows1 = pred.score(outs[0])
    rows2 = pred.score(again)
    assert rows1 == rows2
    assert rows1[0]["abstain_k"] == pred.card.abstain_calibration["abstain_k"]
