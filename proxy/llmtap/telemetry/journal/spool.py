"""The record journal: every tape a telemetry process takes is kept on disk until every record sink has its record.

Issue 44. Records are at least once from the moment a telemetry process reads a tape off a relay's channel to the
moment every configured sink (files, ClickHouse, OTLP logs) has the record; what cannot be kept is counted and said.

Where it sits, and why. On the telemetry side, not the relay's: the relay's per-chunk work stays a timestamp, an
append and a send, and a relay never waits on a disk. The telemetry process appends what it reads off each relay's
socket to the journal before anything else is done with it (``append``, on its event loop: one ``write()`` of the
complete frames one read gave, as they came, so nothing is encoded again), then queues it for the recorder as
before. What a kill of the telemetry process can take is then only what was still in the socket or in the relay's
gather (``llmtap.wire.socketchannel``): a few tens of milliseconds, counted by the relays' sequence numbers.

What is kept until when. A request is journaled from its first message (the one with its head: it is given a
reference, ``ref``, the next of the slot) and done once (``Req``): the recorder made it final and every sink
settled its record (``llmtap.worker.Progress``: the file sink wrote it to the kernel, ClickHouse took it, the OTLP
log export returned; or the sink dropped it and counted it), or the recorder dropped the tape (counted). What is
done is written to the slot's acknowledgement log (``llmtap.telemetry.journal.files``), with the bits of each sink that
has it. A segment whose requests are all done is deleted. The journal is bounded (``max_bytes``): past it, the
oldest segment goes, and the requests in it are no longer kept for a restart (said once; if one is still not in
every sink when the process stops, it is counted lost as ``journal_full``).

A full disk. The journal shares its disk with the record files, and a tape is larger than its record: a journal that
went on writing would fill the disk first and the records would be lost for the journal's sake. So when a write
fails for lack of room (``NO_SPACE``) the journal gives way (``_give_way``, said once): it journals nothing more, the
segment being written is closed so that it is deleted, as every segment is, once its requests' records are with the
sinks, and the requests begun meanwhile go to the sinks as before but are not kept for a restart (``unjournaled``;
one of them still not in every sink when the process stops is counted lost as ``journal_full``). Every
``ROOM_EVERY`` seconds it looks for room again, and journals again once two segments' worth are free (said, with the
count of requests that went unjournaled).

At start, the segments the last run left are replayed on the recorder's worker, a slice at a time between the
relays' messages (``replay``): every request not done is played back into a record again, to the sinks that lack
it only; its spans, metrics and listeners (the live view, the access log) again only when the last run had not
emitted them (``EMITTED``): at least once, the same trace and span ids, which the readers count once. A chunk a
kill cut short is skipped and said. When the replay ends, the log says "N records of the last run recovered".

At shutdown (SIGTERM), the sinks have the flush timeout to take what waits; what they have not taken stays in the
journal for the next start, and the log says how many ("N records kept in the journal for the next start"). The
chart's grace (preStop 5 s, then the relays' drain of up to 30 s, then this flush) bounds it; a SIGKILL at the end
of the grace loses nothing the journal holds.

What never reaches the journal is counted (``llmtap.telemetry.journal.sequences``): the relays number the stream ends
they hand over, and a gap is an end lost on its way (``in_transit``); after a kill of the whole tree the relays' ledgers
(``llmtap.wire.ledger``) say what each had handed over and was still relaying (``in_flight``).

Durability, and its price. No ``fsync`` per write: a process kill (SIGKILL, the OOM killer) loses nothing written, since
the kernel holds it; a crash of the node loses what was written since the last sync (every ``SYNC_EVERY`` seconds and at
each segment's close), and the chunks' CRC finds what it cut short. Measured (``python -m bench.probes.journal``,
50-chunk streams, 8 a read; 2026-12-07 on this 2-core machine under a load of 10+): 0.13 µs a chunk on the event loop
(the write of what was read) and 0.12 µs on the worker (references, acknowledgements), about 12 µs a request together,
against the 20 to 50 µs a chunk the telemetry process spends; the relay's part is a sequence number in each end and
three stores into its ledger per request, 0.2 to 0.3 µs a request.

Counters. The loss counters go on across a telemetry restart: their totals, and each relay's last reported total
of ``channel_full`` drops (by relay id), are kept in the slot's ``counters.json`` (``llmtap.telemetry.journal.losses``),
so a relay that sends its totals again at once when its channel is made again adds only their rise.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry.metrics import Meter, Observation

from llmtap.telemetry import semconv as sc
from llmtap.telemetry.journal.files import (
    EMITTED,
    SETTLED,
    SINK_BITS,
    AckLog,
    Req,
    Seg,
    SegmentFile,
    Slot,
    segment_name,
    take_slot,
)
from llmtap.telemetry.journal.replay import Replay
from llmtap.telemetry.journal.sequences import SEQUENCES_FILE, Sequences, last_run
from llmtap.wire.messages import END, SEGMENT, Raw

if TYPE_CHECKING:
    from llmtap.telemetry.journal.start import SinkLike

__all__ = [
    "EMITTED",
    "JOURNAL_DROP_REASONS",
    "ROOM_EVERY",
    "SEGMENT_BYTES",
    "SINK_BITS",
    "Spool",
]

log = logging.getLogger("llmtap.telemetry")

#: A segment is closed (synced, and a new one begun) past this many bytes.
SEGMENT_BYTES = 4 * 1024 * 1024
#: Seconds between syncs of what was written (what a crash of the node can lose).
SYNC_EVERY = 2.0
#: Seconds between two looks at the sinks' progress while records wait for them.
POLL_EVERY = 0.25
#: Why the journal lost a record (``llmtap_telemetry_records_dropped_total``): ``journal_full``, a record that its
#: bound made it let go of and that a sink had still not taken when the process stopped; ``journal_unreadable``, a
#: request of the last run whose tape the recorder could not read back (another build's, or a failure: logged).
JOURNAL_DROP_REASONS = ("journal_full", "journal_unreadable")
_REF_RUN = 1 << 40
#: What a write that failed for lack of room says: the journal then gives way to the records (``Spool._give_way``).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: Seconds between two looks for room again on a full disk.
ROOM_EVERY = 5.0


class Spool:
    """One telemetry process's journal: its slot under ``root``, the requests it keeps, the replay of the last run.

    ``append``, ``dropped`` and ``source_gone`` run on the event loop's thread; everything else on the recorder's
    worker (or, at shutdown, the thread that closes it). One lock keeps the two apart.
    """

    def __init__(
        self,
        root: str | Path,
        sinks: Sequence[SinkLike],
        *,
        index: int = 0,
        max_bytes: int = 256 * 1024 * 1024,
        segment_bytes: int = SEGMENT_BYTES,
        on_lost: Callable[[str, int], None] | None = None,
        on_recovered: Callable[[int], None] | None = None,
        on_tapes_lost: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """The journal's state, declared once with what each part holds: its settings, its slot and the last
        run's segments found for the replay (``_open_slot``), the live state (``_live_state``), the counts."""
        self.root = Path(root)
        self.sinks = list(sinks)
        self.max_bytes = max(max_bytes, 2 * segment_bytes)
        self.segment_bytes = segment_bytes
        self._on_lost = on_lost
        self._on_recovered = on_recovered
        self._clock = clock
        self._bits = [SINK_BITS.get(s.kind, 0) for s in self.sinks]
        #: What a request needs to be done: every sink's bit, and its spans and metrics made.
        self.need = EMITTED | sum(set(self._bits))
        self._lock = threading.Lock()
        self._open_slot(index)
        self._live_state(clock)
        #: The relays' numbers of the stream ends the journal saw, and what never reached it (counted as tapes lost).
        self.sequences = Sequences(self.slot.path / SEQUENCES_FILE, index, self.run, on_tapes_lost)
        self.replay = Replay(self)
        #: Counts since start: requests journaled, done, let go by the bound; and of the last run: recovered.
        self.journaled = 0
        self.done = 0
        self.recovered = 0
        self.unkept = 0
        #: Requests begun while the journal could not be written (its disk full): never kept for a restart.
        self.unjournaled = 0

    def _open_slot(self, index: int) -> None:
        """Take the slot, find the last run's segments and number this run after every run the slot remembers."""
        self.slot: Slot = take_slot(self.root, index)
        self._old = self.slot.segments()
        # One past every run this slot remembers, not only those whose segments are left: a run number used again
        # would have the relays' numbers it saw reconciled against another run's
        # (``llmtap.telemetry.journal.sequences``).
        latest = max((run for run, _, _ in self._old), default=0)
        self.run = max(latest, last_run(self.slot.path / SEQUENCES_FILE)) + 1
        self._next_ref = self.run * _REF_RUN
        self._segs: dict[tuple[int, int], Seg] = {}
        for run, number, path in self._old:
            with contextlib.suppress(OSError):
                self._segs[(run, number)] = Seg((run, number), path, path.stat().st_size, run * _REF_RUN, None)

    def _live_state(self, clock: Callable[[], float]) -> None:
        """The segments, requests and acknowledgements in flight, and the disk's state, as a run starts."""
        self._number = 0
        self._current: Seg | None = None
        self._to_close: list[Seg] = []
        self._reqs: dict[int, Req] = {}
        self._by_key: dict[tuple[int, int], Req] = {}
        self._waiting: list[deque[tuple[int, Req]]] = [deque() for _ in self.sinks]
        self._dirty: set[Req] = set()
        # Acknowledgements made on the event loop's thread (a dropped end), written with the worker's next ones.
        self._pending_acks: list[tuple[int, int]] = []
        self._acks = AckLog(self.slot.acks)
        self._synced = self._polled = clock()
        self._unsynced = False
        #: Requests the bound let go of (no longer kept for a restart), not done yet.
        self._unkept: set[Req] = set()
        self._failing: str | None = None
        # Since when the journal gives way to the records on a full disk (None: it does not), and when it last
        # looked for room again.
        self._full_since: float | None = None
        self._room_at = 0.0
        self._closed = False

    # -- the event loop's side ------------------------------------------------------------------------------

    def append(self, source: int, raw: bytes, messages: Sequence[Raw]) -> None:
        """What one read of relay ``source``'s channel gave: ``raw``, the complete frames of ``messages``."""
        if not raw or self._closed:
            return
        with self._lock:
            seg = self._segment()
            first = self._next_ref
            written = seg is not None and self._write(seg, source, first, raw)
            self._register(source, messages, seg if written else None)

    def _segment(self) -> Seg | None:
        if self._full_since is not None and not self._room_again():
            return None
        seg = self._current
        if seg is not None and seg.size < self.segment_bytes:
            return seg
        if seg is not None:
            seg.closed = True
            self._to_close.append(seg)
            self._current = None
        self._number += 1
        path = self.slot.path / segment_name(self.run, self._number)
        try:
            file = SegmentFile(path, self.run, self._number, self._next_ref)
        except OSError as exc:
            self._failed(exc)
            self._give_way(exc)
            return None
        ident = (self.run, self._number)
        seg = self._current = self._segs[ident] = Seg(ident, path, file.size, self._next_ref, file)
        return seg

    def _write(self, seg: Seg, source: int, first: int, raw: bytes) -> bool:
        assert seg.file is not None
        try:
            seg.file.append(source, first, raw)
        except OSError as exc:
            self._failed(exc)
            self._give_way(exc)
            return False
        seg.size = seg.file.size
        self._unsynced = True
        if self._failing is not None:
            log.warning(
                "record journal %s is written again (%d requests went unjournaled while it could not be: not kept "
                "for a restart)",
                self.slot.path,
                self.unjournaled,
            )
            self._failing = None
        return True

    def _give_way(self, exc: OSError) -> None:
        """The journal's disk is full: it gives way to the records (the lock is held). No tape is journaled until
        ``segment_bytes`` are free again (looked at every ``ROOM_EVERY`` seconds); the segment being written is
        closed, so that it goes, as every segment does, once its requests' records are with the sinks; the requests
        begun meanwhile are not kept for a restart (``unjournaled``), and go to the sinks as before."""
        if exc.errno not in NO_SPACE or self._full_since is not None:
            return
        self._full_since = self._room_at = self._clock()
        seg, self._current = self._current, None
        if seg is not None:
            seg.closed = True
            self._to_close.append(seg)
        log.warning(
            "record journal %s: its disk is full; it gives way to the records until %d MiB are free there again: "
            "no tape is journaled (not kept for a restart) and its segments go as their records reach the sinks",
            self.slot.path,
            self.segment_bytes >> 20,
        )

    def _room_again(self) -> bool:
        """Whether the full disk has room for a segment again (looked at every ``ROOM_EVERY`` seconds)."""
        now = self._clock()
        if now - self._room_at < ROOM_EVERY:
            return False
        self._room_at = now
        try:
            fs = os.statvfs(self.slot.path)
        except OSError:
            return False
        if fs.f_bavail * fs.f_frsize < 2 * self.segment_bytes:
            return False
        self._full_since = None
        return True

    def _failed(self, exc: OSError) -> None:
        if self._failing is None:
            log.warning(
                "record journal %s cannot be written (%s); records go to the sinks as before, but are not kept for "
                "a restart until it can",
                self.slot.path,
                exc.strerror or exc,
            )
        self._failing = exc.strerror or str(exc)

    def _register(self, source: int, messages: Sequence[Raw], seg: Seg | None) -> None:
        """Each tape message's request: a new one for a head (the next reference, as ``_Replay`` counts them)."""
        key_of = self._by_key
        for message in messages:
            kind = message[0]
            if kind != SEGMENT and kind != END:
                continue
            key = (source, message[1])
            if kind == END and len(message) > 6 and message[5]:
                # Every end the relay numbered reached the journal, whether its request is known here or not (a
                # stream whose start went to a telemetry process since killed): no gap, so not counted in_transit.
                self.sequences.seen(message[5], message[6])
            if message[2] is not None:
                req = Req(self._next_ref, source)
                self._next_ref += 1
                self.journaled += 1
                self._reqs[req.ref] = req
                key_of[key] = req
                if seg is None:
                    self._unkept.add(req)
                    self.unjournaled += 1
            else:
                found = key_of.get(key)
                if found is None:
                    continue
                req = found
            if seg is not None:
                self._touch(req, seg)
            if kind == END:
                req.ended = True

    @staticmethod
    def _touch(req: Req, seg: Seg) -> None:
        if seg.ident not in req.segs:
            req.segs.append(seg.ident)
            seg.outstanding += 1

    def dropped(self, source: int, message: Raw) -> None:
        """The recorder's queue turned ``message`` of relay ``source`` away: a stream's end makes its request done
        (the tape is counted dropped there)."""
        if message[0] != END:
            return
        with self._lock:
            req = self._by_key.pop((source, message[1]), None)
            if req is not None:
                self._finish(req)

    def source_gone(self, source: int) -> None:
        """Relay ``source`` disconnected: its streams without an end never get one (done: nothing to record)."""
        with self._lock:
            gone = [k for k, req in self._by_key.items() if k[0] == source and not req.ended]
            for key in gone:
                self._finish(self._by_key.pop(key))

    # -- the recorder's worker ------------------------------------------------------------------------------

    def ended(self, source: int, key: int) -> int | None:
        """The recorder reached the end of stream ``key`` of ``source``: its request's reference (None: not kept)."""
        with self._lock:
            req = self._by_key.pop((source, key), None)
        return None if req is None else req.ref

    def settle(self, ref: int | None) -> None:
        """The request ``ref`` makes no record (its tape was dropped and counted, or recording it failed)."""
        if ref is None:
            return
        with self._lock:
            req = self._reqs.get(ref)
            if req is not None:
                self._finish(req)

    def replayed(self, ref: int | None) -> bool:
        """Whether request ``ref`` is one the last run began (played back from its journal)."""
        return ref is not None and ref < self.run * _REF_RUN

    def mask_of(self, ref: int | None) -> int:
        """What already has request ``ref``'s record (bits): nonzero only for one the last run began."""
        if ref is None:
            return 0
        req = self._reqs.get(ref)
        return 0 if req is None else req.mask

    def emitted(self, ref: int | None) -> None:
        """Request ``ref``'s spans, metrics and listeners are made."""
        req = self._reqs.get(ref) if ref is not None else None
        if req is not None and not req.mask & EMITTED:
            req.mask |= EMITTED
            self._dirty.add(req)

    def track(self, ref: int | None, sink: int, seq: int) -> None:
        """Request ``ref``'s record went to sink number ``sink`` as the ``seq``-th record it was given."""
        req = self._reqs.get(ref) if ref is not None else None
        if req is not None:
            self._waiting[sink].append((seq, req))

    def due(self) -> float | None:
        """When ``poll`` should run next (None: nothing waits)."""
        if not self._reqs and not self._unsynced and not self._to_close and not self._pending_acks:
            return None
        return self._polled + POLL_EVERY

    def poll(self) -> None:
        """What the sinks settled since the last look becomes acknowledgements; segments done are deleted; what was
        written is synced now and then; the bound is kept."""
        self._polled = self._clock()
        for i, sink in enumerate(self.sinks):
            settled, waiting, bit = sink.progress.settled, self._waiting[i], self._bits[i]
            while waiting and waiting[0][0] < settled:
                req = waiting.popleft()[1]
                req.mask |= bit
                self._dirty.add(req)
        acks: list[tuple[int, int]] = []
        # Taken whole: at a shutdown whose worker overran the flush timeout, it may still be adding to it.
        dirty, self._dirty = self._dirty, set()
        with self._lock:
            for req in dirty:
                if req.ref not in self._reqs:
                    continue
                if req.mask & self.need == self.need:
                    self._finish(req, acks)
                else:
                    acks.append((req.ref, req.mask))
            closing, self._to_close = self._to_close, []
            self._keep_bound()
        self._write_acks(acks)
        for seg in closing:
            if seg.file is not None:
                seg.file.close()
                seg.file = None
        self._sync()
        self._delete_done()

    def _finish(self, req: Req, acks: list[tuple[int, int]] | None = None) -> None:
        """``req`` is done: no longer kept; acknowledged when a segment of it stays (the lock is held)."""
        self._reqs.pop(req.ref, None)
        self._unkept.discard(req)
        self.done += 1
        keep_ack = False
        for ident in req.segs:
            seg = self._segs.get(ident)
            if seg is not None:
                seg.outstanding -= 1
                keep_ack = keep_ack or seg.outstanding > 0 or not seg.closed
        if keep_ack:
            entry = (req.ref, req.mask | SETTLED)
            if acks is not None:
                acks.append(entry)
            else:
                self._pending_acks.append(entry)

    def _write_acks(self, acks: list[tuple[int, int]]) -> None:
        with self._lock:
            acks.extend(self._pending_acks)
            self._pending_acks = []
        if not acks:
            return
        try:
            self._acks.append(acks)
            self._unsynced = True
        except OSError as exc:
            self._failed(exc)

    def _sync(self) -> None:
        now = self._clock()
        if not self._unsynced or now - self._synced < SYNC_EVERY:
            return
        self._synced = now
        self._unsynced = False
        current = self._current
        if current is not None and current.file is not None:
            current.file.sync()
        self._acks.sync()

    def _delete_done(self) -> None:
        """Delete each closed segment none of whose requests waits; compact the acknowledgements once they grew."""
        with self._lock:
            done = [k for k, s in self._segs.items() if s.closed and s.outstanding <= 0 and self._replayed(k)]
            if done:
                self.sequences.save()  # the numbers these segments hold, kept for the next start
            for ident in done:
                seg = self._segs.pop(ident)
                with contextlib.suppress(OSError):
                    os.unlink(seg.path)
            oldest = min((s.first_ref for s in self._segs.values()), default=self._next_ref)
        if done and self._acks.size > max(2 * self._acks.compacted, 1 << 20):
            bits, _ = AckLog.read(self._acks.path)
            try:
                self._acks.compact({ref: mask for ref, mask in bits.items() if ref >= oldest})
            except OSError as exc:
                self._failed(exc)

    def _replayed(self, ident: tuple[int, int]) -> bool:
        return self.replay is None or self.replay.past(ident)

    def _keep_bound(self) -> None:
        """Past ``max_bytes``, the oldest segments go; their requests are no longer kept (said once)."""
        total = sum(s.size for s in self._segs.values())
        let_go = 0
        for ident in sorted(self._segs):
            if total <= self.max_bytes:
                break
            seg = self._segs[ident]
            if seg is self._current:
                continue
            let_go += self._let_go(ident, seg)
            total -= seg.size
        if let_go:
            self.unkept += let_go
            if self.unkept == let_go:
                log.warning(
                    "record journal %s reached its bound (%d MiB): the oldest segments go, and %d records in them "
                    "are no longer kept for a restart (a sink that has not taken one by shutdown loses it, counted "
                    "as journal_full); raise record_journal_mb or see why a sink is slow",
                    self.slot.path,
                    self.max_bytes >> 20,
                    let_go,
                )

    def _let_go(self, ident: tuple[int, int], seg: Seg) -> int:
        del self._segs[ident]
        if seg.file is not None:
            seg.file.close()
            seg.file = None
        with contextlib.suppress(OSError):
            os.unlink(seg.path)
        if self.replay is not None and not self.replay.past(ident):
            return self.replay.skip(ident)
        count = 0
        for req in self._reqs.values():
            if ident in req.segs:
                req.segs.remove(ident)
                if req not in self._unkept:
                    self._unkept.add(req)
                    count += 1
        return count

    # -- shutdown -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """After the sinks closed: what they settled is acknowledged; what they did not stays for the next start
        (said with its count), or, let go by the bound, is counted lost."""
        self.poll()
        with self._lock:
            self._closed = True
            lost = len(self._unkept)
            kept = len(self._reqs) - lost
            current, self._current = self._current, None
        if current is not None and current.file is not None:
            current.file.close()
            current.file = None
            current.closed = True  # deleted below when every request in it is done
        self._delete_done()
        if not self._segs:
            with contextlib.suppress(OSError):
                self._acks.compact({})  # nothing left to acknowledge
        self._acks.close()
        self.sequences.save()
        if kept:
            log.warning("record journal: %d records kept in the journal for the next start", kept)
        if lost:
            log.warning(
                "record journal: %d records lost at shutdown (journal_full: let go of at the journal's bound, and "
                "not taken by every sink in time)",
                lost,
            )
            self.lost("journal_full", lost)
        self.slot.release()

    def lost(self, reason: str, n: int) -> None:
        """Count ``n`` records lost for ``reason`` (``JOURNAL_DROP_REASONS``)."""
        if self._on_lost is not None and n:
            self._on_lost(reason, n)

    def observe(self, meter: Meter) -> None:
        """Its gauges on ``meter``: bytes on disk, requests kept."""
        meter.create_observable_gauge(
            sc.METRIC_JOURNAL_SIZE,
            callbacks=[lambda options: [Observation(self.size)]],
            unit="By",
            description="Bytes of tapes the record journal holds on disk now (--record-journal).",
        )
        meter.create_observable_gauge(
            sc.METRIC_JOURNAL_RECORDS,
            callbacks=[lambda options: [Observation(self.outstanding)]],
            unit="{record}",
            description="Requests the record journal keeps until every record sink has their record.",
        )

    @property
    def size(self) -> int:
        """Bytes of segments on disk now."""
        return sum(s.size for s in list(self._segs.values()))

    @property
    def outstanding(self) -> int:
        """Requests kept and not done."""
        return len(self._reqs)
