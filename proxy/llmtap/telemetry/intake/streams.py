"""The streams the recorder plays back, and the streams it cannot: both bounded, whatever overload drops.

A stream reaches the recorder as messages (``llmtap.wire.messages``): segments while it runs, then its end. From its
first segment to its end it is open, its ``Playback`` waiting here; at most ``MAX_OPEN_STREAMS`` are (past it the
oldest goes, counted ``evicted``). When the recorder's full queue turns one of its messages away (``submit``, on the
thread that reads the relays), the stream can no longer make a true record: it is gone. That thread only notes the
loss (``dropped``); the worker takes the notes before each message it plays, lets the stream's playback go, and
ignores the rest of its messages. A gone stream is counted once: when its end comes (``queue_full``), or at once
when the end itself was turned away (``Drops.end``, by the reader) or the stream was evicted. Its entry then waits
for messages still in the queue, and is forgotten when its end comes, after ``GONE_SECONDS``, or once
``MAX_GONE`` streams were lost after it: an end that never comes (turned away under overload) leaves nothing behind
for long.

With a record journal (``spool``), every end that reaches the worker takes its request's reference from it, and an end
that cannot become a record settles it: ``queue_full`` for a gone stream not yet counted, nothing more for one counted
already (evicted, or its end turned away), ``split`` for an end whose start never came here (it went to a telemetry
process that is gone). A hole (``llmtap.telemetry.intake.holes``) is played into its open stream before the message it
came with.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from llmtap.telemetry.intake.relays import Drops
from llmtap.telemetry.intake.replay import Playback
from llmtap.wire.messages import End, Head, Segment

if TYPE_CHECKING:
    from llmtap.telemetry.intake.holes import Hole
    from llmtap.telemetry.journal.spool import Spool

__all__ = ["GONE_SECONDS", "MAX_GONE", "MAX_OPEN_STREAMS", "Streams"]

#: Streams being played back at once (their segments came, their end not yet); past it the oldest goes.
MAX_OPEN_STREAMS = 4096
#: Gone streams remembered at most (about 200 bytes each); past it the oldest are forgotten.
MAX_GONE = 16384
#: Seconds a gone stream is remembered at most: long enough for the messages of it still in the queue.
GONE_SECONDS = 300.0

#: A stream: the relay it came from (the recorder's source) and the relay's key for it.
Key = tuple[int, int]


class _Gone(NamedTuple):
    counted: bool  # its loss is counted already (its end was turned away, or it was evicted)
    route: str | None  # for the log line of the count its end makes
    at: float  # when it went (the worker's clock)


class Streams:
    """Open streams by key, and gone ones; used by the recorder's worker thread, except ``dropped``."""

    def __init__(
        self,
        drops: Drops,
        start: Callable[[Head], Playback],
        *,
        limit: int = MAX_OPEN_STREAMS,
        gone_limit: int = MAX_GONE,
        gone_seconds: float = GONE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._drops = drops
        self._start = start
        self._limit = limit
        self._gone_limit = gone_limit
        self._gone_seconds = gone_seconds
        self._clock = clock
        self._open: OrderedDict[Key, Playback] = OrderedDict()
        self._gone: OrderedDict[Key, _Gone] = OrderedDict()
        # What the reader's thread turned away, for the worker: (stream, whether it was its end). A deque's append
        # and popleft are atomic; the worker empties it before each message, so it holds the losses of one wait.
        self._notes: deque[tuple[Key, bool]] = deque(maxlen=gone_limit)
        #: The record journal, once the recorder opened it (None: not kept).
        self.spool: Spool | None = None

    @property
    def open(self) -> int:
        """Streams being played back now."""
        return len(self._open)

    @property
    def gone(self) -> int:
        """Gone streams remembered now."""
        return len(self._gone)

    def dropped(self, key: Key, *, end: bool) -> None:
        """A message of stream ``key`` was turned away (the reader's thread; ``end``: its end, counted there)."""
        self._notes.append((key, end))

    def take(self, key: Key, m: Segment | End, hole: Hole | None = None) -> Playback | None:
        """Play one message of stream ``key`` (after ``hole``, reads of its stream that were turned away before it);
        its playback when ``m`` ends a stream that can be recorded, its timeline carrying the journal's ``ref``."""
        self._settle()
        spool = self.spool
        ref = spool.ended(key[0], key[1]) if spool is not None and isinstance(m, End) else None
        gone = self._gone.get(key)
        if gone is not None:
            if isinstance(m, End):
                del self._gone[key]
                if not gone.counted:
                    self._drops.tape("queue_full", gone.route)
                if spool is not None:
                    spool.settle(ref)
            return None
        playback = self._open.pop(key, None)
        if playback is not None and hole is not None:
            playback.skip(hole.size, hole.at)
        if playback is None and m.head is not None:
            playback = self._start(m.head)
        if playback is not None:
            playback.feed(m.reads)
        if isinstance(m, End):
            if playback is None:
                # Its start went to a telemetry process that is gone (a restart): neither can make its record. (Or
                # its first message was turned away here and the note of it is forgotten, past MAX_GONE or
                # GONE_SECONDS.)
                self._drops.tape("split", None)
                if spool is not None:
                    spool.settle(ref)
            else:
                playback.tl.ref = ref
            return playback
        if playback is not None:
            self._open[key] = playback
            if len(self._open) > self._limit:
                oldest, evicted = self._open.popitem(last=False)
                self._drops.tape("evicted", evicted.tl.route)
                self._forget(oldest, _Gone(True, evicted.tl.route, self._clock()))
        return None

    def forget(self, source: int) -> None:
        """Relay ``source`` went away, every message it sent taken: its open streams never end (counted ``evicted``),
        and nothing more of it comes."""
        self._settle()
        for key in [k for k in self._open if k[0] == source]:
            self._drops.tape("evicted", self._open.pop(key).tl.route)
        for key in [k for k in self._gone if k[0] == source]:
            del self._gone[key]

    def _settle(self) -> None:
        """Take the reader's notes: each stream they name is gone; gone streams past their time are forgotten."""
        now = self._clock()
        notes = self._notes
        while notes:
            key, end = notes.popleft()
            playback = self._open.pop(key, None)
            was = self._gone.pop(key, None)
            route = playback.tl.route if playback is not None else was.route if was is not None else None
            self._forget(key, _Gone(end or (was is not None and was.counted), route, now))
        gone = self._gone
        while gone and now - next(iter(gone.values())).at > self._gone_seconds:
            gone.popitem(last=False)

    def _forget(self, key: Key, gone: _Gone) -> None:
        self._gone[key] = gone
        while len(self._gone) > self._gone_limit:
            self._gone.popitem(last=False)
