"""Predictor: prepare (channels, size, normalisation), forward on CPU tensors, score rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import ModelCard, save_checkpoint
from models.ensembles import EnsembleOutput, build_ensemble
from models.predictor import Predictor

torch.set_num_threads(1)
KEYS = {
    "prediction",
    "label",
    "probabilities",
    "vgmu",
    "snr",
    "tu",
    "au",
    "eu",
    "abstain",
    "abstain_k",
}


def _save(
    d, *, vgn: bool, in_channels: int = 1, size=(28, 28), abstain_k=0.8, ensemble: str = "lle"
):
    torch.manual_seed(0)
    backbone = "lenet5" if in_channels == 1 else "resnet18"
    kw = {} if in_channels == 1 else {"widths": (4, 8), "blocks": (1, 1)}
    model = build_ensemble(ensemble, backbone, 4, 3, vgn, in_channels, backbone_kwargs=kw)
    card = ModelCard(
        name="tiny",
        version="0.0.1",
        backbone=backbone,
        backbone_kwargs=kw,
        ensemble=ensemble,
        members=3,
        vgn=vgn,
        class_names=["a", "b", "c", "d"],
        in_channels=in_channels,
        input_size=size,
        mean=[0.5] * in_channels,
        std=[0.25] * in_channels,
        abstain_calibration={}
        if abstain_k is None
        else {"abstain_k": abstain_k, "members": "q" if vgn else "p", "by_members": {"p": 2.5}},
    )
    save_checkpoint(model, card, d)
    return Predictor.from_dir(d, device="cpu")


def test_prepare_gray_model(tmp_path):
    pred = _save(tmp_path, vgn=True)
    assert pred.name == "tiny" and pred.version == "0.0.1" and pred.device == torch.device("cpu")
    img = torch.randint(0, 256, (1, 28, 28), dtype=torch.uint8)
    assert pred.prepare_mode == "mnist"  # a 1x28x28 model reads digits
    x = pred.prepare(img, "none")  # pixels as sent: normalised only
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    torch.testing.assert_close(x, (img.float() / 255 - 0.5) / 0.25)
    # noise has no digit in it: the canonical reading is an empty canvas, and says why
    assert pred.read(img).finding.name == "fills_canvas"
    assert not pred.conform(img).any()
    rgb = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)
    assert pred.prepare(rgb).shape == (1, 28, 28)
    rgba = torch.randint(0, 256, (4, 28, 28), dtype=torch.uint8)
    assert pred.prepare(rgba).shape == (1, 28, 28)
    same = torch.full((3, 28, 28), 200, dtype=torch.uint8)  # gray RGB -> exact gray value
    expect = torch.full((1, 28, 28), (200 / 255 - 0.5) / 0.25)
    torch.testing.assert_close(pred.prepare(same, "none"), expect, atol=1.01 / 255 / 0.25, rtol=0)
    with pytest.raises(ValueError, match="uint8"):
        pred.prepare(img.float())
    with pytest.raises(ValueError, match="channels"):
        pred.prepare(torch.zeros(5, 28, 28, dtype=torch.uint8))


def test_prepare_rgb_model_expands_gray(tmp_path):
    pred = _save(tmp_path, vgn=False, in_channels=3, size=(32, 32))
    assert pred.prepare_mode == "none"  # not a digit model: pixels as sent
    gray = torch.randint(0, 256, (1, 28, 28), dtype=torch.uint8)
    x = pred.prepare(gray)
    assert x.shape == (3, 32, 32)
    torch.testing.assert_close(x[0], x[2])


def test_forward_and_score_vgn(tmp_path):
    pred = _save(tmp_path, vgn=True)
    imgs = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8)
    x = torch.stack([pred.prepare(i, "none") for i in imgs])
    out = pred.forward(x)
    assert isinstance(out, EnsembleOutput)
    assert out.p.device.type == "cpu" and out.p.shape == (5, 3, 4) and out.q.shape == (5, 3, 4)
    assert not out.p.requires_grad
    torch.testing.assert_close(pred.forward(x).p, out.p)  # eval mode: deterministic
    rows = pred.score(out, top_k=2)
    assert len(rows) == 5
    served = out.q.mean(1)
    for r, s in zip(rows, served, strict=True):
        assert set(r) == KEYS
        assert r["abstain_k"] == 0.8  # calibrated default from the card
        assert r["label"] == ["a", "b", "c", "d"][r["prediction"]]
        assert r["probabilities"][0]["label"] == r["label"]  # one distribution per answer
        probs = [e["probability"] for e in r["probabilities"]]
        assert len(probs) == 2 and probs[0] >= probs[1]
        assert probs[0] == pytest.approx(float(s.max()), abs=1e-6)  # q̄ for VGN models
        assert 0 <= r["tu"] <= 1 + 1e-6 and isinstance(r["abstain"], bool)
    never = pred.score(out, abstain_k=0.0)
    assert all(not r["abstain"] and r["abstain_k"] == 0.0 for r in never)
    always = pred.score(out, abstain_k=1e9, top_k=99)
    assert all(r["abstain"] for r in always) and len(always[0]["probabilities"]) == 4
    # vgmu_on="p": the whole answer from p, with the k calibrated on p
    raw = pred.score(out, vgmu_on="p", top_k=1)
    for r, s in zip(raw, out.p.mean(1), strict=True):
        assert r["abstain_k"] == 2.5 and r["prediction"] == int(s.argmax())
        assert r["probabilities"][0]["probability"] == pytest.approx(float(s.max()), abs=1e-6)


def test_first_probability_is_the_prediction_even_on_ties(tmp_path):
    """Stable ordering: ties list the lowest class first, exactly as argmax predicts it."""
    pred = _save(tmp_path, vgn=False, abstain_k=None)
    p = torch.tensor([[[0.4, 0.4, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]]] * 3)
    for r in pred.score(EnsembleOutput(p, None), top_k=4):
        assert r["prediction"] == 0 and r["probabilities"][0]["label"] == r["label"] == "a"
        assert [e["label"] for e in r["probabilities"]] == ["a", "b", "c", "d"]


def test_vgmu_on_q_needs_a_vgn_model(tmp_path):
    pred = _save(tmp_path, vgn=False, abstain_k=None)
    with pytest.raises(ValueError, match="no variance gate"):
        pred.score(pred.forward(torch.zeros(1, 1, 28, 28)), vgmu_on="q")


def test_score_non_vgn_uses_p_mean_and_default_k(tmp_path):
    pred = _save(tmp_path, vgn=False, abstain_k=None)
    out = pred.forward(torch.zeros(2, 1, 28, 28))
    assert out.q is None
    rows = pred.score(out, top_k=1)
    assert rows[0]["abstain_k"] == 1.0
    assert rows[0]["probabilities"][0]["probability"] == pytest.approx(
        float(out.p.mean(1)[0].max()), abs=1e-6
    )


def test_compiled_bucketed_path_matches_eager(tmp_path):
    """torch.compile with power-of-two buckets: same answers as eager.

    On this CPU it runs inductor's C++ backend; a 5-row batch is padded to the 8-row bucket.
    """
    pred = _save(tmp_path, vgn=True)
    x = torch.randint(0, 256, (7, 1, 28, 28), dtype=torch.uint8)
    opts = pred.options(top_k=3)
    eager = pred.score_columns(pred.run([x]), opts).data
    assert pred.compile(warm_up=(8,))
    compiled = pred.score_columns(pred.run([x[:5]]), opts).data
    assert compiled.shape == eager[:5].shape == (5, 7 + 2 * 3)
    np.testing.assert_allclose(compiled, eager[:5], rtol=1e-5, atol=1e-5)

    # Two serving threads (VGE_BATCHES_IN_FLIGHT=2) call the compiled code: they take turns, and
    # each gets its own batch's answers. Both sizes fall in the warmed 8-row bucket: another
    # bucket would compile again (~7 s of this test's 30) and test nothing more here.
    from concurrent.futures import ThreadPoolExecutor

    def serve(rows: int) -> np.ndarray:
        return pred.score_columns(pred.run([x[:rows]]), opts).data

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(serve, [5, 7] * 8))
    for rows, data in zip([5, 7] * 8, got, strict=True):
        np.testing.assert_allclose(data, eager[:rows], rtol=1e-5, atol=1e-5)


def test_run_takes_numpy_and_tensor_parts_alike(tmp_path):
    """The engine hands ``Predictor.run`` NumPy views of shared memory, tools hand tensors: one
    ``np.concatenate`` gathers either, and float32 prepared parts join uint8 ones."""
    pred = _save(tmp_path, vgn=True)
    x = torch.randint(
        0, 256, (6, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    opts = pred.options(top_k=2)
    want = pred.score_columns(pred.run([x]), opts).data
    parts = [x[:1].numpy(), x[1:4].numpy(), x[4:]]
    np.testing.assert_array_equal(pred.score_columns(pred.run(parts), opts).data, want)
    prepared = torch.stack([pred.prepare(img, "none") for img in x[3:]])  # float32 (3, 1, 28, 28)
    mixed = [x[:3].numpy(), prepared.numpy()]
    got = pred.score_columns(pred.run(mixed), opts).data
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_deep_ensemble_loads_and_answers_as_its_unconverted_module(tmp_path):
    """A DE's members are stacked (5-d convolution weights), which channels_last refuses: the
    CPU predictor converts only 4-d weights (a DE failed to load before, in benchmarks.paper)."""
    from models.checkpoint import load_checkpoint

    pred = _save(tmp_path, vgn=True, ensemble="de")
    assert any(p.dim() == 5 for p in pred.module.parameters())
    plain, _ = load_checkpoint(tmp_path, "cpu")
    x = torch.randn(6, 1, 28, 28)
    out = pred.forward(x)
    with torch.inference_mode():
        want = plain.eval()(x)
    torch.testing.assert_close(out.q, want.q, rtol=1e-4, atol=1e-5)
    assert len(pred.score(out)) == 6


def test_cpu_weights_take_the_strides_of_module_to_channels_last():
    """The default model's 4-d weights are restrided exactly as ``Module.to(memory_format=
    channels_last)`` does, the one-channel first convolution included (``.contiguous`` left it
    NCHW, and the forward pass slowed by 1.4x)."""
    from models.checkpoint import load_checkpoint
    from models.nets.fold import fold_batchnorm
    from models.zoo import default_model_dir

    pred = Predictor.from_dir(default_model_dir(), device="cpu")
    ref, _ = load_checkpoint(default_model_dir(), "cpu")
    fold_batchnorm(ref.eval())
    ref = ref.to(memory_format=torch.channels_last)
    got = dict(pred.module.named_parameters())
    for name, param in ref.named_parameters():
        assert got[name].stride() == param.stride(), name
