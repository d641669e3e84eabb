"""A training run's memory, estimated before it runs (models.training.budget)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from models.training import TrainConfig, load_config
from models.training.budget import (
    OPTIMISER_STATES,
    TRAINING_OPTIMISER,
    device_memory,
    estimate_training_memory,
    input_shape,
)

REPO = Path(__file__).resolve().parents[2]
ZOO = sorted((REPO / "models" / "zoo").glob("*.yaml"))
GIB = 1024**3


def test_the_issues_job_needs_hundreds_of_gib() -> None:
    """cnn4 width 2048, hidden 3600, M = 2, batch 4,096: 987 M parameters, under the parameter
    bound, yet ~18 GiB of weights and their training state and far more activations."""
    cfg = TrainConfig(backbone="cnn4", backbone_kwargs={"width": 2048, "hidden": 3600},
                      members=2, vgn=False, batch_size=4096)  # fmt: skip
    cfg.check_architecture()  # the parameter bound alone lets it through
    est = estimate_training_memory(cfg)
    assert est.parameters == 986_897_780
    assert est.gradient_bytes == 4 * est.parameters  # float32, all trainable
    assert est.optimiser_bytes == 2 * est.gradient_bytes  # Adam: exp_avg, exp_avg_sq
    weights = est.parameter_bytes + est.gradient_bytes + est.optimiser_bytes + est.snapshot_bytes
    assert 18 * GIB < weights < 19 * GIB
    # the first convolution alone: 4096 images x 2048 channels x 28 x 28 floats = 24.5 GiB
    assert est.activation_bytes > 100 * GIB
    assert est.total_bytes == weights + est.activation_bytes
    assert "986,897,780 parameters" in est.describe() and "4096 images" in est.describe()


@pytest.mark.parametrize("recipe", ZOO, ids=lambda p: p.stem)
def test_the_shipped_recipes_need_little(recipe: Path) -> None:
    est = estimate_training_memory(load_config(recipe))
    assert est.total_bytes < 0.5 * GIB, est.describe()
    config = load_config(recipe)
    outliers = config.outlier_batch_size if config.outlier_exposure > 0 else 0
    assert est.batch == 128 + outliers  # outliers share the pass


def test_activations_grow_with_the_batch_and_the_optimiser_is_adam() -> None:
    small = estimate_training_memory(TrainConfig(backbone="cnn4", batch_size=1024,
                                                 eval_batch_size=2))  # fmt: skip
    large = estimate_training_memory(TrainConfig(backbone="cnn4", batch_size=2048,
                                                 eval_batch_size=2))  # fmt: skip
    assert large.activation_bytes == pytest.approx(2 * small.activation_bytes, rel=0.01)
    assert large.parameter_bytes == small.parameter_bytes
    assert TRAINING_OPTIMISER == "adam" and OPTIMISER_STATES["adam"] == 2
    # validation without gradients: a huge eval batch is counted by its peak, not per layer
    evals = estimate_training_memory(TrainConfig(backbone="cnn4", batch_size=2,
                                                 eval_batch_size=8192))  # fmt: skip
    assert evals.activation_bytes > small.activation_bytes / 4


@pytest.mark.parametrize(
    ("kwargs", "shape"),
    [
        ({}, (10, 1, 28, 28)),
        ({"dataset": "CIFAR100"}, (100, 3, 32, 32)),
        ({"dataset": "imagefolder:x+mnist-bundled"}, (10, 1, 28, 28)),
        ({"dataset": "imagefolder:x", "image_size": 64}, (10, 3, 64, 64)),
        ({"dataset": "imagefolder:x"}, (10, 3, 32, 32)),
    ],
)
def test_input_shape_without_reading_data(kwargs: dict, shape: tuple) -> None:
    assert input_shape(TrainConfig(**kwargs)) == shape


@pytest.mark.parametrize("ensemble", ["de", "lle", "mcd", "mcd_lle"])
def test_every_ensemble_kind_is_estimated_in_milliseconds(ensemble: str) -> None:
    import time

    cfg = TrainConfig(backbone="lenet5", ensemble=ensemble, members=5,
                      vgn=ensemble in ("de", "lle"))  # fmt: skip
    estimate_training_memory(cfg)  # imports and torch's first dispatch
    t0 = time.perf_counter()
    est = estimate_training_memory(cfg)
    assert time.perf_counter() - t0 < 1.0
    assert est.activation_bytes > 0 and est.parameters > 0


def test_the_estimate_is_near_a_real_training_step() -> None:
    """One real forward + backward + Adam step of cnn4 (width 64, batch 1,024) in a fresh
    process: the most memory its tensors hold at once, beyond the weights and the batch (saved
    activations, temporaries, gradients, Adam's moments), is about what the estimate says, and
    never more (the budget must not under-count, nor refuse jobs 1.5x too eagerly).

    Measured by torch's own tracker of tensor storages (``MemTracker``, a dispatch mode), not by
    the process's peak resident memory, which this test used to read: for the same step that was
    1,576 MiB on an idle 2-core box and 612 MiB in a full ``pytest -n 2`` run, so a bound on it
    failed by chance (why is not settled: not transparent huge pages, which the box does not use
    here). Tensor bytes are the same on every run: 1,523 MiB against 1,633 MiB estimated."""
    code = (
        "import torch\n"
        "from torch.distributed._tools.mem_tracker import MemTracker\n"
        "from models.training import TrainConfig\n"
        "torch.set_num_threads(1)\n"
        "c = TrainConfig(backbone='cnn4', backbone_kwargs={'width': 64}, batch_size=1024)\n"
        "m = c.build(10, 1); opt = torch.optim.Adam(m.parameters())\n"
        "x = torch.randn(1024, 1, 28, 28); y = torch.randint(0, 10, (1024,))\n"
        "held = sum(t.nbytes for t in (x, y, *m.parameters(), *m.buffers()))\n"
        "tracker = MemTracker(); tracker.track_external(m, opt, x, y)\n"
        "with tracker:\n"
        "    out, log_p = m(x, return_log_p=True)\n"
        "    (-out.p.mean(1).gather(1, y[:, None]).log().mean()).backward(); opt.step()\n"
        "(peak,) = tracker.get_tracker_snapshot('peak').values()\n"
        "print(peak['Total'] - held)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    measured = int(done.stdout.split()[-1])
    est = estimate_training_memory(TrainConfig(backbone="cnn4", backbone_kwargs={"width": 64},
                                               batch_size=1024, eval_batch_size=2))  # fmt: skip
    step = est.activation_bytes + est.gradient_bytes + est.optimiser_bytes
    assert measured > 1_000 * 2**20, measured  # the step was tracked: ~1.5 GiB of activations
    assert measured < step < 1.5 * measured, (step, measured)


def test_device_memory_is_the_hosts_or_its_limit() -> None:
    import os

    host = device_memory("cpu")
    assert host.kind == "host"
    assert 0 < host.total <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
