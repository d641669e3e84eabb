"""`vge train --config FILE.yaml|json --out DIR [flags]`: train an ensemble and write a checkpoint.

Every ``TrainConfig`` field is a flag (``--field-name``; generated from the model with
:mod:`service.cli.flags`, as ``vge serve``'s are from ``Settings``), and flags override fields of
the config file (or of the defaults when no file is given). A bad config or flag is reported as one line on stderr with exit status 2. Under ``torchrun`` the same command trains
with DistributedDataParallel (see :mod:`models.training`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.cli import CliError, check_output_dir, flags

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from models.training import TrainConfig

#: Flags of ``vge train`` that are not ``TrainConfig`` fields.
OWN_FLAGS = ("config", "out", "quiet")

#: Help for the fields whose ``TrainConfig`` description is missing (a field's own description
#: wins; the drift test checks that every key is a field and every flag has help).
_HELP: dict[str, str] = {
    "backbone_kwargs": "keyword arguments of the backbone as a JSON object, e.g. '{\"width\": 64}'",
    "vgn": "add the VGN layer (de/lle only)",
    "version": "model version written to the card",
    "description": "free text written to the card",
    "data_root": "where torchvision datasets live",
    "allow_download": "let torchvision download the dataset",
    "max_train_samples": "train on a seeded subset of this many training images",
    "epochs": "maximum epochs (early stopping may end sooner)",
    "lr": "Adam learning rate",
    "weight_decay": "Adam weight decay",
    "batch_size": "training batch size",
    "eval_batch_size": "validation and test batch size",
    "seed": "random seed",
    "patience": "early-stopping patience (epochs)",
    "min_delta": "early-stopping minimum improvement of the validation loss",
    "device": "cpu | cuda | cuda:N; unset: cuda when there is one",
    "deterministic": "seeded, deterministic kernels (cuDNN, cuBLAS)",
    "target_deferral": "abstain_k calibration: deferral rate",
    "target_risk": "abstain_k calibration: selective risk",
    "outlier_batch_size": "outliers per outlier-exposure batch",
    "outlier_pool": "generated outliers in the outlier-exposure pool",
}


def config_fields() -> dict[str, FieldInfo]:
    """The ``TrainConfig`` fields, one flag each (imports the training package: ~1 s)."""
    from models.training import TrainConfig

    return dict(TrainConfig.model_fields)


def help_text(name: str, field: FieldInfo) -> str:
    """The field's description (or :data:`_HELP`'s), then its default."""
    from models.training.config import DEFAULT_ARCHITECTURE

    if name == "backbone":  # the registry's names, never a restated list
        from models.nets import available_backbones

        text = " | ".join(available_backbones())
    else:
        text = (field.description or _HELP.get(name, "")).rstrip()
    text += f" (default: {flags.shown_default(field, DEFAULT_ARCHITECTURE.get(name))})"
    return text.replace("%", "%%")  # argparse %-formats help strings


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, default None (not given: the file's value or the
    field's default). Bools are ``--x/--no-x``, Literals take their choices, lists and dicts
    JSON; other values stay strings that ``TrainConfig`` validates as it does a config file's,
    so a bad one is the same one-line "invalid training config" error."""
    for name, field in config_fields().items():
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text(name, field)}
        if flags.is_type(field.annotation, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif (values := flags.choices(field.annotation)) is not None:
            kwargs.update(
                choices=values, type=flags.choice_of(values), metavar=flags.metavar(field)
            )
        elif flags.is_structured(field.annotation):
            kwargs.update(type=flags.json_value, metavar=flags.metavar(field))
        else:
            kwargs.update(type=str, metavar=flags.metavar(field))
        p.add_argument(flags.flag_name(name), **kwargs)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train an ensemble (DE, LLE, MCD, MCD-LLE; optionally VGN) and save a checkpoint",
        description="Train from a YAML/JSON config; flags override config fields (one flag per "
        "field of the training config). Writes model.safetensors + model_card.json to --out.",
    )
    p.add_argument("--config", type=Path, default=None, help="YAML or JSON training config")
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    p.set_defaults(func=run)
    # The config's flags are added when `vge train` itself is parsed: reading TrainConfig imports
    # the training package (about a second), which `vge serve` / `vge score` should not pay.
    parse = p.parse_known_args
    added: list[bool] = []

    def parse_with_config_flags(args: Any = None, namespace: Any = None) -> Any:
        if not added:
            add_config_flags(p)
            added.append(True)
        return parse(args, namespace)

    p.parse_known_args = parse_with_config_flags


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config file (``--config``), overridden by the flags given; :class:`CliError` (one
    line) when it is invalid."""
    from models.training import load_config

    overrides = {name: getattr(args, name, None) for name in config_fields()}
    try:
        return load_config(args.config, overrides)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from models.training import train
    from models.training.runtime import check_device

    config = config_from_args(args)

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
        what = exc.strerror or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if exc.filename is None:  # e.g. a full disk while saving, or an image PIL cannot read
            raise CliError(f"training failed: {what} (reading the data or writing {args.out})") \
                from None  # fmt: skip
        if Path(exc.filename).resolve().is_relative_to(Path(args.out).resolve()):
            raise CliError(f"{args.out}: cannot write the model ({what})") from None
        # the data (an image that cannot be read, a folder it may not list), not the output
        raise CliError(f"{exc.filename}: {what}") from None
    print(out)
    return 0
