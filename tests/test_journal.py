"""The record journal (issue 44): its files, and the spool that keeps each tape until every sink has its record."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from bench.telemetry import chat_tape
from llmtap.telemetry.journal import CHUNK, AckLog, SegmentFile, read_chunks, segment_name, take_slot
from llmtap.telemetry.spool import EMITTED, SETTLED, SINK_BITS, Spool, open_spool
from llmtap.wire.framing import encode_frame
from llmtap.wire.messages import END, SEGMENT
from llmtap.worker import Progress

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
    spool.lost = lost  # type: ignore[attr-defined]
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
    assert spool.lost == {}  # type: ignore[attr-defined]


def test_what_the_sinks_did_not_take_is_replayed_to_those_sinks_only(tmp_path: Path, caplog: Any) -> None:
    sinks = [FakeSink("files"), FakeSink("clickhouse")]
    spool = spool_of(tmp_path, sinks)
    for key in (1, 2, 3):
        feed(spool, 0, request(key))
    for key in (1, 2):
        record(spool, sinks, 0, key)
    sinks[0].progress.release(2)  # the files have 1 and 2; ClickHouse has neither; 3 was never recorded
    with caplog.at_level(logging.WARNING, "llmtap.telemetry"):
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
    with caplog.at_level(logging.WARNING, "llmtap.telemetry"):
        while not spool.replay.done:
            got += spool.replay.next_slice()
    sources = {s for s, m in got if m[1] == 1}
    assert len(sources) == 1
    ends = [m for _, m in got if m[0] == END]
    assert [m[1] for m in ends] == [1]
    assert "1 records of the last run recovered, 1 could not be (1 streams whose end never reached" in caplog.text
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
    assert spool.lost == {"journal_full": unkept}  # type: ignore[attr-defined]
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
