"""Holes in a stream: the reads of segments the recorder's full queue turned away, played as a gap.

The recorder's queue is bounded in messages (``telemetry.queue_size``) as well as in response bytes. A fast long
stream sends a segment every 32 KiB of response (a 1 GiB stream, 32,768 of them), and when the worker fell that
far behind, one segment that did not fit used to lose the whole stream: no record, counted ``queue_full`` though
nothing else was queued. Now a segment turned away becomes a hole in its stream: a few numbers (its reads' bytes,
their count and the last one's arrival), kept on the producer's side until the stream's next message fits, which
carries the hole in front of it (``Holed``), so the worker plays it in order, as reads without bytes. The stream's
timing on either side of the hole and its record survive, and the record counts as partial
(``llmtap_telemetry_tapes_dropped_total{llmtap_telemetry_reason="partial"}``). The end of a stream with a hole may
use the queue's reserve, where the relays' lessons and the server spans also go.

Only a stream whose head is already queued gets a hole: a turned-away first message (it carries the request
and its body, up to ``max_inspect_bytes``) still loses its stream, counted ``queue_full``, so that under overload
the queue and this bookkeeping stay as small as before; at most ``MAX_HOLES`` streams have a hole at once.
Used by the thread that submits (the process's socket reader or the relay's loop), never by the worker.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

from llmtap.wire.messages import Raw

__all__ = ["MAX_HOLES", "Hole", "Holed", "Holes"]

#: Streams with a hole at once (each a few numbers); past it a turned-away segment loses its stream.
MAX_HOLES = 4096

Key = tuple[int, int]


class Hole:
    """The reads of a stream's turned-away segments: their bytes, their count, and when the last one arrived."""

    __slots__ = ("at", "reads", "size")

    def __init__(self) -> None:
        self.size = 0
        self.reads = 0
        self.at = 0.0

    def add(self, reads: Raw) -> None:
        """The ``Reads`` (encoded) of one more turned-away segment."""
        times, sizes = array("d"), array("l")
        times.frombytes(reads[0])
        sizes.frombytes(reads[2])
        self.size += sum(sizes)
        self.reads += len(sizes)
        if times:
            self.at = times[-1]


class Holed(NamedTuple):
    """A stream's message with the hole that comes before it (a queue item: the worker plays the hole first)."""

    message: Raw
    hole: Hole


class Holes:
    """The streams with a hole not yet handed to the worker, and those that had one (until their end)."""

    def __init__(self) -> None:
        self._open: dict[Key, Hole] = {}
        self._holed: set[Key] = set()

    def punch(self, key: Key, message: Raw) -> bool:
        """A segment the full queue turned away: its reads join its stream's hole. False when it cannot (it carries
        the stream's head, or ``MAX_HOLES`` streams have one): the stream is then lost, as before holes."""
        if message[2] is not None:
            return False
        hole = self._open.get(key)
        if hole is None:
            if key not in self._holed and len(self._holed) >= MAX_HOLES:
                return False
            hole = self._open[key] = Hole()
            self._holed.add(key)
        hole.add(message[3])
        return True

    def holed(self, key: Key) -> bool:
        """Whether the stream had a hole (its end may use the queue's reserve)."""
        return key in self._holed

    def carry(self, key: Key, message: Raw) -> Raw | Holed:
        """What to queue for ``message``: itself, or with the hole that waits before it (taken)."""
        if not self._open:
            return message
        hole = self._open.pop(key, None)
        return message if hole is None else Holed(message, hole)

    def ended(self, key: Key) -> None:
        """The stream's end was queued or dropped: nothing of it is kept here."""
        self._holed.discard(key)
        self._open.pop(key, None)

    def forget(self, source: int) -> None:
        """Relay ``source`` went away: its streams' ends will not come."""
        self._holed = {k for k in self._holed if k[0] != source}
        self._open = {k: v for k, v in self._open.items() if k[0] != source}
