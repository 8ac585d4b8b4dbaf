"""Builds the OpenTelemetry providers from ``Settings``: OTLP over gRPC or HTTP, and the /metrics reader.

Nothing here is global: the providers are returned to the caller (the CLI), which injects them into
the app and shuts them down on exit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

from proxy.settings import Telemetry
from proxy.telemetry.prometheus import PrometheusReader

log = logging.getLogger("llmtap.telemetry")


class CountingSpanExporter(SpanExporter):
    """Wraps an exporter and counts spans it failed to deliver, for ``/metrics``."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.failed_spans = 0
        self.exported_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export, counting failures instead of raising."""
        try:
            result = self.inner.export(spans)
        except Exception:
            log.debug("span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.exported_spans += len(spans)
        else:
            self.failed_spans += len(spans)
        return result

    def shutdown(self) -> None:
        """Shut the wrapped exporter down."""
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Flush the wrapped exporter."""
        return self.inner.force_flush(timeout_millis)


@dataclass(slots=True)
class Providers:
    """The providers the app was given, and the handles needed to inspect and stop them."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    prometheus: PrometheusReader | None
    span_exporter: CountingSpanExporter | None

    def shutdown(self) -> None:
        """Flush and stop everything; errors are logged, never raised."""
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


def _span_exporter(t: Telemetry) -> SpanExporter | None:
    if t.traces_exporter == "console":
        return ConsoleSpanExporter()
    if t.traces_exporter != "otlp" or t.traces_endpoint is None:
        return None
    headers = dict(t.traces_headers)
    if t.traces_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

        return HTTPSpanExporter(
            endpoint=_http_endpoint(t.traces_endpoint, "traces", specific=_specific("TRACES")), headers=headers
        )
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCSpanExporter

    return GRPCSpanExporter(
        endpoint=t.traces_endpoint, headers=headers, insecure=t.traces_endpoint.startswith("http://")
    )


def _metric_exporter(t: Telemetry) -> MetricExporter | None:
    if t.metrics_exporter == "console":
        return ConsoleMetricExporter()
    if t.metrics_exporter != "otlp" or t.metrics_endpoint is None:
        return None
    headers = dict(t.metrics_headers)
    if t.metrics_protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HTTPMetricExporter

        return HTTPMetricExporter(
            endpoint=_http_endpoint(t.metrics_endpoint, "metrics", specific=_specific("METRICS")), headers=headers
        )
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GRPCMetricExporter

    return GRPCMetricExporter(
        endpoint=t.metrics_endpoint, headers=headers, insecure=t.metrics_endpoint.startswith("http://")
    )


def _specific(signal: str) -> bool:
    return bool(os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def _http_endpoint(endpoint: str, signal: str, *, specific: bool) -> str:
    """OTLP/HTTP: a base endpoint gets ``/v1/<signal>`` appended; a signal-specific one is used as is."""
    if specific:
        return endpoint
    return endpoint.rstrip("/") + f"/v1/{signal}"


def build(t: Telemetry, env: Mapping[str, str] | None = None) -> Providers:
    """Providers for the given telemetry settings."""
    if t.sdk_disabled:
        return Providers(None, None, None, None)
    res = resource(env)
    tracer_provider = TracerProvider(resource=res)
    span_exporter: CountingSpanExporter | None = None
    inner = _span_exporter(t)
    if inner is not None:
        span_exporter = CountingSpanExporter(inner)
        # A bounded queue: when the collector is down or slow, spans are dropped, never buffered without end.
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter, max_queue_size=t.queue_size))
    readers: list[MetricReader] = []
    prometheus = PrometheusReader() if t.prometheus else None
    if prometheus is not None:
        readers.append(prometheus)
    metric_exporter = _metric_exporter(t)
    if metric_exporter is not None:
        readers.append(
            PeriodicExportingMetricReader(metric_exporter, export_interval_millis=t.metric_export_interval_ms)
        )
    meter_provider = MeterProvider(resource=res, metric_readers=readers)
    return Providers(tracer_provider, meter_provider, prometheus, span_exporter)
