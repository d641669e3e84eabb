"""Where a run executes: device, DDP process group (under ``torchrun``), seeding."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from models.device import resolve_device

from .config import TrainConfig

__all__ = ["Runtime", "barrier", "broadcast_from_main", "runtime", "seed_everything", "wrap_ddp"]


@dataclass(frozen=True)
class Runtime:
    """This process's device and place in the (possibly single-process) group."""

    device: torch.device
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: validates, writes the checkpoint and emits events."""
        return self.rank == 0


def check_device(device: str | None) -> None:
    """Raise ``ValueError`` unless ``device`` (None: the default) exists on this machine: checked
    before training, not found out by torch mid-run (a CUDA build says "no NVIDIA driver", a CPU
    build fails an assertion)."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 or (dev.index or 0) >= count:
            raise ValueError(f"device {device!r} is not on this machine ({count} CUDA device(s))")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} is not on this machine")


def _distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


@contextmanager
def runtime(config: TrainConfig) -> Iterator[Runtime]:
    """Join the torchrun process group when ``WORLD_SIZE > 1`` (nccl on CUDA, gloo on CPU), pick
    the device (``cuda:LOCAL_RANK`` under DDP) and leave the group on exit."""
    import torch.distributed as dist

    rank, world, local_rank = _distributed()
    use_cuda = resolve_device(config.device).type == "cuda"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device(f"cuda:{local_rank}" if world > 1 else (config.device or "cuda"))
        if device.index is not None:
            torch.cuda.set_device(device)
    else:
        device = torch.device(config.device or "cpu")
    try:
        yield Runtime(device, rank, world)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seed Python, NumPy and torch; request deterministic kernels (SI S3.2: cuDNN and cuBLAS)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def wrap_ddp(model: nn.Module, rt: Runtime) -> nn.Module:
    """``model`` in DistributedDataParallel when there are several processes, else itself."""
    if rt.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None
    )


def broadcast_from_main(values: Tensor, rt: Runtime) -> Tensor:
    """Rank 0's ``values`` (a CPU tensor) on every rank."""
    if rt.world == 1:
        return values
    import torch.distributed as dist

    values = values.to(rt.device)
    dist.broadcast(values, src=0)
    return values.cpu()


def barrier(rt: Runtime) -> None:
    """Wait for every rank (no-op in a single process)."""
    if rt.world > 1:
        import torch.distributed as dist

        dist.barrier()
