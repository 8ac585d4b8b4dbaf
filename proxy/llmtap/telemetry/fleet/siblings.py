"""Several telemetry processes, one upstream: what each learns that the others must know, passed between them.

With ``--telemetry-workers`` above one, each request's tape goes to one telemetry process by its trace id
(``llmtap.wire.tape.shard_of``), so one busy upstream's requests spread over all of them. Some state must
still see every request to an upstream: the queue/prefill estimator's slot replay (when each request ended,
and when it decoded), its unloaded-TTFT envelope (each request sent to an idle upstream), the cache
diagnosis's index of recent prompts (each prompt's block chain, once its prefill is done) and the slot count
learned from the upstream's gauges. Each process keeps all of it for every upstream, from its own requests and
from the lessons the others send it (named lessons, ``llmtap.wire.lessons``, in ``Facts`` messages, on a Unix
socket of each process's own, ``llmtap.serve.sockets.facts_paths``). A request's own figures are computed once,
where it is recorded; its lessons are a few dozen bytes (a prompt's chain: 16 bytes per 1,024 characters). Two
more kinds go to one process only: each finished request to process 0's live view (``LiveEntry``), and the
upstream's spans from process 0's span receiver to the process that recorded their request (``PassedSpans``).

Lessons leave in batches: once ``BATCH`` wait, or ``BATCH_WAIT`` seconds after the oldest was offered (the
recorder wakes for it), so a process sends a few times a second when idle and a few hundred when busy. What that
bounds: a request recorded in one process before a lesson it needed arrived from another is estimated as if the
request that lesson describes had not been seen. For the slot replay that means no answer, so its split falls
back to the envelope (``method: envelope``, still ``estimated``); for the cache diagnosis, a prompt whose
prefix another process's request sent within those milliseconds reads as not sent before, as two requests
sent together do in one process. Late lessons are put in order (``SlotLog``). Lessons that cannot be passed (a
sibling's buffer full, or the sibling restarting) are dropped and counted (``llmtap.telemetry.facts.dropped``),
never waited for. A process started again (``llmtap.serve.telemetry``) begins with that state empty, as a lone
process does, and learns it again from the requests that follow, its own and the others'.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from llmtap.telemetry.fleet.peers import partition
from llmtap.wire.lessons import Lesson, PassedSpans, decode_lesson, encode_lesson
from llmtap.wire.messages import FACTS, Facts
from llmtap.wire.socketchannel import SocketChannel
from llmtap.wire.tape import shard_of

__all__ = ["BATCH", "BATCH_WAIT", "FACT_DROP_REASONS", "SLOTS_EVERY", "Lessons", "Siblings", "by_process"]

#: Lessons sent together at most, and the longest one waits for company (seconds).
BATCH = 64
BATCH_WAIT = 0.005
#: A slot count learned from the upstream's gauges (``SlotCount``) is told at most once every this many seconds
#: per upstream.
SLOTS_EVERY = 1.0
#: Why lessons were lost: a sibling's buffer full or the sibling away (the sender), the receiver's queue full.
FACT_DROP_REASONS = ("channel_full", "queue_full")
#: Bytes of lessons that may wait for one sibling: a second of a busy process's lessons.
BUFFER_LIMIT = 4 << 20


def by_process(
    request: ExportTraceServiceRequest, index: int, count: int
) -> tuple[ExportTraceServiceRequest | None, dict[int, tuple[bytes, int]]]:
    """The spans of ``request`` whose requests process ``index`` recorded (None: none), and the others' as
    bytes with their span count, by process (``shard_of`` their trace id, as the relay chose)."""
    groups = partition(request, lambda span: shard_of(int.from_bytes(span.trace_id, "big"), 0, count))
    mine = groups.pop(index, None)
    return (mine[0] if mine is not None else None), {
        k: (export.SerializeToString(), n) for k, (export, n) in groups.items()
    }


class Siblings:
    """The other telemetry processes: lessons offered on the recorder's thread, sent in batches from the loop's.

    ``dropped(reason, n)`` counts lessons that could not be sent (``channel_full``: a sibling's buffer full or
    the sibling away).
    """

    def __init__(
        self,
        paths: Sequence[str],
        index: int,
        loop: asyncio.AbstractEventLoop,
        dropped: Callable[[str, int], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: This process's index among ``count`` (``paths``: every process's lesson socket, this one's too).
        self.index = index
        self.count = len(paths)
        self.channels = {
            i: SocketChannel(path, limit=BUFFER_LIMIT, quiet=True) for i, path in enumerate(paths) if i != index
        }
        self._loop = loop
        self._dropped = dropped
        self._clock = clock
        self._pending: list[Lesson] = []
        self._first: list[Lesson] = []  # for process 0 only (the live view's)
        self._since = 0.0
        # Per upstream, when its slot count was last told (the recorder's thread only).
        self._slots_at: dict[str, float] = {}

    async def start(self) -> None:
        """Connect to every sibling (their sockets were bound before any process started)."""
        for channel in self.channels.values():
            await channel.start()

    def offer(self, lessons: list[Lesson], *, first_only: bool = False) -> None:
        """Lessons of one request (the recorder's thread): sent with the batch they join, to every other process
        or (``first_only``) to process 0."""
        if not lessons:
            return
        if not self._pending and not self._first:
            self._since = self._clock()
        if first_only:
            self._first += lessons
        else:
            self._pending += lessons
        waiting = len(self._pending) + len(self._first)
        if waiting >= BATCH or self._clock() - self._since >= BATCH_WAIT:
            self.flush()

    def deadline(self) -> float | None:
        """When the waiting lessons must leave (the recorder wakes for it), or None when none wait."""
        return self._since + BATCH_WAIT if self._pending or self._first else None

    def slots_due(self, upstream: str, now: float) -> bool:
        """Whether the slot count of ``upstream`` is to be told again (at most every ``SLOTS_EVERY`` seconds)."""
        last = self._slots_at.get(upstream)
        if last is not None and 0.0 <= now - last < SLOTS_EVERY:
            return False
        if len(self._slots_at) >= 4096:
            self._slots_at.clear()
        self._slots_at[upstream] = now
        return True

    def flush(self) -> None:
        """Send what waits now (the recorder's thread: the batch is full, or its deadline came)."""
        if not self._pending and not self._first:
            return
        batch, self._pending = tuple(self._pending), []
        first, self._first = tuple(self._first), []
        try:
            self._loop.call_soon_threadsafe(self._send, batch, first)
        except RuntimeError:  # the loop closed: shutting down
            self._dropped("channel_full", len(batch) + len(first))

    def _send(self, lessons: tuple[Lesson, ...], to_first: tuple[Lesson, ...]) -> None:
        batch = tuple(encode_lesson(lesson) for lesson in lessons)
        first = tuple(encode_lesson(lesson) for lesson in to_first)
        for index, channel in self.channels.items():
            encoded = batch + first if index == 0 else batch
            if encoded and not channel.send((FACTS, encoded)):
                self._dropped("channel_full", len(encoded))

    def pass_spans(self, index: int, export: bytes) -> bool:
        """Spans of traces process ``index`` recorded (``shard_of``), for its join; the loop's thread. False when
        they could not be passed (counted by the caller)."""
        channel = self.channels.get(index)
        return channel is not None and channel.send((FACTS, (encode_lesson(PassedSpans(export)),)), reserve=True)

    async def aclose(self) -> None:
        """Close the connections, each writing out what it holds first (lessons still waiting for their batch are
        not sent: the others are stopping too)."""
        for channel in self.channels.values():
            await channel.aclose()


class Lessons:
    """What the other telemetry processes tell this one: each lesson of their ``Facts`` decoded on its own and handed
    to the one that learns its kind (the estimator, the cache index, the slot counts, the live view, the join).

    A lesson that cannot be read, or that its learner refuses (``ValueError``, a garbled span export), goes to
    ``unreadable`` and costs only itself."""

    def __init__(
        self, learners: dict[type[Any], Callable[[Any], None]], unreadable: Callable[[Exception], None]
    ) -> None:
        self.learners = learners
        self._unreadable = unreadable

    def take(self, facts: Facts) -> None:
        """Learn each lesson of ``facts`` (the recorder's thread)."""
        learners = self.learners
        for raw in facts.lessons:
            try:
                lesson = decode_lesson(raw)
                learner = learners.get(type(lesson))
                if learner is not None:
                    learner(lesson)
            except (ValueError, TypeError, KeyError, IndexError, DecodeError) as exc:
                self._unreadable(exc)
