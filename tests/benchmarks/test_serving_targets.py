"""benchmarks/serving.py: how target names become server commands and settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving import targets


def test_vge_targets_carry_their_settings(tmp_path: Path) -> None:
    plain, overlap, tuned = targets(
        ["vge", "vge-overlap", "vge@MAX_BATCH_SIZE=1024,vge_batches_in_flight=2"], None, tmp_path
    )
    assert "VGE_BATCHES_IN_FLIGHT" not in plain.env
    assert overlap.env["VGE_BATCHES_IN_FLIGHT"] == "2"
    assert tuned.env["VGE_MAX_BATCH_SIZE"] == "1024"
    assert tuned.env["VGE_BATCHES_IN_FLIGHT"] == "2"
    assert tuned.cmd == plain.cmd and tuned.name.startswith("vge@")
    assert len({plain.port, overlap.port, tuned.port}) == 3


def test_a_model_and_settings_with_colons_in_their_values(tmp_path: Path) -> None:
    (t,) = targets(["vge:lenet5-lle-vgn-mnist@DEVICE=cuda:1,MAX_BATCH_SIZE=64"], None, tmp_path)
    assert t.env["VGE_MODEL_DIR"] == "lenet5-lle-vgn-mnist"
    assert t.env["VGE_DEVICE"] == "cuda:1" and t.env["VGE_MAX_BATCH_SIZE"] == "64"


def test_a_setting_without_a_value_or_on_a_peer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        targets(["vge@MAX_BATCH_SIZE"], None, tmp_path)
    with pytest.raises(SystemExit, match="only vge"):
        targets(["litserve@WORKERS=2"], None, tmp_path)
