"""The engine's control channel: frames of messages; the engine's answers coalesce per iteration."""

from __future__ import annotations

import asyncio
import socket

import pytest

from service.ipc import MAX_FRAME, Outbox, read_frame


async def _pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.StreamWriter]:
    """A connected Unix socket pair: (reader of side b, writer of side a, writer of side b)."""
    a, b = socket.socketpair()
    _, writer_a = await asyncio.open_connection(sock=a)
    reader_b, writer_b = await asyncio.open_connection(sock=b)
    return reader_b, writer_a, writer_b


def test_what_is_put_in_one_loop_iteration_goes_as_one_frame_in_order() -> None:
    async def main() -> None:
        reader, writer, other = await _pair()
        outbox = Outbox(writer, coalesce=True)
        written: list[int] = []
        for i in range(5):
            outbox.put(("infer", i, {"n": i}), after=lambda i=i: written.append(i))
        assert written == []  # nothing is written until the iteration's callbacks have run
        await asyncio.sleep(0)
        assert written == [0, 1, 2, 3, 4]
        outbox.put(("call", 9, None))  # a later iteration: a second frame
        assert await read_frame(reader) == [("infer", i, {"n": i}) for i in range(5)]
        assert await read_frame(reader) == [("call", 9, None)]
        outbox.close()
        other.close()

    asyncio.run(main())


def test_without_coalescing_each_message_is_written_at_once() -> None:
    """A front end's requests: the engine gets each as soon as it is decoded, never held back for
    the rest of a burst (that left the engine idle while the front end decoded)."""

    async def main() -> None:
        reader, writer, other = await _pair()
        outbox = Outbox(writer, coalesce=False)
        written: list[int] = []
        outbox.put(("infer", 1, None), after=lambda: written.append(1))
        assert written == [1]
        outbox.put(("infer", 2, None))
        assert await read_frame(reader) == [("infer", 1, None)]
        assert await read_frame(reader) == [("infer", 2, None)]
        outbox.close()
        other.close()

    asyncio.run(main())


def test_close_sends_what_waits_and_a_closed_outbox_drops_but_runs_callbacks() -> None:
    async def main() -> None:
        reader, writer, other = await _pair()
        outbox = Outbox(writer, coalesce=True)
        outbox.put(("ok", 1, b"rows"))
        outbox.close()  # flushes first
        assert await read_frame(reader) == [("ok", 1, b"rows")]
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)
        ran: list[bool] = []
        outbox.put(("ok", 2, b"late"), after=lambda: ran.append(True))
        await asyncio.sleep(0)
        assert ran == [True]  # the front end's arrival count is released even so
        other.close()

    asyncio.run(main())


def test_an_oversized_frame_header_is_refused_before_reading_it() -> None:
    async def main() -> None:
        reader, writer, other = await _pair()
        writer.write((MAX_FRAME + 1).to_bytes(4, "little"))
        with pytest.raises(ValueError, match="over the limit"):
            await read_frame(reader)
        writer.close()
        other.close()

    asyncio.run(main())
