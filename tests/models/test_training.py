"""Training: config validation, mixture loss, a tiny run (events, checkpoint, determinism),
training-only seeded augmentation, learning-rate schedules, early stopping, cancellation, the
`vge train` CLI, and DDP with 2 CPU processes (gloo)."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.checkpoint import load_checkpoint
from models.data import load_dataset, random_affine
from models.ensembles import EnsembleOutput
from models.training import (
    TrainConfig,
    collect_predictions,
    digit_loss,
    load_config,
    member_variance,
    mixture_nll,
    train,
)
from tests.cli import run_vge

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
TINY = dict(
    max_train_samples=256, epochs=2, members=3, batch_size=64, lr=1e-3, eval_batch_size=1024
)


def test_config_validation_messages():
    with pytest.raises(ValueError, match="Table 2"):
        load_config(None, {"ensemble": "mcd", "vgn": True})
    with pytest.raises(ValueError, match="lerning_rate: unknown field"):
        load_config(None, {"lerning_rate": 0.1})
    with pytest.raises(ValueError, match="dataset: must be 'mnist-bundled'"):
        load_config(None, {"dataset": "imagenet"})
    with pytest.raises(ValueError, match="backbone: unknown backbone; available"):
        load_config(None, {"backbone": "vgg"})
    with pytest.raises(ValueError, match="members: Input should be greater than or equal to 2"):
        load_config(None, {"members": 0})
    with pytest.raises(ValueError, match="device: must be 'cpu'"):
        load_config(None, {"device": "tpu"})
    for name in ("/tmp/evil", "../x", "a/b", "", "-lead"):  # names a URL segment and a file
        with pytest.raises(ValueError, match="name: String should match pattern"):
            load_config(None, {"name": name})
    assert load_config(None, {"name": "digits_v2.1-b"}).name == "digits_v2.1-b"
    with pytest.raises(ValueError, match="not found"):
        load_config("/nonexistent.yaml")
    cfg = TrainConfig()
    assert (cfg.batch_size, cfg.patience, cfg.min_delta, cfg.allow_download) == (
        128,
        5,
        1e-4,
        False,
    )


def test_load_config_yaml_json_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("ensemble: de\nmembers: 4\nvgn: true\nlr: 0.0001\n")
    cfg = load_config(y, {"members": 6, "epochs": None})
    assert (cfg.ensemble, cfg.members, cfg.vgn, cfg.lr, cfg.epochs) == ("de", 6, True, 1e-4, 100)
    assert cfg.model_name() == "lenet5-de-vgn-mnist"
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"ensemble": "MCD_LLE", "members": 2}))
    assert load_config(j).ensemble == "mcd-lle"
    bad = tmp_path / "bad.yaml"
    bad.write_text("members: [1,\n")
    with pytest.raises(ValueError, match="cannot parse"):
        load_config(bad)


def test_mixture_nll_is_stable_and_exact():
    torch.manual_seed(0)
    logits = torch.randn(5, 4, 3) * 50  # extreme logits: naive log(mean(softmax)) underflows
    log_p = torch.log_softmax(logits, -1)
    y = torch.tensor([0, 1, 2, 0, 1])
    out = EnsembleOutput(log_p.exp(), None)
    loss = mixture_nll(out, log_p, y)
    ref = -(torch.logsumexp(log_p.double(), 1) - math.log(4)).gather(1, y[:, None]).mean()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref.item(), rel=1e-5)
    members = mixture_nll(out, log_p, y, loss="members")
    assert members.item() == pytest.approx(
        -log_p.gather(2, y[:, None, None].expand(5, 4, 1)).mean().item(), rel=1e-5
    )
    q = torch.softmax(torch.randn(5, 4, 3), -1)
    vgn = mixture_nll(EnsembleOutput(log_p.exp(), q), log_p, y)
    assert vgn.item() == pytest.approx(-torch.log(q.mean(1).gather(1, y[:, None])).mean().item())


def test_member_variance_and_repulsion_by_hand():
    """Two members, two classes: (0.9, 0.1) and (0.7, 0.3) differ by 0.2 in each class, so the
    unbiased variance is 0.02 per class and 0.04 summed; the loss subtracts weight x that."""
    p = torch.tensor([[[0.9, 0.1], [0.7, 0.3]]])
    assert member_variance(p).item() == pytest.approx(0.04)
    assert member_variance(p[:, :1]).item() == 0.0  # one member: no spread to reward
    out, log_p, y = EnsembleOutput(p, None), p.log(), torch.tensor([0])
    nll = mixture_nll(out, log_p, y).item()
    assert nll == pytest.approx(-math.log(0.8))
    assert digit_loss(out, log_p, y).item() == pytest.approx(nll)
    assert digit_loss(out, log_p, y, repulsion=2.5).item() == pytest.approx(nll - 0.1)


def test_repulsion_pushes_members_apart():
    """Negative correlation's gradient on the members' logits moves them apart: one step of
    the term alone raises their variance; at equal members (no spread) it is zero."""
    logits = torch.tensor([[[2.0, 0.0, -1.0], [1.0, 0.5, 0.0]]], requires_grad=True)
    p = torch.softmax(logits, -1)
    (-member_variance(p)).backward()
    stepped = torch.softmax(logits - 0.5 * logits.grad, -1)
    assert member_variance(stepped).item() > member_variance(p).item()
    same = torch.zeros(1, 3, 4, requires_grad=True)
    member_variance(torch.softmax(same, -1)).backward()
    assert same.grad is not None and same.grad.abs().max().item() == 0.0


def test_bagging_weights_in_the_loss_by_hand():
    """Two members, two classes, p_y = 0.8 and 0.4: equal weights give the unweighted loss;
    weights (3, 1) give -log(0.75 * 0.8 + 0.25 * 0.4) = -log 0.7; a digit no member drew is
    left out; a member of weight 0 gets no gradient from the digit (no VGN)."""
    p = torch.tensor([[[0.8, 0.2], [0.4, 0.6]], [[0.5, 0.5], [0.1, 0.9]]])
    y = torch.tensor([0, 1])
    out = EnsembleOutput(p, None)
    for kind in ("mixture", "members"):
        plain = mixture_nll(out, p.log(), y, kind).item()
        assert mixture_nll(out, p.log(), y, kind, torch.ones(2, 2) * 2).item() == pytest.approx(
            plain
        )
    w = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    assert mixture_nll(out, p.log(), y, weights=w).item() == pytest.approx(-math.log(0.7))
    assert mixture_nll(out, p.log(), y, "members", w).item() == pytest.approx(
        -(0.75 * math.log(0.8) + 0.25 * math.log(0.4))
    )
    q = torch.tensor([[[0.6, 0.4], [0.2, 0.8]]])  # VGN: the gated members' weighted mean
    got = mixture_nll(EnsembleOutput(p[:1], q), p[:1].log(), y[:1], weights=w[:1])
    assert got.item() == pytest.approx(-math.log(0.75 * 0.6 + 0.25 * 0.2))
    logits = torch.randn(1, 2, 2, requires_grad=True)
    log_p = torch.log_softmax(logits, -1)
    mixture_nll(
        EnsembleOutput(log_p.exp(), None), log_p, y[:1], weights=torch.tensor([[1.0, 0.0]])
    ).backward()
    assert logits.grad is not None
    assert logits.grad[0, 1].abs().max().item() == 0.0 and logits.grad[0, 0].abs().max() > 0
    nothing = mixture_nll(out, p.log(), y, weights=torch.zeros(2, 2))
    assert nothing.item() == 0.0
    # the per-member loss is exact bagging: each member's CE over its own resample, counts kept
    # (digit 0 once in each member, digit 1 twice in member 0: p_y = 0.8, 0.4; 0.5)
    bag = mixture_nll(out, p.log(), y, "members", torch.tensor([[1.0, 1.0], [2.0, 0.0]]))
    want = -(math.log(0.8) + math.log(0.4) + 2 * math.log(0.5)) / 4
    assert bag.item() == pytest.approx(want)
    with pytest.raises(ValueError, match="do not match"):
        mixture_nll(out, p.log(), y, weights=torch.ones(2, 3))


def test_bagging_weights_are_fixed_per_run_and_differ_by_kind():
    from models.training.bootstrap import Indexed, bootstrap_weights

    assert bootstrap_weights(5, 3, "none", 1) is None
    a, b = bootstrap_weights(4000, 10, "poisson", 1), bootstrap_weights(4000, 10, "poisson", 1)
    assert a is not None and b is not None and torch.equal(a, b)
    assert not torch.equal(a, bootstrap_weights(4000, 10, "poisson", 2))
    assert a.mean().item() == pytest.approx(1.0, abs=0.02)  # Poisson(1): mean 1, P(0) = e^-1
    assert (a == 0).float().mean().item() == pytest.approx(math.exp(-1), abs=0.02)
    half = bootstrap_weights(4000, 10, "half", 1)
    assert half is not None and set(half.unique().tolist()) == {0.0, 2.0}
    assert (half == 0).float().mean().item() == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError, match="member_bootstrap"):
        bootstrap_weights(5, 3, "jackknife", 1)
    assert Indexed([("x", 7), ("z", 8)])[1] == ("z", 8, 1)
    with pytest.raises(ValueError, match="member_bootstrap"):
        TrainConfig(member_bootstrap="jackknife")
    with pytest.raises(ValueError, match="mcd model trains one network"):
        TrainConfig(ensemble="mcd", member_bootstrap="poisson")


def test_bagging_trains_every_member_on_its_own_resample(tmp_path):
    """member_bootstrap: the run is recorded in the card, is deterministic, and is not the
    unweighted run (same seed and data). The losses themselves are pinned by hand above."""
    cfg = TrainConfig(ensemble="lle", vgn=True, seed=3, member_bootstrap="half", **TINY)
    train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b")
    plain = TrainConfig(ensemble="lle", vgn=True, seed=3, **TINY)
    train(plain, tmp_path / "c")
    (a, card), (b, _), (c, _) = (load_checkpoint(tmp_path / d) for d in "abc")
    assert card.training["config"]["member_bootstrap"] == "half"
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    events: list[dict] = []
    cfg = TrainConfig(ensemble="lle", vgn=True, seed=3, **TINY)
    train(cfg, out, on_event=events.append)
    return cfg, out, events


def test_tiny_run_events_and_checkpoint(tiny_run):
    cfg, out, events = tiny_run
    types = [e["type"] for e in events]
    assert types[0] == "start" and types[-1] == "done"
    assert types.count("epoch") == 2 and types.count("step") == 2 * 4  # 256 / 64 steps per epoch
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert all(e["total_steps"] == 8 and e["eta_s"] >= 0 and e["train_loss"] > 0 for e in steps)
    ep = [e for e in events if e["type"] == "epoch"]
    assert all(0 <= e["val_accuracy"] <= 1 and e["val_loss"] > 0 for e in ep)
    model, card = load_checkpoint(out)
    assert card.ensemble == "lle" and card.vgn and card.members == 3 and len(card.learned_k) == 10
    assert card.learned_k != pytest.approx([math.log(2) + 1e-8] * 10)  # k was trained
    assert card.data_fingerprint and card.mean and card.input_size == (28, 28)
    assert 0 <= card.metrics["test_accuracy"] <= 1 and card.metrics["n_test"] == 1600
    assert card.training["config"]["seed"] == 3 and card.training["epochs_run"] == 2
    assert events[-1]["test_accuracy"] == card.metrics["test_accuracy"]


def test_training_is_deterministic(tiny_run, tmp_path):
    cfg, out, _ = tiny_run
    train(cfg, tmp_path)
    a = json.loads((out / "model_card.json").read_text())
    b = json.loads((tmp_path / "model_card.json").read_text())
    assert a["weights_sha256"] == b["weights_sha256"]


def test_random_affine_matches_torchvision_per_image():
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    x = torch.randn(6, 1, 28, 28)
    out = random_affine(x, torch.Generator().manual_seed(5), [-0.4])
    g = torch.Generator().manual_seed(5)  # redraw the same parameters, in the same order
    u = [torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4)]
    for i in range(6):
        ref = TF.affine(
            x[i],
            angle=float(-10 + 20 * u[0][i]),
            translate=[round(float(-2.8 + 5.6 * u[1][i])), round(float(-2.8 + 5.6 * u[2][i]))],
            scale=float(0.9 + 0.2 * u[3][i]),
            shear=[0.0, 0.0],
            interpolation=InterpolationMode.BILINEAR,
            fill=[-0.4],
        )
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=0)
    assert not torch.equal(out, x)


def test_elastic_distortion_is_torchvisions_per_image():
    """augment_elastic: the batched displacement is drawn as ElasticTransform draws it, and
    random_affine with an identity transform applies it as TF.elastic does."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    from models.data import elastic_displacement

    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    disp = elastic_displacement(4, 28, 28, 34.0, torch.Generator().manual_seed(2))
    assert disp.shape == (4, 28, 28, 2)
    g = torch.Generator().manual_seed(2)
    noise = torch.rand(4, 2, 28, 28, generator=g) * 2 - 1
    for i in range(4):  # ElasticTransform.make_params, image by image, on the same noise
        d = [
            TF.gaussian_blur(noise[i, a][None, None], [33, 33], [4.0, 4.0]) * 34.0 / 28
            for a in (0, 1)
        ]
        want = torch.cat(d, 1).permute(0, 2, 3, 1)
        torch.testing.assert_close(disp[i : i + 1], want, atol=1e-4, rtol=0)
    still = dict(degrees=(0.0, 0.0), translate=(0.0, 0.0), scale=(1.0, 1.0))
    out = random_affine(x, torch.Generator().manual_seed(0), [-0.4], displacement=disp, **still)
    for i in range(4):
        ref = TF.elastic(
            x[i], disp[i : i + 1], interpolation=InterpolationMode.BILINEAR, fill=[-0.4]
        )
        torch.testing.assert_close(out[i], ref, atol=1e-4, rtol=0)
    plain = random_affine(x, torch.Generator().manual_seed(0), [-0.4], **still)
    torch.testing.assert_close(plain, x, atol=1e-5, rtol=0)  # identity without the field
    assert (out - x).abs().amax() > 0.1  # the field moves pixels
    # displacements of about a pixel: a digit stays the same digit
    assert 0.2 < float(disp.mul(14).norm(dim=-1).mean()) < 2.0


def test_elastic_augmentation_needs_augment_and_changes_batches():
    from models.training.step import Augmenter

    with pytest.raises(ValueError, match="augment_elastic is part of the training augmentation"):
        TrainConfig(augment_elastic=34.0)
    bundle = load_dataset("mnist-bundled", max_train_samples=64)
    x = torch.stack([bundle.train[i][0] for i in range(16)])
    runs = {}
    for alpha in (0.0, 34.0, 34.0):
        cfg = TrainConfig(augment=True, augment_elastic=alpha, seed=4)
        runs.setdefault(alpha, []).append(Augmenter.for_run(cfg, bundle, 0)(x))
    torch.testing.assert_close(runs[34.0][0], runs[34.0][1])  # seeded: same batches
    assert not torch.allclose(runs[34.0][0], runs[0.0][0], atol=1e-3)


def test_weight_averaging_validates_and_saves_the_average(tiny_run, tmp_path):
    """ema_decay: early stopping keeps the average's best epoch and that average is what is
    saved (its validation loss is the recorded one); it is not the plain run's weights."""
    from models.training.validate import basic_metrics

    with pytest.raises(ValueError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)
    cfg = TrainConfig(ensemble="lle", vgn=True, seed=3, ema_decay=0.5, **TINY)
    train(cfg, tmp_path)
    model, card = load_checkpoint(tmp_path)
    assert card.training["config"]["ema_decay"] == 0.5
    bundle = load_dataset("mnist-bundled", max_train_samples=TINY["max_train_samples"])
    got = basic_metrics(*collect_predictions(model, bundle.val, "cpu", 1024))
    best = card.training["history"][card.training["best_epoch"] - 1]
    assert got["nll"] == pytest.approx(best["val_loss"], rel=1e-5)
    plain, _ = load_checkpoint(tiny_run[1])  # same seed and data, no averaging
    a, b = model.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def test_subspace_heads_train_save_and_serve(tmp_path):
    """backbone_kwargs head_subspace: the members' feature masks are saved with the weights and
    the served forward (BatchNorm folded) answers as the trained module does."""
    from models.predictor import Predictor

    cfg = TrainConfig(
        backbone="cnn4",
        ensemble="lle",
        vgn=True,
        seed=3,
        backbone_kwargs={"head_subspace": 0.25},
        **{**TINY, "epochs": 1},
    )
    train(cfg, tmp_path)
    model, _ = load_checkpoint(tmp_path)
    assert model.heads.feature_mask[..., 0].sum(1).tolist() == [32.0] * 3
    served = Predictor.from_dir(tmp_path)
    bundle = load_dataset("mnist-bundled", max_train_samples=TINY["max_train_samples"])
    x = torch.stack([bundle.test[i][0] for i in range(8)])
    torch.testing.assert_close(served.forward(x).q, model(x).q, atol=1e-5, rtol=1e-4)


def test_augmentation_only_on_training_batches_and_deterministic(tiny_run, tmp_path, monkeypatch):
    import models.training.step as training_step

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = training_step.augment_batch

    def spy(x, generator, fill, *rest):
        out = real(x, generator, fill, *rest)
        seen.append((x.clone(), out.clone()))
        return out

    monkeypatch.setattr(training_step, "augment_batch", spy)
    cfg = TrainConfig(ensemble="lle", vgn=True, seed=3, augment=True, **TINY)
    train(cfg, tmp_path / "a")
    bundle = load_dataset("mnist-bundled", max_train_samples=TINY["max_train_samples"])
    train_x = torch.stack([bundle.train[i][0] for i in range(len(bundle.train))]).flatten(1)
    # called once per training step (2 epochs x 256/64), always on clean training images ...
    assert len(seen) == 8 and all(x.shape == (64, 1, 28, 28) for x, _ in seen)
    for x, out in seen:
        assert (x.flatten(1)[:, None] == train_x[None]).all(-1).any(-1).all()
        assert not torch.equal(out, x)
    # ... and never on validation/test: the card's accuracies are those of the clean splits
    model, card = load_checkpoint(tmp_path / "a")
    for split, key in ((bundle.val, "val_accuracy"), (bundle.test, "test_accuracy")):
        _, q, y = collect_predictions(model, split, "cpu", TINY["eval_batch_size"])
        assert float((q.mean(1).argmax(1) == y).float().mean()) == card.metrics[key]
    assert card.training["config"]["augment"] is True
    # same seed -> same augmented batches and bit-identical weights; augmentation changed training
    first = [out for _, out in seen]
    seen.clear()
    train(cfg, tmp_path / "b")
    assert all(torch.equal(a, b) for a, (_, b) in zip(first, seen, strict=True))
    sha = [
        json.loads((tmp_path / d / "model_card.json").read_text())["weights_sha256"] for d in "ab"
    ]
    assert sha[0] == sha[1]
    assert sha[0] != json.loads((tiny_run[1] / "model_card.json").read_text())["weights_sha256"]


@pytest.mark.parametrize(
    ("schedule", "lrs"), [("constant", [1e-3, 1e-3]), ("cosine", [1e-3, 5.5e-4])]
)
def test_lr_schedule_recorded(tmp_path, schedule, lrs):
    cfg = TrainConfig(ensemble="lle", lr_schedule=schedule, lr_factor=0.1, **TINY)
    train(cfg, tmp_path)
    history = load_checkpoint(tmp_path)[1].training["history"]
    assert [h["lr"] for h in history] == pytest.approx(lrs)


def test_lr_plateau_reduces_on_stalled_validation_loss(tmp_path):
    cfg = TrainConfig(
        ensemble="lle",
        lr_schedule="plateau",
        lr_patience=0,
        lr_factor=0.5,
        min_delta=1.0,  # no epoch improves by 1.0: reduce after every epoch without improvement
        patience=10,
        **{**TINY, "epochs": 3},
    )
    train(cfg, tmp_path)
    history = load_checkpoint(tmp_path)[1].training["history"]
    # recorded per epoch before the scheduler steps: reduced after epochs 2 and 3
    assert [h["lr"] for h in history] == pytest.approx([1e-3, 1e-3, 5e-4])


def test_early_stopping_and_cancellation(tmp_path):
    cfg = TrainConfig(
        ensemble="lle",
        patience=1,
        min_delta=1.0,
        **{**TINY, "lr": 1e-9, "epochs": 10, "members": 2},
    )
    events: list[dict] = []
    train(cfg, tmp_path / "es", on_event=events.append)
    assert [e["epoch"] for e in events if e["type"] == "epoch"] == [1, 2]  # no 1.0 improvement
    _, card = load_checkpoint(tmp_path / "es")
    assert card.training["best_epoch"] == 1 and card.training["epochs_run"] == 2

    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] >= 3

    events = []
    cfg = TrainConfig(ensemble="mcd", **{**TINY, "epochs": 5})
    train(cfg, tmp_path / "c", on_event=events.append, should_stop=stop)
    assert events[-1]["type"] == "done" and events[-1]["cancelled"] is True
    assert sum(e["type"] == "step" for e in events) == 3
    assert load_checkpoint(tmp_path / "c")[1].training["cancelled"] is True


def test_de_with_batchnorm_trains(tmp_path):
    cfg = TrainConfig(
        ensemble="de",
        backbone="resnet18",
        backbone_kwargs={"widths": [4, 8], "blocks": [1, 1], "dropout": 0.1},
        **{**TINY, "epochs": 1, "members": 2, "max_train_samples": 128},
    )
    train(cfg, tmp_path)
    model, card = load_checkpoint(tmp_path)
    assert card.ensemble == "de" and card.learned_k is None
    rm = model.buf__backbone__stem__1__running_mean
    assert rm.abs().sum() > 0 and not torch.allclose(rm[0], rm[1])


def _vge(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ensemble: mcd\nvgn: true\n")
    r = _vge("train", "--config", str(bad), "--out", str(tmp_path / "o"))  # the real command
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "vgn" in lines[0] and "Traceback" not in r.stderr
    r = run_vge("train", "--out", str(tmp_path / "o"), "--members", "0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_mistakes_found_before_or_during_training_exit_2(tmp_path):
    """An output path that cannot be written is refused before training (it used to fail at the
    save, after the whole run, with a traceback); a device the machine lacks, and an ImageFolder
    without class folders, are one line and exit 2, not tracebacks."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty").mkdir()
    for args, words in (
        (["--out", str(tmp_path / "a-file" / "o")], "is not a writable directory"),
        (["--out", str(tmp_path / "a-file")], "exists and is not a directory"),
        (["--out", str(tmp_path / "o"), "--device", "cuda"],
         "--device: device 'cuda' is not on this machine (0 CUDA device(s))"),
        (["--out", str(tmp_path / "o"), "--dataset", f"imagefolder:{tmp_path / 'empty'}"],
         "class"),
    ):  # fmt: skip
        r = run_vge("train", "--epochs", "1", "--max-train-samples", "64", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_cpu_processes_gloo(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps({**TINY, "ensemble": "lle", "vgn": True, "epochs": 1, "device": "cpu"})
    )
    out = tmp_path / "ddp"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "service.cli",
            "train",
            "--config",
            str(cfg),
            "--out",
            str(out),
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    _, card = load_checkpoint(out)
    assert card.training["world_size"] == 2
    # each rank sees half of the 256 training images per epoch: 2 steps of 64
    assert card.training["history"][0]["epoch"] == 1
    assert len(list(out.iterdir())) == 2  # only rank 0 wrote: weights + card


def test_train_on_bundled_mnist_plus_imagefolder(tmp_path):
    """``imagefolder:<path>+mnist-bundled``: the folder's images join the bundled training split;
    validation, test, classes and normalisation stay the bundled ones."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls, n in (("3", 2), ("7", 1)):
        (tmp_path / "reviewed" / cls).mkdir(parents=True)
        for i in range(n):
            arr = rng.integers(0, 256, size=(28, 28), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / "reviewed" / cls / f"{i}.png")
    dataset = f"imagefolder:{tmp_path / 'reviewed'}+mnist-bundled"
    cfg = TrainConfig(dataset=dataset, ensemble="lle", vgn=True, **{**TINY, "epochs": 1})
    events: list[dict] = []
    train(cfg, tmp_path / "m", on_event=events.append)
    assert events[0]["train_size"] == TINY["max_train_samples"] + 3
    assert sum(e["type"] == "step" for e in events) == 5  # ceil(259 / 64)
    _, card = load_checkpoint(tmp_path / "m")
    bundled = load_dataset("mnist-bundled")
    assert card.dataset == dataset and card.class_names == bundled.class_names
    assert card.mean == list(bundled.mean) and card.metrics["n_test"] == len(bundled.test)
    assert card.model_dump()["training"]["config"]["dataset"] == dataset


def test_bounds_are_422_lines_naming_the_bound(tmp_path):
    """Every size of a run is bounded where the config is validated (API and CLI alike): the
    message names the field and the bound. None of these had an upper bound before."""
    from models.training import LIMITS

    for fields, words in (
        ({"epochs": LIMITS["epochs"] + 1}, "epochs: Input should be less than or equal to 1000"),
        ({"members": LIMITS["members"] + 1}, "members: must be at most 100"),
        ({"mc_samples": 101, "ensemble": "mcd-lle"}, "mc_samples: must be at most 100"),
        ({"batch_size": 4097}, "batch_size: Input should be less than or equal to 4096"),
        ({"eval_batch_size": 8193}, "eval_batch_size: Input should be less than or equal to 8192"),
        ({"image_size": 513}, "image_size: Input should be less than or equal to 512"),
        ({"backbone_kwargs": {"width": 10**7}}, "width: 10000000 is out of range (|value| <= 4096)"),
        ({"backbone_kwargs": {f"a{i}": 1 for i in range(17)}}, "at most 16 keyword arguments"),
        ({"backbone_kwargs": {"widths": [8] * 9}}, "widths: a list of at most 8 items"),
        ({"backbone_kwargs": {"act": "x" * 65}}, "act: a string of at most 64 characters"),
        ({"backbone_kwargs": {"w": {"a": 1}}}, "w: values must be numbers"),
        ({"backbone_kwargs": {"not a name": 1}}, "is not a keyword argument name"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(words)):
            load_config(None, fields)
    # bounded values can still build an ensemble too large to train: its size is bounded as well,
    # and the check stops building past a bounded number of modules (no minutes on the meta device)
    for fields, words in (
        ({"backbone": "cnn4", "backbone_kwargs": {"width": 4096, "hidden": 4096}, "members": 100},
         "parameters; at most 1,000,000,000"),
        ({"backbone": "resnet18", "ensemble": "de", "members": 100,
          "backbone_kwargs": {"blocks": [4096] * 4}}, "more than 100,000 tensor operations"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(words)):
            load_config(None, fields).check_architecture()
    r = run_vge("train", "--out", str(tmp_path / "o"), "--epochs", "100000")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "less than or equal to 1000" in lines[0]


def test_fine_tune_from_a_model_and_served_config(tiny_run, tmp_path):
    """``init_from`` starts a run from a model's verified weights (the card records which); the
    weights must fit (architecture, data prepared alike), checked before the run. ``served_config``
    is the model's own recipe less what belongs to a job (data, size, device, identity)."""
    from models.training import served_config
    from models.training.warmstart import check_init

    _, src, _ = tiny_run
    _, src_card = load_checkpoint(src)
    recipe = served_config(src_card)
    assert recipe["vgn"] is True and recipe["members"] == 3 and recipe["seed"] == 3
    assert recipe["backbone"] == "lenet5" and recipe["epochs"] == 2 and recipe["lr"] == 1e-3
    assert not {"name", "version", "dataset", "device", "max_train_samples"} & recipe.keys()

    cfg = TrainConfig(
        **{**recipe, "epochs": 1, "max_train_samples": 64, "init_from": str(src), "lr": 1e-6}
    )
    cfg.check_architecture()
    train(cfg, tmp_path / "ft")
    model, card = load_checkpoint(tmp_path / "ft")
    start = {"name": src_card.name, "version": src_card.version,
             "weights_sha256": src_card.weights_sha256, "model_dir": str(src)}  # fmt: skip
    assert card.training["init"] == start and card.training["config"]["init_from"] == str(src)
    # at lr 1e-6 one epoch barely moves the weights: the run started from the source's, not fresh
    source, _ = load_checkpoint(src)
    for (name, a), b in zip(model.state_dict().items(), source.state_dict().values(), strict=True):
        if a.is_floating_point():
            assert torch.allclose(a, b, atol=1e-3), name
    assert abs(card.metrics["test_accuracy"] - src_card.metrics["test_accuracy"]) < 0.02

    for fields, words in (
        ({"members": 4}, "do not fit this architecture (members 4 != 3)"),
        ({"dataset": f"imagefolder:{tmp_path}"}, "are not those of dataset"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            check_init(TrainConfig(**{**recipe, **fields, "init_from": str(src)}))
    r = run_vge("train", "--out", str(tmp_path / "o"), "--init-from", str(tmp_path / "nothing"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "model card not found" in lines[0], r.stderr


def test_a_last_batch_of_one_image_is_dropped() -> None:
    """A last batch of one image cannot train BatchNorm (cnn4's feature layer: "Expected more
    than 1 value per channel"): 129 images in batches of 128 trained one batch and failed on the
    second. That batch is dropped; any other remainder is kept."""
    from torch.utils.data import TensorDataset

    from models.training.config import TrainConfig
    from models.training.data import train_loader
    from models.training.runtime import Runtime

    rt = Runtime(torch.device("cpu"))
    for n, sizes in ((129, [128]), (130, [128, 2]), (1, [1]), (128, [128])):
        data = TensorDataset(torch.zeros(n, 1), torch.zeros(n, dtype=torch.long))
        loader = train_loader(data, TrainConfig(batch_size=128), rt)
        assert [len(x) for x, _ in loader] == sizes, n
