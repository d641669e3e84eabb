"""benchmarks/asgi_floor.py: the raw ASGI app whose cost is a front end's floor."""

from __future__ import annotations

import asyncio
import json

import httpx

from benchmarks.asgi_floor import ANSWER, app
from benchmarks.serving import BOUNDARY, _pngs, multipart


def test_the_floor_app_reads_the_body_and_answers_like_predict() -> None:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://floor") as client:
            return await client.post(
                "/v1/predict", content=multipart(_pngs(1)),
                headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
            )  # fmt: skip

    r = asyncio.run(post())
    assert r.status_code == 200 and r.content == ANSWER
    assert r.headers["content-length"] == str(len(ANSWER))
    body = json.loads(ANSWER)  # shaped as /v1/predict's answer for one image
    assert set(body) == {"model", "model_version", "results"} and len(body["results"]) == 1
