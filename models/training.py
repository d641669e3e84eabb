"""Training: ``TrainConfig`` and ``train(config, out_dir, on_event, should_stop) -> Path``.

Protocol (SI S3.2): Adam, batch size 128, learning rate 1e-4 for MNIST and 1e-3 otherwise in the
paper, early stopping on the validation loss (min delta 1e-4, patience 5), deterministic seeding,
dataset-specific normalisation. The best-validation-loss weights are restored at the end.

Optional, off by default (the paper uses neither): ``augment`` draws an independent small random
affine transform for every *training* image of every batch (the parameters of
``torchvision.transforms.v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))``,
bilinear, background fill; see :func:`models.data.random_affine`) from a dedicated
``torch.Generator`` seeded from ``seed`` (and the DDP rank), so runs stay deterministic; validation
and test images are never augmented. ``lr_schedule`` = ``"plateau"`` multiplies the learning rate by
``lr_factor`` when the validation loss has not improved by ``min_delta`` for ``lr_patience`` epochs
(``ReduceLROnPlateau``); ``"cosine"`` anneals it to ``lr * lr_factor`` over ``epochs``
(``CosineAnnealingLR``); ``"onecycle"`` warms up to ``lr`` and anneals to ~0 over all ``epochs``,
stepped per batch (``OneCycleLR``; pair it with a patience that lets it run its course). Early
stopping and best-weight restoring are unchanged by any of them.

Loss (as the paper trains each kind, Section 4). VGN models use ``loss="mixture"``: the negative
log-likelihood of the ensemble *mixture* ``-log q̄_y`` with ``q̄ = mean_m q_m``, so the VGN layer and
its per-class ``k`` are trained end to end through the gated prediction that is served (Section
3.1). Models without a gate default to ``loss="members"``: the members' cross-entropies averaged
(the paper trains DE members independently and "losses were averaged across heads" for LLE), which
keeps the members as diverse as the paper's baselines. ``loss="mixture"`` on a non-VGN model trains
the raw mixture ``-log p̄_y`` (stable: ``logsumexp_m(log_softmax(z_m)) - log M``) instead.

Scale-out: launched under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in
DistributedDataParallel (gloo on CPU, nccl on CUDA) with a ``DistributedSampler``; validation loss is
taken from rank 0 and broadcast so every rank makes the same early-stopping decision, and only
rank 0 writes the checkpoint and emits events.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from models.checkpoint import ModelCard, save_card, save_checkpoint
from models.data import TORCHVISION_NAMES, load_dataset, random_affine
from models.ensembles import EnsembleOutput, build_ensemble, normalise_kind
from models.ensembles.factory import VGN_KINDS

__all__ = [
    "TrainConfig",
    "collect_predictions",
    "config_error_message",
    "load_config",
    "mixture_nll",
    "train",
]

EventFn = Callable[[dict[str, Any]], None]
DEFAULT_TARGET_DEFERRAL = 0.05  # abstain_k calibration target when the config names none


class TrainConfig(BaseModel):
    """Validated training configuration (YAML/JSON files and ``vge train`` flags map onto it)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="model name; default <backbone>-<kind>[-vgn]-<data>")
    version: str = "1.0.0"
    description: str = ""
    dataset: str = Field(
        "mnist-bundled", description="mnist-bundled | torchvision name | imagefolder:<path>"
    )
    data_root: str | None = None
    allow_download: bool = False
    image_size: int | None = Field(None, ge=8, description="ImageFolder resize (square)")
    max_train_samples: int | None = Field(None, ge=1)
    backbone: str = "lenet5"
    backbone_kwargs: dict[str, Any] = Field(default_factory=dict)
    ensemble: str = "lle"
    members: int = Field(
        10,
        ge=2,
        description="de/lle: M; mcd: S samples; mcd-lle: H heads (>= 2: scores need a spread)",
    )
    mc_samples: int = Field(10, ge=1, description="mcd-lle: S dropout samples per head")
    vgn: bool = False
    k: float | None = Field(None, gt=0, description="fixed VGN k; omit to learn per-class k")
    loss: Literal["mixture", "members"] | None = Field(
        None, description="mixture | members; default: mixture with vgn, members without"
    )
    epochs: int = Field(100, ge=1)
    lr: float = Field(1e-3, gt=0, le=1)
    lr_schedule: Literal["constant", "plateau", "cosine", "onecycle"] = Field(
        "constant",
        description="constant | plateau (ReduceLROnPlateau on the validation loss) | cosine "
        "(CosineAnnealingLR over epochs) | onecycle (OneCycleLR to lr over all steps, per step)",
    )
    lr_factor: float = Field(
        0.5, gt=0, lt=1, description="plateau: lr multiplier per reduction; cosine: final lr / lr"
    )
    lr_patience: int = Field(
        3, ge=0, description="plateau: epochs without validation-loss improvement before reducing"
    )
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(128, ge=1)
    eval_batch_size: int = Field(512, ge=1)
    seed: int = 0
    patience: int = Field(5, ge=1)
    augment: bool = Field(
        False,
        description="random small affine transforms of training images only (RandomAffine "
        "degrees 10, translate 0.1, scale 0.9-1.1; seeded)",
    )
    min_delta: float = Field(1e-4, ge=0)
    device: str | None = None
    deterministic: bool = True
    target_deferral: float | None = Field(None, gt=0, lt=1)
    target_risk: float | None = Field(None, gt=0, lt=1)

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if v == "mnist-bundled" or v.lower() in TORCHVISION_NAMES:
            return v
        if v.startswith("imagefolder:") and len(v) > len("imagefolder:"):
            return v
        raise ValueError(
            "must be 'mnist-bundled', a torchvision dataset (MNIST, FashionMNIST, "
            "SVHN, CIFAR10, CIFAR100) or 'imagefolder:<path>'"
        )

    @field_validator("backbone")
    @classmethod
    def _backbone(cls, v: str) -> str:
        from models.nets import available_backbones

        if v not in available_backbones():
            raise ValueError(f"unknown backbone; available: {', '.join(available_backbones())}")
        return v

    @field_validator("ensemble")
    @classmethod
    def _ensemble(cls, v: str) -> str:
        return normalise_kind(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                torch.device(v)
            except RuntimeError:
                raise ValueError("must be 'cpu', 'cuda' or 'cuda:N'") from None
        return v

    @property
    def resolved_loss(self) -> str:
        """The loss trained: ``loss`` when given, else mixture with VGN and members without."""
        if self.loss is not None:
            return self.loss
        return "mixture" if self.vgn else "members"

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.vgn and self.ensemble not in VGN_KINDS:
            raise ValueError(
                f"vgn is only available for de and lle ensembles, not "
                f"{self.ensemble!r} (paper Table 2)"
            )
        if self.vgn and self.members < 2:
            raise ValueError("vgn needs members >= 2")
        if self.vgn and self.loss == "members":
            raise ValueError("loss 'members' ignores the VGN layer; use loss 'mixture' with vgn")
        if self.k is not None and not self.vgn:
            raise ValueError("k is only meaningful with vgn: true")
        if self.target_deferral is not None and self.target_risk is not None:
            raise ValueError("give at most one of target_deferral and target_risk")
        return self

    def model_name(self) -> str:
        if self.name:
            return self.name
        data = (
            self.dataset.split(":", 1)[0]
            if self.dataset.startswith("imagefolder:")
            else ("mnist" if self.dataset == "mnist-bundled" else self.dataset.lower())
        )
        return f"{self.backbone}-{self.ensemble}{'-vgn' if self.vgn else ''}-{data}"


def config_error_message(err: ValidationError) -> str:
    """One line describing the first problem of a config ``ValidationError``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}")
    return "invalid training config: " + "; ".join(parts)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML/JSON config file (optional), apply ``overrides`` (``None`` values ignored).

    Raises ``ValueError`` with a one-line, human-readable message on any problem.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found")
        text = p.read_text()
        try:
            if p.suffix.lower() == ".json":
                import json

                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text) or {}
        except Exception as e:  # yaml/json syntax errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"config file {p}: cannot parse: {first}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {p}: expected a mapping of fields at the top level")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(config_error_message(e)) from None


def mixture_nll(out: EnsembleOutput, log_p: Tensor, y: Tensor, loss: str = "mixture") -> Tensor:
    """Training loss, mean over the batch. ``log_p`` member log-probs (B, M, C), ``y`` (B,).

    VGN (``out.q`` given): ``-log q̄_y``. Otherwise ``-log p̄_y`` with
    ``log p̄ = logsumexp_m log p_m - log M`` (stable), or the mean member CE for ``loss="members"``.
    """
    if out.q is not None:
        q_bar = out.q.mean(dim=1)  # (B, C)
        return -torch.log(q_bar.gather(1, y[:, None]).squeeze(1).clamp_min(1e-12)).mean()
    if loss == "members":
        b, m, c = log_p.shape
        return F.nll_loss(log_p.reshape(b * m, c), y.repeat_interleave(m))
    log_mix = torch.logsumexp(log_p, dim=1) - math.log(log_p.shape[1])  # (B, C)
    return F.nll_loss(log_mix, y)


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


def augment_batch(x: Tensor, generator: torch.Generator, fill: list[float]) -> Tensor:
    """The training-time augmentation of one batch (``TrainConfig.augment``); see
    :func:`models.data.random_affine`. A module-level hook so tests can observe where it runs."""
    return random_affine(x, generator, fill)


def _served(p: Tensor, q: Tensor | None) -> Tensor:
    return (q if q is not None else p).mean(dim=1)  # (N, C)


def _basic_metrics(p: Tensor, q: Tensor | None, y: Tensor) -> dict[str, float]:
    probs = _served(p, q)
    acc = float((probs.argmax(1) == y).float().mean())
    nll = float(-torch.log(probs.gather(1, y[:, None]).clamp_min(1e-12)).mean())
    return {"accuracy": acc, "nll": nll}


def _jsonable(obj: Any) -> Any:
    """Convert tensors/numpy/NaN into JSON-ready Python values (NaN/inf -> None)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Tensor):
        return _jsonable(obj.detach().cpu().tolist() if obj.ndim else obj.item())
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)


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


def _distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def train(
    config: TrainConfig,
    out_dir: str | Path,
    on_event: EventFn | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Path:
    """Train the configured ensemble, write the checkpoint to ``out_dir`` and return ``out_dir``.

    ``on_event`` receives dicts with ``type`` in {start, step, epoch, done} and ``epoch``, ``step``,
    ``total_steps``, ``train_loss``, ``val_loss``, ``val_accuracy``, ``eta_s`` where known.
    ``should_stop`` is polled after every step; when it returns True training stops, the best
    weights so far are saved as usual and the ``done`` event carries ``cancelled: True``.
    """
    import torch.distributed as dist

    rank, world, local_rank = _distributed()
    use_cuda = (config.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith(
        "cuda"
    )
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device(f"cuda:{local_rank}" if world > 1 else (config.device or "cuda"))
        if device.index is not None:
            torch.cuda.set_device(device)
    else:
        device = torch.device(config.device or "cpu")
    is_main = rank == 0
    emit: EventFn = on_event if (on_event is not None and is_main) else (lambda e: None)
    out_dir = Path(out_dir)
    try:
        return _train(config, out_dir, emit, should_stop, device, rank, world, is_main)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    config: TrainConfig,
    out_dir: Path,
    emit: EventFn,
    should_stop: Callable[[], bool] | None,
    device: torch.device,
    rank: int,
    world: int,
    is_main: bool,
) -> Path:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    seed_everything(config.seed, config.deterministic)
    bundle = load_dataset(
        config.dataset,
        config.data_root,
        config.allow_download,
        config.max_train_samples,
        config.image_size,
    )
    model = build_ensemble(
        config.ensemble,
        config.backbone,
        bundle.num_classes,
        config.members,
        config.vgn,
        bundle.in_channels,
        backbone_kwargs=config.backbone_kwargs,
        k=config.k,
        mc_samples=config.mc_samples,
    ).to(device)
    net: nn.Module = model
    sampler = None
    if world > 1:
        net = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        sampler = DistributedSampler(
            bundle.train, num_replicas=world, rank=rank, shuffle=True, seed=config.seed
        )
    gen = torch.Generator().manual_seed(config.seed)
    loader = DataLoader(
        bundle.train,
        batch_size=config.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=gen if sampler is None else None,
    )
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler: Any = None
    if config.lr_schedule == "plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt,
            mode="min",
            factor=config.lr_factor,
            patience=config.lr_patience,
            threshold=config.min_delta,
            threshold_mode="abs",
        )
    elif config.lr_schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=config.epochs, eta_min=config.lr * config.lr_factor
        )
    step_scheduler: Any = None  # stepped after every optimiser step
    if config.lr_schedule == "onecycle":
        step_scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=config.lr, total_steps=len(loader) * config.epochs
        )
    # Augmentation parameters come from their own generator (never the global RNG that dropout
    # uses), seeded from the config seed and the rank: same seed, same augmented batches.
    aug_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + 7919 * (rank + 1))
    aug_fill = [-m / s for m, s in zip(bundle.mean, bundle.std, strict=True)]  # black, normalised

    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * config.epochs
    emit(
        {
            "type": "start",
            "epoch": 0,
            "step": 0,
            "total_steps": total_steps,
            "train_size": len(bundle.train),
            "val_size": len(bundle.val),
            "world_size": world,
            "device": str(device),
            "name": config.model_name(),
        }
    )

    best_loss, best_epoch, bad_epochs = math.inf, 0, 0
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    history: list[dict[str, float]] = []
    step, cancelled, epoch = 0, False, 0
    t_loop = time.perf_counter()
    bar = tqdm(
        total=total_steps,
        disable=None if is_main else True,
        desc=config.model_name(),
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        for epoch in range(1, config.epochs + 1):
            if sampler is not None:
                sampler.set_epoch(epoch)
            net.train()
            loss_sum, n_seen = 0.0, 0
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if config.augment:  # training batches only; validation/test never pass here
                    x = augment_batch(x, aug_gen, aug_fill)
                out, log_p = net(x, return_log_p=True)
                loss = mixture_nll(out, log_p, y, config.resolved_loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step_scheduler is not None:
                    step_scheduler.step()
                step += 1
                loss_sum += float(loss.detach()) * len(y)
                n_seen += len(y)
                elapsed = time.perf_counter() - t_loop
                eta = elapsed / step * (total_steps - step)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum / n_seen:.4f}", best_val=f"{best_loss:.4f}")
                emit(
                    {
                        "type": "step",
                        "epoch": epoch,
                        "step": step,
                        "total_steps": total_steps,
                        "train_loss": loss_sum / n_seen,
                        "eta_s": eta,
                    }
                )
                if should_stop is not None and should_stop():
                    cancelled = True
                    break
            if cancelled:
                break
            # Validation on rank 0 (full split), broadcast so all ranks decide alike.
            stats = torch.zeros(2, dtype=torch.float64)
            if is_main:
                p, q, yv = collect_predictions(model, bundle.val, device, config.eval_batch_size)
                probs = _served(p, q)
                stats[0] = float(-torch.log(probs.gather(1, yv[:, None]).clamp_min(1e-12)).mean())
                stats[1] = float((probs.argmax(1) == yv).float().mean())
            if world > 1:
                stats = stats.to(device)
                dist.broadcast(stats, src=0)
                stats = stats.cpu()
            val_loss, val_acc = float(stats[0]), float(stats[1])
            train_loss = loss_sum / max(n_seen, 1)
            history.append(
                {
                    "epoch": epoch,
                    "train_loss": train_loss,
                    "val_loss": val_loss,
                    "val_accuracy": val_acc,
                    "lr": opt.param_groups[0]["lr"],
                }
            )
            if val_loss < best_loss - config.min_delta:
                best_loss, best_epoch, bad_epochs = val_loss, epoch, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                bad_epochs += 1
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(val_loss)  # val_loss is the same on every rank (broadcast above)
            elif scheduler is not None:
                scheduler.step()
            per_epoch = (time.perf_counter() - t_loop) / epoch
            emit(
                {
                    "type": "epoch",
                    "epoch": epoch,
                    "step": step,
                    "total_steps": total_steps,
                    "train_loss": train_loss,
                    "val_loss": val_loss,
                    "val_accuracy": val_acc,
                    "best_val_loss": best_loss,
                    "eta_s": per_epoch * (config.epochs - epoch),
                }
            )
            if is_main and not bar.disable:  # interactive terminal: keep a line per epoch
                bar.write(
                    f"epoch {epoch}: train_loss {train_loss:.4f}  val_loss {val_loss:.4f}  "
                    f"val_acc {val_acc:.4f}"
                )
            if bad_epochs >= config.patience:
                break
    finally:
        bar.close()

    model.load_state_dict(best_state)
    train_seconds = time.perf_counter() - t_start
    if is_main:
        _finalise(
            config,
            model,
            bundle,
            out_dir,
            device,
            history,
            best_epoch,
            best_loss,
            epoch,
            train_seconds,
            world,
            cancelled,
            emit,
        )
    if world > 1:
        dist.barrier()
    return out_dir


def _finalise(
    config: TrainConfig,
    model: nn.Module,
    bundle: Any,
    out_dir: Path,
    device: torch.device,
    history: list[dict[str, float]],
    best_epoch: int,
    best_loss: float,
    epochs_run: int,
    train_seconds: float,
    world: int,
    cancelled: bool,
    emit: EventFn,
) -> None:
    """Evaluate the restored best model, save weights + card, fill metrics and calibration."""
    p_test, q_test, y_test = collect_predictions(model, bundle.test, device, config.eval_batch_size)
    p_val, q_val, y_val = collect_predictions(model, bundle.val, device, config.eval_batch_size)
    basic = _basic_metrics(p_test, q_test, y_test)
    metrics: dict[str, Any] = {
        "split": "test",
        "n_test": len(y_test),
        "test_accuracy": basic["accuracy"],
        "test_nll": basic["nll"],
        "val_accuracy": _basic_metrics(p_val, q_val, y_val)["accuracy"],
        "best_val_loss": best_loss,
    }
    card = ModelCard(
        name=config.model_name(),
        version=config.version,
        description=config.description,
        backbone=config.backbone,
        backbone_kwargs=config.backbone_kwargs,
        ensemble=config.ensemble,
        members=config.members,
        mc_samples=config.mc_samples,
        vgn=config.vgn,
        k_fixed=config.k,
        class_names=bundle.class_names,
        in_channels=bundle.in_channels,
        input_size=bundle.input_size,
        mean=list(bundle.mean),
        std=list(bundle.std),
        dataset=bundle.name,
        data_fingerprint=bundle.fingerprint,
        metrics=metrics,
        training={
            "config": config.model_dump(mode="json"),
            "epochs_run": epochs_run,
            "best_epoch": best_epoch,
            "train_seconds": round(train_seconds, 1),
            "device": str(device),
            "world_size": world,
            "torch": torch.__version__,
            "cancelled": cancelled,
            "history": history,
        },
    )
    # Write the weights first so a failure in evaluation never loses a finished training run.
    card = save_checkpoint(model, card, out_dir)
    try:
        from models.evaluation import evaluate_predictions
        from models.evaluation.calibration import calibrate_served
    except ImportError:  # TODO: evaluation package not available; basic metrics only
        evaluate_predictions = calibrate_served = None  # type: ignore[assignment]
    if evaluate_predictions is not None:
        target_deferral = config.target_deferral
        if target_deferral is None and config.target_risk is None:
            target_deferral = DEFAULT_TARGET_DEFERRAL
        # Calibrate on exactly the served rule (VGMU on q̄ for VGN models), then report the test
        # split under that rule at that k: the card describes what the service does.
        calib = calibrate_served(
            p_val, q_val, y_val, target_deferral=target_deferral, target_risk=config.target_risk
        )
        metrics["evaluation"] = _jsonable(
            evaluate_predictions(p_test, q_test, y_test, abstain_k=calib["abstain_k"])
        )
        from models.evaluation.drift import served_reference

        card = card.model_copy(
            update={
                "metrics": metrics,
                "abstain_calibration": _jsonable(dict(calib)),
                "uncertainty_reference": served_reference(p_val, q_val, calib),
            }
        )
        save_card(card, out_dir)
    emit(
        {
            "type": "done",
            "epoch": epochs_run,
            "step": None,
            "total_steps": None,
            "val_loss": best_loss,
            "val_accuracy": metrics["val_accuracy"],
            "test_accuracy": metrics["test_accuracy"],
            "test_nll": metrics["test_nll"],
            "best_epoch": best_epoch,
            "cancelled": cancelled,
            "path": str(out_dir),
            "eta_s": 0.0,
        }
    )
