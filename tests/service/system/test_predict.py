"""/v1/predict and /v1/score against a real server: library equality, batching, metrics."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
import torch

from tests.service.conftest import Server, approx_result


def test_health_and_models(server: Server) -> None:
    with server.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json()["status"] == "ready"
        for probe in ("/healthz", "/readyz"):  # HEAD probes: the GET's headers, no body
            r, got = c.head(probe), c.get(probe)
            assert (r.status_code, r.content) == (200, b""), probe
            assert r.headers["content-length"] == got.headers["content-length"] != "0", probe
            assert r.headers["content-type"] == got.headers["content-type"], probe
        models = c.get("/v1/models").json()["models"]
    assert len(models) == 1
    m = models[0]
    assert m["name"] == "tiny" and m["classes"] == [str(i) for i in range(10)]
    assert m["ensemble_kind"] == "lle" and m["members"] == 3 and m["device"] == "cpu"
    assert "abstain_k" in m and "metrics" in m


def test_multipart_equals_library(server: Server, pngs: list[bytes], library) -> None:
    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(pngs[:5])]
    with server.client() as c:
        r = c.post("/v1/predict", files=files, params={"top_k": 3, "abstain_k": 0.7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and body["model_version"] == "1.0.0"
    assert len(body["results"]) == 5
    for png, got in zip(pngs[:5], body["results"], strict=True):
        approx_result(got, library(png, abstain_k=0.7, top_k=3))


def test_json_base64_with_body_options(server: Server, pngs: list[bytes], library) -> None:
    payload = {
        "images": [base64.b64encode(b).decode() for b in pngs[5:8]],
        "abstain_k": 2.5,
        "vgmu_on": "q",
        "top_k": 10,
    }
    with server.client() as c:
        r = c.post("/v1/predict", json=payload)
    assert r.status_code == 200, r.text
    for png, got in zip(pngs[5:8], r.json()["results"], strict=True):
        assert got["abstain_k"] == 2.5 and len(got["probabilities"]) == 10
        approx_result(got, library(png, abstain_k=2.5, vgmu_on="q", top_k=10))


def test_default_abstain_k_is_the_calibrated_one(server: Server, pngs: list[bytes]) -> None:
    with server.client() as c:
        calibrated = c.get("/v1/models").json()["models"][0]["abstain_k"]
        got = c.post("/v1/predict", files=[("images", ("a.png", pngs[0]))]).json()
    assert got["results"][0]["abstain_k"] == pytest.approx(calibrated if calibrated else 1.0)


def test_concurrent_requests_batch_and_each_gets_its_own_result(
    server: Server, pngs: list[bytes], library
) -> None:
    before_count = server.metric("vge_batch_size_count", model="tiny")
    before_sum = server.metric("vge_batch_size_sum", model="tiny")
    n = 48

    async def one(client: httpx.AsyncClient, i: int) -> dict:
        r = await client.post("/v1/predict", files=[("images", (f"{i}.png", pngs[i]))],
                              params={"top_k": 2})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["results"][0]

    async def burst() -> list[dict]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(burst())
    for i, got in enumerate(results):
        approx_result(got, library(pngs[i], abstain_k=got["abstain_k"], top_k=2))
    batches = server.metric("vge_batch_size_count", model="tiny") - before_count
    images = server.metric("vge_batch_size_sum", model="tiny") - before_sum
    assert images == n
    assert images / batches > 1, f"{n} concurrent requests ran in {batches} batches: no batching"


def test_score_matches_score_ensemble(server: Server) -> None:
    from models.uncertainty.scoring import score_ensemble

    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(4, 5, 3, generator=g, dtype=torch.float64), dim=-1)
    want = score_ensemble(P, gate_k=1.0, abstain_k=0.5).to_records()
    with server.client() as c:
        r = c.post("/v1/score", json={"probs": P.tolist(), "gate_k": 1.0, "abstain_k": 0.5})
    assert r.status_code == 200, r.text
    got = r.json()["results"]
    assert len(got) == 4
    for g_, w in zip(got, want, strict=True):
        assert g_.keys() == w.keys()
        for k, v in w.items():
            assert g_[k] == (pytest.approx(v, abs=1e-9) if isinstance(v, float) else v), k


def test_metrics_exported_with_contract_names(server: Server, pngs: list[bytes]) -> None:
    with server.client() as c:
        c.post("/v1/predict", files=[("images", ("a.png", pngs[0]))])
        text = c.get("/metrics").text
    for name in (
        "vge_request_duration_seconds_bucket",
        "vge_queue_wait_seconds_bucket",
        "vge_compute_seconds_bucket",
        "vge_batch_size_bucket",
        "vge_queue_depth",
        "vge_inflight_requests",
        "vge_predictions_total",
        "vge_rejections_total",
        "vge_model_load_seconds_bucket",
        "vge_training_jobs",
    ):
        assert name in text, name
    assert 'endpoint="/v1/predict",method="POST",status="200"' in text
    assert 'le="0.001"' in text and 'le="10.0"' in text
    for role in ("frontend", "engine"):  # at 0 before any restart: increase() sees its first
        assert f'vge_process_restarts_total{{role="{role}"}} 0.0' in text
    assert server.metric("vge_predictions_total", model="tiny") >= 1
