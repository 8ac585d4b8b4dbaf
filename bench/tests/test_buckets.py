"""``python -m bench.probes.buckets`` on a small sample: each histogram choice read back through a real Prometheus.

What the README and the reference say of the choices must hold: llmtap's fine buckets and the exponential
aggregation read p50/p95/p99 back within a few percent, the conventions' doubling buckets do not, and
Prometheus reads the explicit ones exactly as llmtap's own ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
import random
import shutil

import pytest

from bench import accuracy
from bench.probes import buckets
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS
from tests.conftest import require_real
from tests.telemetry.test_prometheus import histogram_quantile as promql_reference


def test_percentile_error_of_each_choice() -> None:
    require_real(shutil.which("prometheus") is not None, "Prometheus", "bash .ci/install.d/20-prometheus.sh")
    report = buckets.measure(samples=2000, seed=3)
    assert [row.name for row in report.rows] == [shape.name for shape in buckets.SHAPES]
    worst = {c: max(abs(e) for row in report.rows for e in row.error(c)) for c in buckets.CHOICES}
    assert worst["fine"] < 0.05 and worst["base2"] < 0.05, worst
    assert worst["standard"] > 0.2, worst  # what the fine buckets and base2 are for
    assert report.prometheus_vs_llmtap < 1e-9
    # /metrics writes the bounds over the range of a series' values: fewer lines than all (17 and 140) take.
    assert all(3 <= row.size["standard"] <= 17 for row in report.rows)
    assert all(3 <= row.size["fine"] < 140 for row in report.rows)
    assert all(0 < row.size["base2"] <= 160 and row.scale > 0 for row in report.rows)
    text = buckets.table(report)
    assert text.count("\n| ") == len(report.rows) + 4 and "largest error" in text  # header, rule, rows, two sums


def test_the_accuracy_run_knows_the_bucket_prometheus_answers_in() -> None:
    """``bench.accuracy.hist_bounds`` names the fine bucket that ``histogram_quantile`` interpolates inside, for
    a few samples far apart (where the exact quantile may lie outside it) as for many; edges included."""
    rng = random.Random(5)
    bounds = [*DURATION_BUCKETS, math.inf]
    cases = [[0.02 * 25 ** rng.random() for _ in range(n)] for n in (1, 2, 20, 20, 20, 352)]
    cases.append([DURATION_BUCKETS[40]] * 3 + [DURATION_BUCKETS[60]])  # samples on bucket edges
    for samples in cases:
        series = [(b, float(sum(s <= b for s in samples))) for b in bounds]
        for q in (0.5, 0.95, 0.99, 0.75):
            lo, hi = accuracy.hist_bounds(samples, q)
            value = promql_reference(q, series)
            assert lo <= value <= hi and hi / lo == pytest.approx(2 ** (1 / 8), rel=1e-3), (samples, q, lo, hi)
