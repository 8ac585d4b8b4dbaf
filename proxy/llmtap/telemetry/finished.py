"""A finished request, and the emitters that turn it into output: each owns its output, each sees it once.

The recorder's worker makes a ``Finished`` when a request's summary is final (its server span joined or given
up on, its cache use diagnosed) and hands that one object to every emitter in turn: the spans
(``llmtap.telemetry.spans.SpanWriter``), the metrics (``llmtap.telemetry.metrics.MetricWriter``), the record
line (``RecordEmitter``) and the listeners (``Listeners``: the live view's window, the demo's tables, the access
log). No emitter changes the summary; one that fails is logged and the others still run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol

from llmtap.analysis.cachediag import Diagnosis
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.telemetry.identity import Identity
from llmtap.telemetry.records import record_line
from llmtap.telemetry.sinks import Sink
from llmtap.telemetry.spool import SINK_BITS, Spool

__all__ = ["Emitter", "Finished", "Listener", "Listeners", "RecordEmitter"]

log = logging.getLogger("llmtap.telemetry")

#: A listener: called with each finished request's timeline and summary.
Listener = Callable[[Timeline, Summary], None]


class Finished(NamedTuple):
    """One request, done: its timeline, its final summary, and its cache diagnosis (None: none was made).

    Immutable itself (a named tuple: the cheapest to make, once per request), its summary final. The one thing
    an emitter adds: the ids the root span gives a timeline that came without any (one not from a relay: tools,
    tests), which the metrics' exemplars and the record line then carry; so the spans go first."""

    tl: Timeline
    summary: Summary
    diagnosis: Diagnosis | None

    @classmethod
    def of(cls, tl: Timeline, s: Summary, diagnosis: Diagnosis | None) -> Finished:
        """The finished request, its summary completed with what the diagnosis says (before any emitter sees it)."""
        if diagnosis is not None:
            s.cache_class = diagnosis.cache_class
        return cls(tl, s, diagnosis)


class Emitter(Protocol):
    """Something that writes a finished request somewhere (called on the recorder's worker thread)."""

    def emit(self, request: Finished) -> None:
        """Write ``request``'s output."""
        ...


class RecordEmitter:
    """Each request's record line, built once, to every sink (``--record``, ``--record-logs``, ClickHouse).

    With the record journal (``spool``), each sink's copy is followed until the sink settles it, and a request the
    last run began goes only to the sinks that lack it."""

    def __init__(self, sinks: list[Sink], identity: Identity) -> None:
        self.sinks = sinks
        self.identity = identity
        #: The record journal, which keeps each request's tape until every sink has its record (None: none).
        self.spool: Spool | None = None
        self._bits = [SINK_BITS.get(getattr(sink, "kind", ""), 0) for sink in sinks]

    def emit(self, request: Finished) -> None:
        """The record line to every sink; a lost record is counted by its sink."""
        if not self.sinks:
            return
        spool, ref = self.spool, request.tl.ref
        try:
            line = record_line(request.tl, request.summary, request.diagnosis, self.identity)
        except Exception:
            if spool is not None:
                spool.settle(ref)  # counted as failed by the recorder: no sink waits for it
            raise
        has = spool.mask_of(ref) if spool is not None else 0
        for i, sink in enumerate(self.sinks):
            if has & self._bits[i]:
                continue
            progress = getattr(sink, "progress", None)
            seq = progress.given if progress is not None else 0
            try:
                sink.write(line)
            except Exception:
                log.exception("telemetry: a record sink failed")
                if progress is not None and progress.given == seq:
                    progress.settle_now()
            if spool is not None and progress is not None:
                spool.track(ref, i, seq)

    def flush(self) -> None:
        """Push what the sinks hold out now (a write that fails is counted and said by its sink, once)."""
        for sink in self.sinks:
            try:
                sink.flush()
            except Exception:
                log.exception("telemetry: a record sink could not flush")

    def close(self, timeout: float) -> None:
        """Close every sink."""
        for sink in self.sinks:
            try:
                sink.close(timeout)
            except Exception:
                log.exception("telemetry: a record sink could not close")


class Listeners:
    """The listeners, each given every finished request's timeline and summary; one that raises is logged."""

    def __init__(self) -> None:
        self.callables: list[Listener] = []

    def emit(self, request: Finished) -> None:
        """Call every listener."""
        for listener in self.callables:
            try:
                listener(request.tl, request.summary)
            except Exception:
                log.exception("telemetry: a record listener failed")
