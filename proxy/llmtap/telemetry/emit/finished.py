"""The emitters that turn a finished request into output: each owns its output, each sees it once.

The analysis makes a ``Finished`` request whole (``llmtap.analysis.finish``): its summary, cost and cache class
in it. Once it is final (its server span joined or given up on) the recorder's worker hands that one object to
every emitter in turn (``llmtap.telemetry.emit.batch``): the spans (``llmtap.telemetry.emit.spans.SpanWriter``),
the metrics (``llmtap.telemetry.emit.metrics.MetricWriter``), the record line
(``llmtap.telemetry.records.emitter.RecordEmitter``) and the listeners (``Listeners``: the live view's window,
the demo's tables, the access log). No emitter changes the summary; one that fails is logged and the others
still run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from llmtap.analysis.finish import Finished
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline

__all__ = ["Emitter", "Listener", "Listeners"]

log = logging.getLogger("llmtap.telemetry")

#: A listener: called with each finished request's timeline and summary.
Listener = Callable[[Timeline, Summary], None]


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
