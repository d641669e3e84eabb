"""EngineClient's wait for an answer: the answer, a 504 after the deadline, or nothing once the
request is gone."""

from __future__ import annotations

import asyncio

import pytest

from service.common.errors import DeadlineExceeded
from service.frontend.engine_client import _wait


def test_an_answer_in_time_is_returned_and_its_timer_cancelled() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        loop.call_later(0.01, future.set_result, "rows")
        timers: list[asyncio.TimerHandle] = []
        call_later = loop.call_later

        def recording_call_later(*args, **kwargs):  # type: ignore[no-untyped-def]
            timers.append(call_later(*args, **kwargs))
            return timers[-1]

        loop.call_later = recording_call_later  # type: ignore[method-assign]
        try:
            assert await _wait(future, 0.05) == "rows"
        finally:
            loop.call_later = call_later  # type: ignore[method-assign]
        assert len(timers) == 1 and timers[0].cancelled()  # no timer left per answered request

    asyncio.run(main())


def test_no_answer_is_a_504_naming_the_wait() -> None:
    async def main() -> None:
        future = asyncio.get_running_loop().create_future()
        with pytest.raises(DeadlineExceeded, match=r"did not answer within 0.05s"):
            await _wait(future, 0.05)
        # done, so the engine's late answer is dropped (EngineClient._read_loop checks done())
        assert isinstance(future.exception(), DeadlineExceeded)

    asyncio.run(main())


def test_a_cancelled_request_cancels_its_future() -> None:
    """A client that goes away cancels its handler: the engine's later answer finds the future
    done and only frees the region (EngineClient._read_loop)."""

    async def main() -> None:
        future = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(_wait(future, 5.0))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert future.cancelled()

    asyncio.run(main())
