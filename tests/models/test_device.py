"""models.device.resolve_device: the one "which device" rule, and its users agree with it."""

from __future__ import annotations

import torch

from models.device import resolve_device
from models.predictor import default_device


def test_auto_and_none_pick_cuda_only_when_present_and_names_pass_through() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device().type == resolve_device("auto").type == want
    assert default_device() == resolve_device()
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cuda:1")) == torch.device("cuda:1")  # no GPU needed


def test_settings_auto_device_is_the_same_rule() -> None:
    from service.common.settings import Settings

    assert Settings(device="auto").resolved_device() == str(resolve_device())
    assert Settings(device="cpu").resolved_device() == "cpu"
