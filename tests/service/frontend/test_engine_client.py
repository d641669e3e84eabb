"""EngineClient's wait for an answer: the answer, a 504 after the deadline, or nothing once the
request is gone."""

from __future__ import annotations

import asyncio

import pytest

from service.common.errors import DeadlineExceeded, NotReady
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


def test_a_lost_engine_frees_only_the_regions_it_was_sent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Found by review (2026-11-29): losing the engine freed the whole arena, also the region of
    a request still decoding; a request arriving after the restart was given that same region,
    and each of the two was answered with the other's image. Only regions sent to the engine
    that is gone are freed now; a region still being filled stays its request's."""
    from service.common.shm import HEADER, Arena, new_arena_file
    from service.frontend.engine_client import EngineClient

    async def main() -> None:
        arena = Arena(new_arena_file(1 << 16, "t", base=tmp_path), 1 << 16)
        client = EngineClient(str(tmp_path / "no-engine.sock"), arena)
        try:
            decoding = client.allocate("uint8", (1, 1, 28, 28))  # not sent yet
            sent = client.allocate("uint8", (1, 1, 28, 28))
            future = asyncio.get_running_loop().create_future()
            client._pending[7] = (future, sent.offset)  # sent: the engine holds its region
            client._lost()  # what the read loop does when the connection drops
            assert isinstance(future.exception(), NotReady)
            after = client.allocate("uint8", (1, 1, 28, 28))  # a request after the restart
            assert after.offset != decoding.offset
            assert after.offset == sent.offset > decoding.offset >= HEADER  # freed, reused
            client.release(decoding)
            client.release(after)
            assert client.allocator.used_bytes == 0
        finally:
            arena.close()

    asyncio.run(main())
