"""``train``: a short loop around the small parts of this package."""

from __future__ import annotations

import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from models.data import DataBundle

from .bootstrap import Indexed, bootstrap_weights
from .config import TrainConfig
from .data import TrainLoader, load_data, train_loader
from .events import EventFn, Progress
from .finalise import TrainResult, finalise
from .outliers import OutlierExposure, recalibrate_batchnorm
from .runtime import Runtime, barrier, runtime, seed_everything, wrap_ddp
from .step import Augmenter, Optimisation, build_optimisation, train_step
from .stopping import EarlyStopping
from .validate import validate
from .warmstart import load_init

__all__ = ["train"]

StopFn = Callable[[], bool]


def train(
    config: TrainConfig,
    out_dir: str | Path,
    on_event: EventFn | None = None,
    should_stop: StopFn | None = None,
) -> Path:
    """Train the configured ensemble, write the checkpoint to ``out_dir`` and return ``out_dir``.

    ``on_event`` receives dicts with ``type`` in {start, step, epoch, done} and ``epoch``, ``step``,
    ``total_steps``, ``train_loss``, ``val_loss``, ``val_accuracy``, ``eta_s`` where known (see
    :mod:`models.training.events`). ``should_stop`` is polled after every step; when it returns
    True training stops, the best weights so far are saved as usual and the ``done`` event carries
    ``cancelled: True``.
    """
    out_dir = Path(out_dir)
    with runtime(config) as rt:
        emit = on_event if (on_event is not None and rt.is_main) else _ignore
        t_start = time.perf_counter()
        seed_everything(config.seed, config.deterministic)
        run = _Run.setup(config, rt, emit)
        with run.progress:
            for epoch in range(1, config.epochs + 1):
                train_loss = run.train_epoch(epoch, should_stop)
                if train_loss is None or run.end_epoch(epoch, train_loss):
                    break
        run.stopping.restore()
        if run.ema is not None:  # the average is the model that validated and is saved
            run.model.load_state_dict(run.ema.module.state_dict())
        if rt.is_main:
            card = finalise(
                config,
                run.model,
                run.bundle,
                out_dir,
                rt,
                run.result(time.perf_counter() - t_start),
            )
            run.progress.done(card, out_dir)
        barrier(rt)
    return out_dir


def _ignore(event: dict) -> None:
    pass


@dataclass
class _Run:
    """The parts of one run and its state between epochs."""

    config: TrainConfig
    rt: Runtime
    bundle: DataBundle
    model: nn.Module  # the ensemble itself: validated, saved
    net: nn.Module  # what trains: the model, or its DDP wrapper
    loader: TrainLoader
    opt: Optimisation
    augment: Augmenter | None
    progress: Progress
    stopping: EarlyStopping
    history: list[dict[str, float]] = field(default_factory=list)
    epoch: int = 0  # the last epoch started
    cancelled: bool = False
    init: dict[str, Any] | None = None  # the model whose weights started the run (init_from)
    outliers: OutlierExposure | None = None  # outlier exposure (config.outlier_exposure > 0)
    ema: AveragedModel | None = None  # the weights' moving average (config.ema_decay > 0)
    bagging: Tensor | None = None  # (N_train, M) bagging weights (config.member_bootstrap)

    @property
    def evaluated(self) -> nn.Module:
        """What validates and what early stopping keeps: the weights' average when there is one
        (Polyak averaging smooths the last steps' noise, so the checkpoint a noisy 800-digit
        validation loss picks is less of a draw), else the model itself."""
        return self.ema.module if self.ema is not None else self.model

    @classmethod
    def setup(cls, config: TrainConfig, rt: Runtime, emit: EventFn) -> _Run:
        """Data, model, loader, optimiser, augmentation, progress (``start`` emitted), early
        stopping; in this order, which fixes what the seeded global RNG draws."""
        bundle = load_data(config)
        model = config.build(bundle.num_classes, bundle.in_channels).to(rt.device)
        init = load_init(config, model, bundle) if config.init_from is not None else None
        net = wrap_ddp(model, rt)
        bagging = bootstrap_weights(
            len(cast(Sized, bundle.train)), config.members, config.member_bootstrap, config.seed
        )
        train_set = bundle.train if bagging is None else Indexed(bundle.train)
        loader = train_loader(train_set, config, rt)
        opt = build_optimisation(config, model, len(loader))
        augment = Augmenter.for_run(config, bundle, rt.rank) if config.augment else None
        progress = Progress(emit, config.model_name(), config.epochs, len(loader), rt)
        progress.start(bundle)
        ema = None
        if config.ema_decay > 0:
            avg = get_ema_multi_avg_fn(config.ema_decay)
            ema = AveragedModel(model, multi_avg_fn=avg, use_buffers=True)
        stopping = EarlyStopping(
            ema.module if ema is not None else model, config.patience, config.min_delta
        )
        outliers = None
        if config.outlier_exposure > 0:
            outliers = OutlierExposure.for_run(config, bundle, rt.rank)
        return cls(
            config,
            rt,
            bundle,
            model,
            net,
            loader,
            opt,
            augment,
            progress,
            stopping,
            init=init,
            outliers=outliers,
            ema=ema,
            bagging=bagging,
        )

    def train_epoch(self, epoch: int, should_stop: StopFn | None) -> float | None:
        """One pass over the training batches: their mean loss, or None when cancelled."""
        self.epoch = epoch
        self.loader.set_epoch(epoch)
        self.net.train()
        loss_sum, n_seen = 0.0, 0
        for x, y, *index in self.loader:  # the index: only with bagging (bootstrap.Indexed)
            weights = self.bagging[index[0]] if self.bagging is not None else None
            loss = train_step(
                self.net,
                x,
                y,
                self.opt,
                self.config.resolved_loss,
                self.rt.device,
                self.augment,
                self.outliers,
                self.config.member_repulsion,
                weights,
            )
            if self.ema is not None:
                self.ema.update_parameters(self.model)
            loss_sum += float(loss) * len(y)
            n_seen += len(y)
            self.progress.on_step(epoch, loss_sum / n_seen, self.stopping.best_loss)
            if should_stop is not None and should_stop():
                self.cancelled = True
                return None
        return loss_sum / max(n_seen, 1)

    def end_epoch(self, epoch: int, train_loss: float) -> bool:
        """Validate, record, step the schedule, report; True when early stopping ends the run."""
        if self.outliers is not None:  # the digits' exact BatchNorm statistics (outliers.py)
            recalibrate_batchnorm(self.evaluated, self.bundle.train, self.config.eval_batch_size)
        val_loss, val_acc = validate(
            self.evaluated, self.bundle.val, self.rt, self.config.eval_batch_size
        )
        record = {
            "epoch": epoch,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "lr": self.opt.lr,
        }  # lr before the schedule steps
        self.history.append(record)
        self.stopping.update(epoch, val_loss)
        self.opt.end_epoch(val_loss)  # val_loss is the same on every rank (broadcast)
        self.progress.on_epoch(record, self.stopping.best_loss)
        return self.stopping.should_stop

    def result(self, train_seconds: float) -> TrainResult:
        return TrainResult(
            history=self.history,
            best_epoch=self.stopping.best_epoch,
            best_loss=self.stopping.best_loss,
            epochs_run=self.epoch,
            train_seconds=train_seconds,
            cancelled=self.cancelled,
            init=self.init,
        )
