"""Records as OTLP log records (``--record-logs``): each record also leaves as a log record, event ``llmtap.request``.

The collectors users already run then carry every record, unsampled, to their store (``collectors/`` has
pipelines into ClickHouse and into files). The record is the log record's body (a map, the same fields as a
line of the record files, ``docs/record.schema.json``); the log record carries the request's trace and root
span ids, so a backend links it to the trace. Log records go through the SDK's ``LoggerProvider`` and batch
processor, exported by the OTLP log exporter the ``OTEL_EXPORTER_OTLP_[LOGS_]*`` variables configure, on the
SDK's own thread: the recorder's worker only queues. What waits for export is bounded (the telemetry queue's
size); past it a record is dropped and counted (``otlp_queue_full``), as is one the collector refused
(``otlp_export_failed``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from opentelemetry import trace
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.context import Context
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from llmtap import __version__
from llmtap.config.types import ConfigError, TelemetrySettings
from llmtap.telemetry.emit.setup import http_endpoint, resource
from llmtap.telemetry.identity import INSTANCE_KEY
from llmtap.worker import Progress

__all__ = ["LOG_DROP_REASONS", "CountingExporter", "LogSink", "log_exporter"]

#: The log record's event name.
EVENT_NAME = "llmtap.request"
#: Why a record's log record was lost.
LOG_DROP_REASONS = ("otlp_queue_full", "otlp_export_failed")

log = logging.getLogger("llmtap.telemetry")


def log_exporter(t: TelemetrySettings) -> LogRecordExporter:
    """The OTLP log exporter the environment configures; a clear error when it configures none."""
    if t.logs_exporter != "otlp" or t.logs_endpoint is None:
        raise ConfigError(
            "--record-logs needs an OTLP logs endpoint: set OTEL_EXPORTER_OTLP_ENDPOINT "
            "(or OTEL_EXPORTER_OTLP_LOGS_ENDPOINT), and leave OTEL_LOGS_EXPORTER unset or otlp"
        )
    # Headers: the exporter reads OTEL_EXPORTER_OTLP_[LOGS_]HEADERS itself (checked at start, ``llmtap.config.otel``).
    if t.logs_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HTTPLogExporter

        return HTTPLogExporter(endpoint=http_endpoint(t.logs_endpoint, "logs", specific=t.logs_endpoint_specific))
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GRPCLogExporter

    return GRPCLogExporter(endpoint=t.logs_endpoint, insecure=t.logs_endpoint.startswith("http://"))


class CountingExporter(LogRecordExporter):
    """Wraps the exporter: every returned batch frees its room at the gate; a failed one is counted."""

    def __init__(self, inner: LogRecordExporter, done: Callable[[int, bool], None]) -> None:
        self.inner = inner
        self.done = done

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        """Export, counting failures instead of raising."""
        try:
            result = self.inner.export(batch)
        except Exception:
            log.debug("log record export raised", exc_info=True)
            result = LogRecordExportResult.FAILURE
        self.done(len(batch), result == LogRecordExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        """Shut the wrapped exporter down."""
        self.inner.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Flush the wrapped exporter."""
        return self.inner.force_flush(timeout_millis)


def _hex_id(value: Any, digits: int) -> int | None:
    if not isinstance(value, str) or len(value) != digits:
        return None
    try:
        return int(value, 16) or None
    except ValueError:
        return None


class LogSink:
    """A record sink: each record as one OTLP log record, queued for the SDK's batch processor.

    A record is settled (``progress``, for the record journal) once its export returned, whatever it answered (a
    failed one is counted), or it was dropped; the batch processor exports in the order records came."""

    #: Which sink this is, to the record journal (``llmtap.telemetry.journal.spool``).
    kind = "logs"

    def __init__(
        self,
        exporter: LogRecordExporter,
        *,
        capacity: int,
        on_drop: Callable[[str, int], None],
        provider: LoggerProvider | None = None,
        instance_id: str | None = None,
    ) -> None:
        self.capacity = max(capacity, 1)
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._pending = 0
        self.exported = 0
        #: The records given and not yet exported (``llmtap.worker.Progress``).
        self.progress = Progress()
        # The records' writer is the resource's instance (the SDK would otherwise make up an id of its own).
        own = resource().merge(Resource({INSTANCE_KEY: instance_id})) if instance_id else resource()
        self.provider = provider or LoggerProvider(resource=own, shutdown_on_exit=False)
        batch = self.capacity if self.capacity < 512 else None
        self.provider.add_log_record_processor(
            BatchLogRecordProcessor(
                CountingExporter(exporter, self._done), max_queue_size=self.capacity, max_export_batch_size=batch
            )
        )
        self._logger = self.provider.get_logger("llmtap.records", __version__)
        self._said = False

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record's log record; past ``capacity`` waiting, drop it, counted. Never raises."""
        with self._lock:
            if self._pending >= self.capacity:
                full = True
            else:
                full = False
                self._pending += 1
        if full:
            self.progress.settle_now()
            self._drop("otlp_queue_full", 1)
            return
        self.progress.hold()
        try:
            self._logger.emit(
                LogRecord(
                    timestamp=_time_ns(record.get("time")),
                    observed_timestamp=time.time_ns(),
                    context=_span_context(record),
                    severity_number=SeverityNumber.INFO,
                    severity_text="INFO",
                    body=record,
                    event_name=EVENT_NAME,
                )
            )
        except Exception:
            self.progress.withdraw()
            with self._lock:
                self._pending -= 1
            if not self._said:
                self._said = True
                log.exception("telemetry: a record could not be made a log record; such records are counted")
            self._drop("otlp_export_failed", 1)

    def flush(self) -> None:
        """Nothing to do: the batch processor exports on its own schedule."""

    def close(self, timeout: float = 5.0) -> None:
        """Export what waits, within ``timeout``; what is still waiting then is lost (the process is ending)."""
        worker = threading.Thread(target=self._shutdown, name="llmtap-record-logs-flush", daemon=True)
        worker.start()
        worker.join(timeout)

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.provider.force_flush()
            self.provider.shutdown()

    def _done(self, n: int, ok: bool) -> None:
        self.progress.release(n)
        with self._lock:
            self._pending -= n
        if ok:
            self.exported += n
        else:
            self._drop("otlp_export_failed", n)

    def _drop(self, reason: str, n: int) -> None:
        try:
            self._on_drop(reason, n)
        except Exception:
            log.debug("telemetry: could not count a lost log record", exc_info=True)


def _span_context(record: dict[str, Any]) -> Context | None:
    """The request's root span as the log record's context (how the SDK puts trace and span ids on it)."""
    trace_id, span_id = _hex_id(record.get("trace_id"), 32), _hex_id(record.get("span_id"), 16)
    if trace_id is None or span_id is None:
        return None
    span = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    return trace.set_span_in_context(NonRecordingSpan(span))


def _time_ns(value: Any) -> int | None:
    if not isinstance(value, str):
        return None
    try:
        return int(datetime.fromisoformat(value).timestamp() * 1e9)
    except ValueError:
        return None
