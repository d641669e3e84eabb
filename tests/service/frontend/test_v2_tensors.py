"""V2's tensors are declared once (service/frontend/v2_core.py, ``INPUTS`` and ``OUTPUT_TENSORS``):
the model metadata, the Triton model config and the input checks are read from the declarations,
so the three cannot disagree (issue 35, item 1)."""

from __future__ import annotations

import pytest

from service.common.errors import BadInput
from service.common.model_info import ModelInfo
from service.common.settings import Settings
from service.frontend.v2_core import (
    DTYPES,
    INPUT_NAMES,
    INPUTS,
    OUTPUT_TENSORS,
    OUTPUTS,
    check_input_spec,
    model_config_dict,
    model_metadata_dict,
)

MODEL = ModelInfo(
    generation=1, name="m", version="1.0.0", class_names=tuple("0123456789"), vgn=True,
    in_channels=1, input_size=(28, 28), calibrated_k={"q": 1.0, "p": 1.0},
    description={"input_mean": [0.1307], "input_std": [0.3081], "device": "cpu"},
)  # fmt: skip


def test_metadata_and_config_list_the_declared_tensors() -> None:
    meta = model_metadata_dict(MODEL)
    assert meta["inputs"] == [{"name": "images", "datatype": "UINT8", "shape": [-1, 1, 28, 28]}]
    assert [(o["name"], o["datatype"], o["shape"]) for o in meta["outputs"]] == [
        (t.name, t.datatype, [-1, 10] if t.per_image == "classes" else [-1]) for t in OUTPUT_TENSORS
    ]
    config = model_config_dict(MODEL, Settings())
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("images", "TYPE_UINT8", [1, 28, 28])
    ]
    outputs = {o["name"]: o for o in config["output"]}
    assert list(outputs) == list(OUTPUTS)
    assert outputs["probabilities"] == {"name": "probabilities", "data_type": "TYPE_FP32",
                                        "dims": [10]}  # fmt: skip
    assert outputs["abstain"]["data_type"] == "TYPE_BOOL"
    assert outputs["abstain"]["dims"] == [1] and outputs["abstain"]["reshape"] == {"shape": []}


def test_input_checks_read_the_declarations() -> None:
    assert (
        INPUT_NAMES == {t.datatype: t.name for t in INPUTS} == {"UINT8": "images", "FP32": "input"}
    )
    assert {k: v.str for k, v in DTYPES.items()} == {"UINT8": "|u1", "FP32": "<f4"}
    assert check_input_spec("images", "UINT8", [2, 1, 28, 28], 64) == 2 * 28 * 28
    with pytest.raises(BadInput, match="send raw pixels as 'images' \\(UINT8\\) or prepared"):
        check_input_spec("input", "UINT8", [2, 1, 28, 28], 64)
    with pytest.raises(BadInput, match="use UINT8 or FP32"):
        check_input_spec("images", "INT8", [2, 1, 28, 28], 64)
