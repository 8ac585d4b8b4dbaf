"""Exemplar reservoirs by bisection (``llmtap.telemetry.emit.reservoir``): the bucket the SDK's walk finds, for every
value and every boundary set llmtap's histograms have; and the meter provider ``build`` makes keeps each bucket's
latest exemplar with them, on ``/metrics`` as before."""

from __future__ import annotations

import math
import random

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import AlignedHistogramBucketExemplarReservoir, SimpleFixedSizeExemplarReservoir
from opentelemetry.sdk.metrics._internal.aggregation import (
    _ExplicitBucketHistogramAggregation,
    _ExponentialBucketHistogramAggregation,
    _SumAggregation,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from llmtap.config.types import EXPONENTIAL, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit import instruments, setup
from llmtap.telemetry.emit.instruments import create
from llmtap.telemetry.emit.reservoir import BisectBucketReservoir, reservoir_for

NONE = Context()
BOUNDARY_SETS = {
    name: list(getattr(instruments, name))
    for name in ("DURATION_BUCKETS", "TOKEN_BUCKETS", "OVERHEAD_BUCKETS", "DRIFT_BUCKETS")
}


@pytest.mark.parametrize("name", sorted(BOUNDARY_SETS))
def test_bisection_finds_the_bucket_the_sdks_walk_finds(name: str) -> None:
    boundaries = BOUNDARY_SETS[name]
    walk = AlignedHistogramBucketExemplarReservoir(boundaries)
    bisect = BisectBucketReservoir(boundaries)
    rng = random.Random(7)
    low, high = boundaries[0], boundaries[-1]
    values = [*boundaries, *(math.nextafter(b, -math.inf) for b in boundaries)]
    values += [math.nextafter(b, math.inf) for b in boundaries]
    values += [low / 2, 0.0, -1.0, high * 2, math.inf, -math.inf, math.nan]
    values += [rng.uniform(-high, 2 * high) for _ in range(2000)]
    values += [math.exp(rng.uniform(math.log(max(low, 1e-9)) - 2, math.log(high) + 2)) for _ in range(2000)]
    for value in values:
        assert bisect._find_bucket_index(value, 0, None, NONE) == walk._find_bucket_index(value, 0, None, NONE), value


def test_only_explicit_buckets_change_reservoir() -> None:
    assert reservoir_for(_ExplicitBucketHistogramAggregation) is BisectBucketReservoir
    # Every other aggregation keeps the SDK's default.
    assert reservoir_for(_ExponentialBucketHistogramAggregation) is SimpleFixedSizeExemplarReservoir
    assert reservoir_for(_SumAggregation) is SimpleFixedSizeExemplarReservoir


def test_the_built_provider_keeps_each_buckets_latest_exemplar_by_bisection() -> None:
    providers = setup.build(TelemetrySettings())
    assert providers.meter_provider is not None and providers.prometheus is not None
    try:
        ins = create(providers.meter_provider.get_meter("llmtap-test"), latest=False)

        def record(value: float, trace_id: int) -> None:
            ctx = set_span_in_context(NonRecordingSpan(SpanContext(trace_id, 1, False, TraceFlags(1))))
            ins.ttft.record(value, {sc.ROUTE: "r"}, context=ctx)

        record(0.12, 0xA)
        record(7.5, 0xB)
        record(0.1201, 0xC)  # the bucket of 0.12: its exemplar replaced
        page = providers.prometheus.render(openmetrics=True).splitlines()
        marks = {line.split(" ", 1)[0]: line.split('trace_id="')[1][:32] for line in page if " # {" in line}
        assert sorted(marks.values()) == [f"{0xB:032x}", f"{0xC:032x}"], marks
        # Each in the bucket its value falls in: the smallest ``le`` at or above it.
        for series, trace in marks.items():
            le = float(series.split('le="', 1)[1].split('"', 1)[0])
            value = 7.5 if trace == f"{0xB:032x}" else 0.1201
            below = [b for b in BOUNDARY_SETS["DURATION_BUCKETS"] if b < le]
            assert value <= le and (not below or value > below[-1]), (series, value)
        reservoirs = [
            agg._reservoir
            for storage in ins.ttft._measurement_consumer._reader_storages.values()  # type: ignore[attr-defined]
            for match in storage._instrument_view_instrument_matches[ins.ttft]
            for agg in match._attributes_aggregation.values()
        ]
        assert reservoirs and all(type(r) is BisectBucketReservoir for r in reservoirs), reservoirs
    finally:
        providers.meter_provider.shutdown()


def test_an_exponential_export_beside_metrics_keeps_the_sdks_reservoir_for_its_aggregation() -> None:
    """OTLP export in exponential histograms beside ``/metrics``: each reader's aggregation gets its own reservoir,
    the explicit buckets of ``/metrics`` by bisection, the exponential ones the SDK's default."""
    t = TelemetrySettings(
        metrics_exporter="otlp",
        metrics_endpoint="http://127.0.0.1:9",
        metric_export_interval_ms=3_600_000,
        histogram_aggregation=EXPONENTIAL,
    )
    providers = setup.build(t)
    assert providers.meter_provider is not None
    try:
        ins = create(providers.meter_provider.get_meter("llmtap-test"), latest=False)
        ctx = set_span_in_context(NonRecordingSpan(SpanContext(0xD, 1, False, TraceFlags(1))))
        ins.ttft.record(0.3, {sc.ROUTE: "r"}, context=ctx)
        kinds = sorted(
            (type(agg).__name__, type(agg._reservoir).__name__)
            for storage in ins.ttft._measurement_consumer._reader_storages.values()  # type: ignore[attr-defined]
            for match in storage._instrument_view_instrument_matches[ins.ttft]
            for agg in match._attributes_aggregation.values()
        )
        assert kinds == [
            ("_ExplicitBucketHistogramAggregation", "BisectBucketReservoir"),
            ("_ExponentialBucketHistogramAggregation", "SimpleFixedSizeExemplarReservoir"),
        ], kinds
    finally:
        providers.meter_provider.shutdown(timeout_millis=100)
