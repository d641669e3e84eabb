"""``vge train``'s flags are generated from ``TrainConfig`` (issue 35 item 3): one flag per field
and no other, every flag reaches the config the run gets, and mistakes are one line, exit 2."""

from __future__ import annotations

import argparse
import json
import typing

import pytest

from models.training import TrainConfig
from service.cli import build_parser, main
from service.cli.flags import choices, flag_name
from service.cli.train import _HELP, OWN_FLAGS, add_config_flags, config_from_args


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vge train")
    add_config_flags(p)
    return p


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def _train_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_every_field_has_a_flag_and_every_flag_a_field() -> None:
    parser = build_parser()
    train = _train_subparser(parser)
    # added when `vge train` is parsed: `vge serve` / `vge score` do not import TrainConfig
    assert {a.dest for a in train._actions} == {"help", *OWN_FLAGS}
    parser.parse_args(["train", "--out", "o"])
    dests = {a.dest for a in train._actions if a.dest != "help"}
    fields = set(TrainConfig.model_fields)
    assert not fields & set(OWN_FLAGS)
    assert dests == fields | set(OWN_FLAGS), dests ^ (fields | set(OWN_FLAGS))
    for a in train._actions:
        if a.dest in fields:
            assert flag_name(a.dest) in a.option_strings
            assert a.default is None  # not given: the file's value or the field's default
            assert a.help and not a.help.startswith(" ("), f"{a.dest} has no help"
    assert set(_HELP) <= fields, set(_HELP) - fields


def test_flag_kinds_follow_the_field_types() -> None:
    """Bools are --x/--no-x, Literals choices (from the config, never restated), lists and
    dicts JSON; the backbone help lists the registry."""
    from models.nets import available_backbones

    actions = {a.dest: a for a in _train_parser()._actions}
    for name, field in TrainConfig.model_fields.items():
        if field.annotation is bool:
            assert f"--no-{name.replace('_', '-')}" in actions[name].option_strings, name
    schedules = typing.get_args(TrainConfig.model_fields["lr_schedule"].annotation)
    assert tuple(actions["lr_schedule"].choices) == schedules
    assert tuple(actions["loss"].choices) == ("mixture", "members")
    assert actions["outlier_targets"].choices == ("uniform", "disagree")
    assert actions["backbone"].help.startswith(" | ".join(available_backbones()) + " (default")
    assert actions["k"].metavar == actions["backbone_kwargs"].metavar == "JSON"


#: Flags that are refused without their partner flag.
PARTNERS = {"k": ["--vgn"], "augment_read": ["--augment"], "augment_elastic": ["--augment"],
            "image_size": ["--dataset", "imagefolder:digits"]}  # fmt: skip


def test_every_flag_reaches_the_config() -> None:
    """Each field set by its flag alone, to a value other than its default, is that value in the
    config built from argv (the bug: --augment was parsed and dropped). Bools and Literals are
    tried from their types; a new field of another type needs its line in ``values``."""
    values: dict[str, tuple[list[str], object]] = {
        "backbone": (["cnn4"], "cnn4"),
        "backbone_kwargs": (['{"width": 8}'], {"width": 8}),
        "ensemble": (["de"], "de"),
        "members": (["3"], 3),
        "mc_samples": (["4"], 4),
        "k": (["[0.5, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]"], [0.5, 0.6] + [0.5] * 8),
        "name": (["my-model"], "my-model"),
        "version": (["2.0.0"], "2.0.0"),
        "description": (["hello"], "hello"),
        "dataset": (["FashionMNIST"], "FashionMNIST"),
        "data_root": (["/data"], "/data"),
        "image_size": (["32"], 32),
        "max_train_samples": (["64"], 64),
        "epochs": (["2"], 2),
        "lr": (["0.01"], 0.01),
        "lr_factor": (["0.25"], 0.25),
        "lr_patience": (["7"], 7),
        "weight_decay": (["0.001"], 0.001),
        "batch_size": (["32"], 32),
        "eval_batch_size": (["64"], 64),
        "seed": (["5"], 5),
        "patience": (["2"], 2),
        "min_delta": (["0.01"], 0.01),
        "device": (["cpu"], "cpu"),
        "target_deferral": (["0.1"], 0.1),
        "target_risk": (["0.02"], 0.02),
        "member_repulsion": (["2"], 2.0),
        "outlier_exposure": (["0.5"], 0.5),
        "outlier_batch_size": (["16"], 16),
        "outlier_pool": (["100"], 100),
        "outlier_overlays": (["0.2"], 0.2),
        "calibration_split": (["0.1"], 0.1),
        "augment_read": (["0.25"], 0.25),
        "augment_elastic": (["34"], 34.0),
        "ema_decay": (["0.99"], 0.99),
        "ood_suite_per_group": (["25"], 25),
        "init_from": (["models/x"], "models/x"),
    }
    default = TrainConfig()
    tried = []
    for name, field in TrainConfig.model_fields.items():
        if field.annotation is bool:  # --x or --no-x, whichever is not the default
            flag = flag_name(name) if not getattr(default, name) else f"--no-{flag_name(name)[2:]}"
            tried.append((name, [flag], not getattr(default, name)))
        elif (literal := choices(field.annotation)) is not None:
            for value in literal:
                tried.append((name, [flag_name(name), str(value)], value))
        else:
            assert name in values, f"{name}: add a value other than its default to this test"
            rest, expected = values[name]
            assert getattr(default, name) != expected, f"{name}: not its default, please"
            needs = PARTNERS.get(name, [])
            tried.append((name, [*needs, flag_name(name), *rest], expected))
    assert set(values) <= set(TrainConfig.model_fields)
    for name, argv, expected in tried:
        config = config_from_args(_args("--out", "o", *argv))
        assert getattr(config, name) == expected, (name, argv)
    assert {name for name, _, _ in tried} == set(TrainConfig.model_fields)


def test_flags_override_the_config_file(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 7\naugment: true\nlr: 0.002\nbackbone_kwargs: {width: 8}\n")
    c = config_from_args(_args("--config", str(cfg), "--out", "o", "--epochs", "3"))
    assert (c.epochs, c.augment, c.lr, c.backbone_kwargs) == (3, True, 0.002, {"width": 8})
    c = config_from_args(_args("--config", str(cfg), "--out", "o", "--no-augment"))
    assert (c.epochs, c.augment) == (7, False)
    (tmp_path / "c.json").write_text(json.dumps({"augment": True, "members": 4}))
    c = config_from_args(_args("--config", str(tmp_path / "c.json"), "--out", "o", "--k", "0.5",
                               "--vgn"))  # fmt: skip
    assert (c.augment, c.members, c.k, c.vgn) == (True, 4, 0.5, True)


def test_the_run_gets_the_flags(tmp_path, monkeypatch) -> None:
    """`vge train --augment ...` hands train() a config with augment on (no model trained)."""
    import models.training

    got = {}

    def fake_train(config, out, on_event=None, **kwargs):
        got["config"], got["out"] = config, out
        return out

    monkeypatch.setattr(models.training, "train", fake_train)
    out = tmp_path / "m"
    argv = ["train", "--out", str(out), "--augment", "--max-train-samples", "64", "--epochs",
            "1", "--members", "2", "--device", "cpu", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    c = got["config"]
    assert (c.augment, c.max_train_samples, c.epochs, c.members, got["out"]) == (
        True, 64, 1, 2, out,
    )  # fmt: skip


def test_a_fixed_gate_k_reaches_the_run(tmp_path, monkeypatch) -> None:
    """``--vgn --k 2`` was a traceback: the up-front build checked k's value on the meta
    device."""
    import models.training

    got: dict = {}
    monkeypatch.setattr(models.training, "train", lambda config, out, on_event=None:
                        got.update(config=config) or out)  # fmt: skip
    for k, expected in (("2", 2.0), ("[1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]",
                                      [1.5] * 10)):  # fmt: skip
        argv = ["train", "--out", str(tmp_path / "m"), "--vgn", "--k", k, "--quiet"]
        assert main(argv) == 0
        assert got["config"].k == expected


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--epochs", "many"], "invalid training config: epochs"),
        (["--epochs", "100000"], "less than or equal to 1000"),
        (["--lr-schedule", "sometimes"], "argument --lr-schedule: invalid choice: 'sometimes'"),
        (["--backbone-kwargs", "{width"], "argument --backbone-kwargs: invalid JSON value"),
        (["--backbone", "vgg"], "unknown backbone"),
        (["--k", "0.5"], "k is only meaningful with vgn"),
        (["--augment", "yes"], "unrecognized arguments: yes"),
        # found by review (2026-11-29): tracebacks (exit 1), or failures after training
        (["--device", "xpu"], "must be 'cpu', 'cuda', 'cuda:N' or 'mps'"),
        (["--backbone", "cnn4", "--backbone-kwargs", '{"hidden": 0}'], "hidden must be"),
        (["--backbone", "cnn4", "--backbone-kwargs", '{"width": -1}'], "width must be"),
        (["--version", "1.0 beta/x"], "version"),
        (["--image-size", "64"], "image_size resizes the images of a plain"),
        (["--weight-decay", "1e300"], "weight_decay"),  # trained an epoch, then overflowed
    ],
)
def test_mistakes_are_one_line_exit_2(tmp_path, capsys, argv, words) -> None:
    out = tmp_path / "o"
    try:
        rc = main(["train", "--out", str(out), *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not out.exists()
