"""One distribution per answer, end to end: what a response says about an image is consistent."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as tritonclient_http
from tritonclient.utils import InferenceServerException

from tests.service.conftest import API_KEY, Server, start_in_process
from tests.service.inprocess import InProcessServer

ROOT = Path(__file__).parents[3]
ZOO = ROOT / "models" / "zoo"
EXAMPLES = ROOT / "examples"


def test_first_listed_probability_is_the_prediction(server: Server, pngs: list[bytes]) -> None:
    """For every response: probabilities[0].label == label, the listed probabilities are the
    answer's mean in descending order, and abstain agrees with VGMU's rule at the served k."""
    images = [base64.b64encode(p).decode() for p in pngs]
    checked = 0
    with server.client() as c:
        for vgmu_on in (None, "p", "q"):
            for top_k, abstain_k in ((1, None), (3, 0.0), (10, 2.0)):
                for start in range(0, 64, 16):
                    body: dict = {"images": images[start : start + 16], "top_k": top_k}
                    if vgmu_on:
                        body["vgmu_on"] = vgmu_on
                    if abstain_k is not None:
                        body["abstain_k"] = abstain_k
                    r = c.post("/v1/predict", json=body)
                    assert r.status_code == 200, r.text
                    for res in r.json()["results"]:
                        probs = res["probabilities"]
                        assert probs[0]["label"] == res["label"] == str(res["prediction"])
                        values = [p["probability"] for p in probs]
                        assert values == sorted(values, reverse=True) and len(values) == top_k
                        if abstain_k == 0.0:
                            assert res["abstain"] is False  # k = 0: predict unless tied
                        checked += 1
    assert checked == 3 * 3 * 64


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """A model without a variance gate (LLE, M = 3): answers come from p."""
    from models.training import TrainConfig, train

    work = tmp_path_factory.mktemp("plain")
    model = train(
        TrainConfig(name="plain", epochs=1, max_train_samples=256, members=3, ensemble="lle",
                    vgn=False, batch_size=64, device="cpu"),
        work / "plain",
    )  # fmt: skip
    srv = start_in_process(work, Path(model))
    yield srv
    srv.stop()


def test_vgmu_on_q_without_a_gate_is_422_everywhere(
    plain_server: InProcessServer, pngs: list[bytes]
) -> None:
    with plain_server.client() as c:
        r = c.post("/v1/predict", params={"vgmu_on": "q"}, files=[("images", ("a.png", pngs[0]))])
        assert r.status_code == 422 and "no variance gate" in r.json()["error"], r.text
        ok = c.post("/v1/predict", files=[("images", ("a.png", pngs[0]))])
        assert ok.status_code == 200
        info = c.get("/v1/models").json()["models"][0]
        assert info["answer_members"] == "p" and info["vgn"] is False
    client = tritonclient_http.InferenceServerClient(plain_server.url.removeprefix("http://"))
    inp = tritonclient_http.InferInput("images", [1, 1, 28, 28], "UINT8")
    inp.set_data_from_numpy(np.zeros((1, 1, 28, 28), np.uint8))
    with pytest.raises(InferenceServerException, match="no variance gate"):
        client.infer("plain", [inp], parameters={"vgmu_on": "q"})
    client.close()


def test_calibrated_abstain_k_is_always_accepted(server: Server, pngs: list[bytes]) -> None:
    from models.evaluation.calibration import calibrate_abstain_k
    from models.limits import ABSTAIN_K_MAX

    # the largest k calibration can produce: defer everything, even for the most certain sample
    p = np.zeros((2, 3, 2))
    p[:, :, 0] = 1.0
    k = calibrate_abstain_k(p, [0, 0], target_deferral=1.0)["abstain_k"]
    assert 0 < k <= ABSTAIN_K_MAX
    with server.client() as c:
        r = c.post("/v1/predict", params={"abstain_k": k}, files=[("images", ("a.png", pngs[0]))])
    assert r.status_code == 200 and r.json()["results"][0]["abstain"] is True


@pytest.fixture(scope="module")
def zoo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The shipped default model (cnn4, LLE-VGN), the one ``vge serve`` answers with."""
    srv = start_in_process(tmp_path_factory.mktemp("zoo"), ZOO / "cnn4-lle-vgn-mnist")
    yield srv
    srv.stop()


def test_fp32_input_that_overflows_the_model_is_a_422_not_nan(zoo_server: InProcessServer) -> None:
    """Finite FP32 input far outside the normalised range overflows cnn4's forward pass: the
    scores were NaN, sent as bare NaN tokens (invalid JSON) with a prediction and an abstain."""
    body = {"inputs": [{"name": "input", "shape": [1, 1, 28, 28], "datatype": "FP32",
                        "data": [3e38] * 784}]}  # fmt: skip
    r = httpx.post(zoo_server.url + "/v2/models/cnn4-lle-vgn-mnist/infer", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert "FP32 input 0: the model's outputs are not finite" in r.json()["error"]
    body["inputs"][0]["data"] = [1.0] * 784  # in range: answered
    r = httpx.post(zoo_server.url + "/v2/models/cnn4-lle-vgn-mnist/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_a_cmyk_jpeg_is_answered_like_its_png(zoo_server: InProcessServer) -> None:
    """A CMYK JPEG of the example 7 was read as a blank white image (prediction 1, abstain)."""
    import io

    from PIL import Image

    png = (EXAMPLES / "digit-7.png").read_bytes()
    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("CMYK").save(buf, "JPEG", quality=95)
    files = [("images", ("7.png", png)), ("images", ("7-cmyk.jpg", buf.getvalue()))]
    r = httpx.post(zoo_server.url + "/v1/predict", files=files, timeout=30)
    assert r.status_code == 200, r.text
    as_png, as_cmyk = r.json()["results"]
    assert as_png["prediction"] == as_cmyk["prediction"] == 7
    assert as_cmyk["abstain"] == as_png["abstain"] is False


def test_the_in_process_server_answers_as_a_tree(
    server: Server, tmp_path: Path, tiny_model: Path, pngs: list[bytes]
) -> None:
    """The functional tests' in-process server (tests/service/inprocess.py) is the request path
    of ``vge serve``, not a copy of it: the same requests to it and to the main tree, serving the
    same model, get the same bodies — answers (JSON, V2, a review-free batch), model metadata and
    errors. Stopped, it leaves no thread and no log handler behind in this process."""
    import logging
    import threading

    from tests.service.conftest import copy_model

    # the same weights under the version the tree serves now (other tests promote and roll back)
    version = httpx.get(server.url + "/v1/models", timeout=10).json()["models"][0]["version"]
    model = copy_model(tiny_model, tmp_path / "models" / "tiny", version)
    before = set(threading.enumerate())
    local = start_in_process(
        tmp_path, model, api_key=API_KEY, max_images=16, max_image_bytes=20_000,
        max_payload_bytes=400_000, max_image_pixels=512 * 512, max_score_bytes=200_000,
    )  # fmt: skip
    v2 = {"inputs": [{"name": "images", "shape": [2, 1, 28, 28], "datatype": "UINT8",
                      "data": [0] * 784 + [255] * 784}]}  # fmt: skip
    requests: list[tuple[str, str, dict[str, object]]] = [
        ("POST", "/v1/predict", {"files": [("images", (f"{i}.png", p)) for i, p in
                                           enumerate(pngs[:8])]}),
        ("POST", "/v1/predict", {"json": {"images": [base64.b64encode(pngs[9]).decode()],
                                          "top_k": 3, "vgmu_on": "p", "abstain_k": 0.5}}),
        ("POST", "/v1/predict", {"files": [("images", ("x.png", b"not a png"))]}),
        ("POST", "/v1/predict", {"json": {"images": [], "top_k": 0}}),
        ("POST", "/v2/models/tiny/infer", {"json": v2}),
        ("GET", "/v2/models/tiny", {}),
        ("GET", "/v2/models/lenet/ready", {}),
        ("POST", "/v1/training-jobs", {"json": {"epochs": 1}}),  # no key: 401
    ]  # fmt: skip
    try:
        for method, path, kw in requests:
            a = httpx.request(method, server.url + path, timeout=30, **kw)  # type: ignore[arg-type]
            b = httpx.request(method, local.url + path, timeout=30, **kw)  # type: ignore[arg-type]
            assert (a.status_code, a.headers.get("content-type")) == (
                b.status_code, b.headers.get("content-type")), (path, a.text, b.text)  # fmt: skip
            if a.headers.get("content-type") == "application/json":
                _same(a.json(), b.json(), path)
            else:
                assert a.content == b.content, path
        tree, here = (
            httpx.get(s.url + "/v1/models", timeout=10).json()["models"][0] for s in (server, local)
        )
        # what differs by history: when and why it is served, its promotion's gate comparison
        for volatile in ("served_since", "served_because", "history", "history_id", "loaded_at",
                         "gate"):  # fmt: skip
            tree.pop(volatile, None), here.pop(volatile, None)
        assert tree == here
    finally:
        assert local.stop() == 0, local.log()
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("vge-")]
    assert not set(local._handlers) & set(logging.getLogger().handlers)


def _same(a: object, b: object, where: str) -> None:
    """``a == b`` for JSON documents, floats to 1e-5 (the two engines sum in other orders)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), where
    else:
        assert a == b, where
