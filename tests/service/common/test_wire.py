"""The engine's control channel (service.common.wire): frames of typed messages; the engine's answers
coalesce per iteration; every message round-trips; errors cross as codes."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import ClassVar

import pytest

from models.serving import ScoreOptions
from service.common import errors, wire
from service.common.model_info import ModelInfo
from service.common.wire import (
    MAX_FRAME,
    FrameReader,
    InferRequest,
    InferResults,
    JobLog,
    ListModelHistory,
    ModelUpdate,
    Outbox,
    encode,
    encode_infer,
    read_frame,
)

Body = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

REQUEST = InferRequest(1, 64, "uint8", (1, 1, 28, 28), ScoreOptions(0.5, "p", 1), 1.0)
MODEL = ModelInfo(
    generation=3, name="m", version="1", class_names=("a", "b"), vgn=False, in_channels=1,
    input_size=(28, 28), calibrated_k={"p": 1.0, "q": None}, description={"name": "m"},
)  # fmt: skip


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
            outbox.put(i, JobLog(f"n={i}"))
            outbox.put_result(10 + i, b"rows %d" % i)  # scoring answers: one InferResults
        await asyncio.sleep(0)
        outbox.put(0, ModelUpdate(MODEL))  # a later iteration: a second frame
        results = InferResults([(10 + i, b"rows %d" % i) for i in range(5)])
        assert await read_frame(reader) == [(i, JobLog(f"n={i}")) for i in range(5)] + [
            (0, results)
        ]
        assert await read_frame(reader) == [(0, ModelUpdate(MODEL))]
        outbox.close()

    _over_a_socket(body)


def test_frames_written_one_by_one_are_read_one_by_one() -> None:
    """A front end's requests: each written at once as a frame of one (EngineClient._send)."""

    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode([(1, REQUEST)]))
        writer.write(encode([(2, REQUEST)]))
        assert await read_frame(reader) == [(1, REQUEST)]
        assert await read_frame(reader) == [(2, REQUEST)]

    _over_a_socket(body)


def test_close_sends_what_waits_and_a_closed_outbox_drops_what_comes_later() -> None:
    async def body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        outbox = Outbox(writer)
        outbox.put_result(1, b"rows")
        outbox.close()  # flushes first
        assert await read_frame(reader) == [(0, InferResults([(1, b"rows")]))]
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)
        outbox.put_result(2, b"late")  # the front end is gone: dropped, no error
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
        writer.write(encode([(7, sent)]))
        [(request_id, got)] = await read_frame(reader)
        assert (request_id, got) == (7, sent)
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
    assert len(frames[0]) < len(encode([(7, sent[0])])) / 2

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(frames) + encode([(99, ListModelHistory())]))
        got = await FrameReader(reader).read()
        assert got == [(7 + i, r) for i, r in enumerate(sent)] + [(99, ListModelHistory())]
        requests = [message for _, message in got[:3]]
        assert all(type(r) is InferRequest for r in requests)
        assert requests[0].options is requests[1].options  # one object for equal options
        assert type(requests[2].options) is ScoreOptions and requests[2].options.members == "p"
        reader.feed_data(frames[1])
        assert await read_frame(reader) == [(8, sent[1])]

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
            assert await FrameReader(reader).read() == [(5, req)]

        asyncio.run(main())


def test_the_unpacked_options_cache_is_bounded_and_stays_correct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "_OPTIONS", {})
    monkeypatch.setattr(wire, "_OPTIONS_MAX", 4)
    ks = [0.1 * (i + 1) for i in range(10)]
    frames = b"".join(
        encode_infer(i, InferRequest(0, 64, "uint8", (1, 1, 28, 28), ScoreOptions(k, "p", 1), 1.0))
        for i, k in enumerate(ks)
    )

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(frames)
        got = await FrameReader(reader).read()
        assert [m.options.abstain_k for _, m in got if isinstance(m, InferRequest)] == ks
        assert len(wire._OPTIONS) <= 4

    asyncio.run(main())


def test_the_frame_reader_returns_every_frame_that_has_arrived_in_order() -> None:
    """The engine's and the front ends' read loops: one wake-up per socket read, not two awaits
    per frame; a frame split over several reads is put back together."""

    async def main() -> None:
        reader = asyncio.StreamReader()
        frames = FrameReader(reader)
        reader.feed_data(encode([(1, REQUEST)]) + encode([(2, REQUEST), (3, ListModelHistory(4))]))
        assert await frames.read() == [(1, REQUEST), (2, REQUEST), (3, ListModelHistory(4))]
        third = encode([(5, JobLog("rows" * 100))])
        for cut in (2, 7, len(third) - 1):  # header split, body split, one byte short
            reader.feed_data(third[:cut])
            waiting = asyncio.ensure_future(frames.read())
            await asyncio.sleep(0)
            assert not waiting.done()  # a partial frame is kept, not returned
            reader.feed_data(third[cut:] + encode([(6, JobLog(""))]))
            assert await waiting == [(5, JobLog("rows" * 100)), (6, JobLog(""))]
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


def _every_message() -> list[wire.Message]:
    """One of every message type (a command with each answer it can get)."""
    return [
        wire.Hello("/dev/shm/vge-arena-1", 64 << 20),
        REQUEST,
        InferRequest(2, 4096, "float64", (1, 28, 28), ScoreOptions(0.75, "q", 3), 12.5),  # pickled
        InferResults([(1, b"\x00" * 72), (2, b"")]),
        ModelUpdate(MODEL),
        wire.ReloadModel(),
        wire.PromoteModel("lenet5", force=True),
        wire.PromoteJob("job-1", force=False),
        wire.RollbackModel(),
        wire.RollbackModel("entry-1"),
        ListModelHistory(5),
        wire.SubmitJob({"dataset": "mnist", "epochs": 2, "backbone_kwargs": {"width": [1, 2.5]}}),
        wire.ListJobs(10),
        wire.GetJob("job-1"),
        wire.CancelJob("job-1"),
        wire.JobLogs("job-1", tail=5),
        wire.ModelServed({"name": "m", "gate": None}),
        wire.PromoteRefusal("worse", {"served": {"accuracy": 0.99}, "verdict": "refused"}),
        wire.HistoryEntries([{"id": "e1", "action": "start"}]),
        wire.JobRecord({"id": "job-1", "state": "queued", "events": []}),
        wire.JobList([{"id": "job-1"}]),
        JobLog("epoch 1\n"),
        *(wire.ErrorReply(code, f"{code.value}!", {"Retry-After": "1"}) for code in wire.ErrorCode),
    ]


def test_every_message_round_trips_through_encode_and_decode_equal_to_itself() -> None:
    messages = _every_message()
    defined = {
        cls
        for cls in vars(wire).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == wire.__name__
    }
    assert {type(m) for m in messages} == defined  # a new message type is added here too
    for i, message in enumerate(messages, 1):
        for frame in (encode([(i, message)]), wire.encode_message(i, message)):
            (n,) = struct.unpack("<I", frame[:4])
            [(request_id, got)] = wire.decode(frame[4 : 4 + n])
            assert (request_id, got) == (i, message) and type(got) is type(message)
    assert wire.decode(encode([(i, m) for i, m in enumerate(messages)])[4:]) == list(
        enumerate(messages)
    )


def test_each_admin_command_names_its_answers_and_a_wrong_answer_is_refused() -> None:
    assert wire.check_answer(wire.ListJobs(), wire.JobList([])) == wire.JobList([])
    refusal = wire.PromoteRefusal("worse", {})
    assert wire.check_answer(wire.PromoteModel("m"), refusal) is refusal
    with pytest.raises(RuntimeError, match="answered GetJob with JobLog"):
        wire.check_answer(wire.GetJob("job-1"), JobLog(""))


def test_admin_command_lists_every_command_class() -> None:
    """``AdminCommand`` (what the engine dispatches on, what a front end sends) names exactly the
    :class:`~service.common.wire.Command` subclasses: ``EngineClient.call`` relies on it."""
    listed = {name.strip() for name in wire.AdminCommand.split("|")}
    defined = {c.__name__ for c in wire.Command.__subclasses__() if c.__module__ == wire.__name__}
    assert listed == defined  # (a test below defines a command of its own, to be refused)
    assert all(isinstance(getattr(wire, name), type) for name in listed)


def test_error_codes_map_both_ways_to_the_error_classes() -> None:
    for code in wire.ErrorCode:
        cls = code.error_class()
        if code is wire.ErrorCode.INTERNAL:
            assert cls is None
            continue
        assert cls is not None and cls.code == code.value
        raised = wire.ErrorReply.of(cls("nope", headers={"Retry-After": "3"})).exception()
        assert type(raised) is cls and raised.message == "nope"
        assert raised.headers == {"Retry-After": "3"}

    class EngineSideConflict(errors.Conflict):  # e.g. model_manager.PromoteRefused
        code = "promote_refused"

    reply = wire.ErrorReply.of(EngineSideConflict("gate"))
    assert reply.code is wire.ErrorCode.CONFLICT and type(reply.exception()) is errors.Conflict
    assert wire.ErrorReply.of(ValueError("k < 0")) == wire.ErrorReply(
        wire.ErrorCode.INVALID_VALUE, "k < 0", {}
    )
    fault = wire.ErrorReply.of(KeyError("x"))
    assert fault.code is wire.ErrorCode.INTERNAL and fault.message == "KeyError: 'x'"
    assert type(fault.exception()) is RuntimeError


class _FromANewerEngine:
    """An ErrorReply as an engine with a code this side does not know sends it."""

    def __reduce__(self) -> tuple[object, tuple[str, str, dict[str, str]]]:
        return wire._error_reply, ("teapot", "short and stout", {"Retry-After": "1"})


def test_an_unknown_error_code_arrives_as_an_internal_error() -> None:
    assert wire.ErrorCode.parse("teapot") is wire.ErrorCode.INTERNAL
    assert wire.ErrorCode.parse("queue_full") is wire.ErrorCode.QUEUE_FULL
    [(request_id, got)] = wire.decode(encode([(4, _FromANewerEngine())])[4:])  # type: ignore[list-item]
    assert request_id == 4
    assert got == wire.ErrorReply(wire.ErrorCode.INTERNAL, "short and stout", {"Retry-After": "1"})
    assert isinstance(got, wire.ErrorReply)
    raised = got.exception()
    assert type(raised) is RuntimeError and str(raised) == "short and stout"


@dataclasses.dataclass(frozen=True)
class _NewCommand(wire.Command[JobLog]):
    """A command this engine has no case for (a front end newer than its engine)."""

    answers: ClassVar[tuple[type, ...]] = (JobLog,)


def test_the_engine_answers_an_unknown_command_type_with_a_clear_error() -> None:
    from service.engine.engine import Engine

    class Recorder:
        def __init__(self) -> None:
            self.sent: list[tuple[int, wire.EngineMessage]] = []

        def put(self, request_id: int, message: wire.EngineMessage) -> None:
            self.sent.append((request_id, message))

    engine = Engine.__new__(Engine)  # _dispatch's refusal touches no engine state
    outbox = Recorder()
    asyncio.run(engine._call(outbox, 9, _NewCommand()))  # type: ignore[arg-type]
    [(request_id, reply)] = outbox.sent
    assert request_id == 9 and isinstance(reply, wire.ErrorReply)
    assert reply.code is wire.ErrorCode.INVALID_VALUE
    assert "unknown engine command _NewCommand" in reply.message
    assert type(reply.exception()) is errors.InvalidValue
