"""The engine and a front end's engine client in one process (issue 26, step 5).

The end-to-end tests reach :class:`~service.engine.engine.Engine` only through ``vge serve``
subprocesses; here it runs on this test's event loop, with a real Unix socket and a real
shared-memory arena, and :class:`~service.frontend.engine_client.EngineClient` talks to it as a
front end does. What is checked where the risk is:

* an answer through the wire equals the library's own result for the same pixels;
* a request the engine refuses comes back as the same 4xx error class, not a dead future;
* SIGTERM drains: a request the engine holds is computed and answered before it goes;
* the client reconnects by itself to the next engine on the same socket, and an engine killed
  (-9) with a request held answers that request 503 at once (nothing waits for its deadline).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from models.predictor import Predictor
from service.common.errors import InvalidValue, NotReady
from service.common.settings import Settings
from service.common.shm import Arena, new_arena_file
from service.engine.engine import Engine, engine_main
from service.frontend.engine_client import EngineClient

ARENA_BYTES = 1 << 20


def _settings(tmp: Path, model: Path) -> Settings:
    return Settings(
        model_dir=model, device="cpu", torch_threads=1, max_queue_delay_ms=1,
        jobs_db_url=f"sqlite:///{tmp / 'jobs.sqlite3'}", jobs_dir=tmp / "jobs",
        models_root=tmp / "models", data_root=tmp / "data", review_dir=tmp / "reviews",
        # On SIGTERM the engine serves its connected front ends for drain_s + shutdown_grace_s
        # (5 + 30 s by default) while they drain; this test's client stays connected: 2 s.
        drain_s=0, shutdown_grace_s=2,
    )  # fmt: skip


async def _stop(task: asyncio.Task[None]) -> None:
    """SIGTERM to this process: the engine's own handler (``Engine.run``) drains and returns."""
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 60)


def test_engine_and_client_in_process(
    tmp_path: Path, tiny_model: Path, mnist: tuple[np.ndarray, np.ndarray]
) -> None:
    digits = mnist[0][-4:]  # (4, 28, 28) uint8
    library = Predictor.from_dir(tiny_model, device="cpu")
    x = torch.stack([library.prepare(torch.from_numpy(d).unsqueeze(0)) for d in digits])
    out = library.forward(x)
    want = library.score(out, top_k=3)

    sigint = signal.getsignal(signal.SIGINT)  # Engine.run ignores SIGINT: put it back after

    async def main() -> None:
        socket_path = str(tmp_path / "engine.sock")
        arena = Arena(new_arena_file(ARENA_BYTES, "test", base=tmp_path), ARENA_BYTES)
        engine = asyncio.create_task(Engine(_settings(tmp_path, tiny_model)).run(socket_path))
        client = EngineClient(socket_path, arena)
        client.start()
        try:
            assert await client.wait_ready(120), "the client never saw the engine's model"
            model = client.current_model()
            assert (model.name, model.version) == ("tiny", "1.0.0")

            # one request through the socket and the arena: the library's answer
            region = client.allocate("uint8", (4, 1, 28, 28))
            region.array[:] = digits[:, None]
            opts = model.options(abstain_k=None, vgmu_on=None, top_k=3, default_abstain_k=None)
            columns = await client.infer(model, region, opts, timeout_s=30)
            got = columns.records(list(model.class_names), opts.abstain_k)
            for g, w in zip(got, want, strict=True):
                assert g["prediction"] == w["prediction"] and g["abstain"] == w["abstain"]
                for key in ("vgmu", "tu", "au", "eu"):
                    assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), key

            # a request of a dtype the engine does not take: its refusal, as a 4xx error class
            bad = client.allocate("int16", (1, 1, 28, 28))
            with pytest.raises(InvalidValue):
                await client.infer(model, bad, opts, timeout_s=30)

            # SIGTERM with a request waiting: the engine drains (computes what it holds) and goes;
            # the client then says the engine is not there
            held = client.allocate("uint8", (1, 1, 28, 28))
            held.array[:] = digits[:1, None]
            waiting = asyncio.ensure_future(client.infer(model, held, opts, timeout_s=30))
            await asyncio.sleep(0)  # sent
            await _stop(engine)
            drained = await asyncio.wait_for(waiting, 10)
            assert int(drained.column("prediction")[0]) == want[0]["prediction"]
            await asyncio.sleep(0.1)
            with pytest.raises(NotReady):
                client.current_model()

            # an engine process on the same socket (as the supervisor spawns it): the client
            # reconnects by itself; its batcher holds a request (batch_wait=always, 30 s) when it
            # is killed (-9): the request is answered 503 at once, not left to its deadline
            slow = _settings(tmp_path, tiny_model).model_copy(
                update={"batch_wait": "always", "max_queue_delay_ms": 30_000}
            )
            proc = mp.get_context("spawn").Process(target=engine_main, args=(slow, socket_path))
            proc.start()
            try:
                assert await client.wait_ready(120), "the client did not reconnect"
                model = client.current_model()
                held = client.allocate("uint8", (1, 1, 28, 28))
                waiting = asyncio.ensure_future(client.infer(model, held, opts, timeout_s=60))
                await asyncio.sleep(0.5)
                assert not waiting.done()  # held by the batcher
                os.kill(proc.pid, signal.SIGKILL)
                with pytest.raises(NotReady, match="restarted while this request was in flight"):
                    await asyncio.wait_for(waiting, 10)
            finally:
                proc.kill()
                proc.join(30)
        finally:
            await client.close()
            if not engine.done():
                engine.cancel()
            arena.close()

    try:
        asyncio.run(main())
    finally:
        signal.signal(signal.SIGINT, sigint)


def test_an_engine_whose_start_fails_stops_what_it_started(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A socket path over AF_UNIX's limit fails the start after the batch loop and the jobs'
    log sweeper have started: the error reaches the caller, and neither is left running (an
    engine embedded in another process, as the tests' in-process server embeds one)."""
    import threading

    rundir = tmp_path / ("r" * 120)  # the socket's path: over the 107 bytes AF_UNIX takes
    rundir.mkdir()
    settings = _settings(tmp_path, tiny_model).model_copy(update={"job_log_retention_days": 1.0})
    before = set(threading.enumerate())

    async def main() -> None:
        engine = Engine(settings)
        with pytest.raises(OSError):
            await engine.run(str(rundir / "engine.sock"), stop=asyncio.Event())
        assert engine.batcher._task is None or engine.batcher._task.done()

    asyncio.run(main())
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert "vge-job-log-sweeper" not in left, left
