"""The recorder's inbox: the bounded queue its worker takes from, and what is turned away when it is full.

The relays' messages arrive encoded (``submit``, from the relay's channel in this process or from the telemetry
process's socket reader), the upstream's spans from the admin listener (``submit_spans``); both are queued with the
response bytes they carry, and neither ever blocks nor raises. Tapes may fill the queue up to ``queue_size``; the
other telemetry processes' lessons and the upstream's spans may use a quarter more, so a backlog of tapes delays them
but does not lose them. A segment the full queue turns away becomes a hole in its stream (``holes``), an end its
stream's loss (counted, and told to the journal); past ``MAX_QUEUED_BYTES`` a message keeps its timing and loses its
bytes (its tape is ``partial``), as at the relay's channel.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from llmtap.analysis.timeline import Timeline
from llmtap.telemetry.intake.holes import Holed, Holes
from llmtap.telemetry.intake.relays import Drops
from llmtap.telemetry.intake.streams import Streams
from llmtap.telemetry.journal.spool import Spool
from llmtap.wire.messages import END, FACTS, SEGMENT, Raw, data_size, without_bytes

if TYPE_CHECKING:
    from llmtap.telemetry.fleet.serverspans import ServerSpan

__all__ = ["MAX_QUEUED_BYTES", "STOP", "Gone", "Inbox", "Marker", "Spans"]

log = logging.getLogger("llmtap.telemetry")

#: Response bytes waiting in the queue at most. Past it a message keeps its timing and loses its bytes (its
#: tape is ``partial``), as at the relay's channel: what waits here, and so how long any record waits behind
#: it, stays bounded however fast one upstream streams.
MAX_QUEUED_BYTES = 16 * 1024 * 1024
#: The worker's signal to stop, once it reaches it.
STOP = object()


class Spans(list["ServerSpan"]):
    """Spans the upstream exported, as the receiver read them: a queue item of their own kind, with every span
    of their export (for the backend)."""

    def __init__(self, spans: list[ServerSpan], export: ExportTraceServiceRequest | None) -> None:
        super().__init__(spans)
        self.export = export


class Gone(NamedTuple):
    """A relay disconnected: its last report (its gauges at zero), then what is kept of it goes."""

    report: Raw


class Marker:
    """A flush marker: the worker sets the event when it reaches it."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event


class Inbox:
    """The bounded queue of ``(source, item, size)``; the producers' side runs on any thread."""

    def __init__(
        self,
        queue_size: int,
        drops: Drops,
        streams: Streams,
        facts_dropped: Callable[[str, int], None],
        wake: Callable[[], None],
    ) -> None:
        self._tape_room = queue_size
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size + max(queue_size // 4, 64))
        #: Streams with segments the full queue turned away, played as a gap (the submitting thread's).
        self.holes = Holes()
        self._drops = drops
        self._streams = streams
        self._facts_dropped = facts_dropped
        #: Starts the worker if it is not running (before anything is queued).
        self._wake = wake
        #: The record journal, told of every end turned away (None: none).
        self.spool: Spool | None = None
        # Response bytes queued (by the producer) and taken (by the worker): each written by one thread only.
        self.queued_in = 0
        self.queued_out = 0

    def submit(self, message: Raw, source: int = 0) -> bool:
        """Queue one encoded message from relay ``source``; False when the queue is full. Never blocks, never
        raises. A dropped segment or end makes its stream's record a dropped tape."""
        try:
            self._wake()
            item = self._admitted(message, source, 0)
            if item is None or isinstance(item, bool):
                return item is None
            self.queue.put_nowait(item)
            self.queued_in += item[2]
            return True
        except Exception:
            log.exception("telemetry: could not queue a tape message")
            return False

    def submit_all(self, messages: Sequence[Raw], source: int = 0) -> None:
        """Queue every message of one read from relay ``source`` in order, each as ``submit`` would, under one hold
        of the queue's lock and with one wake-up of the worker: a read carries the ends of several requests when
        they come fast, and a put each cost a lock and a notification each. Never blocks, never raises."""
        if len(messages) <= 1:
            if messages:
                self.submit(messages[0], source)
            return
        try:
            self._wake()
            items: list[tuple[int, Any, int]] = []
            for message in messages:
                item = self._admitted(message, source, len(items))
                if isinstance(item, tuple):
                    items.append(item)
                    # What ``submit`` counts once its message is queued: the bound on bytes sees the batch's.
                    self.queued_in += item[2]
            self._put_all(items)
        except Exception:
            log.exception("telemetry: could not queue a tape message")

    def _admitted(self, message: Raw, source: int, pending: int) -> tuple[int, Any, int] | bool | None:
        """The queue item of ``message`` (``pending`` items not yet put ahead of it); None when its segment became
        a hole; False when the full queue turned it away (counted here)."""
        q = self.queue
        try:
            size = data_size(message)
            if size and self.queued_in + size - self.queued_out > MAX_QUEUED_BYTES:
                message = without_bytes(message) or message
                size = 0
            kind = message[0]
            item: Raw | Holed = message
            queued = q.qsize() + pending
            if kind == SEGMENT or kind == END:
                key = (source, message[1])
                if queued >= self._tape_room and not (kind == END and self.holes.holed(key)):
                    # The end of a stream with a hole may use the reserve; a later segment becomes a hole.
                    if kind == SEGMENT and self.holes.punch(key, message):
                        return None
                    raise queue.Full
                item = self.holes.carry(key, message)
                if kind == END:
                    self.holes.ended(key)
            elif kind != FACTS and queued >= self._tape_room:
                raise queue.Full
            if queued >= q.maxsize:  # what ``put_nowait`` refuses
                raise queue.Full
            return (source, item, size)
        except queue.Full:
            self._turned_away(source, message)
            return False

    def _put_all(self, items: list[tuple[int, Any, int]]) -> None:
        """``put_nowait`` of each item (their room is checked), the lock held once and the worker woken once."""
        if not items:
            return
        q = self.queue
        with q.mutex:
            for item in items:
                q._put(item)
            q.unfinished_tasks += len(items)
            q.not_empty.notify()

    def _turned_away(self, source: int, message: Raw) -> None:
        if message[0] == END:
            self.holes.ended((source, message[1]))
            self._drops.end()
            if self.spool is not None:
                self.spool.dropped(source, message)
            if message[2] is None:  # a segment carried its head: some of it may wait in the queue
                self._streams.dropped((source, message[1]), end=True)
        elif message[0] == SEGMENT:
            self._streams.dropped((source, message[1]), end=False)
        elif message[0] == FACTS:
            self._facts_dropped("queue_full", len(message[1]))

    def submit_spans(
        self, spans: list[ServerSpan], export: ExportTraceServiceRequest | None = None, size: int = 0
    ) -> bool:
        """Queue the upstream's spans for the join, and ``export`` (all the spans they came with, ``size`` bytes)
        for the traces backend; False when the queue is full."""
        try:
            self._wake()
            if size and self.queued_in + size - self.queued_out > MAX_QUEUED_BYTES:
                return False
            self.queue.put_nowait((-1, Spans(spans, export), size))
            self.queued_in += size
            return True
        except queue.Full:
            return False

    def gone(self, source: int, report: Raw) -> None:
        """Relay ``source`` disconnected: ``report`` (its gauges at zero) queued after every message it sent."""
        self._wake()
        self.holes.forget(source)
        self.queue.put((source, Gone(report), 0))

    def timeline(self, tl: Timeline) -> None:
        """Queue a finished timeline as it is (tests and tools that build timelines themselves)."""
        self._wake()
        self.queue.put((-1, tl, 0))

    def abandon(self) -> int:
        """Everything still queued taken off the queue, so that the worker, still at work past the exit's bound,
        takes no more of it; the number of requests whose ends were among it (records that will not be written)."""
        q = self.queue
        with q.mutex:
            items = list(q.queue)
            q.queue.clear()
            q.not_full.notify_all()
        return sum(1 for entry in items if _ends_a_request(entry))

    def taken(self, size: int) -> None:
        """The worker took an item of ``size`` response bytes."""
        self.queued_out += size


def _ends_a_request(entry: Any) -> bool:
    """Whether a queue item is a request's end (a relay's end message, or a journal's timeline played back)."""
    if not isinstance(entry, tuple) or len(entry) != 3:
        return False  # the worker's stop
    item = entry[1]
    if isinstance(item, Holed):
        item = item.message
    if isinstance(item, Timeline):
        return True
    return isinstance(item, tuple) and bool(item) and item[0] == END
