"""A finished request, and the emitters that turn it into output: each owns its output, each sees it once.

The recorder's worker makes a ``Finished`` when a request's summary is final (its server span joined or given
up on, its cache use diagnosed) and hands that one object to every emitter in turn: the spans
(``llmtap.telemetry.emit.spans.SpanWriter``), the metrics (``llmtap.telemetry.emit.metrics.MetricWriter``), the record
line (``llmtap.telemetry.records.emitter.RecordEmitter``) and the listeners (``Listeners``: the live view's window, the
demo's tables, the access log). No emitter changes the summary; one that fails is logged and the others still run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol

from llmtap.analysis.cachediag import Diagnosis
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline

__all__ = ["Emitter", "Finished", "Listener", "Listeners"]

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
