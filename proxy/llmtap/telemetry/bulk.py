"""Many samples of one histogram with one attribute set, at the cost of a bucket lookup each (issue 29).

A stream records a chunk gap per chunk and an inter-token latency per token, all with the request's one
attribute set. Through ``Histogram.record`` each sample is cleaned, copied, hashed and routed again: about
10 µs a sample, more than everything else the telemetry does per chunk. Here the SDK's own path is taken
once per request and view (the attribute set cleaned and hashed once, the aggregation found or made as
``_ViewInstrumentMatch.consume_measurement`` finds or makes it, under its lock where the reader resets on
collect), and each sample goes straight to that aggregation's ``aggregate``. None of them is offered to the
exemplar reservoir: the caller records the one sample that carries the request's span context through the
public API. Reaching the aggregations takes SDK attributes that are not public: without them (another SDK
version, the API's no-op meter) ``record_many`` falls back to ``Histogram.record`` per sample.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Sequence
from time import time_ns
from typing import Any

from opentelemetry.context import Context
from opentelemetry.metrics import Histogram

__all__ = ["record_many"]

log = logging.getLogger("llmtap.telemetry")

try:  # the SDK's internals this module reads; absent: the public path only
    from opentelemetry.attributes import _clean_attribute_value
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation
except ImportError:  # pragma: no cover - another SDK version
    _clean_attribute_value = _hash_attributes = _ExplicitBucketHistogramAggregation = None  # type: ignore[assignment,misc]


class _Sample:
    """What an aggregation reads of a measurement (its value; the rest for a reservoir that is never offered)."""

    __slots__ = ("attributes", "context", "instrument", "time_unix_nano", "value")

    def __init__(self, instrument: Any, context: Context, attributes: Any) -> None:
        self.value = 0.0
        self.time_unix_nano = time_ns()
        self.instrument = instrument
        self.context = context
        self.attributes = attributes


def _matches(hist: Histogram) -> list[Any] | None:
    """Every view of ``hist`` in every reader (the SDK's ``_ViewInstrumentMatch``), or None when unreachable."""
    consumer = getattr(hist, "_measurement_consumer", None)
    storages = getattr(consumer, "_reader_storages", None)
    if storages is None or _hash_attributes is None:
        return None
    matches: list[Any] = []
    for storage in storages.values():
        found = getattr(storage, "_get_or_init_view_instrument_match", None)
        if found is None:
            return None
        matches.extend(found(hist))
    return matches


def record_many(hist: Histogram, values: Sequence[float], attributes: dict[str, Any], context: Context) -> None:
    """Record each of ``values`` (none of them an exemplar) with ``attributes``, as ``hist.record`` would."""
    if not values:
        return
    enabled = getattr(hist, "_is_enabled", None)
    matches = _matches(hist) if enabled is not None and enabled() else None
    if matches is None or any(not math.isfinite(v) or v < 0 for v in values):
        for value in values:
            hist.record(value, attributes, context=context)
        return
    cleaned = _clean_attribute_value(attributes, None)
    if not isinstance(cleaned, dict):
        for value in values:
            hist.record(value, attributes, context=context)
        return
    sample = _Sample(hist, context, cleaned)
    for match in matches:
        view_keys = match._view._attribute_keys
        own = dict(cleaned) if view_keys is None else {k: v for k, v in cleaned.items() if k in view_keys}
        key = _hash_attributes(own)
        if match._reset_on_collect:
            # A collection swaps the aggregations out: hold the lock until every sample is in this one.
            with match._lock:
                _aggregate(match._get_or_create_aggregation(key, own), sample, values)
            continue
        aggregation = match._attributes_aggregation.get(key)
        if aggregation is None:
            with match._lock:
                aggregation = match._get_or_create_aggregation(key, own)
        _aggregate(aggregation, sample, values)


def _aggregate(aggregation: Any, sample: _Sample, values: Sequence[float]) -> None:
    if type(aggregation) is _ExplicitBucketHistogramAggregation:
        # What its ``aggregate`` does per sample, for all of them under one hold of its lock.
        agg: Any = aggregation
        with agg._lock:
            if agg._value is None:
                agg._value = agg._get_empty_bucket_counts()
            counts, bounds = agg._value, agg._boundaries
            for value in values:
                counts[bisect_left(bounds, value)] += 1
            agg._sum += sum(values)
            if agg._record_min_max:
                agg._min = min(agg._min, *values)
                agg._max = max(agg._max, *values)
        return
    aggregate = aggregation.aggregate
    for value in values:
        sample.value = value
        aggregate(sample, False)
