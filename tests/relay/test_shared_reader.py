"""``/metrics`` and the OTLP metric export from one reader: each sample aggregated once, every exemplar to both.

Through the SDK's real meter provider and the telemetry settings' own wiring (``llmtap.telemetry.emit.setup.build``);
the exporter under test keeps what it is given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import Aggregation, ExponentialBucketHistogramAggregation
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from llmtap.config.otel import telemetry_from_env
from llmtap.telemetry.emit.setup import build
from llmtap.telemetry.exposition.prometheus import PrometheusReader
from tests.conftest import PATIENCE
from tests.e2e.test_otlp import HTTPReceiver

BOUNDS = [0.1, 0.5, 1.0]


class Keeping(MetricExporter):
    """Keeps every collection it is given; counts its flushes and shutdowns."""

    def __init__(self) -> None:
        super().__init__()
        self.exports: list[MetricsData] = []
        self.flushed = self.shut = 0

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        self.flushed += 1
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.shut += 1


def in_span(trace_id: int) -> Context:
    """A context whose current span is a sampled one of ``trace_id``."""
    span = SpanContext(trace_id, trace_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(span))


def points(data: MetricsData, name: str) -> list[HistogramDataPoint]:
    found = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]
    assert all(isinstance(p, HistogramDataPoint) for p in found)
    return found  # type: ignore[return-value]


def traces(exemplars: Sequence[Any]) -> list[int]:
    return sorted(e.trace_id for e in exemplars)


def _readers(provider: MeterProvider) -> list[Any]:
    return list(provider._metric_readers)


@pytest.fixture
def fed() -> Any:
    reader = PrometheusReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    exporter = Keeping()
    assert reader.shares(exporter)
    reader.feed(exporter, 3_600_000)  # no tick within the test: exports are asked for
    hist = provider.get_meter("t").create_histogram("latency", unit="s", explicit_bucket_boundaries_advisory=BOUNDS)
    yield reader, provider, exporter, hist
    provider.shutdown()


def test_every_exemplar_reaches_the_export_though_a_scrape_collected_it_first(fed: Any) -> None:
    reader, _, exporter, hist = fed
    hist.record(0.05, {"route": "r"}, context=in_span(1))
    hist.record(0.7, {"route": "r"}, context=in_span(2))
    page = reader.render(openmetrics=True)
    assert f'trace_id="{1:032x}"' in page and f'trace_id="{2:032x}"' in page
    # The scrape emptied the SDK's reservoirs; the export still carries both.
    assert reader.export()
    [point] = points(exporter.exports[-1], "latency")
    assert point.count == 2 and traces(point.exemplars) == [1, 2]
    # Sent once: the next export has only what came since, the newest of its bucket ...
    hist.record(0.06, {"route": "r"}, context=in_span(3))
    hist.record(0.07, {"route": "r"}, context=in_span(4))
    assert reader.export()
    [point] = points(exporter.exports[-1], "latency")
    assert point.count == 4 and traces(point.exemplars) == [4]
    # ... while the page keeps each bucket's newest whatever was exported.
    page = reader.render(openmetrics=True)
    assert f'trace_id="{4:032x}"' in page and f'trace_id="{2:032x}"' in page
    assert f'trace_id="{1:032x}"' not in page


def test_one_aggregation_serves_the_page_and_the_export(fed: Any) -> None:
    reader, _, exporter, hist = fed
    for value in (0.2, 0.3, 2.0):
        hist.record(value, {"route": "r"})
    reader.export()
    [point] = points(exporter.exports[-1], "latency")
    page = reader.render()
    assert point.count == 3 and list(point.bucket_counts) == [0, 2, 0, 1]
    assert 'latency_seconds_count{route="r"} 3' in page
    assert point.exemplars == []


def test_flush_and_shutdown_export_and_shutdown_stops_the_exporter(fed: Any) -> None:
    _, provider, exporter, hist = fed
    hist.record(0.2, {"route": "r"})
    assert provider.force_flush()
    assert len(exporter.exports) == 1 and exporter.flushed == 1
    hist.record(0.3, {"route": "r"})
    provider.shutdown()
    assert len(exporter.exports) == 2 and exporter.shut == 1
    [point] = points(exporter.exports[-1], "latency")
    assert point.count == 2


def test_the_exporter_is_fed_at_its_interval() -> None:
    reader = PrometheusReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    exporter = Keeping()
    reader.feed(exporter, 50)
    provider.get_meter("t").create_counter("requests").add(1)
    try:
        deadline = time.monotonic() + PATIENCE
        while len(exporter.exports) < 2:
            assert time.monotonic() < deadline, f"{len(exporter.exports)} exports"
            time.sleep(0.02)
    finally:
        provider.shutdown()


def test_an_exporter_that_wants_deltas_or_exponential_histograms_gets_its_own_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader = PrometheusReader()
    assert reader.shares(OTLPMetricExporter(endpoint="http://127.0.0.1:9/v1/metrics"))
    exponential: dict[type, Aggregation] = {Histogram: ExponentialBucketHistogramAggregation()}
    assert not reader.shares(
        OTLPMetricExporter(endpoint="http://127.0.0.1:9/v1/metrics", preferred_aggregation=exponential)
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    assert not reader.shares(OTLPMetricExporter(endpoint="http://127.0.0.1:9/v1/metrics"))


@pytest.mark.parametrize("histograms", ["explicit_bucket_histogram", "base2_exponential_bucket_histogram"])
def test_build_feeds_a_sharing_exporter_from_the_metrics_reader_and_gives_another_its_own(histograms: str) -> None:
    receiver = HTTPReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": histograms,
    }
    try:
        providers = build(telemetry_from_env(env))
        assert providers.meter_provider is not None and providers.prometheus is not None
        readers = _readers(providers.meter_provider)
        if histograms == "explicit_bucket_histogram":
            # The defaults: fed from /metrics' reader, no second reader.
            assert readers == [providers.prometheus]
        else:
            # Exponential histograms over OTLP: a reader of their own (the page keeps explicit buckets).
            assert len(readers) == 2 and isinstance(readers[1], PeriodicExportingMetricReader)
        meter = providers.meter_provider.get_meter("t")
        meter.create_counter("shared.requests").add(3)
        meter.create_histogram("shared.latency", unit="s").record(0.2, context=in_span(5))
        assert "shared_latency_seconds_count 1" in providers.prometheus.render()
        providers.shutdown()
        # Once more at shutdown, exemplar and all, though the scrape above collected first.
        metrics = receiver.received.latest_metrics()
        assert metrics["shared.requests"][1].sum.data_points[0].as_int == 3
        latency = metrics["shared.latency"][1]
        point = (
            latency.histogram.data_points[0]
            if histograms == "explicit_bucket_histogram"
            else (latency.exponential_histogram.data_points[0])
        )
        assert point.count == 1 and [int.from_bytes(e.trace_id, "big") for e in point.exemplars] == [5]
    finally:
        receiver.close()
