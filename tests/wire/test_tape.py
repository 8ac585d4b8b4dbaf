"""The relay's tape, its channel and its playback: what crosses from the relay to the telemetry side."""

from __future__ import annotations

import asyncio
import dataclasses
import marshal
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from llmtap.analysis import tokens
from llmtap.config.types import Route, Settings, TelemetrySettings
from llmtap.relay.channel import LocalChannel, SocketChannel
from llmtap.serve.relay import tape_gather
from llmtap.telemetry.intake.replay import Playback
from llmtap.wire.framing import frames
from llmtap.wire.messages import END, SEGMENT, STATS, End, Segment, decode
from llmtap.wire.socketchannel import GATHER_BYTES
from llmtap.wire.tape import SEGMENT_BYTES, Tape
from llmtap.wire.tracecontext import Sampler, TraceIds, begin, parse_traceparent
from tests.support.tapes import chat_tape

ROUTE = Route(prefix="/", upstream="http://upstream:8000", name="default")
# Content capture on: the timeline keeps the output's text, so a test can read it back.
SETTINGS = Settings(routes=(ROUTE,), telemetry=TelemetrySettings(capture_content=True))
ROUTES = {ROUTE.name: ROUTE}
BODY = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'


def event(text: str) -> bytes:
    return b'data: {"model": "m", "choices": [{"index": 0, "delta": {"content": "' + text.encode() + b'"}}]}\n\n'


USAGE = b'data: {"model": "m", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}\n\n'


def tape_of(
    reads: list[bytes], key: int = 1, *, fail: tuple[str, str | None, bool] | None = None
) -> tuple[Tape, list[tuple[Any, ...]]]:
    """A tape of a streamed chat request received at 10 s whose upstream sent ``reads`` 20 ms apart from 10.1 s
    (and the relay's ``fail``ure, if any); the messages it would hand over."""
    return chat_tape(
        key,
        reads,
        received=10.0,
        body=BODY,
        trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
        span_id=0x00F067AA0BA902B7,
        fail=fail,
    )


def play(messages: list[tuple[Any, ...]]) -> Any:
    playback: Playback | None = None
    for message in messages:
        # What crosses between processes is marshal's form: exactly what the socket channel sends.
        m = decode(marshal.loads(marshal.dumps(message)))
        assert isinstance(m, (Segment, End))
        if playback is None:
            assert m.head is not None
            playback = Playback(m.head, SETTINGS, ROUTES)
        else:
            assert m.head is None  # the head travels once, with the first message
        playback.feed(m.reads)
        if isinstance(m, End):
            return playback.finish(m.tail)
    raise AssertionError("no end message")


def test_a_stream_played_back_gives_the_timeline_the_relay_saw() -> None:
    reads = [event("Hel"), event("lo") + event(" there"), USAGE + b"data: [DONE]\n\n"]
    _, messages = tape_of(reads)
    assert [m[0] for m in messages] == [END]
    tl = play(messages)
    assert tl.protocol == "openai_chat" and tl.request is not None and tl.request.model == "m"
    assert list(tl.chunk_times) == pytest.approx([10.1, 10.12])  # one content chunk per upstream read
    assert tl.output is not None and tl.output.text == "Hello there"
    assert list(tl.chunk_tokens) == [tokens.count("Hel"), tokens.count("lo there")]
    assert tl.first_content_delivered == pytest.approx(10.1001)
    assert tl.usage is not None and (tl.usage.input_tokens, tl.usage.output_tokens) == (9, 3)
    assert tl.response_bytes == sum(len(r) for r in reads)
    assert (tl.trace_id, tl.span_id) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    assert tl.outcome == "ok" and tl.end == pytest.approx(10.16)


def test_a_long_stream_leaves_in_segments_and_the_relay_holds_little() -> None:
    reads = [event("x" * 200) for _ in range(2000)]  # about 500 KB
    _, messages = tape_of(reads)
    kinds = [m[0] for m in messages]
    assert kinds[-1] == END and kinds.count(SEGMENT) >= len(b"".join(reads)) // (SEGMENT_BYTES + 300)
    # Each segment holds at most the bound plus one read: what one open stream keeps in the relay.
    largest = max(len(m[3][3]) for m in messages)
    assert largest < SEGMENT_BYTES + len(reads[0])
    tl = play(messages)
    assert len(tl.chunk_times) == 2000 and tl.response_bytes == len(b"".join(reads))
    # Played in segments or whole, the same timeline.
    whole = [tape_of(reads[:1])[1][0]]
    one = play(whole)
    assert one.output is not None and one.output.text == "x" * 200
    assert list(one.chunk_tokens) == [tokens.count("x" * 200)]


@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@hsettings(max_examples=60, deadline=None)
def test_playback_does_not_depend_on_how_reads_were_cut(cuts: list[int]) -> None:
    """Whatever the read boundaries, the content and usage played back are the stream's."""
    stream = event("a") + event("b") + event("c") + USAGE + b"data: [DONE]\n\n"
    points = sorted({c for c in cuts if 0 < c < len(stream)})
    reads = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    tl = play(tape_of(reads)[1])
    assert tl.output is not None and tl.output.text == "abc"
    assert tl.usage is not None and tl.usage.output_tokens == 3


def test_relay_failures_and_cancellation_reach_the_timeline() -> None:
    _, messages = tape_of([event("a")], fail=("idle_timeout", "upstream stopped sending", False))
    tl = play(messages)
    assert (tl.outcome, tl.error_type, tl.error_message) == ("error", "idle_timeout", "upstream stopped sending")
    _, messages = tape_of([event("a")], fail=("cancelled", None, True))
    assert play(messages).outcome == "cancelled"
    tape = Tape(
        1, method="GET", path="/", inner_path="/", route="default", protocol=None, received=1.0, received_wall_ns=0
    )
    tape.fail("upstream_closed", "first")
    tape.fail("idle_timeout", "second")  # the first failure wins
    assert (tape.error_type, tape.error_message) == ("upstream_closed", "first")


@given(data=st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=64)), max_size=20), cut=st.integers(1, 50))
@hsettings(max_examples=80, deadline=None)
def test_frames_come_out_whole_however_the_bytes_are_cut(data: list[tuple[int, bytes]], cut: int) -> None:
    wire = b"".join(len(m).to_bytes(4, "big") + m for m in (marshal.dumps(d) for d in data))
    buffer = bytearray()
    out: list[Any] = []
    for i in range(0, len(wire), cut):
        buffer += wire[i : i + cut]
        out.extend(frames(buffer))
    assert out == data and not buffer


class _Sink:
    def __init__(self, room: int) -> None:
        self.room = room
        self.got: list[tuple[Any, ...]] = []

    def submit(self, message: tuple[Any, ...], source: int = 0) -> bool:
        if len(self.got) >= self.room:
            return False
        self.got.append(message)
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        pass


def test_local_channel_counts_what_the_full_recorder_turns_away() -> None:
    sink = _Sink(room=2)
    channel = LocalChannel(sink)
    assert [channel.send((STATS, i)) for i in range(4)] == [True, True, False, False]
    assert channel.dropped == 2 and len(sink.got) == 2


class _Listener:
    """A Unix-socket server that keeps every byte it reads: ``arrived`` is set once more than ``past`` bytes
    are in, ``ended`` once the sender closed its end."""

    def __init__(self, path: str, past: int = 0) -> None:
        self.path = path
        self.past = past
        self.received = bytearray()
        self.arrived = asyncio.Event()
        self.ended = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 20):
            self.received.extend(data)
            if len(self.received) > self.past:
                self.arrived.set()
        self.ended.set()
        writer.close()

    async def __aenter__(self) -> _Listener:
        self._server = await asyncio.start_unix_server(self._handle, self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def wait(self, event: asyncio.Event) -> None:
        async with asyncio.timeout(10):
            await event.wait()


async def test_socket_channel_delivers_batched_and_drops_while_nobody_listens(tmp_path: Path) -> None:
    path = str(tmp_path / "t.sock")
    alone = SocketChannel(path)
    assert not alone.send((STATS, 1)) and alone.dropped == 1  # not connected: dropped, never waits
    async with _Listener(path) as listener:
        channel = SocketChannel(path)
        await channel.start()
        messages = [(END, i, None, (b"", b"", b"", b"x" * i), None, 0, 0) for i in range(100)]
        assert all(channel.send(m) for m in messages)
        await channel.aclose()
        await listener.wait(listener.ended)  # the relay closed its end: everything it sent has arrived
    assert frames(listener.received) == messages and channel.dropped == 0


async def test_socket_channel_gathers_and_sends_at_once_what_may_not_wait(tmp_path: Path) -> None:
    path = str(tmp_path / "t.sock")
    async with _Listener(path) as listener:
        # A gather far longer than the test: whatever arrives before the end was sent at once, or by aclose.
        channel = SocketChannel(path, gather=600.0)
        await channel.start()
        tapes = [(END, i, None, (b"", b"", b"", b"x" * i), None, 0, 0) for i in range(5)]
        assert all(channel.send(m) for m in tapes)
        await asyncio.sleep(0.1)
        assert not listener.received  # gathered: nothing written yet
        stats = (STATS, 7)
        assert channel.send(stats, at_once=True)
        await listener.wait(listener.arrived)
        # Whatever waited left with it, in the order sent (``frames`` takes what it reads out of the buffer).
        assert frames(listener.received) == [*tapes, stats]
        later = (END, 9, None, (b"", b"", b"", b"z"), None, 0, 0)
        assert channel.send(later)
        await channel.aclose()  # what waits for a gather is written at the close
        await listener.wait(listener.ended)
    assert frames(listener.received) == [later] and channel.dropped == 0


async def test_socket_channel_gathers_no_more_than_its_bytes(tmp_path: Path) -> None:
    """A gather is for many small tapes: past ``GATHER_BYTES`` what it holds leaves at once (a fast long stream's
    segments would otherwise wait in the relay's memory by the megabyte)."""
    path = str(tmp_path / "t.sock")
    async with _Listener(path, past=GATHER_BYTES) as listener:
        channel = SocketChannel(path, gather=600.0)
        await channel.start()
        try:
            small = (END, 1, None, (b"", b"", b"", b"s" * 100), None, 0, 0)
            assert channel.send(small)
            await asyncio.sleep(0.1)
            assert not listener.received  # one small tape: gathered
            segments = [(SEGMENT, 2, None, (b"", b"", b"", b"x" * SEGMENT_BYTES)) for _ in range(9)]
            assert all(channel.send(m) for m in segments)  # 288 KiB: past the bound
            await listener.wait(listener.arrived)
            assert frames(listener.received)[0] == small
        finally:
            await channel.aclose()


def test_a_relay_gathers_its_tapes_only_when_it_is_the_only_one() -> None:
    assert tape_gather(SETTINGS) == 0.25  # the default: 250 ms
    assert tape_gather(dataclasses.replace(SETTINGS, telemetry_gather=200)) == 0.2
    assert tape_gather(dataclasses.replace(SETTINGS, telemetry_gather=0)) == 0.0
    # Several relays: every relay's tapes at once, in the order their streams ended.
    assert tape_gather(dataclasses.replace(SETTINGS, workers=2)) == 0.0


async def test_socket_channel_drops_past_its_buffer_bound(tmp_path: Path) -> None:
    path = str(tmp_path / "t.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    channel = SocketChannel(path, limit=64 * 1024)
    await channel.start()
    peer, _ = listener.accept()  # connected, and never reads
    try:
        big = (END, 1, None, (b"", b"", b"", b"y" * 16 * 1024), None, 0, 0)
        results = []
        for _ in range(200):
            results.append(channel.send(big))
            await asyncio.sleep(0)
        assert results[0] and not results[-1] and channel.dropped > 0
    finally:
        peer.close()
        listener.close()
        await channel.aclose()


def test_traceparent_is_read_by_the_w3c_rules() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(good) == (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
    assert parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra") is not None
    for bad in (
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  # version 00 with more
        "garbage",
    ):
        assert parse_traceparent(bad) is None, bad


def test_the_relay_continues_the_clients_trace_or_starts_one() -> None:
    sampler = Sampler()
    child = begin("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", sampler)
    assert child.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736 and not child.sampled
    assert child.span_id not in (0, 0x00F067AA0BA902B7)
    assert child.traceparent == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{child.span_id:016x}-00".encode()
    root = begin("not a traceparent", sampler)
    assert root.trace_id != child.trace_id and root.sampled
    assert len({begin(None, sampler).span_id for _ in range(1000)}) == 1000
    # Small ids keep their leading zeros, and the sampled flag reads 01.
    assert TraceIds(1, 2, True).traceparent == b"00-" + b"0" * 31 + b"1-" + b"0" * 15 + b"2-01"
    assert parse_traceparent(root.traceparent.decode()) == (root.trace_id, root.span_id, 1)


def test_the_relays_sampling_matches_the_sdks() -> None:
    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

    env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    ours = Sampler.from_env(env)
    theirs = TraceIdRatioBased(0.25)
    ids = [begin(None, Sampler()).trace_id for _ in range(2000)]
    for trace_id in ids:
        decision = theirs.should_sample(None, trace_id, "x").decision
        assert ours.sampled(trace_id, None) == (decision == Decision.RECORD_AND_SAMPLE)
    assert 300 < sum(ours.sampled(t, None) for t in ids) < 700
    assert not Sampler.from_env({"OTEL_TRACES_SAMPLER": "always_off"}).sampled(ids[0], 1)
    assert Sampler.from_env({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}).sampled(ids[0], 1)
    assert Sampler.from_env({}).sampled(ids[0], None)


class _Refusing:
    """A channel that refuses the stream's messages it is offered while their number is in ``refuse`` (a retry
    without bytes counts as another offer), and keeps what it takes."""

    shards = 1
    dropped = 0

    def __init__(self, refuse: range) -> None:
        self.refuse = refuse
        self.offered = 0
        self.got: list[tuple[Any, ...]] = []

    def send(self, message: tuple[Any, ...], *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        if message[0] in (SEGMENT, END):
            self.offered += 1
            if self.offered in self.refuse:
                return False
            self.got.append(message)
        return True

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("refuse", [range(3, 20), range(1, 12)], ids=["mid-stream", "from-the-head"])
def test_segments_the_channel_cannot_take_become_a_hole_and_the_stream_keeps_its_record(refuse: range) -> None:
    """Issue 44: a segment the relay's channel could not take even without its bytes lost the rest of the stream
    (the relay counted the whole tape dropped). Now its reads are a hole, sent ahead of what follows once there
    is room (the head with it, when the head was in what was refused); the stream is recorded, partial."""
    from llmtap.relay.app import create_app

    channel = _Refusing(refuse)
    app = create_app(SETTINGS, channel=channel)
    reads = [event("x" * 20_000) for _ in range(60)] + [USAGE + b"data: [DONE]\n\n"]
    tape, _ = tape_of(reads)  # a tape with the request's head; the reads are played here, as the relay does
    tape.take_reads()
    tape.head_sent = False
    tape.response_bytes = 0

    async def stream() -> None:
        for i, read in enumerate(reads):
            t = 10.1 + 0.02 * i
            full = tape.read(t, read)
            tape.delivered(t + 0.0001)
            if full:
                app.handover.segment(tape)
        tape.end = 10.1 + 0.02 * len(reads)
        app.handover.hand_over(tape)

    asyncio.run(stream())
    assert app.tapes_dropped == 0
    tl = play(channel.got)
    assert tl.outcome == "ok" and tl.response_bytes == sum(len(r) for r in reads)
    assert tl.usage is not None and tl.usage.output_tokens == 3  # the end came, with its usage
    assert 0 < len(tl.chunk_times) < 60  # the content on either side of the hole was read
