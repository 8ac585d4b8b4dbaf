"""Many samples of one histogram with one attribute set, at the cost of a bucket lookup each.

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
from collections.abc import Callable, Sequence
from functools import partial
from time import time_ns
from typing import Any

from opentelemetry.context import Context, get_current
from opentelemetry.metrics import Histogram

__all__ = ["Batch", "Fixed", "Kept", "record_many"]

log = logging.getLogger("llmtap.telemetry")

try:  # the SDK's internals this module reads; absent: the public path only
    from opentelemetry.attributes import _clean_attribute_value
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
    from opentelemetry.sdk.metrics._internal.aggregation import (
        _ExplicitBucketHistogramAggregation,
        _SumAggregation,
    )
except ImportError:  # pragma: no cover - another SDK version
    _clean_attribute_value = _hash_attributes = None  # type: ignore[assignment]
    _ExplicitBucketHistogramAggregation = _SumAggregation = None  # type: ignore[assignment,misc]


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
    Batch().many(hist, values, attributes, context)


def _total(values: Sequence[float]) -> float | None:
    """The sum of ``values``, or None when one is negative or not finite (a NaN or an infinity makes the sum
    one of those: what the SDK would refuse or warn of, left to ``Histogram.record``)."""
    total = sum(values)
    return total if math.isfinite(total) and min(values) >= 0 else None


def _aggregate(aggregation: Any, sample: _Sample, values: Sequence[float], total: float) -> None:
    if type(aggregation) is _ExplicitBucketHistogramAggregation:
        # What its ``aggregate`` does per sample, for all of them under one hold of its lock.
        agg: Any = aggregation
        with agg._lock:
            if agg._value is None:
                agg._value = agg._get_empty_bucket_counts()
            counts, bounds = agg._value, agg._boundaries
            for value in values:
                counts[bisect_left(bounds, value)] += 1
            agg._sum += total
            if agg._record_min_max:
                agg._min = min(agg._min, *values)
                agg._max = max(agg._max, *values)
        return
    aggregate = aggregation.aggregate
    for value in values:
        sample.value = value
        aggregate(sample, False)


_PLAIN = frozenset((str, bool, int, float))

try:  # the SDK's exemplar filters whose verdict depends on the measurement's context alone
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, AlwaysOnExemplarFilter, TraceBasedExemplarFilter

    _CONTEXT_FILTERS: frozenset[type] = frozenset(
        (AlwaysOffExemplarFilter, AlwaysOnExemplarFilter, TraceBasedExemplarFilter)
    )
except ImportError:  # pragma: no cover - another SDK version
    _CONTEXT_FILTERS = frozenset()


def _flat(attributes: dict[str, Any]) -> bool:
    """Whether every key is non-empty text and every value a plain str, bool, int or finite float (what cleaning
    leaves as it is)."""
    for k, v in attributes.items():
        if type(k) is not str or not k or type(v) not in _PLAIN or (type(v) is float and not math.isfinite(v)):
            return False
    return True


def _flat_key(attributes: dict[str, Any]) -> Any:
    """The SDK's ``_hash_attributes`` of a flat set (``_flat``), built directly: the same tuple, a third the work."""
    return ("mapping", tuple([(k, (type(v).__name__, v)) for k, v in sorted(attributes.items())]))


#: An attribute set as held: cleaned, and its aggregation key and attributes per view (made on first use).
Held = tuple[dict[str, Any], dict[int, tuple[Any, Any, dict[str, Any]]]]


def _cleaned(attributes: dict[str, Any]) -> Held | None:
    """``attributes`` cleaned as the SDK cleans them, with no view's key yet; None when the SDK would not take it."""
    if _flat(attributes):
        return dict(attributes), {}  # what cleaning gives such a set: a copy
    cleaned = _clean_attribute_value(attributes, None)
    return (cleaned, {}) if isinstance(cleaned, dict) else None


class Fixed(dict[str, Any]):
    """An attribute set its maker never changes once made (``emit.sets``): ``Kept`` holds it by its identity, and
    finds it again without building its key. A plain ``dict`` is held by its content alone."""

    __slots__ = ()


class Kept:
    """Attribute sets cleaned and hashed once for many requests, and each instrument's views, for one meter provider.

    A short request's attribute sets are few and the same from one request to the next (its route, model,
    outcome and shape): a batch given these keeps each flat set (``_flat``) by its content, so the next request
    with the same set skips the cleaning, the copy and the per-view keys, at the cost of one tuple built and
    looked up. The content key holds each value's type beside it, as the SDK's key does: ``True``, ``1`` and
    ``1.0`` are equal in Python, not to the SDK. A set that is not flat is cleaned per request as before (the SDK
    warns of what it drops each time). Bounded: emptied when ``limit`` sets are held (a set then costs what it
    did once more). For one meter provider (its views are the keys' views), used from one thread at a time.
    """

    __slots__ = ("_fixed", "_matches", "_reached", "_sets", "limit")

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._sets: dict[tuple[Any, ...], Held] = {}
        # id of a ``Fixed`` set -> (the set, kept alive so its id is not reused; the set held)
        self._fixed: dict[int, tuple[Fixed, Held]] = {}
        # id of an instrument -> what a batch reads of it (``_reach``)
        self._reached: dict[int, Reach] = {}
        # id of an instrument -> (the instrument, kept alive so its id is not reused; its views, or None)
        self._matches: dict[int, tuple[Any, list[Any] | None]] = {}

    def held(self, attributes: dict[str, Any]) -> Held | None:
        """``attributes`` held: the kept set of the same content, or a new one (kept when flat); a ``Fixed`` set
        found by its identity first."""
        if type(attributes) is Fixed:
            fixed = self._fixed.get(id(attributes))
            if fixed is not None and fixed[0] is attributes:
                return fixed[1]
            held = self._by_content(attributes)
            if held is not None and _flat(attributes):
                if len(self._fixed) >= self.limit:
                    self._fixed.clear()
                self._fixed[id(attributes)] = (attributes, held)
            return held
        return self._by_content(attributes)

    def _by_content(self, attributes: dict[str, Any]) -> Held | None:
        try:
            key = (*attributes.items(), *map(type, attributes.values()))
            held = self._sets.get(key)
        except TypeError:  # a value that cannot be hashed (a list): not flat, cleaned for this request alone
            return _cleaned(attributes)
        if held is not None:
            return held
        if not _flat(attributes):
            return _cleaned(attributes)
        if len(self._sets) >= self.limit:
            self._sets.clear()
        held = self._sets[key] = (dict(attributes), {})
        return held

    def reach(self, instrument: Any) -> Reach:
        """``_reach(instrument)``, found once per instrument, its views by ``matches``."""
        found = self._reached.get(id(instrument))
        if found is None or found[0] is not instrument:
            if len(self._reached) >= self.limit:
                self._reached.clear()
            found = self._reached[id(instrument)] = _reach(instrument, self.matches)
        return found

    def matches(self, instrument: Any) -> list[Any] | None:
        """``_matches(instrument)``, found once per instrument (a provider's readers and views are fixed)."""
        found = self._matches.get(id(instrument))
        if found is None or found[0] is not instrument:
            if len(self._matches) >= self.limit:
                self._matches.clear()
            found = self._matches[id(instrument)] = (instrument, _matches(instrument))
        return found[1]


#: What ``Batch`` reads of an instrument: the instrument (kept alive: its id is the key), its ``_is_enabled``, its
#: exemplar filter and its views; None where out of reach.
Reach = tuple[Any, Callable[[], bool] | None, Any, list[Any] | None]


def _reach(instrument: Any, matches: Callable[[Any], list[Any] | None]) -> Reach:
    """What ``Batch`` reads of ``instrument``, its views found by ``matches``."""
    enabled = getattr(instrument, "_is_enabled", None)
    consumer = getattr(instrument, "_measurement_consumer", None)
    exemplars = getattr(getattr(consumer, "_sdk_config", None), "exemplar_filter", None)
    views = matches(instrument) if enabled is not None and exemplars is not None else None
    return instrument, enabled, exemplars, views


#: One deferred measurement: a value, or many values (``many``) with their sum; and, when the exemplar filter kept
#: it, the measurement the reservoir is offered (None: not offered).
_Entry = tuple[float, Sequence[float] | None, "_Sample | None"]


class _Group:
    """The measurements of one instrument with one held attribute set deferred in a batch, in the order made."""

    __slots__ = ("entries", "held", "instrument", "matches")

    def __init__(self, instrument: Any, held: Held, matches: list[Any]) -> None:
        self.instrument = instrument  # kept alive: its id is the group's key
        self.held = held
        self.matches = matches
        self.entries: list[_Entry] = []


def _aggregate_entries(aggregation: Any, group: _Group) -> None:
    """What ``aggregate`` (and ``_aggregate`` for many values) does per entry, in order, the lock held once for
    all: the same bucket counts, the same sum (the same additions in the same order), min, max and count; then
    the kept entries offered to the reservoir in order, as ``aggregate`` offers each."""
    entries = group.entries
    kind = type(aggregation)
    agg: Any = aggregation
    if kind is _ExplicitBucketHistogramAggregation:
        with agg._lock:
            if agg._value is None:
                agg._value = agg._get_empty_bucket_counts()
            counts, bounds, record_min_max = agg._value, agg._boundaries, agg._record_min_max
            for value, values, _ in entries:
                agg._sum += value
                if values is None:
                    if record_min_max:
                        agg._min = min(agg._min, value)
                        agg._max = max(agg._max, value)
                    counts[bisect_left(bounds, value)] += 1
                    continue
                for one in values:
                    counts[bisect_left(bounds, one)] += 1
                if record_min_max:
                    agg._min = min(agg._min, *values)
                    agg._max = max(agg._max, *values)
    elif kind is _SumAggregation and all(values is None for _, values, _ in entries):
        with agg._lock:
            if agg._value is None:
                agg._value = 0
            for value, _, _ in entries:
                agg._value = agg._value + value
    else:
        sample = _Sample(group.instrument, get_current(), group.held[0])
        for value, values, kept in entries:
            if values is not None:
                _aggregate(aggregation, sample, values, value)
            elif kept is not None:
                aggregation.aggregate(kept, True)
            else:
                sample.value = value
                aggregation.aggregate(sample, False)
        return
    for _, _, kept in entries:
        if kept is not None:
            agg._sample_exemplar(kept, True)


class Batch:
    """One finished request's measurements, each attribute set cleaned and hashed once for all its instruments.

    A request records about twenty values (latencies, tokens, counts) over five attribute sets of about ten
    attributes each. ``Histogram.record`` and ``Counter.add`` clean the set, copy it and hash it again in every
    view of every reader, per call: 30 µs a call with two readers, two thirds of it that. Here a set is
    cleaned once and hashed once per view for the whole request; each value then takes the path the SDK's
    ``_ViewInstrumentMatch.consume_measurement`` takes from its hash on: the aggregation found or made, under
    its lock where the reader resets on collect, and given the measurement with the exemplar filter's verdict,
    so exemplars are kept as the public API keeps them. A value the SDK would refuse or warn of (negative, not
    finite), a disabled instrument, or SDK internals out of reach: the public API, as before. Use one batch per
    request, on one thread; it holds the request's attribute sets until it is dropped. Given ``kept`` (``Kept``, one
    per meter provider), the sets and each instrument's views are taken from it and left in it for the next request.

    ``defer``: the measurements wait in the batch, grouped by instrument and attribute set, until ``flush``; a
    batch then serves many requests (``MetricWriter.batch``). A group's values go to each of its aggregations
    at once, the lock held once, the aggregation and its view's key found once: what each request's values add
    up to is what they would have added up to one by one (the same additions in the same order in each
    aggregation), and each value the exemplar filter keeps is offered to the reservoir in its turn. Anything
    that takes the public API meanwhile flushes first, so nothing is taken out of its order.
    """

    __slots__ = ("_groups", "_kept", "_reached", "_sets", "_verdicts", "defer")

    def __init__(self, kept: Kept | None = None, *, defer: bool = False) -> None:
        self._kept = kept
        self.defer = defer
        # id of an attribute set -> (the set, kept alive so its id is not reused; the set held)
        self._sets: dict[int, tuple[dict[str, Any], Held]] = {}
        # (id of the instrument, id of the held set) -> its deferred measurements, in the order first made
        self._groups: dict[tuple[int, int], _Group] = {}
        # id of an instrument -> (the instrument, kept alive so its id is not reused; what ``_reach`` found)
        self._reached: dict[int, Reach] = {}
        # id of a context -> (the context, kept alive so its id is not reused; the filter; its verdict)
        self._verdicts: dict[int, tuple[Context, Any, bool]] = {}

    def record(self, hist: Any, value: float, attributes: dict[str, Any], context: Context | None = None) -> None:
        """``hist.record(value, attributes, context=context)``."""
        if not self._direct(hist, value, attributes, context):
            self.flush()
            hist.record(value, attributes, context=context)

    def add(self, counter: Any, value: float, attributes: dict[str, Any], context: Context | None = None) -> None:
        """``counter.add(value, attributes, context=context)``."""
        if not self._direct(counter, value, attributes, context):
            self.flush()
            counter.add(value, attributes, context=context)

    def flush(self) -> None:
        """Every deferred measurement to its aggregations, group by group in the order the groups were made."""
        groups = self._groups
        if not groups:
            return
        self._groups = {}
        for group in groups.values():
            self._feed(group.held, group.matches, partial(_aggregate_entries, group=group))

    def _verdict(self, exemplars: Any, value: float, attributes: dict[str, Any], context: Context) -> bool:
        """The exemplar filter's verdict on a measurement; the SDK's own filters, which read the context alone
        (whether its span is sampled) or nothing, asked once per context in a batch."""
        if type(exemplars) not in _CONTEXT_FILTERS:
            return bool(exemplars.should_sample(value, time_ns(), attributes, context))
        verdicts = self._verdicts
        found = verdicts.get(id(context))
        if found is None or found[0] is not context or found[1] is not exemplars:
            found = verdicts[id(context)] = (context, exemplars, exemplars.should_sample(value, 0, attributes, context))
        return bool(found[2])

    def _group(self, instrument: Any, held: Held, matches: list[Any]) -> _Group | None:
        """The group deferred measurements of ``instrument`` with ``held`` join (made here), or None when this batch
        does not defer them: not asked, SDK internals out of reach, or a view that keeps some attributes alone
        (two sets may then share an aggregation, whose order only one group would keep)."""
        if not self.defer or _SumAggregation is None:
            return None
        key = (id(instrument), id(held))
        group = self._groups.get(key)
        if group is None:
            if any(match._view._attribute_keys is not None for match in matches):
                return None
            group = self._groups[key] = _Group(instrument, held, matches)
        return group

    def many(self, hist: Histogram, values: Sequence[float], attributes: dict[str, Any], context: Context) -> None:
        """``record_many(hist, values, attributes, context)``, the attribute set cleaned and hashed once with the
        request's others."""
        if not values:
            return
        enabled = getattr(hist, "_is_enabled", None)
        matches = self._matches(hist) if enabled is not None and enabled() else None
        total = _total(values)
        held = self._held(attributes) if matches is not None and total is not None else None
        if matches is None or total is None or held is None:
            self.flush()
            for value in values:
                hist.record(value, attributes, context=context)
            return
        group = self._group(hist, held, matches)
        if group is not None:
            group.entries.append((total, values, None))
            return
        self.flush()
        sample = _Sample(hist, context, held[0])
        self._feed(held, matches, lambda aggregation: _aggregate(aggregation, sample, values, total))

    def _matches(self, instrument: Any) -> list[Any] | None:
        """The instrument's views (``_matches``), from ``kept`` where given."""
        return _matches(instrument) if self._kept is None else self._kept.matches(instrument)

    def _held(self, attributes: dict[str, Any]) -> Held | None:
        """The set, cleaned, and its per-view keys (made on first use); None when the SDK would not take it."""
        mine = self._sets.get(id(attributes))
        if mine is not None and mine[0] is attributes:
            return mine[1]
        held = _cleaned(attributes) if self._kept is None else self._kept.held(attributes)
        if held is not None:
            self._sets[id(attributes)] = (attributes, held)
        return held

    @staticmethod
    def _view(held: Held, match: Any) -> tuple[Any, dict[str, Any]]:
        """The aggregation key and attributes of a held set in one view (``match``)."""
        cleaned, views = held
        # Every view that keeps all attributes hashes the set alike (key 0); one that keeps some, by its keys
        # (held beside the key, so that their id is not reused while the set is kept).
        view_keys = match._view._attribute_keys
        view = views.get(0 if view_keys is None else id(view_keys))
        if view is None or view[0] is not view_keys:
            own = dict(cleaned) if view_keys is None else {k: v for k, v in cleaned.items() if k in view_keys}
            key = _flat_key(own) if _flat(own) else _hash_attributes(own)
            view = views[0 if view_keys is None else id(view_keys)] = (view_keys, key, own)
        return view[1], view[2]

    def _reach(self, instrument: Any) -> Reach:
        """What ``_direct`` reads of an instrument: whether it is enabled (a call), its exemplar filter and its views;
        found once per instrument in a deferring batch (a batch lives a few milliseconds), and kept in ``kept``
        where given (a provider's instruments, readers and exemplar filter are fixed)."""
        reach = self._reached.get(id(instrument)) if self.defer else None
        if reach is None or reach[0] is not instrument:
            reach = _reach(instrument, _matches) if self._kept is None else self._kept.reach(instrument)
            if self.defer:
                self._reached[id(instrument)] = reach
        return reach

    def _direct(self, instrument: Any, value: float, attributes: dict[str, Any], context: Context | None) -> bool:
        if value < 0 or not math.isfinite(value):
            return False
        _, enabled, exemplars, matches = self._reach(instrument)
        if enabled is None or exemplars is None or not enabled() or matches is None:
            return False
        held = self._held(attributes)
        if held is None:
            return False
        cleaned = held[0]
        group = self._group(instrument, held, matches)
        if group is not None:
            context = context if context is not None else get_current()
            keep = self._verdict(exemplars, value, cleaned, context)
            kept = None
            if keep:
                kept = _Sample(instrument, context, cleaned)
                kept.value = value
            group.entries.append((value, None, kept))
            return True
        self.flush()
        sample = _Sample(instrument, context if context is not None else get_current(), cleaned)
        sample.value = value
        keep = exemplars.should_sample(value, sample.time_unix_nano, cleaned, sample.context)
        self._feed(held, matches, lambda aggregation: aggregation.aggregate(sample, keep))
        return True

    @classmethod
    def _feed(cls, held: Held, matches: Any, feed: Callable[[Any], None]) -> None:
        """Hands each view's aggregation of a held set to ``feed``, made where it is new."""
        for match in matches:
            key, own = cls._view(held, match)
            if match._reset_on_collect:
                # A collection swaps the aggregations out: hold the lock until what is fed is in this one.
                with match._lock:
                    feed(match._get_or_create_aggregation(key, dict(own)))
                continue
            aggregation = match._attributes_aggregation.get(key)
            if aggregation is None:
                with match._lock:
                    aggregation = match._get_or_create_aggregation(key, dict(own))
            feed(aggregation)
