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


def test_stop_waits_for_every_process_of_the_server_not_only_its_leader(tmp_path: Path) -> None:
    """A server whose children outlive it (PyTriton's tritonserver shuts down ~10 s after its
    Python parent): ``stop`` returns once the whole process group is gone, so the next server
    measured does not share the CPUs with it."""
    import os
    import subprocess
    import sys
    import time

    from benchmarks.serving import Target, group_alive

    # the leader exits at once on SIGTERM; its child ignores SIGTERM for 1.5 s, then exits
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1.5)"
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    t = Target(name="t", cmd=[], env={}, path="/", ready_path="/")
    t.proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    time.sleep(0.5)  # the child is running
    assert group_alive(t.proc.pid)
    started = time.monotonic()
    t.stop()
    assert not group_alive(t.proc.pid)
    assert time.monotonic() - started >= 0.8  # it waited for the child, not only the leader
    with_leader_only = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    os.killpg(with_leader_only.pid, 9)
    with_leader_only.wait()
    assert not group_alive(with_leader_only.pid)  # a reaped group is not alive
