"""The recorder's open and gone streams: each loss counted once, nothing of a lost stream kept long."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from llmtap.config.types import Route, Settings, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.intake.relays import Drops
from llmtap.telemetry.intake.replay import Playback
from llmtap.telemetry.intake.streams import Streams
from llmtap.telemetry.journal.losses import Losses
from llmtap.telemetry.recorder import Recorder
from llmtap.wire.messages import END, SEGMENT, End, Head, Segment, decode
from tests.conftest import PATIENCE
from tests.support.tapes import chat_tape

ROUTES = (Route(prefix="/", upstream="http://upstream:8000", name="default"),)
SETTINGS = Settings(routes=ROUTES)
#: One read past a tape's segment size: its stream goes as a segment, then its end.
BIG = b'data: {"choices": [{"delta": {"content": "' + b"x" * 40_000 + b'"}}]}\n\n'
SMALL = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'


class _Counter:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def add(self, n: int, attributes: dict[str, str]) -> None:
        self.seen[next(iter(attributes.values()))] += n


class _Instruments:
    def __init__(self) -> None:
        self.telemetry_dropped = _Counter()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def messages(key: int) -> list[tuple[Any, ...]]:
    """A stream's messages as the relay sends them: a segment (with the head), a segment, the end."""
    raw = chat_tape(key, [BIG, BIG, SMALL])[1]
    assert [m[0] for m in raw] == [SEGMENT, SEGMENT, END]
    return raw


def parts(key: int) -> list[Segment | End]:
    out = [decode(m) for m in messages(key)]
    assert all(isinstance(m, Segment | End) for m in out)
    return out  # type: ignore[return-value]


def streams(**kw: Any) -> tuple[Streams, Counter[str], _Clock]:
    instruments = _Instruments()
    clock = _Clock()

    def start(head: Head) -> Playback:
        return Playback(head, SETTINGS, {r.name: r for r in ROUTES})

    losses = Losses({"tapes": instruments.telemetry_dropped}, sc.TELEMETRY_REASON)  # type: ignore[dict-item]
    drops = Drops(instruments, losses)  # type: ignore[arg-type]
    return Streams(drops, start, clock=clock, **kw), instruments.telemetry_dropped.seen, clock


def test_a_whole_stream_is_played_and_leaves_nothing() -> None:
    s, dropped, _ = streams()
    first, second, end = parts(1)
    assert s.take((0, 1), first) is None and s.open == 1
    assert s.take((0, 1), second) is None
    played = s.take((0, 1), end)
    assert played is not None and played.finish(end.tail).status_code == 200  # type: ignore[union-attr]
    assert s.open == s.gone == 0 and sum(dropped.values()) == 0


def test_a_stream_whose_end_was_turned_away_is_let_go_and_forgotten() -> None:
    s, dropped, clock = streams(gone_seconds=60.0)
    first, second, _ = parts(1)
    assert s.take((0, 1), first) is None and s.open == 1
    s.dropped((0, 1), end=True)  # the reader counted it (``Drops.end``): its end never comes
    assert s.take((0, 1), second) is None  # still in the queue when the end was turned away: ignored
    assert s.open == 0 and s.gone == 1
    assert sum(dropped.values()) == 0  # counted by the reader, not again here
    clock.now += 61
    other = parts(2)
    s.take((0, 2), other[0])
    assert s.gone == 0 and s.open == 1


def test_gone_streams_are_bounded_by_count_whatever_the_overload() -> None:
    s, _, _ = streams(gone_limit=100)
    end = parts(0)[2]
    for key in range(5_000):
        s.dropped((0, key), end=key % 2 == 0)
        if key % 250 == 0:
            s.take((1, key), end)  # the worker goes on with other streams meanwhile
            assert s.gone <= 100
    s.take((1, 0), end)
    assert s.gone == 100 and s.open == 0


def test_open_streams_are_bounded_and_an_evicted_one_is_counted_once() -> None:
    s, dropped, _ = streams(limit=2)
    for key in (1, 2, 3):
        s.take((0, key), parts(key)[0])
    assert s.open == 2 and dropped["evicted"] == 1
    _, second, end = parts(1)
    assert s.take((0, 1), second) is None and s.take((0, 1), end) is None  # the evicted stream's rest: ignored
    assert s.open == 2 and s.gone == 0 and sum(dropped.values()) == 1


def test_the_open_streams_of_a_relay_gone_are_dropped_and_counted() -> None:
    s, dropped, _ = streams()
    s.take((5, 1), parts(1)[0])
    s.take((6, 1), parts(1)[0])
    s.dropped((5, 2), end=False)
    s.forget(5)
    assert s.open == 1 and s.gone == 0 and dropped["evicted"] == 1


def test_a_stream_with_a_segment_turned_away_is_counted_when_its_end_comes() -> None:
    s, dropped, _ = streams()
    first, _, end = parts(1)
    s.take((0, 1), first)
    s.dropped((0, 1), end=False)
    assert s.take((0, 1), end) is None
    assert dropped["queue_full"] == 1 and s.open == s.gone == 0


def test_an_end_whose_stream_is_unknown_is_counted() -> None:
    """An end whose start never came here (it went to a telemetry process that is gone, or the note of its loss is
    forgotten) is counted once, as ``split``."""
    s, dropped, _ = streams(gone_limit=1)
    s.dropped((0, 1), end=False)
    s.dropped((0, 2), end=False)  # the note of stream 1 is forgotten past the bound
    assert s.take((0, 1), parts(1)[2]) is None
    assert dropped["split"] == 1 and sum(dropped.values()) == 1


def test_the_recorder_under_overload_keeps_no_stream_it_cannot_record() -> None:
    """The queue full: a stream's end turned away after its first segment was queued (a later segment would become
    a hole, ``llmtap.telemetry.intake.holes``, and the end of a stream with a hole may use the queue's reserve). Its
    loss is counted once, its playback let go as soon as the worker goes on, and the requests around it are recorded. A
    stream of one message turned away is counted, and leaves no entry."""
    recorder = Recorder(Settings(routes=ROUTES, telemetry=TelemetrySettings(queue_size=1)))
    entered, gate = threading.Event(), threading.Event()

    def hold(tl: Any, s: Any) -> None:
        if not entered.is_set():
            entered.set()
            assert gate.wait(PATIENCE)

    recorder.listeners.append(hold)
    try:
        assert recorder.submit(chat_tape(100, [SMALL])[1][-1])
        assert entered.wait(PATIENCE)  # the worker is held inside the first record
        first, _, end = messages(1)
        assert recorder.submit(first)  # the queue's one place
        assert not recorder.submit(end)
        assert not recorder.submit(chat_tape(102, [SMALL])[1][-1])  # a stream of one message: nothing else waits
        gate.set()
        assert recorder.flush(PATIENCE)
        assert recorder.submit(chat_tape(101, [SMALL])[1][-1])
        assert recorder.flush(PATIENCE)
    finally:
        gate.set()
        recorder.close()
    assert recorder.recorded == 2 and recorder.dropped == 2
    assert recorder.streams.open == 0 and recorder.streams.gone == 1
