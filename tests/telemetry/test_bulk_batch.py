"""A request's measurements through ``bulk.Batch`` give the points and exemplars the public API gives."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.attributes import _clean_attribute_value
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import Counter as SdkCounter, Histogram as SdkHistogram, MeterProvider
from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ExponentialHistogramDataPoint,
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from llmtap.telemetry.emit.bulk import Batch, Kept, _flat, _flat_key


def _point(name: str, p: Any) -> tuple[Any, ...]:
    exemplars = tuple(
        sorted(
            (round(e.value, 9), e.trace_id, e.span_id, tuple(sorted((e.filtered_attributes or {}).items())))
            for e in p.exemplars
        )
    )
    attributes = tuple(sorted(p.attributes.items()))
    if isinstance(p, NumberDataPoint):
        return (name, attributes, round(p.value, 9), exemplars)
    if isinstance(p, ExponentialHistogramDataPoint):
        buckets: Any = (p.scale, p.positive.offset, tuple(p.positive.bucket_counts))
    else:
        assert isinstance(p, HistogramDataPoint)
        buckets = tuple(p.bucket_counts)
    return (name, attributes, p.count, round(p.sum, 9), p.min, p.max, buckets, exemplars)


def _points(temporality: AggregationTemporality, exponential: bool, batched: bool, kept: bool = False) -> list[Any]:
    views = [View(instrument_name="h", aggregation=ExponentialBucketHistogramAggregation())] if exponential else []
    # Views that keep some attributes only: their series add up several attribute sets.
    views += [
        View(instrument_name="h", name="h.by_a", attribute_keys={"a"}),
        View(instrument_name="c", name="c.by_n", attribute_keys={"n"}),
    ]
    prefer: dict[type, AggregationTemporality] = {SdkHistogram: temporality, SdkCounter: temporality}
    other = AggregationTemporality.DELTA if temporality == AggregationTemporality.CUMULATIVE else temporality
    readers = [
        InMemoryMetricReader(preferred_temporality=prefer),
        InMemoryMetricReader(preferred_temporality={**prefer, SdkHistogram: other, SdkCounter: other}),
    ]
    provider = MeterProvider(metric_readers=readers, views=views, shutdown_on_exit=False)
    meter = provider.get_meter("t")
    hist = meter.create_histogram("h", explicit_bucket_boundaries_advisory=[0.01, 0.02, 0.05])
    other_hist = meter.create_histogram("g")
    counter = meter.create_counter("c")
    # Kept sets across requests: a limit of 3 empties it now and then.
    keep = Kept(limit=3) if kept else None
    rng = random.Random(5)
    # Counters keep exemplars by reservoir sampling on the global generator: the same seed, the same choices.
    random.seed(11)
    points: list[Any] = []
    for _round in range(2):  # two collections: delta resets between them
        for request in range(12):
            sampled = request % 3 != 0
            span = NonRecordingSpan(SpanContext(request + 1, request + 100, False, TraceFlags(1 if sampled else 0)))
            ctx: Context | None = trace.set_span_in_context(span) if request % 4 else None
            shared = {"a": "x" if request % 2 else "y", "n": request % 3}
            wider = {**shared, "m": "model", "stream": True}
            batch = Batch(keep)
            calls: list[tuple[Any, ...]] = [
                ("record", hist, rng.uniform(0, 0.08), shared),
                ("record", hist, rng.uniform(0, 0.08), wider),
                ("record", other_hist, rng.uniform(0, 3), shared),
                ("add", counter, rng.randint(0, 50), wider),
                ("add", counter, 1, {**wider, "outcome": "ok"}),
                # Equal in Python, not to the SDK: each its own series.
                ("add", counter, 1, {"a": "x", "n": 1}),
                ("add", counter, 1, {"a": "x", "n": True}),
                ("add", counter, 1, {"a": "x", "n": 1.0}),
                ("record", other_hist, rng.uniform(0, 3), {"a": ["x", "y"]}),  # not flat: cleaned per request
                ("record", hist, rng.uniform(0, 0.08), shared),  # the same set again
            ]
            for kind, instrument, value, attributes in calls:
                if batched:
                    getattr(batch, kind)(instrument, value, attributes, ctx)
                else:
                    getattr(instrument, kind)(value, attributes, context=ctx)
        for reader in readers:
            data = reader.get_metrics_data()
            assert data is not None
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points += [_point(m.name, p) for p in m.data.data_points]
    provider.shutdown()
    return sorted(points, key=repr)


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
@pytest.mark.parametrize("exponential", [False, True], ids=["explicit", "exponential"])
def test_a_batch_gives_the_points_and_exemplars_of_the_public_api(
    temporality: AggregationTemporality, exponential: bool
) -> None:
    public = _points(temporality, exponential, batched=False)
    assert len(public) >= 20
    assert any(p[-1] for p in public), "no exemplar was kept: the comparison would not show their loss"
    assert _points(temporality, exponential, batched=True) == public
    assert _points(temporality, exponential, batched=True, kept=True) == public


def test_kept_sets_are_taken_by_content_and_bounded() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    counter = provider.get_meter("t").create_counter("c")
    kept = Kept(limit=4)
    first = kept.held({"a": "x", "n": 1})
    assert first is not None
    assert kept.held({"a": "x", "n": 1}) is first  # another dict, the same content
    assert kept.held({"a": "x", "n": True}) is not first  # the same in Python, not to the SDK
    assert kept.held({"n": 1, "a": "x"}) is not first  # another order: another set, as the SDK keeps it
    assert kept.held({"a": ["x"]}) is not kept.held({"a": ["x"]})  # not flat: cleaned each time
    kept.held({"a": "y"})  # the fourth flat set fills it ...
    assert kept.held({"a": "x", "n": 1}) is first
    kept.held({"a": "z"})  # ... and the fifth empties it first
    assert kept.held({"a": "x", "n": 1}) is not first
    assert kept.matches(counter) is kept.matches(counter)
    provider.shutdown()


def test_values_the_sdk_refuses_take_the_public_path(caplog: pytest.LogCaptureFixture) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    meter = provider.get_meter("t")
    hist, counter = meter.create_histogram("h"), meter.create_counter("c")
    batch = Batch()
    with caplog.at_level(logging.WARNING):
        batch.record(hist, float("nan"), {"a": 1})
        batch.record(hist, -1.0, {"a": 1})
        batch.add(counter, -2, {"a": 1})
        batch.record(hist, 0.5, {"a": 1})
    # The SDK's own warnings, and only the valid value counted.
    assert caplog.text.count("non-negative") + caplog.text.count("not finite") >= 2
    data = reader.get_metrics_data()
    assert data is not None
    [h] = [m for m in data.resource_metrics[0].scope_metrics[0].metrics if m.name == "h"]
    [p] = h.data.data_points
    assert isinstance(p, HistogramDataPoint) and (p.count, p.sum) == (1, 0.5)
    provider.shutdown()


def test_a_flat_set_is_keyed_as_the_sdk_keys_it_and_anything_else_is_left_to_the_sdk() -> None:
    rng = random.Random(9)
    plain: list[Any] = ["", "x", "ünï", True, False, 0, 1, -7, 2**70, 0.0, 1.5, -2.25]
    for _ in range(300):
        attributes = {f"k{rng.randint(0, 30)}": rng.choice(plain) for _ in range(rng.randint(0, 12))}
        assert _flat(attributes)
        assert _clean_attribute_value(attributes, None) == attributes
        assert _flat_key(attributes) == _hash_attributes(attributes)
    # Sequences, None, non-text or empty keys, non-finite floats and other types: not flat.
    for odd in ({"a": (1, 2)}, {"a": None}, {"": 1}, {1: "a"}, {"a": float("nan")}, {"a": b"x"}, {"a": [1]}):
        assert not _flat(odd), odd  # type: ignore[arg-type]
