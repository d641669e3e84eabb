"""Bagging the members (``TrainConfig.member_bootstrap``): a fixed weight per training digit
and member, and the training set indexed so that a batch can look its weights up.

Breiman's bagging (1996) fits every member on its own resample of the data; with a fixed weight
``w_im`` per digit ``i`` and member ``m`` (Poisson(1) counts, or 0/2: each member draws each
digit with probability ½) one pass over the data trains all members at once: the mixture NLL
takes each digit's mixture over the members that drew it, weighted by their counts (the
per-member loss is exact bagging; :func:`models.training.loss.mixture_nll`). Members should then
differ where the data is thin, which is where an ensemble should disagree; on well-covered
digits every resample says the same. The weights are drawn once per run (from the config seed),
not afresh every step: weights drawn anew every epoch average out to the full data for every
member (the diversity would vanish).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["Indexed", "bootstrap_weights"]

#: Where the weights' generator is seeded from, beside the config seed (the augmentation and the
#: outlier pool have their own tags, so turning bagging on changes neither).
_TAG = 0xB007


def bootstrap_weights(n: int, members: int, kind: str, seed: int) -> Tensor | None:
    """``(n, members)`` float weights of ``kind`` (``poisson``: Poisson(1) counts; ``half``: 0 or 2,
    each with probability ½), or None for ``none``. Same arguments, same weights."""
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed * 1_000_003 + _TAG)
    if kind == "poisson":
        return torch.poisson(torch.ones(n, members), generator=g)
    if kind == "half":
        return 2.0 * (torch.rand(n, members, generator=g) < 0.5).float()
    raise ValueError(f"member_bootstrap must be none, poisson or half; got {kind!r}")


class Indexed(Dataset):
    """``dataset`` with each item's index appended: ``(*item, i)``, so a batch carries the rows
    of its digits in :func:`bootstrap_weights`'s table through any sampler (DDP's included)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return (*self.dataset[i], i)
