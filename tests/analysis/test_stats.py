"""The one quantile implementation (``llmtap.analysis.stats``): ``quantile`` and ``histogram_quantile``."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from llmtap.analysis.stats import histogram_quantile, quantile, sorted_quantile
from tests.telemetry.test_prometheus import histogram_quantile as promql_reference


def type7(values: list[float], q: float) -> float:
    """The reference formula: Hyndman and Fan's type 7, x[h] + (h - floor h)(x[h+1] - x[h]), h = (n-1)q."""
    x = sorted(values)
    h = (len(x) - 1) * q
    j = int(h)
    return x[j] if j + 1 >= len(x) else x[j] + (h - j) * (x[j + 1] - x[j])


def test_no_values_have_no_quantile() -> None:
    assert quantile([], 0.5) is None
    assert sorted_quantile([], 0.0) is None
    assert quantile(iter(()), 1.0) is None


def test_one_value_is_every_quantile() -> None:
    assert [quantile([0.25], q) for q in (0.0, 0.01, 0.5, 0.99, 1.0)] == [0.25] * 5


def test_p0_and_p100_are_the_extremes() -> None:
    values = [3.0, -1.0, 7.5, 2.0]
    assert quantile(values, 0.0) == -1.0
    assert quantile(values, 1.0) == 7.5


def test_between_ranks_it_interpolates_linearly() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5  # an even count: the mean of the middle two
    assert quantile([10.0, 20.0], 0.25) == 12.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)


def test_ties_give_the_tied_value_exactly() -> None:
    assert quantile([2.0, 2.0, 2.0], 0.37) == 2.0
    assert quantile([1.0, 5.0, 5.0, 5.0, 9.0], 0.5) == 5.0
    assert quantile([1.0, math.inf, math.inf], 0.9) == math.inf  # no inf - inf


def test_unsorted_input_and_any_iterable() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert quantile(values, 0.8) == sorted_quantile(sorted(values), 0.8) == pytest.approx(4.2)
    assert quantile((v for v in values), 0.5) == 3.0
    assert values == [5.0, 1.0, 4.0, 2.0, 3.0]  # the caller's list is not sorted in place


@pytest.mark.parametrize("n", [2, 3, 7, 20, 101])
def test_agrees_with_statistics_inclusive_and_the_reference_formula(n: int) -> None:
    rng = random.Random(n)
    values = [rng.lognormvariate(-1.0, 0.8) for _ in range(n)]
    for parts in (4, 10, 20, 100):
        cuts = statistics.quantiles(values, n=parts, method="inclusive")
        ours = [quantile(values, i / parts) for i in range(1, parts)]
        assert ours == pytest.approx(cuts, rel=1e-12), parts
    for q in (0.0, 0.05, 0.5, 0.95, 0.99, 1.0):
        assert quantile(values, q) == pytest.approx(type7(values, q), rel=1e-12), q


@pytest.mark.parametrize("q", [-0.01, 1.01, math.nan])
def test_a_quantile_outside_zero_to_one_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="outside"):
        quantile([1.0], q)
    with pytest.raises(ValueError, match="outside"):
        histogram_quantile([1.0, math.inf], [1.0, 1.0], q)


# -- histogram buckets -----------------------------------------------------------------------------


BOUNDS = [0.1, 0.2, 0.4, 0.8, math.inf]
CUMULATIVE = [2.0, 10.0, 30.0, 31.0, 32.0]


def test_buckets_read_as_promql_reads_them() -> None:
    series = list(zip(BOUNDS, CUMULATIVE, strict=True))
    for q in (0.01, 0.05, 0.0625, 0.3125, 0.5, 0.9, 0.9375, 0.97, 0.999, 1.0):
        assert histogram_quantile(BOUNDS, CUMULATIVE, q) == pytest.approx(promql_reference(q, series)), q


def test_a_rank_on_a_bucket_edge_reads_that_bucket_s_upper_bound() -> None:
    # Rank 10 of 32 is the last count of the (0.1, 0.2] bucket.
    assert histogram_quantile(BOUNDS, CUMULATIVE, 10 / 32) == pytest.approx(0.2)
    # Empty buckets after it do not move the figure.
    assert histogram_quantile([0.1, 0.2, 0.4, math.inf], [5.0, 5.0, 5.0, 10.0], 0.5) == pytest.approx(0.1)


def test_the_inf_bucket_reads_as_the_highest_finite_bound() -> None:
    assert histogram_quantile(BOUNDS, CUMULATIVE, 1.0) == 0.8
    assert histogram_quantile([1.0, math.inf], [0.0, 3.0], 0.5) == 1.0


def test_p0_is_the_start_of_the_first_bucket_that_counts() -> None:
    assert histogram_quantile(BOUNDS, CUMULATIVE, 0.0) == 0.0
    assert histogram_quantile([0.1, 0.2, 0.4, math.inf], [0.0, 0.0, 4.0, 4.0], 0.0) == 0.2


def test_empty_buckets_have_no_quantile() -> None:
    assert histogram_quantile([], [], 0.5) is None
    assert histogram_quantile([0.1, math.inf], [0.0, 0.0], 0.5) is None


def test_chi_square_tail_and_homogeneity() -> None:
    from llmtap.analysis.stats import chi_square_p, homogeneity

    # The tables' 5% and 1% critical values, and the closed forms for 2 and 4 degrees of freedom.
    for statistic, dof, p in ((3.841459, 1, 0.05), (5.991465, 2, 0.05), (11.344867, 3, 0.01), (23.209251, 10, 0.01)):
        assert chi_square_p(statistic, dof) == pytest.approx(p, rel=1e-5), (statistic, dof)
    for x in (0.1, 1.0, 7.0, 40.0):
        assert chi_square_p(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi_square_p(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-9)
    assert chi_square_p(0.0, 3) == 1.0
    # Issue 30's mix: 24 short before; 12 short and 24 long after.
    statistic, dof, p = homogeneity([24, 0], [12, 24])  # type: ignore[misc]
    assert dof == 1 and statistic == pytest.approx(80 / 3) and p < 1e-6
    assert homogeneity([10, 10], [10, 10]) == (0.0, 1, 1.0)
    assert homogeneity([5, 0], [7, 0]) is None and homogeneity([0, 0], [3, 4]) is None
