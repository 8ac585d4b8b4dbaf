"""Percentiles with bootstrap confidence intervals, for raw samples and for histogram buckets alike.

No numpy: a bootstrap resample's k-th smallest value is the empirical distribution's value at a
Beta(k, n-k+1)-distributed position (the k-th order statistic of n uniform draws), so one draw per
resample gives the exact bootstrap distribution of a percentile, whatever n is, in O(1). Seedable, so
tests and repeated reports give the same intervals.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Distribution:
    """An empirical distribution: raw samples, or a histogram's cumulative buckets ``(le, count)``."""

    def __init__(self, values: Iterable[float] = (), *, buckets: Sequence[tuple[float, float]] | None = None) -> None:
        self._values = sorted(values)
        self._bounds: list[float] = []
        self._cumulative: list[float] = []
        if buckets:
            for le, count in sorted(buckets):
                self._bounds.append(le)
                self._cumulative.append(max(count, self._cumulative[-1] if self._cumulative else 0.0))

    @property
    def n(self) -> int:
        """How many requests the distribution holds."""
        if self._bounds:
            return round(self._cumulative[-1])
        return len(self._values)

    def at_rank(self, rank: float) -> float:
        """The value of rank ``rank`` (1..n): nearest rank for samples, interpolated inside a bucket."""
        if not self._bounds:
            return self._values[min(len(self._values), max(1, math.ceil(rank))) - 1]
        # As Prometheus' histogram_quantile: linear inside the bucket that holds the rank.
        i = min(bisect.bisect_left(self._cumulative, rank), len(self._bounds) - 1)
        upper = self._bounds[i]
        lower, below = (0.0, 0.0) if i == 0 else (self._bounds[i - 1], self._cumulative[i - 1])
        if math.isinf(upper):
            return lower
        inside = self._cumulative[i] - below
        return upper if inside <= 0 else lower + (upper - lower) * (rank - below) / inside

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, or None when empty."""
        n = self.n
        if n == 0:
            return None
        return self.at_rank(max(1, math.ceil(q * n)) if not self._bounds else q * n)

    def resampled_quantile(self, q: float, rng: random.Random) -> float:
        """The ``q`` quantile of one bootstrap resample (n draws with replacement), drawn exactly in O(1)."""
        n = self.n
        k = max(1, math.ceil(q * n))
        u = rng.betavariate(k, n - k + 1)
        return self.at_rank(max(1, math.ceil(u * n)) if not self._bounds else max(u * n, 1e-9))

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
