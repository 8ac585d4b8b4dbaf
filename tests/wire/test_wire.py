"""The messages between the relay and the telemetry process: every kind survives encode, frame and decode;
bad frames and messages of another build are said and dropped, never a crash."""

from __future__ import annotations

import asyncio
import logging
import marshal
import math
import struct
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from llmtap.config.types import Route, Settings
from llmtap.telemetry.process import _Intake
from llmtap.telemetry.recorder import Recorder
from llmtap.wire import framing
from llmtap.wire.framing import MAX_FRAME, FrameReader, encode_frame, encode_frames, frames
from llmtap.wire.messages import (
    END,
    FACTS,
    SEGMENT,
    STATS,
    End,
    Facts,
    Head,
    Message,
    Reads,
    Segment,
    Stats,
    Tail,
    WireError,
    data_size,
    decode,
    decode_end,
    decode_facts,
    decode_segment,
    decode_stats,
    encode,
    encode_end,
    encode_facts,
    encode_segment,
    encode_stats,
    ready_of,
    without_bytes,
)
from llmtap.wire.tape import Tape
from tests.support.tapes import chat_tape

ROUTE = Route(prefix="/", upstream="http://upstream:8000", name="default")

# -- values of every field's type, as the relay makes them ------------------------------------------------

text = st.text(max_size=20)
times = st.floats(allow_nan=False, allow_infinity=False)
maybe_time = st.none() | times
ints = st.integers(min_value=-(2**62), max_value=2**62)
pairs = st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=12)), max_size=4).map(tuple)
counts = st.lists(st.tuples(text, st.integers(0, 2**40)), max_size=4).map(tuple)

heads = st.builds(
    Head,
    text,
    text,
    text,
    text,
    st.none() | text,
    times,
    ints,
    st.none() | st.binary(max_size=16),
    st.none() | st.tuples(text, text),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=8, max_size=8),
    st.booleans(),
    st.binary(max_size=200),
    st.booleans(),
    st.booleans(),
    maybe_time,
    maybe_time,
    maybe_time,
    maybe_time,
    st.none() | st.integers(100, 599),
    pairs,
    st.none() | ints,
    ints,
    pairs,
    st.none() | text,
)
arrays = st.binary(max_size=64)
reads = st.builds(Reads, arrays, arrays, arrays, st.binary(max_size=300))
tails = st.builds(Tail, maybe_time, st.none() | text, st.none() | text, st.booleans(), ints, ints)
keys = st.integers(0, 2**62)
segments = st.builds(Segment, keys, st.none() | heads, reads)
ends = st.builds(End, keys, st.none() | heads, reads, tails)
stats = st.builds(Stats, st.booleans(), st.integers(0, 2**40), counts, counts, counts, counts, counts)
# A lesson as the telemetry processes pass them: its kind, then plain values (bytes, text, numbers, tuples).
lessons = st.tuples(text, text, ints | maybe_time, maybe_time | st.tuples(st.binary(max_size=16)))
facts = st.builds(Facts, st.lists(lessons, max_size=4).map(tuple))
messages: st.SearchStrategy[Message] = segments | ends | stats | facts


def crossed(batch: list[Message], cut: int) -> list[Message]:
    """``batch`` encoded, framed, written as one byte stream, read back ``cut`` bytes at a time, decoded."""
    wire = b"".join(b"".join(encode_frames(encode(m))) for m in batch)
    reader = FrameReader()
    out: list[Message] = []
    for i in range(0, len(wire), cut):
        out.extend(decode(raw) for raw in reader.feed(wire[i : i + cut]))
    assert reader.broken is None and reader.pending == 0
    return out


@given(batch=st.lists(messages, max_size=6), cut=st.integers(1, 300))
@hsettings(max_examples=150, deadline=None)
def test_every_message_kind_comes_back_equal_with_its_names(batch: list[Message], cut: int) -> None:
    out = crossed(batch, cut)
    assert out == batch
    # Equal as named values, not only as tuples: the same kind, and the head, reads and tail named too.
    assert [type(m) for m in out] == [type(m) for m in batch]
    for m in out:
        if isinstance(m, (Segment, End)):
            assert isinstance(m.reads, Reads) and (m.head is None or isinstance(m.head, Head))
        if isinstance(m, End):
            assert isinstance(m.tail, Tail)


@given(m=messages)
@hsettings(max_examples=100, deadline=None)
def test_each_pair_inverts_and_the_encoded_form_is_plain(m: Message) -> None:
    raw = encode(m)
    # marshal takes plain tuples only: what crosses is one, its kind first.
    assert type(raw) is tuple and marshal.loads(marshal.dumps(raw)) == raw
    if isinstance(m, Segment):
        assert raw[0] == SEGMENT and encode_segment(m) == raw and decode_segment(raw) == m
    elif isinstance(m, End):
        assert raw[0] == END and encode_end(m) == raw and decode_end(raw) == m
    elif isinstance(m, Facts):
        assert raw[0] == FACTS and encode_facts(m) == raw and decode_facts(raw) == m and ready_of(raw) is None
    else:
        assert raw[0] == STATS and encode_stats(m) == raw and decode_stats(raw) == m
        assert ready_of(raw) is m.ready


def test_a_relay_tape_decodes_to_what_the_tape_held() -> None:
    tape, raws = chat_tape(7, [b"data: {}\n\n", b"data: [DONE]\n\n"], trace_id=0xABC, span_id=0xDEF)
    (m,) = [decode(raw) for raw in raws]
    assert isinstance(m, End) and m.key == 7 and m.head is not None
    head = m.head
    assert (head.method, head.route, head.protocol, head.status_code) == ("POST", "default", "openai_chat", 200)
    assert int.from_bytes(head.trace_id, "big") == 0xABC and int.from_bytes(head.span_id, "big") == 0xDEF
    assert head.response_headers == ((b"content-type", b"text/event-stream"),)
    assert m.reads.data == b"data: {}\n\ndata: [DONE]\n\n" and data_size(raws[0]) == len(m.reads.data)
    assert m.tail.end == tape.end and m.tail.response_bytes == len(m.reads.data) and not m.tail.cancelled


def test_the_tape_builds_each_field_where_its_name_says() -> None:
    """The relay builds the encoded form itself (``Tape.head``, ``tail``): every decoded field is the tape's own
    attribute of that name, so no two fields can trade places unnoticed."""
    tape = Tape(
        9,
        method="PUT",
        path="/p",
        inner_path="/ip",
        route="r",
        protocol="openai_chat",
        received=1.5,
        received_wall_ns=15,
    )
    distinct: dict[str, Any] = {
        "prompt_version": b"v2",
        "parent": ("00-tp", "ts"),
        "trace_id": 0x1234,
        "span_id": 0x56,
        "sampled": False,
        "body": b"{}",
        "body_complete": False,
        "strip_usage": True,
        "body_read": 1.6,
        "admitted": 1.7,
        "sent": 1.8,
        "written": 1.85,
        "headers_at": 1.9,
        "status_code": 203,
        "response_headers": [(b"h", b"v")],
        "upstream_seq": 4,
        "upstream_ahead": 3,
        "attribution": [(b"x-llmtap-team", b"a")],
        "key_fingerprint": "kf",
        "record_id": 0xFEED,
        "end": 2.5,
        "error_type": "idle_timeout",
        "error_message": "m",
        "cancelled": True,
        "surplus": 7,
    }
    for name, value in distinct.items():
        setattr(tape, name, value)
    tape.read(2.0, b"abc")
    tape.delivered(2.1)
    m = decode(tape.end_message())
    assert isinstance(m, End) and m.key == 9 and m.head is not None
    for name in Head._fields:
        expected = getattr(tape, name)
        if name in ("trace_id", "record_id"):
            expected = expected.to_bytes(16, "big")
        elif name == "span_id":
            expected = expected.to_bytes(8, "big")
        elif isinstance(expected, list):
            expected = tuple(expected)
        assert getattr(m.head, name) == expected, name
    for name in Tail._fields:
        assert getattr(m.tail, name) == getattr(tape, name), name
    assert m.tail.response_bytes == 3 and m.reads.data == b"abc"
    assert array("d", m.reads.times).tolist() == [2.0] and array("d", m.reads.delivered).tolist() == [2.1]
    assert array("l", m.reads.sizes).tolist() == [3]


def test_the_bytes_are_left_out_once_and_the_timing_kept() -> None:
    _, raws = chat_tape(1, [b"data: {}\n\n"])
    timing = without_bytes(raws[0])
    assert timing is not None and data_size(timing) == 0
    m, kept = decode(raws[0]), decode(timing)
    assert isinstance(kept, End) and isinstance(m, End)
    assert kept.reads == m.reads._replace(data=b"") and (kept.head, kept.tail) == (m.head, m.tail)
    assert without_bytes(timing) is None  # nothing left to leave out
    assert without_bytes(encode_stats(Stats(True, 0, (), (), (), (), ()))) is None


# -- what cannot be read ----------------------------------------------------------------------------------


def test_a_message_of_another_build_fails_loudly_naming_the_mismatch() -> None:
    good = encode_stats(Stats(True, 0, (), (), (), (), ()))
    with pytest.raises(WireError, match=rf"{len(good) - 1} fields where this build has {len(good)}.*different builds"):
        decode(good[:-1])
    _, raws = chat_tape(1, [b"x"])
    end = raws[0]
    with pytest.raises(WireError, match="message head of 28 fields where this build has 27"):
        decode((*end[:2], (*end[2], "new field"), *end[3:]))
    with pytest.raises(WireError, match="message tail of 5 fields"):
        decode((*end[:4], end[4][:5], *end[5:]))
    with pytest.raises(WireError, match="run of reads of 3 fields"):
        decode((*end[:3], end[3][:3], *end[4:]))
    with pytest.raises(WireError, match="unknown kind 0"):
        decode((0, 1, "default"))  # the start message of older builds is gone
    with pytest.raises(WireError, match="not a non-empty tuple"):
        decode(())


@given(raw=st.recursive(st.none() | st.integers() | st.binary(max_size=8), lambda c: st.tuples(c, c) | st.tuples(c)))
@hsettings(max_examples=200, deadline=None)
def test_any_garbled_message_is_a_wire_error_or_a_message(raw: Any) -> None:
    try:
        decode(raw)
    except WireError:
        pass


@given(batch=st.lists(messages, max_size=6), cut=st.integers(1, 300))
@hsettings(max_examples=100, deadline=None)
def test_a_body_travels_beside_its_message_and_comes_back_whole(batch: list[Message], cut: int) -> None:
    """Issue 44: a request body past ``BESIDE_BYTES`` goes in a raw frame of its own, never copied into its message's
    frame on the relay; read back at any cut, every message is whole again. Here the bound is 4 bytes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(framing, "BESIDE_BYTES", 4)
        assert crossed(batch, cut) == batch


def test_a_body_out_of_turn_stops_the_reader() -> None:
    head = b"".join(encode_frame(encode_stats(Stats(True, 1, (), (), (), (), ()))))
    raw = struct.pack("!I", 5 | 1 << 31) + b"body!"
    reader = FrameReader()
    assert reader.feed(head + raw) and reader.broken is not None  # raw bytes where a message was due
    _, raws = chat_tape(7, [b"data: {}\n\n"])
    tape = raws[-1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(framing, "BESIDE_BYTES", 4)
        message, data, _, _ = encode_frames(tape)
    reader = FrameReader()
    assert reader.feed(message + data + head) == [] and reader.broken is not None  # its body never came


def test_a_frame_cut_short_waits_for_the_rest_at_every_byte() -> None:
    reports = [Stats(True, i, (("r", i),), (), (), (), ()) for i in range(3)]
    stream = b"".join(b"".join(encode_frame(encode_stats(m))) for m in reports)
    for cut in range(len(stream) + 1):
        buffer = bytearray(stream[:cut])
        got = frames(buffer)
        buffer += stream[cut:]
        got += frames(buffer)
        assert [decode(r) for r in got] == reports
        assert not buffer


def test_garbled_frames_stop_the_reader_and_keep_what_came_before() -> None:
    good = b"".join(encode_frame(encode_stats(Stats(True, 1, (), (), (), (), ()))))
    reader = FrameReader()
    # A body marshal cannot read, after a good frame in the same read.
    out = reader.feed(good + struct.pack("!I", 3) + b"\xff\xfe\xfd" + good)
    assert [decode(r) for r in out] == [Stats(True, 1, (), (), (), (), ())]
    assert reader.broken is not None and "cannot be read" in str(reader.broken)
    assert reader.feed(good) == [] and reader.pending == 0  # nothing after it is trusted
    # A length no relay sends: said at once, never buffered up to it.
    huge = FrameReader()
    assert huge.feed(struct.pack("!I", MAX_FRAME + 1) + b"x" * 10) == []
    assert huge.broken is not None and "framing is lost" in str(huge.broken) and huge.pending == 0
    # A frame that holds a value, not a message.
    value = FrameReader()
    body = marshal.dumps(42)
    assert value.feed(struct.pack("!I", len(body)) + body) == [] and value.broken is not None


def test_a_message_marshal_cannot_encode_is_refused_at_the_relay() -> None:
    with pytest.raises(WireError, match="cannot be encoded"):
        encode_frame((STATS, object()))


# -- the telemetry side, whole --------------------------------------------------------------------------


def test_the_recorder_drops_a_message_it_cannot_read_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder(Settings(routes=(ROUTE,)))
    try:
        with caplog.at_level(logging.ERROR, logger="llmtap.telemetry"):
            rec.take(0, (STATS, True, 0, (("default", 2),), (), (), ()))  # a relay of another build
        assert "different builds" in caplog.text
        assert rec.unreadable == 1
        assert rec.relays_ready == {}  # nothing of it was read as something else
        rec.take(0, encode_stats(Stats(True, 0, (("default", 1),), (), (), (), ())))
        assert rec.relays_ready == {0: True}
        _, raws = chat_tape(1, [b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
        rec.take(0, raws[0])
        assert rec.recorded == 1 and rec.failed == 0
    finally:
        rec.close()


async def test_the_telemetry_process_resets_a_relay_that_sends_garbage(tmp_path: Path) -> None:
    rec = Recorder(Settings(routes=(ROUTE,)))
    connected: set[int] = set()
    path = str(tmp_path / "t.sock")
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: _Intake(rec, 3, connected), path)
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"".join(encode_frame(encode_stats(Stats(True, 0, (("default", 1),), (), (), (), ())))))
        writer.write(struct.pack("!I", 5) + b"\x00garb")
        await writer.drain()
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # the telemetry side closed the connection
        writer.close()
        assert rec.flush(10)
        # What came before the garbage was taken; the relay is gone until it connects again.
        assert rec.relays_ready == {3: False} and connected == set()
    finally:
        server.close()
        await server.wait_closed()
        rec.close()


def test_the_end_carries_every_read_held_whether_or_not_segments_went_before() -> None:
    """``end_message`` takes the reads still on the tape (the last ones, ``take_reads(last=True)``): after a segment,
    only those read since; a read never delivered carries NaN as its delivery."""
    tape = Tape(3, method="POST", path="/v1/x", inner_path="/v1/x", route="r", protocol=None, received=0.0,
                received_wall_ns=0)  # fmt: skip
    tape.read(1.0, b"ab")
    tape.delivered(1.5)
    first = decode(tape.segment_message())
    tape.read(2.0, b"cde")
    tape.delivered(2.5)
    tape.read(3.0, b"f")
    end = decode(tape.end_message())
    assert isinstance(first, Segment) and isinstance(end, End) and end.head is None
    times, delivered, sizes = array("d", end.reads.times), array("d", end.reads.delivered), array("l", end.reads.sizes)
    assert (list(times), list(sizes), end.reads.data) == ([2.0, 3.0], [3, 1], b"cdef")
    assert delivered[0] == 2.5 and math.isnan(delivered[1])
