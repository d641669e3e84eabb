"""How much memory a training run needs, estimated before it starts (no memory, milliseconds).

Why: the parameter bound of :data:`~models.training.config.LIMITS` says nothing about a run's
activations, and the optimiser triples the weights: a cnn4 with ``width: 2048, hidden: 3600``,
``members: 2`` and ``batch_size: 4096`` has 987 M parameters (under the 10⁹ bound) yet needs about
20 GB for its weights and their training state and hundreds of GB for one batch's activations.
A server that accepts training jobs checks this estimate against the memory it can spare
(:mod:`service.engine.jobs`), and refuses the job before it is written anywhere.

The estimate, per part (float32 throughout, as :func:`models.training.train` trains):

* **parameters** — every parameter and buffer of the ensemble, built on the meta device;
* **gradients** — one per trainable parameter;
* **optimiser** — the optimiser's state per trainable parameter: Adam (what
  :func:`models.training.step.build_optimisation` builds) keeps two (``exp_avg``,
  ``exp_avg_sq``); :data:`OPTIMISER_STATES` names the count per optimiser;
* **best weights** — :class:`models.training.stopping.EarlyStopping` keeps a copy of the state
  dict (parameters and buffers);
* **activations** — one training forward pass of ``batch_size`` images (plus
  ``outlier_batch_size`` generated outliers with outlier exposure, which go through the same
  pass) run on the meta device under a dispatch mode that adds up every tensor an operator
  creates (views and in-place results share memory and are not counted): an upper bound of what
  autograd keeps for the backward pass, plus the largest of them once more for the gradient in
  flight through it. Validation runs ``eval_batch_size`` images without gradients: its peak is
  counted as two of its largest tensors, and the larger of the two passes is the estimate.

Input data, the DataLoader's workers and the framework itself are not counted: they do not grow
with the knobs a job turns, and the budget a caller sets leaves room for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .config import LIMITS, TrainConfig

__all__ = [
    "JOB_MEMORY_FRACTION",
    "OPTIMISER_STATES",
    "DeviceMemory",
    "MemoryEstimate",
    "device_memory",
    "estimate_training_memory",
    "gib",
    "input_shape",
]

#: Optimiser state tensors kept per trainable parameter (each the parameter's size).
OPTIMISER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
#: The optimiser :func:`models.training.train` uses (``step.build_optimisation``).
TRAINING_OPTIMISER = "adam"

_GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """A training run's estimated peak memory, by part (bytes)."""

    parameters: int  # count of parameter elements (the ensemble's size)
    parameter_bytes: int  # parameters and buffers
    gradient_bytes: int
    optimiser_bytes: int
    snapshot_bytes: int  # early stopping's copy of the best weights
    activation_bytes: int  # one batch through forward and backward (or validation's peak)
    batch: int  # images in one training forward pass
    optimiser: str

    @property
    def total_bytes(self) -> int:
        """Everything above: what the run's process needs at its peak, data aside."""
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimiser_bytes
            + self.snapshot_bytes
            + self.activation_bytes
        )

    def describe(self) -> str:
        """One line by part, in GiB: what a refusal shows so the client knows what to shrink."""
        weights = self.parameter_bytes + self.gradient_bytes + self.optimiser_bytes
        return (
            f"{gib(self.total_bytes)}: {self.parameters:,} parameters with their gradients, "
            f"{self.optimiser} state and best-weights copy {gib(weights + self.snapshot_bytes)}, "
            f"activations of one batch of {self.batch} images {gib(self.activation_bytes)}"
        )


def gib(n: float) -> str:
    """``n`` bytes in GiB, as a short string (``"1.25 GiB"``; small values keep 3 decimals)."""
    value = n / _GIB
    return f"{value:.3f} GiB" if value < 10 else f"{value:,.1f} GiB"


def input_shape(config: TrainConfig) -> tuple[int, int, int, int]:
    """``(classes, channels, height, width)`` of the run's input without reading its data.

    The bundled MNIST (also with an ImageFolder added) and MNIST/FashionMNIST: 28×28 gray;
    SVHN/CIFAR: 32×32 colour; an ImageFolder alone: ``image_size`` (default 32) in colour, and
    its classes, unknown until it is read, counted as ``k``'s length or 10 (as
    :meth:`TrainConfig.check_architecture` counts them).
    """
    from models.data import dataset_shape, parse_imagefolder

    shape = dataset_shape(config.dataset)
    folder = parse_imagefolder(config.dataset)
    if shape is None:  # an ImageFolder alone: resized to image_size (32 when not given)
        classes = len(config.k) if isinstance(config.k, list) else 10
        side = config.image_size or 32
        return classes, 3, side, side
    classes, channels = shape
    if (folder is not None and folder[1]) or config.dataset == "mnist-bundled":
        return classes, channels, 28, 28
    side = 28 if channels == 1 else 32
    return classes, channels, side, side


class _Allocations(TorchDispatchMode):
    """Adds up the bytes of every tensor an operator creates (views and in-place results, which
    share their input's memory, excepted), remembers the largest, and stops a pass that makes more
    than ``LIMITS["build_ops"]`` calls (the bound a build has, so the check stays milliseconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.largest = 0
        self.calls = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        if self.calls > LIMITS["build_ops"]:
            raise ValueError(
                f"one forward pass takes more than {LIMITS['build_ops']:,} tensor operations "
                "(the training bound): fewer members, blocks or layers"
            )
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    size = t.numel() * t.element_size()
                    self.total += size
                    self.largest = max(self.largest, size)
        return out


def _forward(model: torch.nn.Module, batch: int, shape: tuple[int, int, int, int]) -> _Allocations:
    """One forward pass of ``batch`` images on the meta device, counted (:class:`_Allocations`)."""
    _, channels, height, width = shape
    x = torch.empty(batch, channels, height, width, device="meta")
    counter = _Allocations()
    with counter:
        model(x, return_log_p=True)
    return counter


def estimate_training_memory(config: TrainConfig) -> MemoryEstimate:
    """The peak memory of training ``config`` (see the module docstring for what is counted).

    Builds the ensemble and runs one training and one validation forward pass on the meta
    device: no memory is allocated and it takes milliseconds for the shipped recipes. Call it
    after :meth:`TrainConfig.check_architecture`, which bounds the build. Raises ``ValueError``
    when a pass would make more than ``LIMITS["build_ops"]`` tensor operations.
    """
    shape = input_shape(config)
    classes, channels = shape[0], shape[1]
    with torch.device("meta"):
        model = config.build(classes, channels)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)

    batch = config.batch_size + (config.outlier_batch_size if config.outlier_exposure > 0 else 0)
    model.train()
    train = _forward(model, max(batch, 2), shape)  # BatchNorm1d refuses a batch of one
    model.eval()
    with torch.no_grad():
        evaluation = _forward(model, max(config.eval_batch_size, 1), shape)
    activations = max(train.total + train.largest, 2 * evaluation.largest)
    return MemoryEstimate(
        parameters=sum(p.numel() for p in params),
        parameter_bytes=param_bytes + buffer_bytes,
        gradient_bytes=grad_bytes,
        optimiser_bytes=OPTIMISER_STATES[TRAINING_OPTIMISER] * grad_bytes,
        snapshot_bytes=param_bytes + buffer_bytes,
        activation_bytes=activations,
        batch=batch,
        optimiser=TRAINING_OPTIMISER,
    )


#: The share of a device's memory one training job may plan to use when no budget is set: half
#: of the host's RAM (shared with the serving processes, the data and the framework), 80 % of a
#: GPU's memory (the served model, the only other tenant, is small).
JOB_MEMORY_FRACTION: dict[str, float] = {"host": 0.5, "gpu": 0.8}


@dataclass(frozen=True)
class DeviceMemory:
    """The memory a run on some device can have: ``kind`` ``"gpu"`` or ``"host"``, bytes."""

    kind: Literal["host", "gpu"]
    total: int


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max``, else v1), None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 says "unlimited" with a huge number
            return int(text)
    return None


def device_memory(device: str | torch.device | None) -> DeviceMemory:
    """The memory of the device a run with ``device`` trains on (``None``: as training resolves
    it, a GPU when present): the GPU's total memory, else the host's physical memory or its
    cgroup limit, whichever is lower."""
    from models.device import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        return DeviceMemory(
            "gpu", int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
        )
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return DeviceMemory("host", min(total, limit) if limit else total)
