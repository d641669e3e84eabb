"""The engine's control channel: frames of messages; the engine's answers coalesce per iteration."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from models.serving import ScoreOptions
from service.common import ipc
from service.common.ipc import (
    MAX_FRAME,
    FrameReader,
    InferRequest,
    Outbox,
    encode,
    encode_infer,
    read_frame,
)

Body = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _over_a_socket(body: Body) -> None:
    """Run ``body(reader, writer)`` on a connected Unix socket pair: ``writer`` writes one side,
    ``reader`` reads the other; both sides are closed afterwards."""

    async def main() -> None:
        a, b = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=a)
        reader, other = await asyncio.open_connection(sock=b)
        try:
            await body(reader, writer)
        finally:
            writer.close()
            other.close()

    asyncio.run(main())


def test_what_is_put_in_one_loop_iteration_goes_as_one_frame_in_order() -> None:
    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        outbox = Outbox(writer)
        for i in range(5):
            outbox.put(("ok", i, {"n": i}))
        await asyncio.sleep(0)
        outbox.put(("model", 0, None))  # a later iteration: a second frame
        assert await read_frame(reader) == [("ok", i, {"n": i}) for i in range(5)]
        assert await read_frame(reader) == [("model", 0, None)]
        outbox.close()

    _over_a_socket(body)


def test_frames_written_one_by_one_are_read_one_by_one() -> None:
    """A front end's requests: each written at once as a frame of one (EngineClient._send)."""

    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode([("infer", 1, None)]))
        writer.write(encode([("infer", 2, None)]))
        assert await read_frame(reader) == [("infer", 1, None)]
        assert await read_frame(reader) == [("infer", 2, None)]

    _over_a_socket(body)


def test_close_sends_what_waits_and_a_closed_outbox_drops_what_comes_later() -> None:
    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        outbox = Outbox(writer)
        outbox.put(("ok", 1, b"rows"))
        outbox.close()  # flushes first
        assert await read_frame(reader) == [("ok", 1, b"rows")]
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)
        outbox.put(("ok", 2, b"late"))  # the front end is gone: dropped, no error
        await asyncio.sleep(0)

    _over_a_socket(body)


def test_an_oversized_frame_header_is_refused_before_reading_it() -> None:
    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((MAX_FRAME + 1).to_bytes(4, "little"))
        with pytest.raises(ValueError, match="over the limit"):
            await read_frame(reader)

    _over_a_socket(body)


def test_an_infer_request_crosses_whole_and_its_options_still_group() -> None:
    """InferRequest and ScoreOptions pickle as constructor calls: every field comes back, and the
    options hash and compare like the sender's (they are the batcher's grouping key)."""
    options = ScoreOptions(abstain_k=0.75, members="q", top_k=3)
    sent = InferRequest(2, 4096, "uint8", (1, 1, 28, 28), options, 12.5)
    assert sent.__reduce__() == (InferRequest, (2, 4096, "uint8", (1, 1, 28, 28), options, 12.5))
    assert options.__reduce__() == (ScoreOptions, (0.75, "q", 3))

    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode([("infer", 7, sent)]))
        [(kind, request_id, got)] = await read_frame(reader)
        assert (kind, request_id, got) == ("infer", 7, sent)
        assert type(got) is InferRequest and type(got.options) is ScoreOptions
        assert got.options == options and hash(got.options) == hash(options)
        assert {got.options: "group"}[ScoreOptions(0.75, "q", 3)] == "group"
        with pytest.raises(AttributeError):  # still frozen
            got.options.top_k = 4  # type: ignore[misc]

    _over_a_socket(body)


def test_a_packed_infer_request_crosses_whole_and_equal_options_arrive_as_one_object() -> None:
    """The front end's per-request message is a packed record, not a pickle; every field comes
    back, and requests with equal options share one ScoreOptions (the batcher's grouping key)."""
    options = ScoreOptions(abstain_k=0.75, members="q", top_k=3)
    sent = [
        InferRequest(2, 4096, "uint8", (1, 1, 28, 28), options, 12.5),
        InferRequest(3, 8192, "float32", (64, 3, 32, 32), ScoreOptions(0.75, "q", 3), 0.001),
        InferRequest(-1, 2**40, "uint8", (2, 1, 28, 28), ScoreOptions(1e-9, "p", 10), 3600.0),
    ]
    frames = [encode_infer(7 + i, r) for i, r in enumerate(sent)]
    assert all(f[4:5] == b"I" for f in frames)  # packed, not pickled (b"\x80")
    assert len(frames[0]) < len(encode([("infer", 7, sent[0])])) / 2

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(frames) + encode([("call", 99, ("models.history", {}))]))
        got = await FrameReader(reader).read()
        assert got == [("infer", 7 + i, r) for i, r in enumerate(sent)] + [
            ("call", 99, ("models.history", {}))
        ]
        assert got[0][2].options is got[1][2].options  # one object for equal options
        assert type(got[2][2].options) is ScoreOptions and got[2][2].options.members == "p"
        reader.feed_data(frames[1])
        assert await read_frame(reader) == [("infer", 8, sent[1])]

    asyncio.run(main())


def test_an_infer_request_the_record_cannot_hold_goes_pickled_and_arrives_unchanged() -> None:
    """Another dtype, another rank or a field out of range: the engine still gets the request as
    sent and answers it with its own error (it refuses dtypes other than uint8/float32)."""
    options = ScoreOptions(0.5, "p", 1)
    odd = [
        InferRequest(1, 64, "float64", (1, 1, 28, 28), options, 1.0),
        InferRequest(1, 64, "uint8", (1, 28, 28), options, 1.0),
        InferRequest(1, -64, "uint8", (1, 1, 28, 28), options, 1.0),  # offset is unsigned
        InferRequest(1, 64, "uint8", (1, 1, 28, 28), ScoreOptions(0.5, "p", 2**33), 1.0),
    ]
    for req in odd:
        frame = encode_infer(5, req)
        assert frame[4] == 0x80  # a pickle

        async def main(frame: bytes = frame, req: InferRequest = req) -> None:
            reader = asyncio.StreamReader()
            reader.feed_data(frame)
            assert await FrameReader(reader).read() == [("infer", 5, req)]

        asyncio.run(main())


def test_the_unpacked_options_cache_is_bounded_and_stays_correct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ipc, "_OPTIONS", {})
    monkeypatch.setattr(ipc, "_OPTIONS_MAX", 4)
    ks = [0.1 * (i + 1) for i in range(10)]
    frames = b"".join(
        encode_infer(i, InferRequest(0, 64, "uint8", (1, 1, 28, 28), ScoreOptions(k, "p", 1), 1.0))
        for i, k in enumerate(ks)
    )

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(frames)
        got = await FrameReader(reader).read()
        assert [m[2].options.abstain_k for m in got] == ks
        assert len(ipc._OPTIONS) <= 4

    asyncio.run(main())


def test_the_frame_reader_returns_every_frame_that_has_arrived_in_order() -> None:
    """The engine's and the front ends' read loops: one wake-up per socket read, not two awaits
    per frame; a frame split over several reads is put back together."""

    async def main() -> None:
        reader = asyncio.StreamReader()
        frames = FrameReader(reader)
        reader.feed_data(encode([("infer", 1, None)]) + encode([("infer", 2, "x"), ("call", 3, 4)]))
        assert await frames.read() == [("infer", 1, None), ("infer", 2, "x"), ("call", 3, 4)]
        third = encode([("ok", 5, b"rows" * 100)])
        for cut in (2, 7, len(third) - 1):  # header split, body split, one byte short
            reader.feed_data(third[:cut])
            waiting = asyncio.ensure_future(frames.read())
            await asyncio.sleep(0)
            assert not waiting.done()  # a partial frame is kept, not returned
            reader.feed_data(third[cut:] + encode([("ok", 6, None)]))
            assert await waiting == [("ok", 5, b"rows" * 100), ("ok", 6, None)]
        reader.feed_data(third[:9])
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):  # EOF inside a frame
            await frames.read()

    asyncio.run(main())


def test_the_frame_reader_refuses_an_oversized_frame_and_ends_at_eof() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((MAX_FRAME + 1).to_bytes(4, "little"))
        with pytest.raises(ValueError, match="over the limit"):
            await FrameReader(reader).read()
        clean = asyncio.StreamReader()
        clean.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await FrameReader(clean).read()

    asyncio.run(main())
