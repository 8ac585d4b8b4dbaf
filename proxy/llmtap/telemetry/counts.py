"""The telemetry process's own counters of what its rooms refused, passed on or lost, in one place.

Each room is handed the count it keeps (a bound method: ``counts.join``, ``counts.routed``, ...) rather than the
recorder that built it; every reason and outcome is counted 0 from the start (``start``), so a rate reads 0, not
nothing. A counter that fails is logged at debug and never reaches a request.
"""

from __future__ import annotations

import logging
from typing import Any

from llmtap.config.types import Settings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import Instruments
from llmtap.telemetry.fleet.forward import OUTCOMES as FORWARD_OUTCOMES
from llmtap.telemetry.fleet.serverspans import OUTCOMES, REJECT_REASONS
from llmtap.telemetry.fleet.siblings import FACT_DROP_REASONS
from llmtap.telemetry.journal.losses import Losses
from llmtap.telemetry.records.sinks import drop_reasons

__all__ = ["ADMIN_REASONS", "TRACE_CONTEXT_REASONS", "Counts"]

log = logging.getLogger("llmtap.telemetry")

#: Why a client's trace header was not read (``llmtap.trace_context.ignored``).
TRACE_CONTEXT_REASONS = ("traceparent_too_long", "tracestate_too_long")
#: Why the admin listener refused or cut something (``llmtap.admin.refused``; the instrument says each).
ADMIN_REASONS = ("connection_evicted", "connection_limit", "event_streams", "unauthorized", "forbidden")


class Counts:
    """Counts on the process's instruments, and losses through ``losses`` (kept across restarts)."""

    def __init__(self, instruments: Instruments, losses: Losses) -> None:
        self.instruments = instruments
        self.losses = losses

    def start(self, settings: Settings, *, forwarding: bool, routing: bool) -> None:
        """Every reason and outcome at 0 (``forwarding``: spans go on to a traces backend; ``routing``: to peers)."""
        for reason in drop_reasons(settings):
            self.record_drop(reason, 0)
        if settings.content.on:
            for reason in sc.CONTENT_DROP_REASONS:
                self.content_drop(reason, 0)
        if forwarding:
            for outcome in FORWARD_OUTCOMES:
                self.forward(outcome, 0)
        self.start_routing(routing)
        for outcome in OUTCOMES:
            self.join(outcome, 0)
        for reason in REJECT_REASONS:
            self.rejected(reason, 0)
        for reason in ADMIN_REASONS:
            self.admin(reason, 0)
        self.instruments.event_streams.add(0)
        self.instruments.live_samples_dropped.add(0)
        for reason in FACT_DROP_REASONS:
            self.facts_dropped(reason, 0)
        for reason in TRACE_CONTEXT_REASONS:
            self.trace_context(reason, 0)

    def start_routing(self, routing: bool) -> None:
        """The outcomes of spans passed to another replica or telemetry process at 0, when some may be."""
        if routing:
            for outcome in FORWARD_OUTCOMES[:3]:
                self.routed(outcome, 0)

    def _add(self, instrument: Any, n: int, attributes: dict[str, str] | None, what: str) -> None:
        try:
            instrument.add(n, attributes)
        except Exception:
            log.debug("telemetry: could not count %s", what, exc_info=True)

    def rejected(self, reason: str, n: int = 1) -> None:
        """An OTLP body the span receiver refused."""
        self._add(self.instruments.otlp_rejected, n, {sc.OTLP_REJECT_REASON: reason}, "a refused OTLP body")

    def admin(self, reason: str, n: int = 1) -> None:
        """Something the admin listener refused or cut (``ADMIN_REASONS``)."""
        self._add(self.instruments.admin_refused, n, {sc.ADMIN_REASON: reason}, "an admin refusal")

    def live_samples_dropped(self, n: int) -> None:
        """The live view let ``n`` of its oldest latency values go, past its bound."""
        self._add(self.instruments.live_samples_dropped, n, None, "dropped live view values")

    def event_streams(self, change: int) -> None:
        """The live view's open ``/events`` streams went up or down by ``change``."""
        self._add(self.instruments.event_streams, change, None, "an event stream")

    def facts_dropped(self, reason: str, n: int = 1) -> None:
        """Lessons for or from the other telemetry processes that were lost (``FACT_DROP_REASONS``)."""
        self._add(self.instruments.facts_dropped, n, {sc.TELEMETRY_REASON: reason}, "a lost lesson")

    def unowned(self, n: int) -> None:
        """Spans of traces no process of this replica relayed, given up on."""
        self.forward("unowned", n)

    def routed(self, outcome: str, n: int) -> None:
        """Spans passed to another replica or telemetry process, by outcome."""
        self._add(self.instruments.otlp_routed, n, {sc.OTLP_FORWARD_OUTCOME: outcome}, "a span passed on")

    def trace_context(self, reason: str, n: int = 1) -> None:
        """A client's trace header too long to read."""
        self._add(self.instruments.trace_context_ignored, n, {sc.TRACE_CONTEXT_REASON: reason}, "a trace header")

    def forward(self, outcome: str, n: int) -> None:
        """Spans passed on to the traces backend, by outcome."""
        self._add(self.instruments.otlp_forwarded, n, {sc.OTLP_FORWARD_OUTCOME: outcome}, "a forwarded span")

    def clickhouse_insert(self, outcome: str, n: int) -> None:
        """A batch of records sent to ClickHouse, by outcome."""
        self._add(self.instruments.clickhouse_inserts, n, {sc.CLICKHOUSE_OUTCOME: outcome}, "a ClickHouse insert")

    def join(self, outcome: str, n: int) -> None:
        """A request's wait for its server span, by outcome."""
        self._add(self.instruments.server_spans, n, {sc.SERVER_SPAN_OUTCOME: outcome}, "a server span")

    def content_drop(self, reason: str, n: int) -> None:
        """Content events lost (``--content-event``), by reason (``semconv.CONTENT_DROP_REASONS``)."""
        self._add(self.instruments.content_events_dropped, n, {sc.TELEMETRY_REASON: reason}, "a lost content event")

    def record_drop(self, reason: str, n: int) -> None:
        """Records a sink lost."""
        self.losses.add("records", reason, n)

    def journal_drop(self, reason: str, n: int) -> None:
        """Records the journal lost (its totals written at once)."""
        self.losses.add("records", reason, n, sync=True)

    def recovered(self, n: int) -> None:
        """Records of the last run made again."""
        self.losses.add("recovered", "", n, sync=True)
