"""The engine's dynamic batcher, in process (no subprocess): grouping, deadlines, limits, swap, drain.

A real tiny model runs the batches; the batcher's results are checked against the predictor's own
scoring of the same rows.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from models.predictor import Predictor
from models.serving import ScoreOptions
from service.common.errors import DeadlineExceeded, QueueFull
from service.common.metrics import Metrics
from service.engine.batcher import Batcher


@pytest.fixture(scope="module")
def predictor(tiny_model: Path) -> Predictor:
    return Predictor.from_dir(tiny_model, device="cpu")


@pytest.fixture(scope="module")
def pixels(mnist: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(mnist[0][-32:]).unsqueeze(1).contiguous()  # (32, 1, 28, 28) uint8


def _batcher(**kw: object) -> Batcher:
    """A batch of up to 32 images, a queue of 64, ``batch_wait=always``; ``kw`` overrides."""
    opts: dict = dict(max_batch_size=32, max_delay_s=0.05, max_queue_length=64, wait_always=True)
    opts.update(kw)
    opts.setdefault("metrics", Metrics())
    return Batcher(**opts)


def _alone(predictor: Predictor, x: torch.Tensor, options: ScoreOptions) -> np.ndarray:
    return predictor.score_columns(predictor.run([x]), options).data


def test_requests_with_different_options_share_a_batch_and_get_their_own_rows(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    a = ScoreOptions(abstain_k=0.5, members="q", top_k=3)
    b = ScoreOptions(abstain_k=2.0, members="p", top_k=1)
    metrics = Metrics()

    async def main() -> list:
        batcher = _batcher(max_delay_s=0.2, metrics=metrics)
        batcher.start()
        jobs = [
            batcher.submit(predictor, "tiny", pixels[i : i + 2], a if i % 4 == 0 else b, 10.0)
            for i in range(0, 16, 2)
        ]
        out = await asyncio.gather(*jobs)
        await batcher.drain(5.0)
        return out

    results = asyncio.run(main())
    for n, cols in enumerate(results):
        i = 2 * n
        opts = a if i % 4 == 0 else b
        np.testing.assert_allclose(cols.data, _alone(predictor, pixels[i : i + 2], opts),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        assert cols.top_k == opts.top_k
    # all 8 requests (16 images) went through one forward pass
    assert metrics.batch_size.labels(model="tiny")._sum.get() == 16
    assert metrics.compute.labels(model="tiny")._sum.get() > 0


def test_full_queue_is_refused_at_once_with_retry_after(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)

    async def main() -> None:
        batcher = _batcher(max_queue_length=4, max_delay_s=0.3)
        batcher.start()
        first = asyncio.create_task(batcher.submit(predictor, "tiny", pixels[:4], opts, 10.0))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as refused:
            await batcher.submit(predictor, "tiny", pixels[:1], opts, 10.0)
        assert int(refused.value.headers["Retry-After"]) >= 1
        assert len(await first) == 4
        await batcher.drain(5.0)

    asyncio.run(main())


def test_deadline_passes_while_queued_never_computed(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)
    metrics = Metrics()

    async def main() -> None:
        batcher = _batcher(max_delay_s=0.5, metrics=metrics)
        batcher.start()
        with pytest.raises(DeadlineExceeded):
            await batcher.submit(predictor, "tiny", pixels[:1], opts, 0.05)
        assert batcher.queued_rows == 0
        await batcher.drain(5.0)

    asyncio.run(main())
    assert metrics.batch_size.labels(model="tiny")._sum.get() == 0  # nothing was computed


def test_a_batch_never_mixes_models(tiny_model: Path, pixels: torch.Tensor) -> None:
    """After a swap, requests admitted for the old predictor run on it, in their own batch."""
    old = Predictor.from_dir(tiny_model, device="cpu")
    new = Predictor.from_dir(tiny_model, device="cpu")
    with torch.no_grad():
        for p in new.module.parameters():
            p.mul_(0.5)  # a different model
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=2)
    metrics = Metrics()

    async def main() -> list:
        batcher = _batcher(max_delay_s=0.1, metrics=metrics)
        batcher.start()
        out = await asyncio.gather(
            batcher.submit(old, "tiny", pixels[:3], opts, 10.0),
            batcher.submit(new, "tiny", pixels[:3], opts, 10.0),
            batcher.submit(old, "tiny", pixels[3:5], opts, 10.0),
        )
        await batcher.drain(5.0)
        return out

    a, b, c = asyncio.run(main())
    np.testing.assert_allclose(a.data, _alone(old, pixels[:3], opts), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.data, _alone(new, pixels[:3], opts), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.data, _alone(old, pixels[3:5], opts), rtol=1e-5, atol=1e-6)
    assert metrics.batch_size.labels(model="tiny")._sum.get() == 8
    assert not np.allclose(a.data, b.data)


def test_queue_depth_is_per_model_and_reaches_zero_for_a_swapped_out_model(
    tiny_model: Path, pixels: torch.Tensor
) -> None:
    """``vge_queue_depth{model}`` counts that model's queued images: during a swap both models
    have requests queued, and once the old model's last batch is taken its depth reads 0 (not the
    queue's total at that moment, held forever)."""
    old, new = (Predictor.from_dir(tiny_model, device="cpu") for _ in range(2))
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)
    metrics = Metrics()

    def depth(model: str) -> float:
        return metrics.queue_depth.labels(model=model)._value.get()

    async def main() -> None:
        batcher = _batcher(metrics=metrics)  # its batch loop not started: the queue stays put
        answers: list = []
        units = [
            batcher.enqueue(old, "a", pixels[:3], opts, 10.0, lambda c, e: answers.append(e)),
            batcher.enqueue(new, "b", pixels[:2], opts, 10.0, lambda c, e: answers.append(e)),
            batcher.enqueue(new, "b", pixels[2:3], opts, 10.0, lambda c, e: answers.append(e)),
        ]
        await asyncio.sleep(0)  # the gauges are set once per loop iteration
        assert (depth("a"), depth("b")) == (3, 3)
        assert batcher.queued_rows == 6 and batcher.queued_rows_of("b") == 3
        assert [u.rows for u in batcher._take(old)] == [3]  # the old model's last batch
        assert (depth("a"), depth("b")) == (0, 3)
        batcher.cancel(units[2])  # its front end went away
        assert (depth("a"), depth("b"), batcher.queued_rows_of("b")) == (0, 2, 2)
        assert [u.rows for u in batcher._take(new)] == [2]
        assert (depth("a"), depth("b"), batcher.queued_rows) == (0, 0, 0)

    asyncio.run(main())


async def _slow_batcher_with_queued(
    predictor: Predictor, pixels: torch.Tensor, opts: ScoreOptions, n: int
) -> tuple[Batcher, list[asyncio.Task]]:
    """A started batcher that would wait 5 s for a fuller batch, holding ``n`` one-image requests."""
    batcher = _batcher(max_delay_s=5.0)
    batcher.start()
    queued = [
        asyncio.create_task(batcher.submit(predictor, "tiny", pixels[i : i + 1], opts, 30.0))
        for i in range(n)
    ]
    await asyncio.sleep(0.05)
    return batcher, queued


def test_enqueue_answers_each_request_once_and_a_cancelled_one_never(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """The engine's path: callbacks, no futures. A request whose front end went away is dropped
    from the queue (never computed, never answered); the others get their own rows, once."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)
    metrics = Metrics()

    async def main() -> None:
        batcher = _batcher(max_delay_s=0.2, metrics=metrics)
        batcher.start()
        answers: dict[int, list] = {i: [] for i in range(4)}
        units = [
            batcher.enqueue(
                predictor,
                "tiny",
                pixels[2 * i : 2 * i + 2],
                opts,
                10.0,
                lambda c, e, i=i: answers[i].append((c, e)),
            )  # fmt: skip
            for i in range(4)
        ]
        assert batcher.queued_rows == 8
        batcher.cancel(units[1])
        assert batcher.queued_rows == 6
        await batcher.drain(5.0)
        assert answers[1] == []
        for i in (0, 2, 3):
            [(columns, error)] = answers[i]
            assert error is None
            np.testing.assert_allclose(
                columns.data, _alone(predictor, pixels[2 * i : 2 * i + 2], opts), atol=1e-5
            )

    asyncio.run(main())
    assert metrics.batch_size.labels(model="tiny")._sum.get() == 6  # one batch, without unit 1


def test_drain_computes_what_is_queued_then_refuses(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)

    async def main() -> None:
        batcher, queued = await _slow_batcher_with_queued(predictor, pixels, opts, 5)
        t0 = asyncio.get_running_loop().time()
        await batcher.drain(10.0)
        assert asyncio.get_running_loop().time() - t0 < 2.0  # flushed, not after the 5 s wait
        assert [len(r) for r in await asyncio.gather(*queued)] == [1] * 5
        with pytest.raises(QueueFull, match="shutting down"):
            await batcher.submit(predictor, "tiny", pixels[:1], opts, 1.0)

    asyncio.run(main())


def test_hurry_runs_batches_at_once_and_keeps_admitting(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """While the front ends drain, queued and newly arriving requests run without batch waits."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)

    async def main() -> None:
        batcher, queued = await _slow_batcher_with_queued(predictor, pixels, opts, 3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        batcher.hurry()
        assert [len(r) for r in await asyncio.gather(*queued)] == [1] * 3
        assert loop.time() - t0 < 2.0
        assert batcher.admitting  # still accepting: the drain period goes on
        t0 = loop.time()
        assert len(await batcher.submit(predictor, "tiny", pixels[:2], opts, 30.0)) == 2
        assert loop.time() - t0 < 2.0  # a late arrival does not wait for a fuller batch either
        await batcher.drain(5.0)

    asyncio.run(main())


def test_on_scored_sees_each_option_group_once_per_batch_and_cannot_fail_answers(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """The monitoring hook gets every scored group's rows, one call per group per batch (not per
    request); a hook that raises leaves the answers intact."""
    a = ScoreOptions(abstain_k=0.5, members="q", top_k=3)
    b = ScoreOptions(abstain_k=2.0, members="p", top_k=1)
    seen: list[tuple[object, int, int]] = []

    def hook(pred: object, columns, options) -> None:  # noqa: ANN001
        seen.append((pred, len(columns), columns.top_k, options))
        raise RuntimeError("a broken monitor")

    async def main() -> list:
        batcher = _batcher(max_delay_s=0.2, on_scored=hook)
        batcher.start()
        jobs = [batcher.submit(predictor, "tiny", pixels[i : i + 2], a if i < 6 else b, 10.0)
                for i in range(0, 10, 2)]  # fmt: skip
        out = await asyncio.gather(*jobs)
        await batcher.drain(5.0)
        return out

    results = asyncio.run(main())
    assert [len(r) for r in results] == [2] * 5
    # each group with the options it was scored with
    assert sorted(seen, key=lambda s: s[2]) == [(predictor, 4, 1, b), (predictor, 6, 3, a)]


def _lone_request_seconds(batcher: Batcher, predictor: Predictor, pixels: torch.Tensor) -> float:
    """Start ``batcher``, submit one image, return how long its answer took; then drain."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)

    async def main() -> float:
        batcher.start()
        t0 = asyncio.get_running_loop().time()
        await batcher.submit(predictor, "tiny", pixels[:1], opts, 10.0)
        took = asyncio.get_running_loop().time() - t0
        await batcher.drain(5.0)
        return took

    return asyncio.run(main())


def test_adaptive_runs_a_lone_request_at_once(predictor: Predictor, pixels: torch.Tensor) -> None:
    """Nothing on its way from a front end: no wait, whatever ``max_delay_s`` is."""
    metrics = Metrics()
    batcher = _batcher(max_delay_s=5.0, metrics=metrics, wait_always=False, arriving=lambda: 0)
    assert _lone_request_seconds(batcher, predictor, pixels) < 2.5  # never held for the 5 s window
    assert metrics.batch_size.labels(model="tiny")._sum.get() == 1


def test_adaptive_holds_the_batch_for_a_request_on_its_way(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """A front end reports one more request decoding: the first waits for it, one forward pass."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)
    metrics = Metrics()
    arriving = [1]

    async def main() -> list:
        batcher = _batcher(
            max_delay_s=5.0, metrics=metrics, wait_always=False, arriving=lambda: arriving[0]
        )
        batcher.start()
        first = asyncio.create_task(batcher.submit(predictor, "tiny", pixels[:1], opts, 10.0))
        await asyncio.sleep(0.2)
        assert not first.done()  # held: something is on its way
        arriving[0] = 0  # decoded; sent right after (as EngineClient.infer does)
        second = batcher.submit(predictor, "tiny", pixels[1:3], opts, 10.0)
        out = await asyncio.gather(first, second)
        await batcher.drain(5.0)
        return out

    a, b = asyncio.run(main())
    assert (len(a), len(b)) == (1, 2)
    # one forward pass (one observation) of 3 images
    hist = metrics.batch_size.labels(model="tiny")
    assert hist._sum.get() == 3
    assert sum(b.get() for b in hist._buckets) == 1


def test_adaptive_waits_at_most_max_delay_for_what_never_comes(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """A request reported on its way but never sent (its decode failed) delays the batch by
    ``max_delay_s`` at most."""
    batcher = _batcher(max_delay_s=0.3, wait_always=False, arriving=lambda: 1)
    assert 0.29 <= _lone_request_seconds(batcher, predictor, pixels) < 5.0


class _Gated:
    """A real predictor whose forward pass first passes ``gate`` (a barrier's or an event's
    ``wait``): batches reach the model only as the test lets them. ``entered`` counts arrivals."""

    def __init__(self, predictor: Predictor, gate: Callable[[], object]) -> None:
        self._predictor = predictor
        self.card = predictor.card
        self.gate = gate
        self.entered = 0  # forward passes begun

    def run(self, parts: list[torch.Tensor]):  # noqa: ANN201 - EnsembleOutput
        self.entered += 1
        self.gate()
        return self._predictor.run(parts)

    def score_columns(self, out, options):  # noqa: ANN001, ANN201
        return self._predictor.score_columns(out, options)


def test_two_batches_in_flight_compute_at_once_and_answer_their_own_rows(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """``in_flight=2``: the second batch is taken while the first computes (the barrier in the
    forward pass lets neither through alone), each request gets its own rows, and drain waits for
    both."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=2)
    barrier = threading.Barrier(2, timeout=10)  # neither batch passes alone
    gated = _Gated(predictor, barrier.wait)
    metrics = Metrics()

    async def main() -> list:
        batcher = _batcher(max_batch_size=2, wait_always=False, metrics=metrics, in_flight=2)
        batcher.start()
        answers = [
            asyncio.create_task(batcher.submit(gated, "tiny", pixels[i : i + 1], opts, 20.0))
            for i in range(4)
        ]
        await asyncio.sleep(0.05)  # both batches taken; their forward passes meet at the barrier
        await batcher.drain(10.0)
        assert all(a.done() for a in answers)  # drain returned after both batches answered
        return [a.result() for a in answers]

    out = asyncio.run(main())
    for i, columns in enumerate(out):
        np.testing.assert_allclose(
            columns.data, _alone(predictor, pixels[i : i + 1], opts), rtol=1e-5, atol=1e-6
        )
    assert metrics.batch_size.labels(model="tiny")._sum.get() == 4
    assert not barrier.broken


def test_in_flight_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="in_flight must be at least 1"):
        _batcher(in_flight=0)


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` holds (a compute thread has reached a point), at most 5 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_drain_timeout_answers_computing_requests_503_and_never_twice(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """A batch still computing when drain's time is up: its requests are answered 503 at once,
    and the batch finishing later answers nobody a second time."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)
    release = threading.Event()
    held = _Gated(predictor, lambda: release.wait(10))

    async def main() -> None:
        batcher = _batcher(wait_always=False)
        batcher.start()
        answers: list[tuple] = []
        batcher.enqueue(held, "tiny", pixels[:2], opts, 30.0, lambda c, e: answers.append((c, e)))
        await _until(lambda: held.entered == 1)  # taken: computing, held in the forward pass
        await batcher.drain(0.1)
        assert len(answers) == 1 and answers[0][0] is None
        assert isinstance(answers[0][1], QueueFull) and "shut down" in str(answers[0][1])
        release.set()
        await asyncio.sleep(0.5)  # the batch finishes; its answer goes nowhere
        assert len(answers) == 1

    asyncio.run(main())


def test_a_second_batch_starts_beside_a_computing_one_only_when_full(
    predictor: Predictor, pixels: torch.Tensor
) -> None:
    """``in_flight=2``: while a batch computes, two queued images (of a max batch of 4) wait for it;
    two more make a full batch, which starts at once beside it."""
    opts = ScoreOptions(abstain_k=1.0, members="q", top_k=1)
    release = threading.Event()
    held = _Gated(predictor, lambda: release.wait(10))

    async def main() -> list:
        batcher = _batcher(max_batch_size=4, wait_always=False, in_flight=2)
        batcher.start()
        first = asyncio.create_task(batcher.submit(held, "tiny", pixels[:4], opts, 30.0))
        await _until(lambda: held.entered == 1)
        rest = [
            asyncio.create_task(batcher.submit(held, "tiny", pixels[i : i + 1], opts, 30.0))
            for i in range(4, 6)
        ]
        await asyncio.sleep(0.2)
        assert held.entered == 1  # half a batch: it waits for the computing one
        # ... and its arrivals did not wake the batch loop one by one (only a full batch does)
        assert not batcher._wakeup.is_set() and batcher._wake_rows == 4
        rest += [
            asyncio.create_task(batcher.submit(held, "tiny", pixels[i : i + 1], opts, 30.0))
            for i in range(6, 8)
        ]
        await _until(lambda: held.entered == 2)  # full: it computes beside the first
        release.set()
        out = await asyncio.gather(first, *rest)
        await batcher.drain(5.0)
        return out

    out = asyncio.run(main())
    assert [len(c) for c in out] == [4, 1, 1, 1, 1]
