"""The shipped model trained to defer on non-digits (``cnn4-lle-vgn-oe-mnist`` 2.0.0, outlier
exposure) meets the abstain targets of issue 25 on the committed sample of the OOD suite
(models/data/ood-suite-sample.npz, 40 images per group; its card holds the 500-per-group
numbers), through the library's served path and through a real server. The default
(``cnn4-lle-vgn-mnist`` 2.0.0) stays the default because the OE model's validation-calibrated k
defers 5.75 % of the test split, over the in-distribution target's 5 % (see
models/zoo/cnn4-lle-vgn-oe-mnist/README.md); its card records the suite too, and how far it is
from the targets."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.data_ood import ABSTAIN_TARGETS, FAR_GROUPS, load_ood_sample
from models.predictor import Predictor
from models.zoo import default_model_dir, zoo_model_dir

OE_MODEL = "cnn4-lle-vgn-oe-mnist"

torch.set_num_threads(1)


def _rates_through_predictor() -> dict[str, float]:
    pred = Predictor.from_dir(zoo_model_dir(OE_MODEL), device="cpu")
    rates = {}
    for group, images in load_ood_sample().items():
        rows = pred.predict([torch.from_numpy(img).unsqueeze(0) for img in images])
        rates[group] = float(np.mean([r["abstain"] for r in rows]))
    return rates


def test_oe_model_defers_on_the_committed_ood_sample() -> None:
    rates = _rates_through_predictor()
    for group, target in ABSTAIN_TARGETS.items():
        assert rates[group] >= target, (group, rates)


def test_cards_record_the_suite_and_the_oe_model_meets_the_targets() -> None:
    default = json.loads((default_model_dir() / "model_card.json").read_text())
    old = default["metrics"]["evaluation"]["ood_suite"]
    assert old["groups"]["noise"]["meets_target"] is False  # why the OE model exists
    card = json.loads((zoo_model_dir(OE_MODEL) / "model_card.json").read_text())
    suite = card["metrics"]["evaluation"]["ood_suite"]
    k = card["abstain_calibration"]["abstain_k"]
    assert suite["abstain_k"] == pytest.approx(k)
    for group, target in ABSTAIN_TARGETS.items():
        g = suite["groups"][group]
        assert g["n"] == 500 and g["target"] == target and g["meets_target"], (group, g)
    assert suite["far"]["scores"]["vgmu"]["auroc"] >= 0.95
    assert suite["all"]["scores"]["vgmu"]["auroc"] >= 0.95  # the whole-suite target
    # On digits (test split, as its README states): accuracy and accepted answers meet the
    # targets; the served deferral is what keeps it from being the default.
    ev = card["metrics"]["evaluation"]
    assert ev["classification"]["accuracy"] >= 0.99
    assert 1 - ev["abstention"]["accepted_risk"] >= 0.998


def _b64_png(img: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_a_real_server_defers_on_the_committed_ood_sample(tmp_path: Path) -> None:
    from tests.service.conftest import start_server

    sample = load_ood_sample()
    expected = _rates_through_predictor()
    srv = start_server(tmp_path / "srv", zoo_model_dir(OE_MODEL), workers=1)
    try:
        with srv.client() as c:
            for group in FAR_GROUPS:
                body = {"images": [_b64_png(img) for img in sample[group]]}
                r = c.post("/v1/predict", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == OE_MODEL
                results = r.json()["results"]
                rate = float(np.mean([res["abstain"] for res in results]))
                assert rate >= ABSTAIN_TARGETS[group], (group, rate)
                assert rate == pytest.approx(expected[group])  # the server is the library
    finally:
        srv.stop()
