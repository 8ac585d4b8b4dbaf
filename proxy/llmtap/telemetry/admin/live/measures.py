"""What the live view's window measures with: a sparse histogram of latencies (``Hist``) and a series' busy time
(``Busy``), and the clock they share (slots of ``SLOT`` seconds, busy time in ticks of ``TICK``)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from llmtap.analysis.stats import histogram_quantile, sorted_quantile
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS

__all__ = ["HORIZON", "QUANTILES", "SLOT", "TICK", "Busy", "Hist"]

#: Seconds per tally; a window's start is rounded down to a slot boundary.
SLOT = 5.0
#: The longest window kept, in seconds.
HORIZON = 900.0
QUANTILES = (0.5, 0.95, 0.99)
#: The resolution of busy time, in seconds: a series marks each tick in which one of its requests was in flight.
TICK = 0.01
_TICKS = round(SLOT / TICK)
_EDGE = 1e-6


@dataclass(slots=True)
class Hist:
    """A sparse histogram over ``DURATION_BUCKETS``: bucket index to count, as the OTel SDK buckets values."""

    counts: dict[int, int] = field(default_factory=dict)
    count: int = 0
    total: float = 0.0
    #: The smallest and largest value counted (a bucket reading is held between them).
    low: float = math.inf
    high: float = -math.inf

    def add(self, value: float) -> None:
        """Count one value in the bucket whose upper bound is the first >= value (the SDK's rule)."""
        i = bisect_left(DURATION_BUCKETS, value)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.count += 1
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)

    def add_many(self, values: Sequence[float]) -> None:
        """``add`` each of ``values``, in order (the sum too: the same total to the last bit)."""
        if not values:
            return
        counts, bounds, total = self.counts, DURATION_BUCKETS, self.total
        for value in values:
            i = bisect_left(bounds, value)
            counts[i] = counts.get(i, 0) + 1
            total += value
        self.count += len(values)
        self.total = total
        self.low = min(self.low, min(values))
        self.high = max(self.high, max(values))

    def merge(self, other: Hist) -> None:
        """Add another histogram's counts."""
        for i, n in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + n
        self.count += other.count
        self.total += other.total
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile`` over these counts (``llmtap.analysis.stats.histogram_quantile``)."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        """Several quantiles, the cumulative counts added up once."""
        top = max(self.counts, default=-1)
        bounds = [*DURATION_BUCKETS[: top + 1], math.inf][: top + 1]
        cumulative = list(accumulate(self.counts.get(i, 0) for i in range(top + 1)))
        return [histogram_quantile(bounds, cumulative, q) for q in qs]

    def figures(self, exact: Sequence[float] | None = None) -> dict[str, Any]:
        """Count, sum and the page's three percentiles: over ``exact`` (every value counted here, in ascending
        order) when given, else read from the buckets and held between the smallest and largest value."""
        out: dict[str, Any] = {"count": self.count, "sum": self.total, "exact": exact is not None}
        if exact is not None:
            values = [sorted_quantile(exact, q) for q in QUANTILES]
        else:
            values = [None if v is None else min(max(v, self.low), self.high) for v in self.quantiles(QUANTILES)]
        for q, value in zip(QUANTILES, values, strict=True):
            out[f"p{round(q * 100)}"] = value
        return out


@dataclass(slots=True)
class Busy:
    """The time a series had requests in flight, at ``TICK`` resolution, on the requests' own clock.

    One bit per tick, a Python integer per slot (kept for ``HORIZON``), and the ticks since start: overlapping
    requests count once, and a gap with nothing in flight not at all. Bounded however many requests come."""

    slots: dict[int, int] = field(default_factory=dict)
    ticks: int = 0
    #: The smallest slot in ``slots`` (None: none): the slots are looked over for those past the horizon only when
    #: it is past it (every ``SLOT`` seconds), not at every request (with 180 slots kept, the look cost more than
    #: the rest of ``add``); the same slots go as when they were looked over every time.
    low: int | None = None

    def add(self, start: float, end: float) -> None:
        """Mark ``start`` to ``end`` (seconds) busy; at least the one tick ``start`` falls in."""
        # Ticks [first, last), rounded so that a time on a tick's edge (10.0 / 0.01 = 1000.0000000000001) stays on it.
        first = math.floor(start / TICK + _EDGE)
        last = max(math.ceil(end / TICK - _EDGE), first + 1)
        # Slots past the horizon are not kept: their ticks count in the total only.
        oldest = (last - 1) // _TICKS - math.ceil(HORIZON / SLOT)
        if first < oldest * _TICKS:
            self.ticks += oldest * _TICKS - first
            first = oldest * _TICKS
        for slot in range(first // _TICKS, (last - 1) // _TICKS + 1):
            base = slot * _TICKS
            lo, hi = max(first, base) - base, min(last, base + _TICKS) - base
            old = self.slots.get(slot, 0)
            new = old | (((1 << (hi - lo)) - 1) << lo)
            self.ticks += new.bit_count() - old.bit_count()
            self.slots[slot] = new
        added = first // _TICKS
        if self.low is None or added < self.low:
            self.low = added
        if self.low < oldest:
            for k in [k for k in self.slots if k < oldest]:
                del self.slots[k]
            self.low = min(self.slots, default=None)

    def seconds(self, since: float | None = None) -> float:
        """Busy seconds since ``since`` (on the requests' clock), or since start (None)."""
        if since is None:
            return self.ticks * TICK
        first = math.floor(since / TICK + _EDGE)
        ticks = 0
        for slot, mask in self.slots.items():
            base = slot * _TICKS
            if base + _TICKS > first:
                ticks += (mask >> max(first - base, 0)).bit_count()
        return ticks * TICK
