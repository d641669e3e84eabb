"""Queue policy (503 + Retry-After, 504 deadlines), hot swap under load, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import API_KEY, Server, start_in_process, start_server
from tests.service.inprocess import InProcessServer


@pytest.fixture(scope="module")
def slow_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[InProcessServer]:
    """Batches always wait 3 s for more requests (long enough for a loaded CI box to send the
    next request inside the window); the queue holds 4 images. In process: the queue's policy,
    not processes, is under test."""
    srv = start_in_process(
        tmp_path_factory.mktemp("slow"), tiny_model,
        max_batch_size=64, max_queue_delay_ms=3000, batch_wait="always", max_queue_length=4,
        max_images=4,
    )  # fmt: skip
    yield srv
    srv.stop()


def _files(pngs: list[bytes], n: int) -> list:
    return [("images", (f"{i}.png", pngs[i])) for i in range(n)]


def test_overload_gives_503_with_retry_after(
    slow_server: InProcessServer, pngs: list[bytes]
) -> None:
    results: dict[str, httpx.Response] = {}

    def first() -> None:  # fills the queue (4 images) and waits 3 s for its batch
        results["first"] = httpx.post(slow_server.url + "/v1/predict", files=_files(pngs, 4),
                                      timeout=30)  # fmt: skip

    t = threading.Thread(target=first)
    t.start()
    deadline = time.monotonic() + 5
    while slow_server.metric("vge_queue_depth", model="tiny") < 4:
        assert time.monotonic() < deadline, "first request never queued"
        time.sleep(0.01)
    r = httpx.post(slow_server.url + "/v1/predict", files=_files(pngs, 1), timeout=30)
    t.join()
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert "queue is full" in r.json()["error"]
    assert results["first"].status_code == 200 and len(results["first"].json()["results"]) == 4
    assert slow_server.metric("vge_rejections_total", reason="queue_full") >= 1


def test_deadline_gives_504_before_compute(slow_server: InProcessServer, pngs: list[bytes]) -> None:
    before = slow_server.metric("vge_batch_size_count", model="tiny")
    t0 = time.monotonic()
    r = httpx.post(slow_server.url + "/v1/predict", params={"timeout_s": 0.05},
                   files=_files(pngs, 1), timeout=30)  # fmt: skip
    assert r.status_code == 504, r.text
    assert time.monotonic() - t0 < 2.0  # answered at its deadline, not after the 3 s batch
    assert "deadline" in r.json()["error"]
    time.sleep(0.5)
    assert slow_server.metric("vge_batch_size_count", model="tiny") == before  # never computed
    assert slow_server.metric("vge_rejections_total", reason="deadline") >= 1
    assert slow_server.metric("vge_queue_depth", model="tiny") == 0


def test_hot_swap_under_load_has_zero_failures(server: Server, pngs: list[bytes]) -> None:
    admin = {"X-API-Key": API_KEY}
    stop = asyncio.Event()
    last_swap: list[float] = []  # when the promote back to tiny-v1 returned

    async def load(client: httpx.AsyncClient, i: int, seen: list) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            r = await client.post("/v1/predict", files=[("images", ("a.png", pngs[i % 64]))])
            seen.append((r.status_code, r.json().get("model_version"), sent))

    async def until_answers(seen: list, n: int) -> None:
        deadline = time.monotonic() + 30
        while len(seen) < n:
            assert time.monotonic() < deadline, f"only {len(seen)} answers"
            await asyncio.sleep(0.05)

    async def main() -> list:
        seen: list = []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            workers = [asyncio.create_task(load(client, i, seen)) for i in range(8)]
            await until_answers(seen, 8)
            before_swap = len(seen)
            r = await client.post("/v1/models/promote", json={"model": "tiny-v2"}, headers=admin)
            assert r.status_code == 200, r.text
            assert r.json()["model"]["version"] == "2.0.0"
            assert {v for _, v, _ in seen[:before_swap]} == {"1.0.0"}
            await asyncio.sleep(0.5)
            r = await client.post("/v1/models/reload", headers=admin)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
            r = await client.post("/v1/models/promote", json={"model": "tiny-v1"}, headers=admin)
            assert r.status_code == 200, r.text
            last_swap.append(time.monotonic())
            await until_answers(seen, len(seen) + 16)
            stop.set()
            await asyncio.gather(*workers)
        return seen

    seen = asyncio.run(main())
    statuses = [s for s, _, _ in seen]
    assert statuses.count(200) == len(seen), f"failed during swap: {set(statuses)}"
    assert "2.0.0" in {v for _, v, _ in seen}
    after = {v for _, v, sent in seen if sent > last_swap[0]}  # sent once tiny-v1 was back
    assert after == {"1.0.0"}
    assert server.metric("vge_model_load_seconds_count") >= 4


def test_sigterm_drains_without_dropping(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, pngs: list[bytes]
) -> None:
    # The batch waits up to 10 s for more rows, so all n requests are caught queued in the engine
    # however slowly a loaded CI box sends them; SIGTERM must compute them at once, not at 10 s.
    srv = start_server(
        tmp_path_factory.mktemp("drain"), tiny_model,
        max_batch_size=64, max_queue_delay_ms=10_000, batch_wait="always", max_queue_length=64,
        request_timeout_s=60, shutdown_grace_s=20, drain_s=0.5,
    )  # fmt: skip
    n = 12
    responses: list[httpx.Response | Exception] = []
    client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=n))

    def one(i: int) -> None:
        try:
            responses.append(client.post(srv.url + "/v1/predict",
                                         files=[("images", ("a.png", pngs[i]))]))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            responses.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    # Wait until every request is either queued in the engine or (should a slow box have let the
    # 10 s batch window close first) already answered; at least one must be in flight at SIGTERM.
    deadline = time.monotonic() + 60
    depths: list[float] = []
    while True:
        depths.append(srv.metric("vge_queue_depth", model="tiny"))
        if depths[-1] >= 1 and depths[-1] + len(responses) >= n:
            break
        assert time.monotonic() < deadline, (
            f"requests never queued: depths {depths[-20:]}, answered {len(responses)}; "
            f"{srv.log()[-2000:]}"
        )
        time.sleep(0.02)
    sigterm_at = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # new work is not admitted: readiness is false or the listener is closed
    try:
        late = httpx.get(srv.url + "/readyz", timeout=2)
        assert late.status_code == 503
    except httpx.TransportError:
        pass
    for t in threads:
        t.join(30)
    client.close()
    assert time.monotonic() - sigterm_at < 8  # drained at once, not at the batch's 10 s flush
    assert srv.proc.wait(30) == 0, srv.log()
    assert len(responses) == n
    bad = [r for r in responses if not isinstance(r, httpx.Response) or r.status_code != 200]
    assert not bad, bad


def test_serves_shipped_default_model_without_arguments(
    tmp_path_factory: pytest.TempPathFactory, pngs: list[bytes]
) -> None:
    from models.zoo import default_model_dir

    if not default_model_dir().is_dir():
        pytest.skip("the shipped default model is not built yet")
    from models.predictor import Predictor

    srv = start_server(tmp_path_factory.mktemp("default"), None)
    try:
        card = Predictor.from_dir(default_model_dir(), device="cpu").card
        with srv.client() as c:
            info = c.get("/v1/models").json()["models"][0]
            r = c.post("/v1/predict", files=[("images", ("a.png", pngs[0]))])
        assert info["name"] == card.name and info["device"] == "cpu"
        assert r.status_code == 200 and r.json()["model"] == card.name
        assert f"model {card.name}" in srv.log() and "listening on http://127.0.0.1:" in srv.log()
    finally:
        assert srv.stop() == 0
