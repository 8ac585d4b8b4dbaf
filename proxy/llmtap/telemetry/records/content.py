"""The opt-in content event: ``gen_ai.client.inference.operation.details``, one OTLP log record per request.

The GenAI conventions (open-telemetry/semantic-conventions-genai, ``model/gen-ai/events.yaml``; status
development, no release yet) define it to carry a request's details apart from its trace: the inference span's
attributes, with the content ones (``gen_ai.system_instructions``, ``gen_ai.input.messages``,
``gen_ai.output.messages``) in structured form, at severity DEBUG. Content is off unless ``--content-event``
names a field (``llmtap.config.kinds.content_rules``): OpenTelemetry's own content variable
(``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``) does not turn it on. Each field is kept, hashed or
dropped by its rule and kept ones are cut to ``--content-event-max-bytes`` (``llmtap.analysis.content``); the
event names the cut fields in ``llmtap.content.truncated``. The log record carries the request's trace and root
span ids, so a backend links it to the trace.

Log records go through the SDK's batch processor to the OTLP logs endpoint the ``OTEL_EXPORTER_OTLP_[LOGS_]*``
variables configure, on the SDK's thread. What waits for export is bounded (the telemetry queue's size): past it
an event is dropped, and so is one the collector refused or never answered, one that could not be made, and every
one when the SDK installed is too old (``llmtap.telemetry.recorder``); each is counted by reason
(``llmtap_telemetry_content_events_dropped_total``, ``semconv.CONTENT_DROP_REASONS``) and each reason said once in
the log. A field past ``--content-event-max-bytes`` is cut, not dropped: the event says which.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.context import Context
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from llmtap import __version__
from llmtap.analysis.content import INPUT, OUTPUT, SYSTEM, content_of
from llmtap.analysis.finish import Finished
from llmtap.config.types import ContentEvent, Settings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.setup import resource
from llmtap.telemetry.records.content_drops import DropLog
from llmtap.telemetry.records.logs import CountingExporter

__all__ = ["ContentEmitter", "content_emitter"]

log = logging.getLogger("llmtap.telemetry")

#: Each field's attribute.
ATTRIBUTE = {SYSTEM: sc.SYSTEM_INSTRUCTIONS, INPUT: sc.INPUT_MESSAGES, OUTPUT: sc.OUTPUT_MESSAGES}


def content_emitter(settings: Settings, on_drop: Callable[[str, int], None] | None = None) -> ContentEmitter | None:
    """The content event's emitter when ``--content-event`` names a field, else None (no event, no exporter);
    ``on_drop`` counts the events lost, by reason."""
    if not settings.content.on:
        return None
    from llmtap.telemetry.records.logs import log_exporter

    exporter = log_exporter(settings.telemetry)
    return ContentEmitter(settings.content, exporter, capacity=settings.telemetry.queue_size, on_drop=on_drop)


class ContentEmitter:
    """Each LLM request's content event, queued for the SDK's batch processor; never raises."""

    def __init__(
        self,
        rules: ContentEvent,
        exporter: LogRecordExporter,
        *,
        capacity: int = 2048,
        provider: LoggerProvider | None = None,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self.rules = rules
        self.capacity = max(capacity, 1)
        self.dropped = DropLog(on_drop)
        self._lock = threading.Lock()
        #: Events given to the batch processor whose export has not returned (the bound: ``capacity``).
        self._pending = 0
        self.exported = 0
        self.provider = provider or LoggerProvider(resource=resource(), shutdown_on_exit=False)  # closed by close()
        batch = self.capacity if self.capacity < 512 else None
        counting = CountingExporter(exporter, self._done)
        self.provider.add_log_record_processor(
            BatchLogRecordProcessor(counting, max_queue_size=self.capacity, max_export_batch_size=batch)
        )
        self._logger = self.provider.get_logger("llmtap.content", __version__)

    def emit(self, request: Finished) -> None:
        """The request's content event (none for a request no protocol names); past ``capacity`` waiting, dropped
        and counted. Never raises."""
        tl = request.tl
        if tl.protocol is None:
            return
        with self._lock:
            full = self._pending >= self.capacity
            if not full:
                self._pending += 1
        if full:
            self.dropped("otlp_queue_full", 1, f"{self.capacity} events already wait for export")
            return
        try:
            self._logger.emit(
                LogRecord(
                    timestamp=time.time_ns(),
                    context=_root(tl.trace_id, tl.span_id),
                    severity_number=SeverityNumber.DEBUG,
                    severity_text="DEBUG",
                    event_name=sc.EVENT_OPERATION_DETAILS,
                    attributes=details(request, self.rules),
                )
            )
        except Exception as exc:
            with self._lock:
                self._pending -= 1
            log.debug("telemetry: a content event could not be made", exc_info=True)
            self.dropped("unmade", 1, f"it could not be made ({type(exc).__name__}: {exc})")

    def _done(self, n: int, ok: bool) -> None:
        """A batch's export returned: its room is free; a failed one is lost."""
        with self._lock:
            self._pending -= n
            if ok:
                self.exported += n
        if not ok:
            self.dropped("otlp_export_failed", n, "the OTLP logs endpoint refused the export or could not be reached")

    def close(self) -> None:
        """Export what waits (the process is ending)."""
        self.provider.shutdown()


def details(request: Finished, rules: ContentEvent) -> dict[str, Any]:
    """The event's attributes: the request's identity as its span has it, then each field by its rule."""
    tl = request.tl
    req = tl.request
    attrs: dict[str, Any] = {
        sc.OPERATION_NAME: req.operation if req is not None else "chat",
        sc.PROVIDER_NAME: tl.provider_name,
    }
    for name, value in (
        (sc.REQUEST_MODEL, req.model if req is not None else None),
        (sc.RESPONSE_MODEL, tl.response_model),
        (sc.RESPONSE_ID, tl.response_id),
    ):
        if value:
            attrs[name] = value
    if tl.finish_reasons:
        attrs[sc.RESPONSE_FINISH_REASONS] = list(tl.finish_reasons)
    content = content_of(tl, rules.rules, rules.max_bytes)
    for name, value in content.values.items():
        attrs[ATTRIBUTE[name]] = value
    if content.cut:
        attrs[sc.CONTENT_TRUNCATED] = content.cut
    return attrs


def _root(trace_id: str | None, span_id: str | None) -> Context | None:
    """The request's root span as the log record's context: how the SDK puts the trace and span ids on it."""
    try:
        tid, sid = int(trace_id or "", 16), int(span_id or "", 16)
    except ValueError:
        return None
    if not tid or not sid:
        return None
    span = SpanContext(tid, sid, is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    return trace.set_span_in_context(NonRecordingSpan(span))
