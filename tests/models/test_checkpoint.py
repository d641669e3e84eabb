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


# ------------------------------------------------------------------ the card as untrusted input
# (issue 36, item 1): validated whole, every failure a CheckpointError naming the field


def _write_card(d, **changes) -> None:
    card = json.loads((d / CARD_FILE).read_text())
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        if sub:
            card[section] = {**card.get(section, {}), sub: value}
        else:
            card[key] = value
    (d / CARD_FILE).write_text(json.dumps(card))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"uncertainty_reference__deferral": "not-a-number"}, "uncertainty_reference.deferral"),
        ({"uncertainty_reference__fractions": {"vgmu": [1.0]}}, "fractions"),
        ({"uncertainty_reference__fractions": {"../x": [0.0] * 12}}, "fractions"),
        ({"abstain_calibration__abstain_k": "abc"}, "abstain_calibration.abstain_k"),
        ({"class_names": [str(i) for i in range(9)] + ["../outside"]}, "class_names"),
        ({"class_names": [str(i) for i in range(9)] + ["/abs"]}, "class 9"),
        ({"class_names": ["0"] * 10}, "appears more than once"),
        ({"name": "../evil"}, "name"),
        ({"version": "1..0"}, "version"),
        ({"input_size": [768, 768]}, "input_size"),
        ({"input_size": [30000, 30000]}, "input_size"),
        ({"in_channels": -1}, "in_channels"),
        ({"mean": []}, "mean"),
        ({"std": [0.0]}, "std"),
        ({"metrics": {"nll": float("nan")}}, "metrics"),
        ({"training": {"history": [{"loss": float("inf")}]}}, "history[0].loss"),
        ({"members": 101}, "members"),
        ({"backbone_kwargs": {"width": 10**9}}, "backbone_kwargs"),
        ({"learned_k": [1.0] * 3}, "learned_k"),
    ],
)
def test_a_bad_card_is_refused_naming_the_field(saved, changes, named):
    _, _, d = saved
    _write_card(d, **changes)
    with pytest.raises(CheckpointError, match="invalid model card") as info:
        load_checkpoint(d)
    assert named in str(info.value)


def test_card_sections_keep_their_order_and_the_shipped_cards_load():
    from models.checkpoint import read_card
    from models.zoo import zoo_dir, zoo_models

    for name in zoo_models():
        raw = json.loads((zoo_dir() / name / CARD_FILE).read_text())
        card = read_card(zoo_dir() / name)
        dumped = card.model_dump(mode="json")
        for section in ("abstain_calibration", "uncertainty_reference"):
            assert list(dumped[section]) == list(raw[section]), (name, section)
            assert dumped[section] == raw[section]


def test_symlinked_weights_are_refused_without_hashing_them(saved, tmp_path_factory):
    """A hash oracle no more: the error never carries the target's sha256, and the target is
    never opened (a FIFO as the target would block a reader for good)."""
    import hashlib
    import os

    from models.checkpoint import file_sha256

    _, card, d = saved
    secret = tmp_path_factory.mktemp("secret") / "passwd"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/sh\n")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    (d / WEIGHTS_FILE).unlink()
    (d / WEIGHTS_FILE).symlink_to(secret)
    with pytest.raises(CheckpointError, match="symbolic link") as info:
        load_checkpoint(d)
    assert digest[:16] not in str(info.value) and digest not in str(info.value)
    with pytest.raises(CheckpointError, match="symbolic link"):
        file_sha256(d / WEIGHTS_FILE)
    (d / WEIGHTS_FILE).unlink()
    os.mkfifo(d / WEIGHTS_FILE)  # not a regular file: refused at once, not read
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_checkpoint(d)
    (d / WEIGHTS_FILE).unlink()
    (d / CARD_FILE).rename(d / "real-card.json")
    (d / CARD_FILE).symlink_to(d / "real-card.json")
    with pytest.raises(CheckpointError, match="model card is a symbolic link"):
        load_checkpoint(d)


@pytest.mark.parametrize("weights", ["junk", "truncated", "other-architecture"])
def test_weights_that_are_not_the_cards_are_refused_by_their_header(saved, weights):
    """The card's sha256 matches these files (whoever wrote the card hashed them): the header
    is what refuses them, before anything is allocated for them."""
    from models.checkpoint import file_sha256

    _, _, d = saved
    path = d / WEIGHTS_FILE
    if weights == "junk":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not safetensors at all")
        match = "not a readable safetensors file"
    elif weights == "truncated":
        path.write_bytes(path.read_bytes()[:-16])
        match = "not a readable safetensors file"
    else:
        save_checkpoint(build_ensemble("lle", "lenet5", 10, 4, vgn=True), _card(members=4), d)
        card = json.loads((d / CARD_FILE).read_text())
        (d / CARD_FILE).write_text(json.dumps({**card, "members": 3}))  # the weights hold 4 heads
        match = "do not match the card's architecture"
    _write_card(d, weights_sha256=file_sha256(path))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(d)


def test_a_card_is_never_written_that_would_not_load(tmp_path):
    from models.checkpoint import save_card

    card = _card().model_copy(update={"metrics": {"nll": float("nan")}})  # copies skip validation
    with pytest.raises(ValueError, match="metrics"):
        save_card(card, tmp_path)
    assert not (tmp_path / CARD_FILE).exists()


def test_weights_take_the_mode_any_new_file_gets(tmp_path):
    """Weights are world-readable under the usual umask 022 (to be packaged) and private under
    ``vge serve``'s default VGE_UMASK 0077 (issue 36: files the server creates are 0600)."""
    import os
    import stat

    model = build_ensemble("lle", "lenet5", 10, 3, vgn=True)
    old = os.umask(0o077)
    try:
        save_checkpoint(model, _card(), tmp_path / "private")
        os.umask(0o022)
        save_checkpoint(model, _card(), tmp_path / "shared")
    finally:
        os.umask(old)
    mode = lambda d: stat.S_IMODE((tmp_path / d / "model.safetensors").stat().st_mode)  # noqa: E731
    assert mode("private") == 0o600 and mode("shared") == 0o644
