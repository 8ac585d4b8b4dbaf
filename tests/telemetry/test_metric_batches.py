"""Metrics recorded a batch of requests at a time equal those recorded one request at a time: every bucket, sum,
count, min, max, counter value and exemplar, whatever the readers' aggregation and temporality."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, UpDownCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

from llmtap.analysis.finish import Finished
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Attribution, Settings, TelemetrySettings
from llmtap.telemetry.emit.bulk import Batch, Fixed, Kept
from llmtap.telemetry.emit.sets import NONE, Sets
from llmtap.telemetry.recorder import Recorder
from llmtap.types import Usage
from tests.telemetry.test_recorder import ROUTES, timeline
from tests.telemetry.test_unread_spans import metric_view

DELTA: dict[type, AggregationTemporality] = {
    Counter: AggregationTemporality.DELTA,
    Histogram: AggregationTemporality.DELTA,
}
READERS: dict[str, Callable[[], InMemoryMetricReader]] = {
    "cumulative": InMemoryMetricReader,
    "delta": lambda: InMemoryMetricReader(preferred_temporality=DELTA),
    "exponential": lambda: InMemoryMetricReader(
        preferred_aggregation={Histogram: ExponentialBucketHistogramAggregation()}
    ),
}


def requests() -> list[Timeline]:
    """Streamed and not, several models, failures, costs in fractions (float sums whose order shows), sampled
    and not: each request with the relay's ids."""
    out: list[Timeline] = []
    for i in range(40):
        usage = Usage(input_tokens=17 + i * 13, output_tokens=1 + i % 9)
        tl = timeline(1 + i % 11, stream=i % 3 != 0, model=f"m{i % 4}", response_model=None, usage=usage)
        tl.trace_id = f"{0x0AF7651916CD43DD8448EB211C800000 + i * 104729:032x}"
        tl.span_id = f"{0x00B7AD6B71690000 + i:016x}"
        tl.sampled = i % 4 != 1
        tl.relay_delays = array("d", [0.0001 * (j + 1) * (1 + i % 3) for j in range(1 + i % 5)])
        if i % 7 == 4:
            tl.outcome, tl.error_type = "error", "upstream_error"
        out.append(tl)
    return out


def recorder(reader: InMemoryMetricReader, views: tuple[View, ...] = ()) -> tuple[Recorder, MeterProvider]:
    provider = MeterProvider(metric_readers=[reader], views=list(views), shutdown_on_exit=False)
    settings = Settings(routes=ROUTES, telemetry=TelemetrySettings())
    return Recorder(settings, meter_provider=provider), provider


def finished(rec: Recorder) -> list[Finished]:
    """Each request made whole by this recorder's analysis (its state as the recorder's worker would carry it)."""
    return [rec.analysis.finish(tl, None) for tl in requests()]


@pytest.mark.parametrize("readers", sorted(READERS))
@pytest.mark.parametrize("size", [2, 7, 64])
def test_a_batch_records_what_its_requests_record_one_by_one(readers: str, size: int) -> None:
    one_reader, batch_reader = READERS[readers](), READERS[readers]()
    one, one_provider = recorder(one_reader)
    batched, batch_provider = recorder(batch_reader)
    try:
        for request in finished(one):
            one.emission.emit([request])
        done = finished(batched)
        for start in range(0, len(done), size):
            batched.emission.emit(done[start : start + size])
        view = metric_view(one_reader)
        assert view == metric_view(batch_reader)
        assert one.failed == batched.failed == 0
        # The requests' own figures are there, exemplars too (the sampled requests' trace ids).
        assert sum(len(row[2]) for rows in view.values() for row in rows) > 0
        assert len(view) > 10
    finally:
        for rec, provider in ((one, one_provider), (batched, batch_provider)):
            rec.close()
            provider.shutdown()


def test_a_view_that_keeps_some_attributes_is_recorded_in_order() -> None:
    """Two attribute sets that such a view folds into one series: their values still go in in their order."""
    views = (View(instrument_name="*", attribute_keys={"llmtap.route"}),)
    one_reader, batch_reader = InMemoryMetricReader(), InMemoryMetricReader()
    one, one_provider = recorder(one_reader, views)
    batched, batch_provider = recorder(batch_reader, views)
    try:
        for request in finished(one):
            one.emission.emit([request])
        batched.emission.emit(finished(batched))
        assert metric_view(one_reader) == metric_view(batch_reader)
    finally:
        for rec, provider in ((one, one_provider), (batched, batch_provider)):
            rec.close()
            provider.shutdown()


def test_a_value_the_sdk_refuses_keeps_its_place() -> None:
    """A value taken by the public API (negative, not finite) flushes what waits first."""
    readers = InMemoryMetricReader(), InMemoryMetricReader()
    providers = [MeterProvider(metric_readers=[r], shutdown_on_exit=False) for r in readers]
    values: list[Any] = [0.5, 1.25, -1.0, 3.0, float("inf"), 0.1, 0.2]
    for provider, defer in zip(providers, (False, True), strict=True):
        meter = provider.get_meter("t")
        hist, counter = meter.create_histogram("h"), meter.create_up_down_counter("c")
        assert isinstance(counter, UpDownCounter)
        batch = Batch(Kept(), defer=defer)
        for value in values:
            batch.record(hist, value, {"a": "x"})
            batch.add(counter, value, {"a": "x"})
        batch.flush()
    assert metric_view(readers[0]) == metric_view(readers[1])
    for provider in providers:
        provider.shutdown()


def varied() -> list[Timeline]:
    """Requests whose attribute sets repeat and vary: the batch's requests, and the same again with prompt
    versions, tenants, server ports of other types, drift, cost and over more models than the model label keeps
    (its guard then turns later ones into ``_OTHER``, changing a set the values made before)."""
    out = requests()
    for i, tl in enumerate(requests()):
        tl.prompt_version = f"v{i % 3}" if i % 5 else None
        tl.attribution = {"tenant": f"t{i % 6}"} if i % 2 else {}
        tl.server_port = "8000" if i % 9 == 3 else 8000  # type: ignore[assignment]
        if tl.request is not None:
            tl.request.model = f"model-{i}" if i % 4 == 0 else tl.request.model
        out.append(tl)
    # Equal in Python, apart as attribute values: 1, True and 1.0 are three series of otherwise equal requests.
    for port in (1, True, 1.0, 1):
        for tl in requests()[:3]:
            tl.server_port = port  # type: ignore[assignment]
            out.append(tl)
    return out * 2


def kept_or_not(reader: InMemoryMetricReader, limit: int) -> tuple[Recorder, MeterProvider]:
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    attribution = Attribution(metric_dimensions=("tenant",), metric_values=3)
    settings = Settings(routes=ROUTES, telemetry=TelemetrySettings(metric_models=("m0",)), attribution=attribution)
    rec = Recorder(settings, meter_provider=provider)
    rec.metrics._sets.limit = limit
    return rec, provider


@pytest.mark.parametrize("readers", sorted(READERS))
@pytest.mark.parametrize("size", [1, 64])
def test_attribute_sets_kept_by_their_values_record_what_sets_made_per_request_record(readers: str, size: int) -> None:
    """A request's group of sets kept by the values that make it (``emit.sets``) against each request's sets
    made anew (a cache that keeps none): the same figures, series, exemplars and label evictions."""
    fresh_reader, kept_reader = READERS[readers](), READERS[readers]()
    fresh, fresh_provider = kept_or_not(fresh_reader, 0)
    kept, kept_provider = kept_or_not(kept_reader, 256)
    try:
        for rec in (fresh, kept):
            # An exponential histogram's reservoir keeps one exemplar of many at random: the same draws for both.
            random.seed(47)
            done = [rec.analysis.finish(tl, None) for tl in varied()]
            for start in range(0, len(done), size):
                rec.emission.emit(done[start : start + size])
        view = metric_view(fresh_reader)
        # By repr too: 1, True and 1.0 are equal in Python, not in a series' attributes.
        assert repr(view) == repr(metric_view(kept_reader))
        assert fresh.failed == kept.failed == 0
        models = {dict(row[0]).get("gen_ai.request.model") for row in view["llmtap.requests"]}
        assert "_OTHER" in models and "m0" in models
        assert {dict(row[0]).get("llmtap.tenant") for row in view["llmtap.requests"]} >= {"t1", "t3"}
        assert len(kept.metrics._sets._groups) > 1
    finally:
        for rec, provider in ((fresh, fresh_provider), (kept, kept_provider)):
            rec.close()
            provider.shutdown()


def test_a_set_made_from_equal_values_of_other_types_is_its_own() -> None:
    sets = Sets({}, {}, {"r": "a"}, limit=8)
    made = [sets.plus(sets.own, "k", value) for value in (1, True, 1.0, 1)]
    assert [type(m["k"]) for m in made] == [int, bool, float, int]
    assert made[0] is made[3] and made[0] is not made[1] and made[1] is not made[2]
    assert made[0] == {"r": "a", "k": 1} and list(made[0]) == ["r", "k"]
    assert sets.plus(NONE, "x", ["not", "hashable"]) == {"x": ["not", "hashable"]}
    assert NONE == {}


def test_a_fixed_set_is_held_by_its_identity_and_its_content() -> None:
    kept = Kept(limit=2)
    fixed, plain = Fixed({"a": "x", "n": 1}), {"a": "x", "n": 1}
    held = kept.held(fixed)
    assert held is not None and held is kept.held(fixed) and held is kept.held(plain)
    assert type(held[0]) is dict and held[0] == plain
    # Equal content of another type is another set, whichever way it is found.
    other = kept.held(Fixed({"a": "x", "n": True}))
    assert other is not None and other is not held and type(other[0]["n"]) is bool
    # Past the limit, what is held is emptied and made again: still the same content.
    again = [kept.held(Fixed({"a": str(i)})) for i in range(5)]
    assert [h[0] if h else None for h in again] == [{"a": str(i)} for i in range(5)]
    assert kept.held(fixed) == held
    # A set the SDK cleans (a list) is cleaned each time, never held by identity.
    listed = Fixed({"a": ["x", "y"]})
    first, second = kept.held(listed), kept.held(listed)
    assert first is not None and second is not None and first is not second and first[0] == {"a": ("x", "y")}
