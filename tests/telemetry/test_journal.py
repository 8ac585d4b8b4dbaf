"""The record journal: its files, and the spool that keeps each tape until every sink has its record."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmtap.config.load import build
from llmtap.config.types import Records, Route, Settings
from llmtap.serve.lines import startup_lines
from llmtap.store.files import ReadStats, read_records
from llmtap.telemetry.journal import spool as spool_module
from llmtap.telemetry.journal.files import (
    CHUNK,
    EMITTED,
    SETTLED,
    SINK_BITS,
    AckLog,
    SegmentFile,
    read_chunks,
    segment_name,
    take_slot,
)
from llmtap.telemetry.journal.losses import STATE_FILE, Losses
from llmtap.telemetry.journal.sequences import Sequences
from llmtap.telemetry.journal.spool import Spool
from llmtap.telemetry.journal.start import open_spool
from llmtap.telemetry.recorder import Recorder
from llmtap.wire.framing import encode_frame
from llmtap.wire.ledger import Ledger
from llmtap.wire.messages import END, SEGMENT
from llmtap.worker import Progress
from tests.conftest import PATIENCE
from tests.support.tapes import chat_tape

EVENT = b'data: {"model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'


class FakeSink:
    """A sink that settles only what the test says."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.progress = Progress()

    def give(self) -> int:
        seq = self.progress.given
        self.progress.hold()
        return seq


def framed(messages: list[tuple[Any, ...]]) -> bytes:
    return b"".join(b"".join(encode_frame(m)) for m in messages)


def request(key: int, reads: int = 3) -> list[tuple[Any, ...]]:
    """The messages of one streamed request (the end last)."""
    return chat_tape(key, [EVENT] * reads)[1]


def feed(spool: Spool, source: int, messages: list[tuple[Any, ...]]) -> None:
    """As the telemetry process's intake would: the frames of one read."""
    spool.append(source, framed(messages), messages)


def record(spool: Spool, sinks: list[FakeSink], source: int, key: int) -> int:
    """As the recorder would at the end of a stream: its reference, emitted, and given to every sink."""
    ref = spool.ended(source, key)
    assert ref is not None
    spool.emitted(ref)
    for i, sink in enumerate(sinks):
        spool.track(ref, i, sink.give())
    return ref


def segments(root: Path) -> list[Path]:
    return sorted(root.rglob("*.seg"))


# -- the files -----------------------------------------------------------------------------------------------


def test_chunks_read_back_and_a_torn_tail_is_skipped_and_measured(tmp_path: Path) -> None:
    path = tmp_path / segment_name(1, 1)
    seg = SegmentFile(path, 1, 1, 0)
    payloads = [os.urandom(n) for n in (0, 1, 100, 70_000)]
    for i, payload in enumerate(payloads):
        seg.append(i, 1000 + i, payload)
    seg.close()
    chunks = read_chunks(path)
    assert [(s, r, p) for s, r, p in chunks.items] == [(i, 1000 + i, p) for i, p in enumerate(payloads)]
    assert chunks.torn == 0
    whole = path.stat().st_size
    # Cut at every point inside the last chunk: the others stay, the rest is measured as torn.
    last = CHUNK.size + len(payloads[-1])
    for cut in (1, CHUNK.size - 1, CHUNK.size, last - 1):
        os.truncate(path, whole - last + cut)
        chunks = read_chunks(path)
        assert [p for _, _, p in chunks.items] == payloads[:-1]
        assert chunks.torn == cut


def test_a_chunk_with_a_flipped_byte_ends_what_is_read(tmp_path: Path) -> None:
    path = tmp_path / segment_name(1, 1)
    seg = SegmentFile(path, 1, 1, 0)
    for payload in (b"one", b"two", b"three"):
        seg.append(0, 0, payload)
    seg.close()
    data = bytearray(path.read_bytes())
    second = CHUNK.size + 3
    data[second + CHUNK.size] ^= 0xFF  # the second payload's first byte
    path.write_bytes(bytes(data))
    chunks = read_chunks(path)
    assert [p for _, _, p in chunks.items] == [b"one"]
    assert chunks.torn == len(data) - second
    # A length that points past the file, or zeros a crash left: the same.
    path.write_bytes(b"\0" * 40)
    assert read_chunks(path).items == [] and read_chunks(path).torn == 40


def test_acknowledgements_add_up_per_reference_and_compact(tmp_path: Path) -> None:
    acks = AckLog(tmp_path / "acks")
    acks.append([(5, 1), (6, 2)])
    acks.append([(5, 2), (7, SETTLED)])
    with open(tmp_path / "acks", "ab") as f:
        f.write(b"\1\2\3")  # a torn write
    bits, torn = AckLog.read(tmp_path / "acks")
    assert bits == {5: 3, 6: 2, 7: SETTLED}
    assert torn == 3
    acks.compact({ref: mask for ref, mask in bits.items() if ref >= 6})
    acks.append([(8, 4)])
    acks.close()
    assert AckLog.read(tmp_path / "acks") == ({6: 2, 7: SETTLED, 8: 4}, 0)


def test_a_slot_is_held_while_its_process_lives(tmp_path: Path) -> None:
    first = take_slot(tmp_path, 0)
    second = take_slot(tmp_path, 0)
    assert first.path.name == "slot-0" and second.path.name == "slot-1"
    first.release()
    assert take_slot(tmp_path, 0).path.name == "slot-0"


# -- the spool ---------------------------------------------------------------------------------------------


def spool_of(root: Path, sinks: list[FakeSink], **kw: Any) -> Spool:
    lost: dict[str, int] = {}
    spool = Spool(root, sinks, on_lost=lambda reason, n: lost.__setitem__(reason, lost.get(reason, 0) + n), **kw)
    spool.lost_counts = lost  # type: ignore[attr-defined]
    return spool


def test_a_request_every_sink_settled_is_done_and_its_segment_goes(tmp_path: Path) -> None:
    sinks = [FakeSink("files"), FakeSink("clickhouse")]
    spool = spool_of(tmp_path, sinks, segment_bytes=4096)
    feed(spool, 0, request(1))
    record(spool, sinks, 0, 1)
    spool.poll()
    assert spool.outstanding == 1
    sinks[0].progress.release(1)
    spool.poll()
    assert spool.outstanding == 1  # ClickHouse has not taken it
    sinks[1].progress.release(1)
    spool.poll()
    assert spool.outstanding == 0
    # Filling past a segment closes it; the closed one, all done, is deleted.
    for key in range(2, 40):
        feed(spool, 0, request(key))
        record(spool, sinks, 0, key)
        for sink in sinks:
            sink.progress.release(1)
    spool.poll()
    left = segments(tmp_path)
    assert len(left) == 1, left  # the one being written
    spool.close()
    assert spool.lost_counts == {}  # type: ignore[attr-defined]
    assert segments(tmp_path) == []  # all done at shutdown: nothing for the next start
    assert (tmp_path / "slot-0" / "acks").stat().st_size == 0


def test_what_the_sinks_did_not_take_is_replayed_to_those_sinks_only(tmp_path: Path, caplog: Any) -> None:
    sinks = [FakeSink("files"), FakeSink("clickhouse")]
    spool = spool_of(tmp_path, sinks)
    for key in (1, 2, 3):
        feed(spool, 0, request(key))
    for key in (1, 2):
        record(spool, sinks, 0, key)
    sinks[0].progress.release(2)  # the files have 1 and 2; ClickHouse has neither; 3 was never recorded
    caplog.set_level(logging.INFO, "llmtap.telemetry")
    spool.close()
    assert "3 records kept in the journal for the next start" in caplog.text

    again = [FakeSink("files"), FakeSink("clickhouse")]
    spool = spool_of(tmp_path, again)
    assert spool.replay is not None
    messages = []
    while not spool.replay.done:
        messages += spool.replay.next_slice()
    assert [m[1][0] for m in messages] == [END, END, END]
    assert "3 records of the last run recovered, 0 could not be" in caplog.text
    masks = []
    for source, message in messages:
        assert source < 0  # not a live relay's source
        ref = spool.ended(source, message[1])
        assert spool.replayed(ref)
        masks.append(spool.mask_of(ref))
        spool.emitted(ref)
        for i, sink in enumerate(again):
            if not masks[-1] & SINK_BITS[sink.kind]:
                spool.track(ref, i, sink.give())
    assert masks == [EMITTED | SINK_BITS["files"]] * 2 + [0]
    assert again[0].progress.given == 1  # only the third went to the files again
    assert again[1].progress.given == 3
    for sink in again:
        sink.progress.release(sink.progress.given)
    spool.poll()
    assert spool.outstanding == 0
    assert segments(tmp_path) == []  # the last run's segment, all done, is gone
    spool.close()


def test_a_torn_tail_is_skipped_and_said(tmp_path: Path, caplog: Any) -> None:
    sinks = [FakeSink("files")]
    spool = spool_of(tmp_path, sinks)
    feed(spool, 0, request(1))
    feed(spool, 0, request(2))
    spool.close()
    (seg,) = segments(tmp_path)
    os.truncate(seg, seg.stat().st_size - 7)  # the kill cut the second write short
    spool = spool_of(tmp_path, [FakeSink("files")])
    assert spool.replay is not None
    with caplog.at_level(logging.WARNING, "llmtap.telemetry"):
        got = spool.replay.next_slice() + spool.replay.next_slice()
    assert [m[1] for _, m in got] == [1]
    assert "could not be read (cut short by a kill or a crash)" in caplog.text
    assert "1 records of the last run recovered" in caplog.text
    spool.close()


def test_a_stream_across_segments_and_one_without_its_end(tmp_path: Path, caplog: Any) -> None:
    sinks = [FakeSink("files")]
    spool = spool_of(tmp_path, sinks, segment_bytes=64 * 1024)
    long = chat_tape(1, [EVENT * 200] * 40)[1]  # segments of 32 KiB, then the end
    assert [m[0] for m in long].count(SEGMENT) >= 2
    for message in long:
        feed(spool, 0, [message])
    feed(spool, 1, request(5)[:-1] or [(SEGMENT, 5, None, (b"", b"", b"", b""))])
    cut = chat_tape(6, [EVENT * 200] * 40)[1][:-1]  # its end never came
    for message in cut:
        feed(spool, 2, [message])
    spool.close()
    assert len(segments(tmp_path)) > 1
    spool = spool_of(tmp_path, [FakeSink("files")])
    assert spool.replay is not None
    got = []
    caplog.set_level(logging.INFO, "llmtap.telemetry")
    while not spool.replay.done:
        got += spool.replay.next_slice()
    sources = {s for s, m in got if m[1] == 1}
    assert len(sources) == 1
    ends = [m for _, m in got if m[0] == END]
    assert [m[1] for m in ends] == [1]
    assert "1 records of the last run recovered, 0 could not be" in caplog.text
    assert "1 streams whose end came after the restart" in caplog.text
    spool.close()


def test_the_bound_lets_the_oldest_go_and_counts_what_is_then_lost(tmp_path: Path, caplog: Any) -> None:
    sinks = [FakeSink("clickhouse")]
    spool = spool_of(tmp_path, sinks, segment_bytes=16 * 1024, max_bytes=32 * 1024)
    assert spool.max_bytes == 32 * 1024
    with caplog.at_level(logging.WARNING, "llmtap.telemetry"):
        for key in range(1, 60):
            feed(spool, 0, request(key))
            record(spool, sinks, 0, key)
            spool.poll()
            assert spool.size <= spool.max_bytes + 16 * 1024
    assert "reached its bound" in caplog.text
    # ClickHouse came back for the newest only: the rest are lost at shutdown, counted.
    unkept = spool.unkept
    assert 0 < unkept < 59
    spool.close()
    assert spool.lost_counts == {"journal_full": unkept}  # type: ignore[attr-defined]
    assert "records kept in the journal for the next start" in caplog.text


def test_an_end_the_recorder_turned_away_and_a_relay_gone_settle(tmp_path: Path) -> None:
    sinks = [FakeSink("files")]
    spool = spool_of(tmp_path, sinks)
    messages = request(1)
    feed(spool, 0, messages)
    spool.dropped(0, messages[-1])
    long = chat_tape(2, [EVENT * 200] * 40)[1]
    feed(spool, 3, long[:1])  # a segment, then the relay went away
    spool.source_gone(3)
    assert spool.outstanding == 0
    spool.close()


def test_a_folder_that_cannot_be_used_is_said_and_records_go_on_unjournaled(tmp_path: Path, caplog: Any) -> None:
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.ERROR, "llmtap.telemetry"):
        assert open_spool(str(tmp_path / "file" / "journal"), [FakeSink("files")], index=0, max_bytes=1 << 30) is None
    assert "cannot be used" in caplog.text
    assert open_spool(None, [FakeSink("files")], index=0, max_bytes=1 << 30) is None
    assert open_spool(str(tmp_path / "j"), [], index=0, max_bytes=1 << 30) is None


# -- what never reached the journal ------------------------------------------------------------------------


def sequences(tmp_path: Path, index: int = 0, run: int = 1) -> tuple[Sequences, dict[str, int]]:
    lost: dict[str, int] = {}
    slot = tmp_path / "journal" / f"slot-{index}"
    slot.mkdir(parents=True, exist_ok=True)
    seqs = Sequences(slot / "sequences.json", index, run, lambda r, n: lost.__setitem__(r, lost.get(r, 0) + n))
    return seqs, lost


def test_a_gap_in_a_relays_numbers_is_counted_in_transit(tmp_path: Path) -> None:
    seqs, lost = sequences(tmp_path)
    for seq in (1, 2, 5, 6, 6, 4):  # 3 and 4 lost on the way (a late 4 is no gap)
        seqs.seen(7, seq)
    assert lost == {"in_transit": 2}
    assert seqs.resolve() == (0, 0)
    seqs.save()
    # The next run: relay 7 goes on from 9 (7 and 8 lost with the process), relay 8 is new.
    again, lost = sequences(tmp_path, run=2)
    again.seen(7, 9)
    again.seen(8, 1)
    assert lost == {}  # not before the last run's numbers are all known
    assert again.resolve() == (2, 0)
    again.seen(9, 3)  # a relay no run here heard of: nothing to count it against
    assert lost == {"in_transit": 2}


class Killed(BaseException):
    """The telemetry process SIGKILLed: nothing after this runs."""


class NoCounter:
    def add(self, n: int, attributes: Any = None) -> None:
        pass


def _start(slot: Path, run: int) -> tuple[Sequences, Losses]:
    """A telemetry process starting on ``slot``, as the recorder does: the counters go on from the last run's, and
    what the last run counted in ``sequences.json`` and was killed before the counters had is added to them."""
    losses = Losses({"tapes": NoCounter()}, "reason")  # type: ignore[dict-item]
    seqs = Sequences(slot / "sequences.json", 0, run, lambda r, n: losses.add("tapes", r, n, sync=True, mark=r))
    losses.keep(slot / STATE_FILE)
    for reason, n in seqs.unmarked(losses.marks).items():
        losses.add("tapes", reason, n, sync=True, mark=reason)
    return seqs, losses


@pytest.mark.parametrize("kill_after", [0, 1, 2, 3, None])
def test_a_gap_is_counted_once_whichever_write_a_kill_comes_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_after: int | None
) -> None:
    # The sequences state and the loss counters are two files: a kill after one is written and before the other must
    # neither have the next start count the gap again nor have it forget the count.
    slot = tmp_path / "journal" / "slot-0"
    slot.mkdir(parents=True)
    seqs, losses = _start(slot, 1)
    for seq in (1, 2, 3):
        seqs.seen(7, seq)
    seqs.resolve()
    seqs.save()
    # Run 2: relay 7 goes on from 10 (4 to 9 lost with run 1), and run 2 is killed while it counts them.
    seqs, losses = _start(slot, 2)
    seqs.seen(7, 10)
    replaced = [0]
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if replaced[0] == kill_after:
            raise Killed
        replaced[0] += 1
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with contextlib.suppress(Killed):
        seqs.resolve()
    monkeypatch.setattr(os, "replace", real_replace)
    # Run 3: the replay reads run 2's end from its segment; relay 7 goes on from 11.
    seqs, losses = _start(slot, 3)
    seqs.seen_old(2, 7, 10)
    seqs.seen(7, 11)
    seqs.resolve()
    assert losses.totals.get(("tapes", "in_transit"), 0) == 6
    # And a fourth start counts nothing more.
    seqs, losses = _start(slot, 4)
    seqs.seen(7, 12)
    seqs.resolve()
    assert losses.totals.get(("tapes", "in_transit"), 0) == 6


def test_runs_killed_before_they_counted_are_counted_once_by_the_next(tmp_path: Path) -> None:
    """A crash loop: run 2 and run 3 each die before their replay ended; run 4 counts every gap, once."""
    first, lost = sequences(tmp_path, run=1)
    for seq in (1, 2, 3):
        first.seen(5, seq)
    assert first.resolve() == (0, 0)
    first.save()  # then killed with 4 and 5 on their way
    second, lost = sequences(tmp_path, run=2)
    for seq in (6, 7):
        second.seen(5, seq)
    second.save()  # a segment of its own deleted before its replay ended; then killed with 8 on its way
    third, lost = sequences(tmp_path, run=3)
    third.seen(5, 9)
    third.seen(5, 12)  # 10 and 11 lost within the run (a connection made again)
    assert lost == {"in_transit": 2}
    # Its segments stay (killed before anything was done); the next replay reads them.
    fourth, lost = sequences(tmp_path, run=4)
    fourth.seen_old(3, 5, 9)
    fourth.seen_old(3, 5, 12)
    fourth.seen(5, 14)
    assert fourth.resolve() == (2 + 1 + 1, 0)  # 4, 5; then 8; then 13
    fourth.save()
    fifth, lost = sequences(tmp_path, run=5)
    fifth.seen(5, 15)
    assert fifth.resolve() == (0, 0)


def test_ends_a_run_journaled_after_it_last_saved_its_numbers_are_no_gap(tmp_path: Path) -> None:
    """Run 1 saves its numbers (a segment went) at 3, journals 4 to 20 and is killed with 21 on its way: the next run
    replays 4 to 20 and counts 21 alone, and what it counted is kept at once (a kill next does not count it again)."""
    first, lost = sequences(tmp_path, run=1)
    for seq in (1, 2, 3):
        first.seen(5, seq)
    first.resolve()
    first.save()
    for seq in range(4, 21):
        first.seen(5, seq)
    second, lost = sequences(tmp_path, run=2)
    second.seen_old(1, 5, 4)
    second.seen_old(1, 5, 20)
    second.seen(5, 22)
    assert second.resolve() == (1, 0)
    assert lost == {"in_transit": 1}
    third, _ = sequences(tmp_path, run=3)  # run 2 killed right after it counted
    third.seen(5, 23)
    assert third.resolve() == (0, 0)


def test_a_dead_relays_ledger_says_what_never_reached_the_journal(tmp_path: Path) -> None:
    folder = tmp_path / "journal"
    dead_relay = Ledger(folder, 11, shards=2)
    dead_relay.handed(0, 20)
    dead_relay.handed(1, 4)
    dead_relay.in_flight(3)
    dead_relay.close()  # its lock goes with it, as with a kill
    live = Ledger(folder, 12, shards=1)
    live.handed(0, 50)
    seqs, lost = sequences(tmp_path, run=2)
    seqs.seen_old(1, 11, 1)
    seqs.seen_old(1, 11, 17)
    assert seqs.resolve() == (3, 3)
    assert lost == {"in_transit": 3, "in_flight": 3}
    # The other telemetry process counts its own shard, then the file goes; the live relay's stays.
    other, lost = sequences(tmp_path, index=1, run=2)
    other.seen_old(1, 11, 1)
    assert other.resolve() == (3, 0)
    assert sorted(p.name for p in (folder / "relays").iterdir()) == [f"relay-{12:016x}.ledger"]
    live.close()
    # A dead relay no journal here heard of (another replica's, on a shared folder) is not counted here.
    stranger = Ledger(folder, 13, shards=1)
    stranger.handed(0, 9)
    stranger.close()
    seqs, lost = sequences(tmp_path, run=3)
    assert seqs.resolve() == (0, 0) and lost == {}
    assert (folder / "relays" / f"relay-{13:016x}.ledger").exists()


# -- the recorder with its journal ----------------------------------------------------------------------


def recorder_on(folder: Path, exporter: InMemorySpanExporter) -> Recorder:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    route = Route(prefix="/", upstream="http://upstream:8000", name="default")
    records = Records(path=str(folder / "records"), journal=str(folder / "records" / ".journal"))
    return Recorder(Settings(routes=(route,), record=records), tracer_provider=provider, journal=0)


def intake(rec: Recorder, source: int, messages: list[tuple[Any, ...]], *, queue: bool = True) -> None:
    """What the telemetry process's intake does with one read: journal it, then queue it for the worker."""
    assert rec.spool is not None
    rec.spool.append(source, framed(messages), messages)
    if queue:
        for message in messages:
            rec.submit(message, source)


def test_a_killed_recorders_requests_are_recorded_by_the_next_and_its_spans_made_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_spans = InMemorySpanExporter()
    first = recorder_on(tmp_path, first_spans)
    (files,) = first.sinks
    # The file sink never gets its lines out (a kill before its next flush); its spans and metrics are made.
    monkeypatch.setattr(files, "flush", lambda: None)
    monkeypatch.setattr(files, "close", lambda timeout=5.0: None)
    intake(first, 0, request(1) + request(2))
    intake(first, 0, request(3), queue=False)  # read off the socket, still in the queue at the kill
    assert first.flush(PATIENCE)
    assert first.spool is not None
    first.spool.poll()  # what the worker does every POLL_EVERY: the emitted ones acknowledged as such
    assert len({s.context.trace_id for s in first_spans.get_finished_spans()}) == 2
    first.spool.slot.release()  # the kill: the slot's lock goes with the process
    monkeypatch.undo()

    again_spans = InMemorySpanExporter()
    again = recorder_on(tmp_path, again_spans)
    try:
        assert again.spool is not None and again.spool.replay is not None
        wait = time.monotonic() + PATIENCE
        while not again.spool.replay.done:
            assert time.monotonic() < wait
            time.sleep(0.02)
        assert again.flush(PATIENCE)
    finally:
        again.close()
    # The request the first run had not emitted gets its spans now; the two it had get none again.
    assert len({s.context.trace_id for s in again_spans.get_finished_spans()}) == 1
    got = list(read_records(tmp_path / "records", ReadStats()))
    assert sorted(r["span_id"] for r in got) == sorted(f"{k + 1:016x}" for k in (1, 2, 3))
    assert again.spool.recovered == 3
    assert segments(tmp_path / "records" / ".journal") == []  # every request done: the segments are gone


def test_the_start_says_where_the_journal_is_or_that_there_is_none(tmp_path: Path) -> None:
    base = {"upstream": "http://u"}
    line = startup_lines(build({**base, "record": str(tmp_path)}, env={}), 8080, 9464)[4]
    assert f"; journal {tmp_path}/.journal/ (256 MiB per telemetry process);" in line
    clickhouse = build({**base, "record_clickhouse": "http://ch:8123"}, env={})
    assert (
        "; not journaled: a restart loses what waits for a sink (--record-journal DIR)"
        in (startup_lines(clickhouse, 8080, 9464)[4])
    )
    assert "journal" not in startup_lines(build(base, env={}), 8080, 9464)[4]


def test_a_tape_of_the_last_run_that_cannot_be_read_is_counted_and_let_go(tmp_path: Path, caplog: Any) -> None:
    sinks = [FakeSink("files")]
    spool = spool_of(tmp_path / "records" / ".journal", sinks)
    good = request(1)
    older = [(*m[:5],) if m[0] == END else m for m in request(2)]  # an end of a build before the numbers
    feed(spool, 0, good + older)
    spool.close()
    caplog.set_level(logging.INFO, "llmtap.telemetry")
    again = recorder_on(tmp_path, InMemorySpanExporter())
    try:
        assert again.spool is not None and again.spool.replay is not None
        wait = time.monotonic() + PATIENCE
        while not again.spool.replay.done:
            assert time.monotonic() < wait
            time.sleep(0.02)
        assert again.flush(PATIENCE)
    finally:
        again.close()
    assert [r["span_id"] for r in read_records(tmp_path / "records", ReadStats())] == [f"{2:016x}"]
    assert "1 records of the last run recovered, 1 could not be" in caplog.text
    assert "1 that could not be read" in caplog.text
    assert segments(tmp_path / "records" / ".journal") == []


def test_on_a_full_disk_the_journal_gives_way_to_the_records_and_comes_back(
    tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal write that fails for lack of room: no more tapes journaled, the segment being written goes once its
    requests are done, the requests begun meanwhile still reach the sinks; room again: journaled again, and said."""
    sinks = [FakeSink("files")]
    clock = [0.0]
    spool = spool_of(tmp_path, sinks, segment_bytes=4096, clock=lambda: clock[0])
    feed(spool, 0, request(1))
    full = [True]
    real_append = SegmentFile.append

    def append(self: SegmentFile, source: int, ref: int, payload: bytes) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(self, source, ref, payload)

    free = [0]

    class Fs:
        f_frsize = 1

        @property
        def f_bavail(self) -> int:
            return free[0]

    monkeypatch.setattr(SegmentFile, "append", append)
    monkeypatch.setattr(os, "statvfs", lambda path: Fs())
    with caplog.at_level(logging.WARNING, "llmtap.telemetry"):
        for key in range(2, 6):
            feed(spool, 0, request(key))
        assert caplog.text.count("gives way to the records") == 1
        for key in range(1, 6):
            record(spool, sinks, 0, key)
        sinks[0].progress.release(5)
        spool.poll()
        assert spool.outstanding == 0
        assert segments(tmp_path) == [], "the segment written when the disk filled stays"
        assert spool.unjournaled == 4
        # Room again, but looked for only every ROOM_EVERY seconds.
        full[0] = False
        free[0] = 1 << 30
        feed(spool, 0, request(6))
        assert segments(tmp_path) == []
        clock[0] += spool_module.ROOM_EVERY
        feed(spool, 0, request(7))
        assert len(segments(tmp_path)) == 1
        assert "written again (5 requests went unjournaled" in caplog.text  # 2 to 6
    spool.close()


def test_an_end_whose_start_this_journal_never_had_is_no_gap(tmp_path: Path) -> None:
    """A stream whose start went to a telemetry process since killed: its end, numbered by the relay, reached this
    journal all the same, so the next end after it is no gap (it was counted in_transit, and recorded too)."""
    sinks = [FakeSink("files")]
    spool = spool_of(tmp_path, sinks)
    for key, seq in ((1, 1), (2, 2), (3, 3)):
        end = list(request(key)[-1])
        end[5], end[6] = 7, seq
        if key == 2:
            end[2] = None  # its head went to the process before
        feed(spool, 0, [tuple(end)])
    assert spool.sequences.resolve() == (0, 0)
    assert spool.sequences.in_transit == 0
    spool.close()


def test_a_run_number_is_never_used_again_in_a_slot(tmp_path: Path) -> None:
    """Every segment of runs 1 and 2 done and deleted: the next start is run 3, not 1 again (its numbers would be
    reconciled against run 2's as if older, and the ends between counted in_transit)."""
    sinks = [FakeSink("files")]
    for run in (1, 2):
        spool = spool_of(tmp_path, sinks)
        assert spool.run == run
        feed(spool, 0, request(run))
        record(spool, sinks, 0, run)
        sinks[0].progress.release(1)
        spool.close()
        assert segments(tmp_path) == []
    assert spool_of(tmp_path, sinks).run == 3
