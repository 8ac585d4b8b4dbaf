"""``python -m bench.buckets`` on a small sample: each histogram choice read back through a real Prometheus.

What the README and the reference say of the choices must hold: llmtap's fine buckets and the exponential
aggregation read p50/p95/p99 back within a few percent, the conventions' doubling buckets do not, and
Prometheus reads the explicit ones exactly as llmtap's own ``histogram_quantile`` does.
"""

from __future__ import annotations

import shutil

from bench import buckets
from tests.conftest import require_real


def test_percentile_error_of_each_choice() -> None:
    require_real(shutil.which("prometheus") is not None, "Prometheus", "bash .ci/install.d/20-prometheus.sh")
    report = buckets.measure(samples=2000, seed=3)
    assert [row.name for row in report.rows] == [shape.name for shape in buckets.SHAPES]
    worst = {c: max(abs(e) for row in report.rows for e in row.error(c)) for c in buckets.CHOICES}
    assert worst["fine"] < 0.05 and worst["base2"] < 0.05, worst
    assert worst["standard"] > 0.2, worst  # what the fine buckets and base2 are for
    assert report.prometheus_vs_llmtap < 1e-9
    assert {row.size["standard"] for row in report.rows} == {17}
    assert {row.size["fine"] for row in report.rows} == {140}
    assert all(0 < row.size["base2"] <= 160 and row.scale > 0 for row in report.rows)
    text = buckets.table(report)
    assert text.count("\n| ") == len(report.rows) + 4 and "largest error" in text  # header, rule, rows, two sums
