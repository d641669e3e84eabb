"""A training job's log: capped while written, read from its end, rendered for a person."""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
from pathlib import Path

from service.common.job_logs import CappedLog, read_tail, render_text


def test_the_log_is_capped_and_keeps_the_newest_lines(tmp_path: Path) -> None:
    log = CappedLog(tmp_path / "train.log", max_bytes=8192)
    lines = [f"line {i:05d} " + "x" * 40 for i in range(2000)]  # ~100 kB through an 8 kB cap

    def write(part: list[str]) -> None:
        for line in part:
            log.write(line + "\n")

    threads = [threading.Thread(target=write, args=(lines[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.write("last\n")
    log.close()
    sizes = [p.stat().st_size for p in tmp_path.glob("train.log*")]
    assert len(sizes) == 2 and sum(sizes) <= 8192, sizes
    tail = read_tail(tmp_path, 100).splitlines()
    assert len(tail) == 100 and tail[-1] == "last"
    assert any(line.startswith("[log rotated at 4,096 bytes") for line in tail)
    whole = [x for x in tail if x.startswith("line ")]
    assert all(len(x) == len(lines[0]) for x in whole)  # lines never cut by a rotation


def test_one_huge_write_keeps_its_end(tmp_path: Path) -> None:
    log = CappedLog(tmp_path / "train.log", max_bytes=8192)
    log.write("a" * 100_000 + "END\n")
    log.close()
    assert (tmp_path / "train.log").stat().st_size <= 4096
    assert read_tail(tmp_path, 1).startswith("[...]") and read_tail(tmp_path, 1).endswith("END\n")


def test_the_tail_is_read_from_the_end_of_any_log(tmp_path: Path) -> None:
    """A 1 GiB log from before the cap (sparse here): tail=2 reads a block, not the file."""
    path = tmp_path / "train.log"
    with path.open("wb") as f:
        f.truncate(1024**3)
        f.seek(0, os.SEEK_END)
        f.write(b'\n{"type": "epoch", "epoch": 3}\ndone\n')
    tracemalloc.start()
    tail = read_tail(tmp_path, 2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tail == '{"type": "epoch", "epoch": 3}\ndone\n'
    assert peak < 1024**2, peak
    # one line of 1 GiB: cut at the read bound, its end kept
    path.write_bytes(b"")
    with path.open("wb") as f:
        f.truncate(1024**3)
        f.seek(0, os.SEEK_END)
        f.write(b"END")
    long = read_tail(tmp_path, 5, max_bytes=1024**2)
    assert long.startswith("[...]") and long.endswith("END\n") and len(long) < 1024**2 + 16
    assert read_tail(tmp_path / "missing", 5) == ""


def test_progress_events_read_as_short_lines() -> None:
    events = [
        {"type": "start", "epoch": 0, "step": 0, "total_steps": 44, "train_size": 5600,
         "val_size": 800, "device": "cpu", "name": "cnn4-lle-vgn-mnist", "world_size": 1},
        {"type": "step", "epoch": 1, "step": 7, "total_steps": 44, "train_loss": 0.52341,
         "eta_s": 125.2},
        {"type": "epoch", "epoch": 1, "step": 22, "total_steps": 44, "train_loss": 0.4,
         "val_loss": 0.3, "val_accuracy": 0.95125, "best_val_loss": 0.3, "eta_s": 3700},
        {"type": "done", "epoch": 2, "step": None, "total_steps": None, "val_loss": 0.2,
         "val_accuracy": 0.96, "test_accuracy": 0.955, "test_nll": 0.17, "best_epoch": 2,
         "cancelled": False, "path": "var/models/job-1", "eta_s": 0.0},
    ]  # fmt: skip
    raw = "job job-1: training {...}\n" + "".join(json.dumps(e) + "\n" for e in events)
    raw += "Traceback (most recent call last):\n{not json}\n"
    assert render_text(raw).splitlines() == [
        "job job-1: training {...}",
        "start: cnn4-lle-vgn-mnist on cpu, 5600 training / 800 validation images, 44 steps",
        "epoch 1  step 7/44  train_loss 0.5234  eta 2m05s",
        "epoch 1  step 22/44  train_loss 0.4000  val_loss 0.3000  val_accuracy 0.9513  eta 1h01m",
        "done  epoch 2  best_epoch 2  val_accuracy 0.9600  test_accuracy 0.9550  test_nll 0.1700"
        "  model var/models/job-1",
        "Traceback (most recent call last):",
        "{not json}",
    ]
