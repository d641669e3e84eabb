"""Predictions over a split and the per-epoch validation (rank 0, broadcast to every rank)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from .runtime import Runtime, broadcast_from_main

__all__ = ["basic_metrics", "collect_predictions", "served", "validate"]


@torch.no_grad()
def collect_predictions(
    model: nn.Module, dataset: Dataset, device: torch.device | str, batch_size: int = 512
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Run ``model`` (eval mode) over ``dataset``: ``p (N, M, C)``, ``q (N, M, C) | None``, labels."""
    was_training = model.training
    model.eval()
    ps, qs, ys = [], [], []
    for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        out = model(x.to(device))
        ps.append(out.p.float().cpu())
        if out.q is not None:
            qs.append(out.q.float().cpu())
        ys.append(torch.as_tensor(y).long())
    model.train(was_training)
    return torch.cat(ps), (torch.cat(qs) if qs else None), torch.cat(ys)


def served(p: Tensor, q: Tensor | None) -> Tensor:
    """The served distribution ``(N, C)``: mean of the gated members ``q`` when there are, else
    of ``p``."""
    return (q if q is not None else p).mean(dim=1)


def basic_metrics(p: Tensor, q: Tensor | None, y: Tensor) -> dict[str, float]:
    """Accuracy and NLL of the served distribution."""
    probs = served(p, q)
    acc = float((probs.argmax(1) == y).float().mean())
    nll = float(-torch.log(probs.gather(1, y[:, None]).clamp_min(1e-12)).mean())
    return {"accuracy": acc, "nll": nll}


def validate(
    model: nn.Module, dataset: Dataset, rt: Runtime, batch_size: int
) -> tuple[float, float]:
    """``(val_loss, val_accuracy)`` of the served distribution on the full split, computed on
    rank 0 and broadcast, so every rank makes the same early-stopping and schedule decisions."""
    stats = torch.zeros(2, dtype=torch.float64)
    if rt.is_main:
        m = basic_metrics(*collect_predictions(model, dataset, rt.device, batch_size))
        stats[0], stats[1] = m["nll"], m["accuracy"]
    stats = broadcast_from_main(stats, rt)
    return float(stats[0]), float(stats[1])
