"""Builds the OpenTelemetry providers from ``Settings``: OTLP over gRPC or HTTP, and the /metrics reader.

Nothing here is global: the providers are returned to the caller (the CLI), which injects them into
the app and shuts them down on exit. Histograms over OTLP follow
``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION`` (read into ``TelemetrySettings.histogram_aggregation``):
``base2_exponential_bucket_histogram`` sends every histogram as an exponential one: at most 160 buckets over
the range its values span, as narrow as that range allows. ``/metrics`` keeps explicit buckets whatever it
says (written sparse: ``prometheus``); explicit ones over OTLP carry every bound of the instruments' advice
(``instruments``: the fine buckets by default).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import (
    Aggregation,
    ExplicitBucketHistogramAggregation,
    ExponentialBucketHistogramAggregation,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

from llmtap import __version__
from llmtap.config.types import EXPONENTIAL, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit import otlp_spans, reservoir
from llmtap.telemetry.exposition.prometheus import PrometheusReader

__all__ = ["ExportGate", "build", "http_endpoint", "process_metrics", "resource"]

log = logging.getLogger("llmtap.telemetry")

#: Why a span never reached the collector (``llmtap.telemetry.reason``).
DROP_REASONS = ("queue_full", "export_failed", "shutdown")


class ExportGate(SpanProcessor):
    """The SDK's batch processor behind a gate that bounds what waits for export and counts what is lost.

    A span passes only while fewer than ``capacity`` spans are between here and the end of their export,
    so the batch queue behind it never overflows (where the SDK would drop without a count). Turned away
    at the gate: ``queue_full`` (the collector is slow or down); refused by the exporter:
    ``export_failed``; still waiting when the flush deadline passed: ``shutdown``. Memory stays bounded
    by ``capacity`` spans whatever the collector does.
    """

    def __init__(self, exporter: SpanExporter, capacity: int) -> None:
        self.capacity = capacity
        self.exported = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._pending = 0
        self._closed = False
        self._lock = threading.Lock()
        # The SDK refuses batches larger than its queue (512 by default): a small queue exports its own size.
        batch = capacity if capacity < 512 else None
        self.exporter = CountingSpanExporter(exporter, self)
        self._batch = BatchSpanProcessor(self.exporter, max_queue_size=capacity, max_export_batch_size=batch)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do when a span starts."""

    def on_end(self, span: ReadableSpan) -> None:
        """Let the span through to the batch queue, or count it dropped."""
        if span.context is None or not span.context.trace_flags.sampled:
            return  # the batch processor ignores unsampled spans too
        with self._lock:
            if self._closed:
                self.dropped["shutdown"] += 1
                return
            if self._pending >= self.capacity:
                self.dropped["queue_full"] += 1
                return
            self._pending += 1
        self._batch.on_end(span)

    def exported_batch(self, count: int, ok: bool) -> None:
        """The exporter returned for ``count`` spans (called by ``CountingSpanExporter``)."""
        with self._lock:
            self._pending -= count
            if ok:
                self.exported += count
            else:
                self.dropped["export_failed"] += count

    def abandon(self) -> int:
        """The flush deadline passed: count what still waits as dropped at shutdown; return how many."""
        with self._lock:
            self._closed = True
            lost, self._pending = self._pending, 0
            self.dropped["shutdown"] += lost
        return lost

    def shutdown(self) -> None:
        """Close the gate and export what waits (the caller bounds how long this may take)."""
        with self._lock:
            self._closed = True
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export what waits now."""
        return self._batch.force_flush(timeout_millis)

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        """The dropped spans by reason, for the observable counter on ``/metrics``."""
        return [Observation(n, {sc.TELEMETRY_REASON: reason}) for reason, n in self.dropped.items()]


class CountingSpanExporter(SpanExporter):
    """Wraps an exporter: failures are counted (never raised) and every returned batch is reported to the gate."""

    def __init__(self, inner: SpanExporter, gate: ExportGate) -> None:
        self.inner = inner
        self.gate = gate

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export, counting failures instead of raising."""
        try:
            result = self.inner.export(spans)
        except Exception:
            log.debug("span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        self.gate.exported_batch(len(spans), result == SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        """Shut the wrapped exporter down."""
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Flush the wrapped exporter."""
        return self.inner.force_flush(timeout_millis)


class CountingMetricExporter(MetricExporter):
    """Wraps a metric exporter and counts the exports that failed (with cumulative sums, the next one catches up)."""

    def __init__(self, inner: MetricExporter) -> None:
        # The reader asks the exporter for its temporality and aggregation: the wrapped exporter's apply.
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner = inner
        self.failed = 0

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        """Export, counting failures instead of raising."""
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            log.debug("metric export raised", exc_info=True)
            result = MetricExportResult.FAILURE
        if result != MetricExportResult.SUCCESS:
            self.failed += 1
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Flush the wrapped exporter."""
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Shut the wrapped exporter down."""
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        """The failed exports, for the observable counter on ``/metrics``."""
        return [Observation(self.failed)]


@dataclass(slots=True)
class Providers:
    """The providers the app was given, and the handles needed to inspect and stop them."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    prometheus: PrometheusReader | None
    span_gate: ExportGate | None = None
    metric_exporter: CountingMetricExporter | None = None

    def shutdown(self, timeout: float = 5.0, *, bound: float | None = None) -> None:
        """Flush and stop everything within ``timeout`` seconds; never raises.

        A dead or slow collector can hold an export for its whole timeout, with retries: past the
        deadline the flush is left to its daemon thread, what it still holds is counted as dropped,
        and the caller goes on (the process exits). ``bound``: the whole exit's flush bound, of which
        ``timeout`` is what is left, as the warning says it (default ``timeout``).
        """
        worker = threading.Thread(target=self._shutdown, name="llmtap-telemetry-flush", daemon=True)
        worker.start()
        worker.join(timeout)
        lost = self.span_gate.abandon() if self.span_gate is not None else 0
        if worker.is_alive():
            log.warning(
                "telemetry: flush not done within %.1f s (collector slow or unreachable); %d spans dropped",
                timeout if bound is None else bound,
                lost,
            )

    def _shutdown(self) -> None:
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is None:
                continue
            try:
                provider.shutdown()
            except Exception:
                log.warning("telemetry shutdown failed", exc_info=True)


def resource(env: Mapping[str, str] | None = None) -> Resource:
    """The service resource: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``, default name ``llmtap``."""
    env = os.environ if env is None else env
    attrs: dict[str, Any] = {}
    if not env.get("OTEL_SERVICE_NAME") and "service.name=" not in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = "llmtap"
    return Resource.create(attrs)


def _span_exporter(t: TelemetrySettings) -> SpanExporter | None:
    if t.traces_exporter == "console":
        return ConsoleSpanExporter()
    if t.traces_exporter != "otlp" or t.traces_endpoint is None:
        return None
    # Headers and timeout: the exporters read OTEL_EXPORTER_OTLP_[<SIGNAL>_]HEADERS and _TIMEOUT themselves
    # (checked at start, ``llmtap.config.otel``); the endpoint is the one the start-up line names.
    if t.traces_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

        return otlp_spans.exporter(
            HTTPSpanExporter(endpoint=http_endpoint(t.traces_endpoint, "traces", specific=t.traces_endpoint_specific))
        )
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCSpanExporter

    return otlp_spans.exporter(
        GRPCSpanExporter(endpoint=t.traces_endpoint, insecure=t.traces_endpoint.startswith("http://"))
    )


def _metric_exporter(t: TelemetrySettings) -> MetricExporter | None:
    if t.metrics_exporter == "console":
        return ConsoleMetricExporter()
    if t.metrics_exporter != "otlp" or t.metrics_endpoint is None:
        return None
    # From the settings, not left to the exporter's own reading of the variable (the same one, checked there).
    aggregation: dict[type, Aggregation] = {
        Histogram: ExponentialBucketHistogramAggregation()
        if t.histogram_aggregation == EXPONENTIAL
        else ExplicitBucketHistogramAggregation()
    }
    if t.metrics_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HTTPMetricExporter

        return HTTPMetricExporter(
            endpoint=http_endpoint(t.metrics_endpoint, "metrics", specific=t.metrics_endpoint_specific),
            preferred_aggregation=aggregation,
        )
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GRPCMetricExporter

    return GRPCMetricExporter(
        endpoint=t.metrics_endpoint,
        insecure=t.metrics_endpoint.startswith("http://"),
        preferred_aggregation=aggregation,
    )


def http_endpoint(endpoint: str, signal: str, *, specific: bool) -> str:
    """OTLP/HTTP: a base endpoint gets ``/v1/<signal>`` appended; a signal-specific one is used as is."""
    if specific:
        return endpoint
    return endpoint.rstrip("/") + f"/v1/{signal}"


def build(t: TelemetrySettings, env: Mapping[str, str] | None = None) -> Providers:
    """Providers for the given telemetry settings."""
    if t.sdk_disabled:
        return Providers(None, None, None, None)
    res = resource(env)
    # No atexit handlers: the caller shuts the providers down, within a deadline (``Providers.shutdown``).
    tracer_provider = TracerProvider(resource=res, shutdown_on_exit=False)
    gate: ExportGate | None = None
    inner = _span_exporter(t)
    if inner is not None:
        # A bounded queue: when the collector is down or slow, spans are dropped and counted, never buffered.
        gate = ExportGate(inner, t.queue_size)
        tracer_provider.add_span_processor(gate)
    readers: list[MetricReader] = []
    prometheus = PrometheusReader() if t.prometheus else None
    if prometheus is not None:
        readers.append(prometheus)
    inner_metrics = _metric_exporter(t)
    metric_exporter = CountingMetricExporter(inner_metrics) if inner_metrics is not None else None
    # An exporter that asks for what /metrics collects is fed from the same reader: one aggregation per series.
    shared = metric_exporter is not None and prometheus is not None and prometheus.shares(metric_exporter)
    if metric_exporter is not None and not shared:
        readers.append(
            PeriodicExportingMetricReader(metric_exporter, export_interval_millis=t.metric_export_interval_ms)
        )
    # Every histogram's exemplars find their bucket by bisection (``emit.reservoir``).
    views = reservoir.views()
    meter_provider = MeterProvider(resource=res, metric_readers=readers, views=views, shutdown_on_exit=False)
    if shared and prometheus is not None and metric_exporter is not None:
        prometheus.feed(metric_exporter, t.metric_export_interval_ms)
    meter = meter_provider.get_meter("llmtap", __version__, schema_url=sc.schema_url(t.semconv_latest))
    process_metrics(meter, time.time(), gate, metric_exporter)
    return Providers(tracer_provider, meter_provider, prometheus, gate, metric_exporter)


def process_metrics(
    meter: Meter, started: float, gate: ExportGate | None, exporter: CountingMetricExporter | None
) -> None:
    """The telemetry process's own instruments: when it started, and (with their exporters) the spans that never
    reached the collector and the metric exports it did not take."""
    meter.create_observable_gauge(
        sc.METRIC_START_TIME,
        callbacks=[lambda options: [Observation(started)]],
        unit="s",
        description="When this telemetry process started (Unix time): its counters count from 0 since then, so a "
        "restart shows here and Prometheus's increase() and rate() read the reset as one; the loss counters (tapes "
        "and records dropped, records recovered) go on from the last run's totals when a record journal keeps them.",
    )
    if gate is not None:
        meter.create_observable_counter(
            sc.METRIC_SPANS_DROPPED,
            callbacks=[gate.observe],
            unit="{span}",
            description="Spans that never reached the collector, by llmtap.telemetry.reason "
            "(queue_full, export_failed, shutdown).",
        )
    if exporter is not None:
        meter.create_observable_counter(
            sc.METRIC_EXPORTS_FAILED,
            callbacks=[exporter.observe],
            unit="{export}",
            description="Metric exports the collector did not take (cumulative sums: the next export catches up).",
        )
