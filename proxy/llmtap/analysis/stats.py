"""Quantiles, and percentiles with bootstrap confidence intervals, for raw samples and histogram buckets alike.

The one place llmtap computes a quantile (the demo, the records' gap figures, ``llmtap compare``, the
live view and the benchmarks all read theirs here), by two definitions, one per kind of input:

* raw samples, ``quantile``: linear interpolation between the closest ranks, the value at position
  ``q * (n - 1)`` of the sorted samples (Hyndman and Fan's type 7). It is numpy's and pandas' default,
  ``statistics.quantiles(method="inclusive")``, and what aiperf reports, so the benchmarks' exact
  figures compare with aiperf's like for like; p0 and p100 are the minimum and the maximum, the median
  of an even count is the mean of the middle two, and a quantile moves smoothly as q does, where the
  nearest rank jumps from one sample to the next.
* histogram buckets, ``histogram_quantile``: Prometheus' ``histogram_quantile``, linear interpolation
  inside the bucket that holds rank ``q * N``, so a figure read from buckets here is what PromQL gives
  over ``/metrics``, to the last digit.

No numpy: a bootstrap resample's k-th smallest value is the empirical distribution's value at a
Beta(k, n-k+1)-distributed position (the k-th order statistic of n uniform draws), and the next one
above it is a Beta(1, n-k) share of the way from there to the top; so two draws per resample give the
exact bootstrap distribution of an interpolated percentile, whatever n is, in O(1). Seedable, so
tests and repeated reports give the same intervals.

Pure functions and values: no I/O.
"""

from __future__ import annotations

import bisect
import math
import random
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Distribution",
    "Estimate",
    "change_estimates",
    "chi_square_p",
    "histogram_quantile",
    "homogeneity",
    "merged",
    "quantile",
    "quantile_estimate",
    "sorted_quantile",
]


def _check(q: float) -> None:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q!r} is outside [0, 1]")


def _between(low: float, high: float, share: float) -> float:
    """``share`` of the way from ``low`` to ``high`` (exactly ``low`` for ties, even infinite ones)."""
    return low if share == 0 or low == high else low + (high - low) * share


def sorted_quantile(ordered: Sequence[float], q: float) -> float | None:
    """``quantile`` of values already in ascending order (read several quantiles after one sort)."""
    _check(q)
    if not ordered:
        return None
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    return _between(ordered[lo], ordered[min(lo + 1, len(ordered) - 1)], pos - lo)


def merged(parts: Sequence[array[float]]) -> array[float]:
    """Sorted arrays (the sorted values of ``llmtap.store.Group``) merged into one sorted array.

    With numpy when it is installed (it comes with the embedded engine): one stable sort of the parts
    laid end to end, far faster than Python's on millions of values; without it, Python's sort."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return array("d")
    if len(parts) == 1:
        return parts[0]
    try:
        import numpy as np
    except ImportError:  # the pure path on its own
        return array("d", sorted(v for p in parts for v in p))
    out = np.sort(np.concatenate([np.frombuffer(p, dtype=np.float64) for p in parts]), kind="stable")
    return array("d", out.tobytes())


def quantile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of raw samples, linear between the closest ranks; None for no values."""
    return sorted_quantile(sorted(values), q)


def histogram_quantile(bounds: Sequence[float], cumulative: Sequence[float], q: float) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative buckets; None when they count nothing.

    ``bounds[i]`` is bucket i's upper bound (``le``), ascending, the last one usually +Inf;
    ``cumulative[i]`` the count at or below it, never decreasing. The first bucket starts at 0. A rank
    in the +Inf bucket reads as the highest finite bound, as Prometheus reads it; q = 0 reads as the
    lower bound of the first bucket that counts anything (where Prometheus gives NaN if that is not
    the first bucket).
    """
    _check(q)
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    if rank > 0:
        i = min(bisect.bisect_left(cumulative, rank), len(bounds) - 1)
    else:
        i = bisect.bisect_right(cumulative, 0.0)
    lower, below = (0.0, 0.0) if i == 0 else (bounds[i - 1], cumulative[i - 1])
    if math.isinf(bounds[i]):
        return lower
    return _between(lower, bounds[i], (rank - below) / (cumulative[i] - below))


class Distribution:
    """An empirical distribution: raw samples, or a histogram's cumulative buckets ``(le, count)``."""

    def __init__(self, values: Iterable[float] = (), *, buckets: Sequence[tuple[float, float]] | None = None) -> None:
        self._values: Sequence[float] = sorted(values)
        self._bounds: list[float] = []
        self._cumulative: list[float] = []
        if buckets:
            for le, count in sorted(buckets):
                self._bounds.append(le)
                self._cumulative.append(max(count, self._cumulative[-1] if self._cumulative else 0.0))

    @classmethod
    def of_sorted(cls, values: Sequence[float]) -> Distribution:
        """Samples already in ascending order, kept as given (an ``array('d')`` of millions stays compact)."""
        dist = cls()
        dist._values = values
        return dist

    @property
    def n(self) -> int:
        """How many requests the distribution holds."""
        if self._bounds:
            return round(self._cumulative[-1])
        return len(self._values)

    def at_or_above(self, value: float) -> int:
        """How many samples are ``value`` or more (0 for buckets: they name no request)."""
        return 0 if self._bounds else len(self._values) - bisect.bisect_left(self._values, value)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, or None when empty: ``quantile`` of samples, ``histogram_quantile`` of buckets."""
        if self._bounds:
            return histogram_quantile(self._bounds, self._cumulative, q)
        return sorted_quantile(self._values, q)

    def _drawn(self, u: float) -> float:
        """The sample a uniform draw ``u`` picks: the empirical distribution's inverse at ``u``."""
        n = len(self._values)
        return self._values[min(n, max(1, math.ceil(u * n))) - 1]

    def resampled_quantile(self, q: float, rng: random.Random) -> float:
        """The ``q`` quantile of one bootstrap resample (n draws with replacement), drawn exactly in O(1)."""
        n = self.n
        if self._bounds:
            k = max(1, math.ceil(q * n))
            u = rng.betavariate(k, n - k + 1)
            value = histogram_quantile(self._bounds, self._cumulative, u)
            assert value is not None  # never empty here: betavariate(k, 0) would have raised first
            return value
        # The resample's quantile lies ``share`` of the way from its (k+1)-th smallest value to the next.
        pos = q * (n - 1)
        k = math.floor(pos)
        share = pos - k
        u = rng.betavariate(k + 1, n - k)
        low = self._drawn(u)
        if share == 0:
            return low
        # The next of the n uniform draws above u: the least of the n-k-1 others, all uniform on (u, 1).
        return _between(low, self._drawn(u + (1.0 - u) * rng.betavariate(1, n - k - 1)), share)

    def cdf(self) -> tuple[list[float], list[float]]:
        """Points of the cumulative distribution (value, share of requests at or below it), for plots."""
        if self._bounds:
            total = self._cumulative[-1] or 1.0
            pairs = [(b, c / total) for b, c in zip(self._bounds, self._cumulative, strict=True) if not math.isinf(b)]
            return [b for b, _ in pairs], [c for _, c in pairs]
        n = len(self._values)
        return list(self._values), [(i + 1) / n for i in range(n)]


@dataclass(frozen=True, slots=True)
class Estimate:
    """A figure and its 95% confidence interval."""

    value: float
    low: float
    high: float


def _interval(draws: list[float], level: float = 0.95) -> tuple[float, float]:
    ordered = sorted(draws)
    tail = (1.0 - level) / 2
    lo = ordered[math.floor(tail * (len(ordered) - 1))]
    hi = ordered[math.ceil((1.0 - tail) * (len(ordered) - 1))]
    return lo, hi


def quantile_estimate(dist: Distribution, q: float, rng: random.Random, resamples: int) -> Estimate | None:
    """The ``q`` quantile with its percentile-bootstrap 95% interval; None when empty."""
    value = dist.quantile(q)
    if value is None:
        return None
    lo, hi = _interval([dist.resampled_quantile(q, rng) for _ in range(resamples)])
    return Estimate(value, lo, hi)


def change_estimates(
    before: Distribution, after: Distribution, q: float, rng: random.Random, resamples: int
) -> tuple[Estimate, Estimate] | None:
    """The change of the ``q`` quantile from before to after: in seconds and relative, each with its interval."""
    b, a = before.quantile(q), after.quantile(q)
    if b is None or a is None:
        return None
    diffs, ratios = [], []
    for _ in range(resamples):
        rb, ra = before.resampled_quantile(q, rng), after.resampled_quantile(q, rng)
        diffs.append(ra - rb)
        ratios.append(ra / rb - 1.0 if rb > 0 else 0.0)
    return Estimate(a - b, *_interval(diffs)), Estimate(a / b - 1.0 if b > 0 else 0.0, *_interval(ratios))


# -- the mix of two sides ---------------------------------------------------------------------------


def chi_square_p(statistic: float, dof: int) -> float:
    """The chance of a chi-square statistic at least ``statistic`` with ``dof`` degrees of freedom (its upper
    tail: the regularized upper incomplete gamma Q(dof/2, statistic/2), by its series below a + 1 and its
    continued fraction above, to about 1e-14)."""
    if dof < 1:
        raise ValueError("dof must be at least 1")
    a, x = dof / 2, statistic / 2
    if x <= 0:
        return 1.0
    scale = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, max(0.0, 1.0 - total * scale))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-15:
            break
    return min(1.0, max(0.0, scale * h))


def homogeneity(before: Sequence[int], after: Sequence[int]) -> tuple[float, int, float] | None:
    """Pearson's chi-square test that two sides share one mix of classes (counts per class, in the same order):
    (statistic, degrees of freedom, p); None when there are fewer than two classes with requests, or a side
    has none."""
    pairs = [(b, a) for b, a in zip(before, after, strict=True) if b + a > 0]
    nb, na = sum(b for b, _ in pairs), sum(a for _, a in pairs)
    if len(pairs) < 2 or nb == 0 or na == 0:
        return None
    total = nb + na
    statistic = 0.0
    for b, a in pairs:
        column = b + a
        for observed, side in ((b, nb), (a, na)):
            expected = side * column / total
            statistic += (observed - expected) ** 2 / expected
    dof = len(pairs) - 1
    return statistic, dof, chi_square_p(statistic, dof)
