"""`vge train --config FILE.yaml|json --out DIR [flags]`: train an ensemble and write a checkpoint.

Flags override fields of the config file (or of the defaults when no file is given). A bad config
is reported as one line on stderr with exit status 2. Under ``torchrun`` the same command trains
with DistributedDataParallel (see :mod:`models.training`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from service.cli import CliError, check_output_dir

# flag -> (TrainConfig field, type, help)
_FLAGS: list[tuple[str, str, type, str]] = [
    ("--name", "name", str, "model name"),
    (
        "--dataset",
        "dataset",
        str,
        "mnist-bundled | MNIST | FashionMNIST | SVHN | CIFAR10 | CIFAR100 | imagefolder:<path>",
    ),
    ("--data-root", "data_root", str, "where torchvision datasets live"),
    ("--backbone", "backbone", str, "cnn4 | lenet5 | resnet18 | wrn28_10"),
    ("--ensemble", "ensemble", str, "de | lle | mcd | mcd-lle"),
    ("--members", "members", int, "de/lle: M; mcd: S samples; mcd-lle: H heads"),
    ("--mc-samples", "mc_samples", int, "mcd-lle: S dropout samples per head"),
    ("--k", "k", float, "fixed VGN k (default: learn per-class k)"),
    ("--epochs", "epochs", int, "maximum epochs (early stopping may end sooner)"),
    ("--lr", "lr", float, "Adam learning rate"),
    ("--batch-size", "batch_size", int, "training batch size"),
    ("--seed", "seed", int, "random seed"),
    ("--patience", "patience", int, "early-stopping patience (epochs)"),
    ("--min-delta", "min_delta", float, "early-stopping minimum improvement"),
    ("--device", "device", str, "cpu | cuda | cuda:N (default: cuda if available)"),
    ("--max-train-samples", "max_train_samples", int, "truncate the training split"),
    ("--image-size", "image_size", int, "ImageFolder resize"),
    ("--target-deferral", "target_deferral", float, "abstain_k calibration: deferral rate"),
    ("--target-risk", "target_risk", float, "abstain_k calibration: selective risk"),
    ("--lr-schedule", "lr_schedule", str, "constant | plateau | cosine | onecycle"),
    (
        "--init-from",
        "init_from",
        str,
        "a model directory whose weights start the run (fine-tuning; same architecture, data "
        "prepared alike)",
    ),
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train an ensemble (DE, LLE, MCD, MCD-LLE; optionally VGN) and save a checkpoint",
        description="Train from a YAML/JSON config; flags override config fields. Writes "
        "model.safetensors + model_card.json to --out.",
    )
    p.add_argument("--config", type=Path, default=None, help="YAML or JSON training config")
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    for flag, field, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=field, type=typ, default=None, help=help_)
    p.add_argument(
        "--vgn",
        dest="vgn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add the VGN layer (de/lle only)",
    )
    p.add_argument(
        "--augment",
        dest="augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random small affine transforms of training images (never val/test)",
    )
    p.add_argument(
        "--allow-download",
        dest="allow_download",
        action="store_true",
        default=None,
        help="let torchvision download the dataset",
    )
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from models.training import load_config, train
    from models.training.runtime import check_device

    overrides: dict[str, Any] = {f: getattr(args, f) for _, f, _, _ in _FLAGS}
    overrides["vgn"] = args.vgn
    overrides["allow_download"] = args.allow_download
    try:
        config = load_config(args.config, overrides)
    except ValueError as exc:
        raise CliError(str(exc)) from None

    def on_event(e: dict[str, Any]) -> None:
        if args.quiet:
            return
        if e["type"] == "epoch" and not sys.stderr.isatty():  # a terminal shows tqdm's lines
            print(
                f"epoch {e['epoch']}: train_loss {e['train_loss']:.4f} val_loss "
                f"{e['val_loss']:.4f} val_acc {e['val_accuracy']:.4f}",
                file=sys.stderr,
            )
        elif e["type"] == "done":
            print(
                f"done: test_accuracy {e['test_accuracy']:.4f} test_nll {e['test_nll']:.4f} "
                f"(best epoch {e['best_epoch']}) -> {e['path']}",
                file=sys.stderr,
            )

    check_output_dir(args.out)
    try:
        check_device(config.device)
    except ValueError as exc:
        raise CliError(f"--device: {exc}") from None
    try:
        config.check_architecture()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        out = train(config, args.out, on_event=on_event)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        # ValueError: dataset not found / downloads off; FileNotFoundError: an ImageFolder without
        # class folders; RuntimeError: torch refusing the run (its first line says why)
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    except OSError as exc:
        raise CliError(f"{args.out}: cannot write the model ({exc.strerror or exc})") from None
    print(out)
    return 0
