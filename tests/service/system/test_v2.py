"""KServe V2 / Open Inference Protocol round trip with the real ``tritonclient.http`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.service.conftest import Server  # noqa: E402

NAMES = ["probabilities", "prediction", "vgmu", "snr", "tu", "au", "eu", "abstain"]


#: The clients a test opened (:func:`_client`), closed after it: left to the GC, tritonclient's
#: ``__del__`` can raise in a later test's collection pass (a PytestUnraisableExceptionWarning).
_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def _client(server: Server):  # noqa: ANN202
    client = tritonclient_http.InferenceServerClient(url=server.url.removeprefix("http://"))
    _OPEN.append(client)
    return client


@pytest.mark.parametrize("binary", [True, False])
def test_v2_round_trip(server: Server, mnist, library, pngs: list[bytes], binary: bool) -> None:
    client = _client(server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny")
    meta = client.get_model_metadata("tiny")
    assert meta["name"] == "tiny" and {o["name"] for o in meta["outputs"]} == set(NAMES)
    assert client.is_model_ready("tiny", meta["versions"][0])
    assert not client.is_model_ready("tiny", "9.9.9")  # 404: a version this server does not serve
    r = httpx.get(server.url + "/v2/models/tiny/versions/9.9.9/ready", timeout=10)
    assert r.status_code == 404 and "has no version '9.9.9'" in r.json()["error"]

    images = mnist[0][-64:][:6][:, None].copy()  # (6, 1, 28, 28) uint8, same digits as pngs
    inp = tritonclient_http.InferInput("images", list(images.shape), "UINT8")
    inp.set_data_from_numpy(images, binary_data=binary)
    outputs = [tritonclient_http.InferRequestedOutput(n, binary_data=binary) for n in NAMES]
    result = client.infer("tiny", [inp], outputs=outputs, parameters={"abstain_k": 0.8})

    probs = result.as_numpy("probabilities")
    assert probs.shape == (6, 10) and probs.dtype == np.float32
    assert result.as_numpy("abstain").dtype == np.bool_
    for i in range(6):
        want = library(pngs[i], abstain_k=0.8, top_k=10)
        assert int(result.as_numpy("prediction")[i]) == want["prediction"]
        assert bool(result.as_numpy("abstain")[i]) == want["abstain"]
        for key in ("vgmu", "snr", "tu", "au", "eu"):
            assert result.as_numpy(key)[i] == pytest.approx(want[key], rel=1e-4, abs=1e-5)
        for entry in want["probabilities"]:
            assert probs[i, int(entry["label"])] == pytest.approx(entry["probability"], abs=1e-5)
    client.close()


def test_v2_fp32_prepared_input(server: Server, library, pngs: list[bytes], tiny_model) -> None:
    import torch
    from torchvision.io import decode_image

    from models.predictor import Predictor

    predictor = Predictor.from_dir(tiny_model, device="cpu")
    x = torch.stack([predictor.prepare(decode_image(torch.frombuffer(bytearray(p), dtype=torch.uint8)))
                     for p in pngs[:3]]).numpy()  # fmt: skip
    client = _client(server)
    inp = tritonclient_http.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("tiny", [inp])
    for i in range(3):
        assert int(result.as_numpy("prediction")[i]) == library(pngs[i])["prediction"]
    client.close()


def test_v2_errors(server: Server) -> None:
    client = _client(server)
    bad = [
        (np.zeros((2, 1, 28, 28), np.int32), "INT32", "datatype"),
        (np.zeros((2, 5, 28, 28), np.uint8), "UINT8", "channels"),
        (np.zeros((2, 1, 14, 14), np.float32), "FP32", "does not match"),
        (np.zeros((17, 1, 28, 28), np.uint8), "UINT8", "too many images"),
    ]
    for arr, dtype, words in bad:
        name = "input" if dtype == "FP32" else "images"
        inp = tritonclient_http.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException, match=words):
            client.infer("tiny", [inp])
    with pytest.raises(InferenceServerException, match="unknown model"):
        inp = tritonclient_http.InferInput("images", [1, 1, 28, 28], "UINT8")
        inp.set_data_from_numpy(np.zeros((1, 1, 28, 28), np.uint8))
        client.infer("nope", [inp])
    client.close()
    # raw protocol errors: {"error": "..."} with 4xx
    url = server.url + "/v2/models/tiny/infer"
    cases = [
        ({"inputs": [{"name": "images", "shape": [1, 4], "datatype": "UINT8", "data": [0] * 4}]},
         400, "shape"),
        ({"inputs": [{"name": "images", "shape": [1, 2, 2], "datatype": "UINT8", "data": [1, 2]}]},
         400, "elements"),
        ({"inputs": [{"name": "images", "shape": [1, 2, 2], "datatype": "UINT8",
                      "data": [1, 2, 3, 300]}]}, 400, "[0, 255]"),
        ({"inputs": []}, 400, "exactly one"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "parameters": {"abstain_k": 2e9}}, 422, "abstain_k"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "parameters": {"vgmu_on": "x"}}, 422, "vgmu_on"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "outputs": [{"name": "nope"}]}, 400, "unknown outputs"),
        # outputs of the wrong kind asked for every output (200), a name twice echoed it twice
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "outputs": ""}, 400, "outputs must be a list"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "outputs": {}}, 400, "outputs must be a list"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "outputs": [{"name": "vgmu"}, {"name": "vgmu"}]}, 400,
         "requested more than once"),
        # JSON that Python would coerce: strings, booleans, ragged lists, true for a number
        ({"inputs": [{"name": "images", "shape": [1, 2, 2], "datatype": "UINT8",
                      "data": ["1", "2", "3", "4"]}]}, 400, "list of numbers"),
        ({"inputs": [{"name": "images", "shape": [1, 2, 2], "datatype": "UINT8",
                      "data": [True, False, True, False]}]}, 400, "list of numbers"),
        ({"inputs": [{"name": "images", "shape": [1, 2, 2], "datatype": "UINT8",
                      "data": [[1, 2], [3]]}]}, 400, "list of numbers"),
        ({"inputs": [{"name": "images", "shape": [1, 2, 2], "datatype": "UINT8",
                      "data": [[1, True], [0, 4]]}]}, 400, "list of numbers"),
        ({"inputs": [{"name": "images", "shape": [1, True, 2], "datatype": "UINT8",
                      "data": [1, 2]}]}, 400, "shape"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "parameters": {"abstain_k": True}}, 422, "abstain_k"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "parameters": {"timeout_s": True}}, 422, "timeout_s"),
        ({"inputs": [{"shape": [1, 28, 28], "datatype": "UINT8", "data": [0] * 784}]}, 400,
         "send raw pixels as 'images'"),  # the protocol requires a name
        # JSON of the wrong kind where the protocol wants a string or an object (were 500s)
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": ["UINT8"],
                      "data": [0] * 784}]}, 400, "datatype ['UINT8'] is not supported"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784, "parameters": [1]}]}, 400,
         "input parameters must be an object"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "outputs": [{"name": ["vgmu"]}]}, 400,
         "unknown outputs"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "outputs": [{"name": "vgmu", "parameters": 5}]}, 400,
         "output 'vgmu' parameters must be an object"),
        # "false" is not false: it must not switch binary output on
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}], "parameters": {"binary_data_output": "false"}}, 400,
         "binary_data_output must be true or false"),
        ({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784}],
          "outputs": [{"name": "vgmu", "parameters": {"binary_data": 1}}]}, 400,
         "binary_data must be true or false"),
    ]  # fmt: skip
    for body, status, words in cases:
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == status, r.text
        assert words in r.json()["error"]
    r = httpx.post(url, content=b"{", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    # the binary extension: the declared size must be exactly the bytes that follow the header
    head = json.dumps({"inputs": [{"name": "images", "shape": [1, 28, 28], "datatype": "UINT8",
                                   "parameters": {"binary_data_size": 784}}]}).encode()  # fmt: skip
    for extra, words in ((b"\0" * 700, "carries 700 bytes"), (b"\0" * 790, "carries 790 bytes")):
        r = httpx.post(url, content=head + extra, timeout=10,
                       headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
        assert r.status_code == 400 and words in r.json()["error"], r.text


def test_v2_binary_outputs_on_the_wire(server: Server, mnist) -> None:
    """Outputs asked for with ``binary_data`` come back as raw tensors after the JSON header
    (``Inference-Header-Content-Length``), equal to the JSON answer."""
    images = mnist[0][-3:][:, None].copy()
    inp = {"name": "images", "shape": list(images.shape), "datatype": "UINT8",
           "data": images.reshape(-1).tolist()}  # fmt: skip
    json_body = {"inputs": [inp]}
    binary_body = {
        "inputs": [inp],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}},
                    {"name": "abstain", "parameters": {"binary_data": True}},
                    {"name": "prediction"}],
    }  # fmt: skip
    url = server.url + "/v2/models/tiny/infer"
    plain = httpx.post(url, json=json_body, timeout=30).json()
    r = httpx.post(url, json=binary_body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:n])
    outs = {o["name"]: o for o in head["outputs"]}
    assert [o["name"] for o in head["outputs"]] == ["probabilities", "abstain", "prediction"]
    size_p = outs["probabilities"]["parameters"]["binary_data_size"]
    assert size_p == 3 * 10 * 4 and outs["abstain"]["parameters"]["binary_data_size"] == 3
    probs = np.frombuffer(r.content[n : n + size_p], dtype="<f4").reshape(3, 10)
    abstain = np.frombuffer(r.content[n + size_p :], dtype=np.bool_)
    want = {o["name"]: o["data"] for o in plain["outputs"]}
    np.testing.assert_allclose(probs.reshape(-1), want["probabilities"], rtol=1e-6)
    assert abstain.tolist() == want["abstain"] and outs["prediction"]["data"] == want["prediction"]


def test_v2_metadata_states_layout_shape_and_normalisation(server: Server, tiny_model) -> None:
    """A client can build either input from the metadata alone: ``images`` [-1, 1, 28, 28] in
    NCHW, and the FP32 input's mean and std (the card's; /v1/models shows the same). It said
    [-1, -1, -1, -1] and showed no normalisation."""
    card = json.loads((tiny_model / "model_card.json").read_text())
    meta = httpx.get(server.url + "/v2/models/tiny", timeout=10).json()
    assert meta["inputs"] == [{"name": "images", "datatype": "UINT8", "shape": [-1, 1, 28, 28]}]
    params = meta["parameters"]
    assert params["images_layout"] == "NCHW" and params["images_shape"] == "[1, 28, 28]"
    assert params["input_datatype"] == "FP32" and params["input_shape"] == "[1, 28, 28]"
    assert json.loads(params["input_mean"]) == pytest.approx(card["mean"])
    assert json.loads(params["input_std"]) == pytest.approx(card["std"])
    described = httpx.get(server.url + "/v1/models", timeout=10).json()["models"][0]
    assert described["input_mean"] == pytest.approx(card["mean"])
    assert described["input_std"] == pytest.approx(card["std"])


def test_v2_nhwc_images_are_answered_like_nchw(server: Server, mnist) -> None:
    """[B, H, W, C] pixels (as numpy/PIL stack images) are unambiguous when dim 1 cannot be a
    channel count: answered like the same images in NCHW (they were a 400 "28 channels"). Neither
    layout fitting is a 400 that names both."""
    client = _client(server)
    gray = mnist[0][-4:]  # (4, 28, 28)
    rgb = np.repeat(gray[:, None], 3, axis=1)  # (4, 3, 28, 28): conformed to gray, as /v1/predict

    def predict(arr: np.ndarray) -> list[int]:
        inp = tritonclient_http.InferInput("images", list(arr.shape), "UINT8")
        inp.set_data_from_numpy(np.ascontiguousarray(arr))
        return client.infer("tiny", [inp]).as_numpy("prediction").tolist()

    want = predict(gray[:, None])
    assert predict(gray[:, :, :, None]) == want  # NHWC, one channel
    assert predict(rgb) == predict(rgb.transpose(0, 2, 3, 1))  # RGB: NCHW and NHWC alike
    with pytest.raises(InferenceServerException, match=r"NCHW.*NHWC"):
        predict(np.zeros((2, 5, 28, 5), np.uint8))
    client.close()


def test_v2_fp32_pixels_not_normalised_are_a_422_with_the_mean_and_std(
    server: Server, mnist, tiny_model
) -> None:
    """FP32 input that is pixels / 255 without the normalisation was answered confidently (the
    default model said "8" with probability 1.0 and no abstain): now a 422 giving the mean and
    std to use. The same pixels normalised, and a constant image, are answered."""
    card = json.loads((tiny_model / "model_card.json").read_text())
    scaled = (mnist[0][-3:][:, None] / 255.0).astype(np.float32)  # (3, 1, 28, 28) in [0, 1]
    client = _client(server)
    inp = tritonclient_http.InferInput("input", list(scaled.shape), "FP32")
    inp.set_data_from_numpy(scaled)
    with pytest.raises(InferenceServerException, match="looks like pixels scaled to") as err:
        client.infer("tiny", [inp])
    message = str(err.value)
    assert str(card["mean"]) in message and str(card["std"]) in message, message
    r = httpx.post(server.url + "/v2/models/tiny/infer", timeout=30, json={"inputs": [
        {"name": "input", "datatype": "FP32", "shape": [1, 1, 28, 28],
         "data": scaled[0].reshape(-1).tolist()}]})  # fmt: skip
    assert r.status_code == 422 and "mean" in r.json()["error"], r.text
    mean, std = card["mean"][0], card["std"][0]
    for ok in ((scaled - mean) / std, np.zeros_like(scaled)):
        inp.set_data_from_numpy(ok.astype(np.float32))
        assert client.infer("tiny", [inp]).as_numpy("prediction").shape == (3,)
    client.close()
