"""One architecture spec for training configs and model cards; cards keep their JSON shape."""

from __future__ import annotations

import json
import math

import pytest
import torch

from models.checkpoint import ArchitectureSpec, ModelCard, read_card
from models.training import DEFAULT_ARCHITECTURE, TrainConfig
from models.training.stopping import EarlyStopping
from models.zoo import default_model_dir

CARD = dict(
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
)


def test_config_and_card_share_the_spec():
    arch = set(ArchitectureSpec.model_fields)
    assert arch == {"backbone", "backbone_kwargs", "ensemble", "members", "mc_samples", "vgn", "k"}
    assert arch <= set(TrainConfig.model_fields) and arch <= set(ModelCard.model_fields)
    cfg = TrainConfig(ensemble="DE", vgn=True, k=2.0, members=4)
    card = ModelCard(**{**CARD, **cfg.architecture().model_dump()})
    assert card.architecture() == cfg.architecture() and card.ensemble == "de" and card.k == 2.0
    # the same validation on both sides
    for bad, match in (
        ({"ensemble": "mcd", "vgn": True}, "Table 2"),
        ({"backbone": "vgg"}, "unknown backbone"),
        ({"members": 1}, "greater than or equal to 2"),
        ({"vgn": True, "k": -1.0}, "must be > 0"),
        ({"vgn": False, "k": 1.0}, "only meaningful with vgn"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)
        with pytest.raises(ValueError, match=match):
            ModelCard(**{**CARD, **bad})
    assert {f: getattr(TrainConfig(), f) for f in DEFAULT_ARCHITECTURE} == DEFAULT_ARCHITECTURE


def test_card_json_keeps_k_fixed_and_its_key_order(tmp_path):
    shipped = default_model_dir()
    raw = json.loads((shipped / "model_card.json").read_text())
    assert "k_fixed" in raw and "k" not in raw
    card = read_card(shipped)
    assert card.k is None and card.k_fixed is None
    assert card.model_dump(mode="json") == raw and list(card.model_dump(mode="json")) == list(raw)
    fixed = ModelCard(**{**CARD, "k_fixed": [1.0] * 10})  # cards name it k_fixed ...
    assert fixed.k == [1.0] * 10 and fixed.model_dump()["k_fixed"] == [1.0] * 10
    assert "k" not in fixed.model_dump() and ModelCard(**fixed.model_dump()) == fixed
    assert ModelCard(**{**CARD, "k": 0.5}).k_fixed == 0.5  # ... and read the spec's name too
    with pytest.raises(ValueError, match="not both"):
        ModelCard(**{**CARD, "k": 0.5, "k_fixed": 0.5})


def test_early_stopping_keeps_the_best_weights():
    model = torch.nn.Linear(2, 1)
    stop = EarlyStopping(model, patience=2, min_delta=0.1)
    assert stop.best_loss == math.inf and not stop.should_stop
    assert stop.update(1, 1.0)
    best = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not stop.update(2, 0.95)  # not better by more than min_delta
    assert not stop.should_stop and not stop.update(3, 2.0) and stop.should_stop
    assert (stop.best_epoch, stop.best_loss, stop.bad_epochs) == (1, 1.0, 2)
    stop.restore()
    assert torch.equal(model.weight, best)


def test_check_buildable_names_what_does_not_fit() -> None:
    """The architecture built on the meta device: what only the build can tell, told at once."""
    import pytest

    from models.data import dataset_shape

    assert dataset_shape("mnist-bundled") == (10, 1) and dataset_shape("cifar100") == (100, 3)
    assert dataset_shape("imagefolder:x") is None  # its folders say
    assert dataset_shape("imagefolder:x+mnist-bundled") == (10, 1)
    TrainConfig(backbone="resnet18", backbone_kwargs={"widths": (4, 8), "blocks": (1, 1)}
                ).check_buildable(10, 3)  # fmt: skip
    with pytest.raises(ValueError, match="backbone_kwargs do not fit lenet5: .*'depth'"):
        TrainConfig(backbone_kwargs={"depth": 3}).check_buildable(10, 1)
    with pytest.raises(ValueError, match="one value per class \\(100\\)"):
        TrainConfig(vgn=True, k=[1.0] * 10).check_buildable(100, 3)
