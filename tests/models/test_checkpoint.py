"""Checkpoints: safetensors + JSON card, sha256 verification, no unpickling."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from models.checkpoint import (
    CARD_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    ModelCard,
    load_checkpoint,
    save_checkpoint,
)
from models.ensembles import build_ensemble

torch.set_num_threads(1)


def _card(**kw) -> ModelCard:
    base = dict(
        name="tiny",
        backbone="lenet5",
        ensemble="lle",
        members=3,
        vgn=True,
        class_names=[str(i) for i in range(10)],
        in_channels=1,
        input_size=(28, 28),
        mean=[0.13],
        std=[0.31],
        data_fingerprint="f" * 64,
        metrics={"test_accuracy": 0.5},
        abstain_calibration={"abstain_k": 0.7, "members": "q", "curve": []},
    )
    base.update(kw)
    return ModelCard(**base)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = build_ensemble("lle", "lenet5", 10, 3, vgn=True)
    with torch.no_grad():
        model.vgn.k_logit.copy_(torch.linspace(-1, 1, 10))
    card = save_checkpoint(model, _card(), tmp_path)
    return model.eval(), card, tmp_path


def test_roundtrip(saved):
    model, card, d = saved
    assert (d / WEIGHTS_FILE).is_file() and (d / CARD_FILE).is_file()
    assert len(card.weights_sha256) == 64
    torch.testing.assert_close(torch.tensor(card.learned_k), model.vgn.k.detach())
    loaded, card2 = load_checkpoint(d, "cpu")
    assert card2 == card and card2.abstain_k == 0.7 and not loaded.training
    x = torch.randn(2, 1, 28, 28)
    a, b = model(x), loaded(x)
    torch.testing.assert_close(a.p, b.p)
    torch.testing.assert_close(a.q, b.q)
    assert json.loads((d / CARD_FILE).read_text())["metrics"] == {"test_accuracy": 0.5}


@pytest.mark.parametrize("kind", ["de", "mcd", "mcd-lle"])
def test_roundtrip_other_kinds(tmp_path, kind):
    torch.manual_seed(0)
    model = build_ensemble(kind, "lenet5", 10, 2, mc_samples=2)
    save_checkpoint(model, _card(ensemble=kind, members=2, vgn=False, mc_samples=2), tmp_path)
    loaded, _ = load_checkpoint(tmp_path)
    sd1, sd2 = model.state_dict(), loaded.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        torch.testing.assert_close(sd1[k], sd2[k])


def test_tampered_weights_are_rejected(saved):
    _, _, d = saved
    raw = bytearray((d / WEIGHTS_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (d / WEIGHTS_FILE).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*sha256"):
        load_checkpoint(d)


def test_missing_and_malformed_files(saved):
    _, _, d = saved
    card_text = (d / CARD_FILE).read_text()
    (d / CARD_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="model_card.json"):
        load_checkpoint(d)
    bad = json.loads(card_text)
    del bad["backbone"]
    (d / CARD_FILE).write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="backbone"):
        load_checkpoint(d)
    (d / CARD_FILE).write_text(card_text)
    (d / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match="model.safetensors.*not found"):
        load_checkpoint(d)
    (d / CARD_FILE).unlink()
    with pytest.raises(CheckpointError, match="model_card.json.*not found"):
        load_checkpoint(d)
    assert issubclass(CheckpointError, ValueError)


def test_architecture_mismatch_is_a_checkpoint_error(saved):
    _, _, d = saved
    card = json.loads((d / CARD_FILE).read_text())
    card["members"] = 4  # weights hold 3 heads
    (d / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(CheckpointError, match="cannot load weights"):
        load_checkpoint(d)


def test_loading_never_unpickles(saved, monkeypatch):
    _, _, d = saved

    def boom(*a, **k):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    load_checkpoint(d)
    assert (d / WEIGHTS_FILE).read_bytes()[8:9] == b"{"  # safetensors: u64 header size + JSON
