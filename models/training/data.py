"""The data of a run: the configured :class:`~models.data.DataBundle` and the training loader
(seeded shuffling; a ``DistributedSampler`` under DDP)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from models.checkpoint import check_class_names
from models.data import DataBundle, load_dataset

from .config import TrainConfig
from .runtime import Runtime

__all__ = ["TrainLoader", "load_data", "train_loader"]


def load_data(config: TrainConfig) -> DataBundle:
    """The configured dataset's train/validation/test splits and metadata.

    Its classes are checked as the model card will check them (names, count): a folder named
    ``../x`` or ``a..b`` stops the run here, not after its last epoch when the card is written.
    """
    bundle = load_dataset(
        config.dataset,
        config.data_root,
        config.allow_download,
        config.max_train_samples,
        config.image_size,
    )
    try:
        check_class_names(list(bundle.class_names))
    except ValueError as exc:
        raise ValueError(f"dataset {config.dataset}: {exc}") from None
    if config.calibration_split > 0:
        bundle = carve_calibration(bundle, config.calibration_split)
    return bundle


def carve_calibration(bundle: DataBundle, share: float) -> DataBundle:
    """``bundle`` with ``share`` of its training digits moved to ``calib`` (stratified by class,
    scikit-learn's ``train_test_split`` with seed 0, the same for every run seed): digits the run
    never trains on, which calibrate ``abstain_k`` together with the validation split
    (:func:`models.training.finalise.finalise`). Seed 0 keeps the carve fixed across training
    seeds, so two seeds' calibration numbers are on the same digits."""
    import numpy as np
    from sklearn.model_selection import train_test_split
    from torch.utils.data import Subset

    labels = np.asarray([int(y) for _, y in DataLoader(bundle.train, batch_size=None)])
    keep, calib = train_test_split(
        np.arange(labels.size), test_size=share, stratify=labels, random_state=0
    )
    extra = {**bundle.extra, "calibration_split": {"share": share, "n": int(calib.size)}}
    return replace(
        bundle,
        train=Subset(bundle.train, sorted(keep.tolist())),
        calib=Subset(bundle.train, sorted(calib.tolist())),
        extra=extra,
    )


@dataclass
class TrainLoader:
    """Training batches ``(x, y)``; :meth:`set_epoch` reshuffles a distributed sampler."""

    loader: DataLoader
    sampler: Any = None  # DistributedSampler under DDP

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def train_loader(dataset: Dataset, config: TrainConfig, rt: Runtime) -> TrainLoader:
    """Shuffled batches of ``config.batch_size`` from a generator seeded with ``config.seed`` (one
    process), or from a ``DistributedSampler`` (same seed) giving each rank its share."""
    sampler = None
    if rt.world > 1:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(
            dataset, num_replicas=rt.world, rank=rt.rank, shuffle=True, seed=config.seed
        )
    gen = torch.Generator().manual_seed(config.seed)
    # A last batch of one image cannot train a network with BatchNorm (its batch statistics need
    # two): it is dropped, one image an epoch (another each epoch: the order is reshuffled).
    # Runs whose count leaves any other remainder are unchanged.
    n = len(sampler) if sampler is not None else len(dataset)  # type: ignore[arg-type]
    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=gen if sampler is None else None,
        drop_last=n % config.batch_size == 1 and n > 1,
    )
    return TrainLoader(loader, sampler)
