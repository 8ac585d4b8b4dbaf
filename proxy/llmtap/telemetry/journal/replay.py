"""The replay of the last run's record journal: its segments, played back into the recorder a slice at a time.

Issue 44 (``llmtap.telemetry.journal.spool`` says why and when). The segments a telemetry process's last run left in its
slot are read one at a time, on the recorder's worker, between the relays' messages: each request whose
acknowledgements (``llmtap.telemetry.journal.files.AckLog``) do not say it is done is registered with the spool again
(under its old reference, so what it still lacks is known) and its messages go to the recorder under a source of
their own (never a live relay's). A request is found by its head, counted the way ``Spool.append`` counted it.
When the last segment is read, the streams whose end never reached the journal are let go, the relays' numbers of
the last run are complete (``llmtap.telemetry.journal.sequences``), and the log says what was recovered and what was
not.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from llmtap.telemetry.journal.files import SETTLED, AckLog, Req, read_chunks
from llmtap.wire.framing import frames
from llmtap.wire.messages import END, SEGMENT, Raw, WireError

if TYPE_CHECKING:
    from llmtap.telemetry.journal.spool import Spool

__all__ = ["REPLAY_SLICE", "Replay"]

log = logging.getLogger("llmtap.telemetry")

#: Messages of the last run handed to the recorder per slice of the replay.
REPLAY_SLICE = 64
#: The first source number of the last run's relays, as the recorder sees their replayed messages (counting down).
_REPLAY_SOURCES = -1000


class Replay:
    """The last run's segments, played back into the recorder a slice at a time (``next_slice``)."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self._queue = [(run, number) for run, number, _ in spool._old]
        self._began = bool(self._queue)
        self._bits, self.torn = AckLog.read(spool.slot.acks)
        self._sources: dict[tuple[int, int], int] = {}
        self._items: deque[tuple[int, Raw]] = deque()
        self._skip: set[tuple[int, int, int]] = set()
        self._open: dict[tuple[int, int, int], Req] = {}
        self.done = False
        self.started = False
        #: Counts for the closing line: requests of the last run taken up again, found done, not whole.
        self.taken = 0
        self.found_done = 0
        self.unread = 0
        self.torn_segments = 0
        self.unreadable = 0

    def past(self, ident: tuple[int, int]) -> bool:
        """Whether segment ``ident`` was read through, every request in it known (or it is not the last run's)."""
        return ident not in self._queue

    def skip(self, ident: tuple[int, int]) -> int:
        """Segment ``ident`` went for the bound before it was read: its requests are lost (how many is not known
        without reading it: said in the closing line as a segment let go unread)."""
        if ident in self._queue:
            self._queue.remove(ident)
        self.unread += 1
        return 0

    def next_slice(self) -> list[tuple[int, Raw]]:
        """Up to ``REPLAY_SLICE`` messages of the last run, each with the source the recorder is to see it from."""
        self.started = True
        while len(self._items) < REPLAY_SLICE and self._queue:
            self._read(self._queue[0])
            self._queue.pop(0)  # read through: its requests are all known now
        out = [self._items.popleft() for _ in range(min(REPLAY_SLICE, len(self._items)))]
        if not out and not self._items:
            self._finish()
        return out

    def taken_end(self, source: int, key: int) -> None:
        """The recorder took the end of stream ``key`` of ``source``; one it could not read (another build's, or a
        failure) left its request waiting: it is let go, and said in the closing line."""
        ref = self.spool.ended(source, key)
        if ref is not None:
            self.spool.settle(ref)
            self.taken -= 1
            self.unreadable += 1
            self.spool.lost("journal_unreadable", 1)

    def _read(self, ident: tuple[int, int]) -> None:
        spool = self.spool
        seg = spool._segs.get(ident)
        if seg is None:
            return
        chunks = read_chunks(seg.path)
        if chunks.torn:
            self.torn_segments += 1
            log.warning(
                "record journal: %d bytes at the end of %s could not be read (cut short by a kill or a crash); skipped",
                chunks.torn,
                seg.path.name,
            )
        run = ident[0]
        for source, first, payload in chunks.items:
            try:
                messages = frames(bytearray(payload))
            except WireError:
                continue
            self._take_chunk(ident, run, source, first, messages)

    def _take_chunk(self, ident: tuple[int, int], run: int, source: int, first: int, messages: list[Raw]) -> None:
        spool = self.spool
        ref = first
        with spool._lock:
            seg = spool._segs.get(ident)
            for message in messages:
                kind = message[0]
                if kind != SEGMENT and kind != END:
                    continue
                key = (run, source, message[1])
                if kind == END and len(message) > 6 and message[5]:
                    spool.sequences.seen_old(run, message[5], message[6])
                if message[2] is not None:
                    mask = self._bits.get(ref, 0)
                    ref += 1
                    if mask & SETTLED or mask & spool.need == spool.need:
                        self.found_done += 1
                        self._skip.add(key)
                        continue
                    req = Req(ref - 1, self._source(run, source), mask)
                    spool._reqs[req.ref] = req
                    self._open[key] = req
                    spool._by_key[(req.source, message[1])] = req
                elif key in self._skip or key not in self._open:
                    continue
                req = self._open[key]
                if seg is not None and ident not in req.segs:
                    req.segs.append(ident)
                    seg.outstanding += 1
                if kind == END:
                    req.ended = True
                    del self._open[key]
                    self.taken += 1
                self._items.append((req.source, message))

    def _source(self, run: int, source: int) -> int:
        found = self._sources.get((run, source))
        if found is None:
            found = self._sources[(run, source)] = _REPLAY_SOURCES - len(self._sources)
        return found

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        spool = self.spool
        with spool._lock:
            # Streams whose end never reached the journal: this process died before it (their end went to the next
            # run, which counts it there) or the relay did too (counted below, as in flight). No record here.
            incomplete = len(self._open)
            for key, req in list(self._open.items()):
                spool._by_key.pop((req.source, key[2]), None)
                spool._finish(req)
            self._open.clear()
        in_transit, in_flight = spool.sequences.resolve()
        spool.recovered = self.taken
        if spool._on_recovered is not None:
            spool._on_recovered(self.taken)
        lost = in_transit + in_flight + self.unreadable
        if not self._began and not lost:
            return
        (log.warning if lost or self.unread or self.torn_segments else log.info)(
            "record journal: %d records of the last run recovered, %d could not be (%d stream ends the relays "
            "handed over never reached the journal, %d requests the relays were relaying when they were killed; "
            "counted as in_transit and in_flight%s%s); %d streams whose end came after the restart, %d records "
            "the sinks already had",
            self.taken,
            lost,
            in_transit,
            in_flight,
            (f"; and {self.unread} segments let go unread at the bound" if self.unread else "")
            + (f"; {self.unreadable} that could not be read" if self.unreadable else ""),
            f"; {self.torn_segments} segments cut short" if self.torn_segments else "",
            incomplete,
            self.found_done,
        )
