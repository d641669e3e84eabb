"""The input pipeline over the wire (issue 32): ``prepare=mnist|none`` on /v1, V2 HTTP and V2
gRPC, and pictures with no digit in them answered with ``abstain: true`` and why."""

from __future__ import annotations

import io

import httpx
import numpy as np
import torch
from PIL import Image
from torchvision.io import encode_png

from tests.service.conftest import Server


def _png(a: np.ndarray) -> bytes:
    return encode_png(torch.from_numpy(np.ascontiguousarray(a))[None]).numpy().tobytes()


def _on_paper(digit: np.ndarray) -> bytes:
    """``digit`` (white on black) written dark on light paper, off centre on a 100 px JPEG."""
    page = np.full((100, 100), 225, np.uint8)
    ink = np.asarray(Image.fromarray(digit).resize((48, 48), Image.BICUBIC), np.float32) / 255
    page[8:56, 40:88] = np.clip(225 - 200 * ink, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(page).convert("RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def test_v1_reads_pictures_and_says_what_it_found(server: Server, mnist, library) -> None:
    """A blank page and a noise picture abstain (input_check blank / fills_canvas or texture)
    whatever the model made of them; a digit on paper is read as the MNIST digit it was made
    from; prepare=none takes pixels as sent, and the same blank page is the model's own answer."""
    digit = mnist[0][-1]
    blank = _png(np.full((60, 80), 240, np.uint8))
    noise = _png(np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8))
    files = [("images", (n, b)) for n, b in
             (("blank.png", blank), ("noise.png", noise), ("paper.jpg", _on_paper(digit)))]  # fmt: skip
    with server.client() as c:
        r = c.post("/v1/predict", files=files)
        assert r.status_code == 200, r.text
        blank_r, noise_r, paper_r = r.json()["results"]
        assert (blank_r["input_check"], blank_r["abstain"]) == ("blank", True)
        assert noise_r["input_check"] in ("fills_canvas", "texture") and noise_r["abstain"]
        assert paper_r["input_check"] == "ok"
        # the reading of the paper digit is what the library reads: same prediction, same scores
        want = library(_png(digit))
        assert paper_r["prediction"] == want["prediction"]
        r = c.post("/v1/predict", files=files[:1], params={"prepare": "none"})
        assert r.status_code == 200 and r.json()["results"][0]["input_check"] == "ok"
        r = c.post("/v1/predict", files=files[:1], params={"prepare": "resize"})
        assert r.status_code == 422 and "prepare" in r.json()["error"]
        body = {"images": [__import__("base64").b64encode(blank).decode()], "prepare": "none"}
        r = c.post("/v1/predict", json=body)
        assert r.status_code == 200 and r.json()["results"][0]["input_check"] == "ok"
        # pictures of two pixels (a 500 once): answered, each with what its reading found
        tiny = [("images", (f"{h}x{w}.png", _png(np.array([[255, 0]], np.uint8).reshape(h, w))))
                for h, w in ((1, 2), (2, 1))]  # fmt: skip
        r = c.post("/v1/predict", files=tiny)
        assert r.status_code == 200, r.text
        assert all(x["input_check"] in ("ok", "blank", "fills_canvas", "texture")
                   for x in r.json()["results"])  # fmt: skip


def test_v2_http_prepare_parameter(server: Server, mnist) -> None:
    """V2 UINT8 images are read like /v1 uploads (a blank page abstains); ``prepare`` is a
    request parameter; FP32 input is the model's own and takes no prepare but none (422)."""
    blank = np.full((2, 1, 28, 28), 200, np.uint8)
    blank[1] = mnist[0][-1]  # an MNIST digit: read as sent
    body = {"inputs": [{"name": "images", "shape": [2, 1, 28, 28], "datatype": "UINT8",
                        "data": blank.ravel().tolist()}]}  # fmt: skip
    url = server.url + "/v2/models/tiny/infer"
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    abstain = next(o for o in r.json()["outputs"] if o["name"] == "abstain")["data"]
    assert abstain[0] is True
    r = httpx.post(url, json={**body, "parameters": {"prepare": "none"}}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(url, json={**body, "parameters": {"prepare": 3}}, timeout=30)
    assert r.status_code == 422 and "prepare" in r.json()["error"]
    fp32 = {"inputs": [{"name": "input", "shape": [1, 1, 28, 28], "datatype": "FP32",
                        "data": [-0.4] * 784}], "parameters": {"prepare": "mnist"}}  # fmt: skip
    r = httpx.post(url, json=fp32, timeout=30)
    assert r.status_code == 422 and "FP32" in r.json()["error"]
