"""Spans nothing reads are not built: a request's other output, and the spans once a processor reads them, are
the same as when every span was built."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.spans import MAX_TRACE_CONTEXT
from llmtap.telemetry.recorder import Recorder
from tests.telemetry.test_recorder import ROUTES, timeline


class Side:
    """A recorder over its own SDK providers; ``read``: with a span processor that keeps every span."""

    def __init__(self, *, read: bool) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        if read:
            self.read()
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        # Every request keeps its chunk spans where they are read: the tail then sees every request.
        telemetry = TelemetrySettings(chunk_detail_sample=0.5)
        self.recorder = Recorder(
            Settings(routes=ROUTES, telemetry=telemetry),
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
        )

    def read(self) -> None:
        """A span processor from now on."""
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def close(self) -> None:
        self.recorder.close()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    unread, read = Side(read=False), Side(read=True)
    yield unread, read
    unread.close()
    read.close()


def requests() -> list[Timeline]:
    """Requests with the relay's ids: streamed and not, failed, with client trace headers short and too long."""
    out: list[Timeline] = []
    for i in range(24):
        tl = timeline(1 + i % 7, stream=i % 3 != 0)
        tl.trace_id = f"{0x4BF92F3577B34DA6A3CE929D0E0E0000 + i * 7919:032x}"
        tl.span_id = f"{0x00F067AA0BA90000 + i:016x}"
        tl.sampled = i % 5 != 0
        if i % 4 == 1:
            tl.parent = (f"00-{tl.trace_id}-{'ab' * 8}-01", "")
        if i % 6 == 2:
            tl.parent = ("00-" + "a" * (MAX_TRACE_CONTEXT + 1), "")
        if i % 6 == 5:
            tl.parent = (f"00-{tl.trace_id}-{'ab' * 8}-01", "k=" + "v" * MAX_TRACE_CONTEXT)
        if i % 8 == 3:
            tl.outcome, tl.error_type = "error", "upstream_error"
        out.append(tl)
    return out


def metric_view(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Every data point read by ``reader``: its attributes and values (buckets, sum, count, min, max; a sum's
    value) and exemplars (ids and value), with no timestamp."""
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                rows = []
                for p in m.data.data_points:
                    values: tuple[Any, ...]
                    if isinstance(p, HistogramDataPoint):
                        values = (tuple(p.bucket_counts), p.sum, p.count, p.min, p.max)
                    elif isinstance(p, NumberDataPoint):
                        values = (p.value,)
                    else:
                        buckets = (p.positive.offset, tuple(p.positive.bucket_counts))
                        negative = (p.negative.offset, tuple(p.negative.bucket_counts))
                        values = (p.scale, p.zero_count, buckets, negative, p.sum, p.count, p.min, p.max)
                    exemplars = sorted((e.trace_id, e.span_id, e.value) for e in p.exemplars or ())
                    rows.append((sorted((p.attributes or {}).items()), values, exemplars))
                out[m.name] = sorted(rows, key=repr)
    return out


def tails(side: Side) -> dict[str, tuple[Any, ...]]:
    """What the chunk-detail tail of each route has seen."""
    found = side.recorder.spans.chunk_detail._tails
    return {route: (t.seen, list(t.ttfts), list(t.gaps), t.ttft, t.gap) for route, t in found.items()}


def test_spans_nothing_reads_are_not_built(sides: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch) -> None:
    unread, _ = sides
    built: list[Timeline] = []
    monkeypatch.setattr(unread.recorder.spans, "root", built.append)
    tl = requests()[1]
    ids = (tl.trace_id, tl.span_id)
    unread.recorder.record(tl)
    assert built == [] and (tl.trace_id, tl.span_id) == ids
    assert unread.recorder.failed == 0


def test_everything_else_is_as_when_the_spans_are_built(sides: tuple[Side, Side]) -> None:
    """Metrics (buckets, sums, counts, exemplars), the ignored trace headers' count and the chunk-detail tail."""
    unread, read = sides
    for side in sides:
        for tl in requests():
            side.recorder.record(tl)
    assert len(read.exporter.get_finished_spans()) > 24 and unread.exporter.get_finished_spans() == ()
    view = metric_view(unread.reader)
    assert view == metric_view(read.reader)
    ignored = view[sc.METRIC_TRACE_CONTEXT_IGNORED]
    assert {dict(a)[sc.TRACE_CONTEXT_REASON]: v[0] for a, v, _ in ignored} == {
        "traceparent_too_long": 4,
        "tracestate_too_long": 4,
    }
    # The tail sees every request that did not fail (three of the 24 did).
    assert tails(unread) == tails(read) and tails(read)["default"][0] == 21
    assert unread.recorder.failed == read.recorder.failed == 0


def test_a_processor_added_later_gets_every_span_from_then_on(sides: tuple[Side, Side]) -> None:
    unread, read = sides
    for tl in requests()[:12]:
        unread.recorder.record(tl)
        read.recorder.record(tl)
    unread.read()
    read.exporter.clear()
    for tl in requests()[12:]:
        unread.recorder.record(tl)
        read.recorder.record(tl)

    def spans(side: Side) -> list[tuple[Any, ...]]:
        return sorted(
            (s.name, s.context.trace_id, s.start_time, s.end_time, sorted((s.attributes or {}).items()))
            for s in side.exporter.get_finished_spans()
            # A chunk span's own id is new in each run; its times and attributes are the same.
        )

    assert len(spans(read)) > 12
    assert spans(unread) == spans(read)


def test_a_request_without_ids_gets_them_from_its_root_span(sides: tuple[Side, Side]) -> None:
    unread, _ = sides
    tl = timeline(3)
    assert tl.trace_id is None and tl.span_id is None
    unread.recorder.record(tl)
    assert tl.trace_id is not None and int(tl.trace_id, 16) != 0
    assert tl.span_id is not None and int(tl.span_id, 16) != 0
