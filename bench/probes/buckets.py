"""How far percentiles read back from each histogram choice lie from the exact values: ``python -m
bench.probes.buckets``.

Known latency distributions (the course's shapes with lognormal spreads: TTFT of a support prompt around
0.78 s, of the same prompt served from cache 0.12 s, of a code completion 25 ms; ITL around 22 ms; a
support answer's E2E) are recorded through llmtap's own instruments (``llmtap.telemetry.emit.instruments``) on
the OpenTelemetry SDK, once per choice:

* ``standard``: the conventions' advisory buckets, the default of the ``gen_ai.*`` histograms;
* ``fine``: llmtap's buckets 2^(1/8) apart (``telemetry.histogram_buckets: fine``, and llmtap's own
  latency histograms always);
* ``base2``: the SDK's base-2 exponential aggregation, what the OTLP exporter sends with
  ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram``.

The explicit ones are rendered by the code behind llmtap's ``/metrics`` (``llmtap.telemetry.exposition.prometheus``,
sparse: the bounds over the range of the values, so "one series holds" counts what a series of that shape costs),
scraped by a real Prometheus and read back with its ``histogram_quantile``; the exponential one is read from the SDK's
data points here (Prometheus' text format has no exponential histograms), interpolated geometrically inside the bucket
that holds the rank and kept within the recorded min and max. Exact: the quantile of the raw samples
(``llmtap.analysis.stats.quantile``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import ExponentialHistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

from llmtap.analysis.stats import histogram_quantile, quantile
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import create
from llmtap.telemetry.exposition.prometheus import PrometheusReader, metric_name
from tests.support.net import LoopbackHTTPServer, answer
from tests.support.proctree import Service
from tests.support.prometheus import promql, start_prometheus

CHOICES = ("standard", "fine", "base2")
EXPLICIT = ("standard", "fine")
QUANTILES = (0.5, 0.95, 0.99)
#: The histogram every sample goes to: a ``gen_ai.*`` one, whose buckets follow the setting.
METRIC = metric_name(sc.RELEASED.operation_duration, "s")


def _lognormal(median: float, sigma: float) -> Callable[[random.Random], float]:
    return lambda rng: rng.lognormvariate(math.log(median), sigma)


def _cached_or_not(rng: random.Random) -> float:
    """Seven in ten requests read their prompt from cache, the rest prefill it in full."""
    return _lognormal(0.12, 0.3)(rng) if rng.random() < 0.7 else _lognormal(0.78, 0.25)(rng)


@dataclass(frozen=True)
class Shape:
    """One latency distribution: a name (the ``dist`` attribute), what it stands for, and how to draw from it."""

    name: str
    what: str
    draw: Callable[[random.Random], float]


SHAPES = (
    Shape("ttft_support", "TTFT, a 6,200-token support prompt (~0.78 s)", _lognormal(0.78, 0.25)),
    Shape("ttft_cached", "TTFT, the same prompt from cache (~0.12 s)", _lognormal(0.12, 0.3)),
    Shape("ttft_code", "TTFT, a 200-token code completion (~25 ms)", _lognormal(0.025, 0.3)),
    Shape("ttft_mixed", "TTFT, 70% cached and 30% not, one series", _cached_or_not),
    Shape("itl", "ITL, ~22 ms per token", _lognormal(0.022, 0.25)),
    Shape("e2e_support", "E2E, a support answer (~7.4 s)", _lognormal(7.4, 0.2)),
)


@dataclass
class Row:
    """One distribution: exact percentiles and, per choice, what was read back and how far off it is."""

    name: str
    what: str
    exact: list[float]
    read: dict[str, list[float]] = field(default_factory=dict)
    #: Per choice: what one series of it costs (explicit: its /metrics lines; base2: its populated buckets).
    size: dict[str, int] = field(default_factory=dict)
    #: The exponential aggregation's scale for this series.
    scale: int = 0

    def error(self, choice: str) -> list[float]:
        """Relative error of each read-back percentile, signed."""
        return [got / want - 1.0 for got, want in zip(self.read[choice], self.exact, strict=True)]


@dataclass
class Report:
    """All rows, and how closely Prometheus' reading matched llmtap's own ``histogram_quantile``."""

    samples: int
    seed: int
    rows: list[Row]
    prometheus_vs_llmtap: float


def draw(samples: int, seed: int) -> dict[str, list[float]]:
    """``samples`` values of every shape, seeded."""
    rng = random.Random(seed)
    return {shape.name: [shape.draw(rng) for _ in range(samples)] for shape in SHAPES}


def exponential_quantile(point: ExponentialHistogramDataPoint, q: float) -> float:
    """The ``q`` quantile of an exponential histogram point (positive values and the zero bucket).

    Bucket ``i`` holds (base^i, base^(i+1)] with base = 2^(2^-scale); inside it the rank is placed
    geometrically, and the result kept within the recorded min and max.
    """
    base = 2.0 ** (2.0**-point.scale)
    rank = q * point.count
    seen = point.zero_count
    if rank <= seen:
        return 0.0
    for k, count in enumerate(point.positive.bucket_counts):
        if count and seen + count >= rank:
            index = point.positive.offset + k
            low = base**index
            value: float = low * base ** ((rank - seen) / count)
            return min(max(value, float(point.min)), float(point.max))
        seen += count
    return float(point.max)


class _Exposition(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        reader = self.server.readers.get(self.path.strip("/"))
        if reader is None:
            self.send_error(404)
            return
        body = reader.render().encode()
        answer(self, body, "text/plain; version=0.0.4")

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class _Server(LoopbackHTTPServer):
    """``/standard`` and ``/fine``: llmtap's Prometheus exposition of each explicit choice."""

    def __init__(self, readers: dict[str, PrometheusReader]) -> None:
        self.readers = readers
        super().__init__(_Exposition)


def _local_buckets(text: str, dist: str) -> tuple[list[float], list[float]]:
    """(bounds, cumulative counts) of one series in an exposition: what Prometheus sees, read here."""
    pattern = re.compile(rf'^{METRIC}_bucket{{dist="{dist}",le="([^"]+)"}} (\S+)$', re.M)
    pairs = [(float(le.replace("+Inf", "inf")), float(n)) for le, n in pattern.findall(text)]
    return [b for b, _ in pairs], [n for _, n in pairs]


def _prometheus(work: Path, target: str) -> tuple[Service, int]:
    """Prometheus scraping each explicit choice's exposition from ``target``, one job each."""
    jobs = "".join(
        f"  - job_name: {choice}\n    metrics_path: /{choice}\n    static_configs: [{{targets: ['{target}']}}]\n"
        for choice in EXPLICIT
    )
    return start_prometheus(work, jobs, cpu=None, log=work / "prometheus.log")


def measure(samples: int = 10_000, seed: int = 20) -> Report:
    """Record every shape under every choice and read its percentiles back."""
    if shutil.which("prometheus") is None:
        raise SystemExit("bench.probes.buckets needs Prometheus: bash .ci/install.d/20-prometheus.sh")
    data = draw(samples, seed)
    rows = [Row(s.name, s.what, [float(quantile(data[s.name], q) or 0.0) for q in QUANTILES]) for s in SHAPES]
    providers: list[MeterProvider] = []
    readers: dict[str, PrometheusReader] = {}
    for choice in EXPLICIT:
        readers[choice] = PrometheusReader()
        providers.append(MeterProvider(metric_readers=[readers[choice]], shutdown_on_exit=False))
        histogram = create(providers[-1].get_meter("bench"), latest=False, fine=choice == "fine").operation_duration
        for name, values in data.items():
            for v in values:
                histogram.record(v, {"dist": name})
    exponential = InMemoryMetricReader(preferred_aggregation={Histogram: ExponentialBucketHistogramAggregation()})
    providers.append(MeterProvider(metric_readers=[exponential], shutdown_on_exit=False))
    histogram = create(providers[-1].get_meter("bench"), latest=False).operation_duration
    for name, values in data.items():
        for v in values:
            histogram.record(v, {"dist": name})
    points = _exponential_points(exponential)
    for row in rows:
        point = points[row.name]
        row.read["base2"] = [exponential_quantile(point, q) for q in QUANTILES]
        row.size["base2"], row.scale = len(point.positive.bucket_counts), point.scale
    server = _Server(readers)
    texts = {choice: reader.render() for choice, reader in readers.items()}
    agreement = 0.0
    with tempfile.TemporaryDirectory(prefix="llmtap-buckets-") as tmp:
        service, port = _prometheus(Path(tmp), server.url.removeprefix("http://"))
        try:
            _wait_scraped(port, samples)
            for row in rows:
                for choice in EXPLICIT:
                    bounds, cumulative = _local_buckets(texts[choice], row.name)
                    row.size[choice] = len(bounds) + 2  # every bucket with +Inf, _sum and _count
                    read = []
                    for q in QUANTILES:
                        selector = f'{METRIC}_bucket{{job="{choice}",dist="{row.name}"}}'
                        value = promql(port, f"histogram_quantile({q}, sum by (le) ({selector}))")
                        assert value is not None, (choice, row.name)
                        local = histogram_quantile(bounds, cumulative, q)
                        assert local is not None
                        agreement = max(agreement, abs(value - local) / local)
                        read.append(value)
                    row.read[choice] = read
        finally:
            service.stop()
            server.close()
            for provider in providers:
                provider.shutdown()
    return Report(samples, seed, rows, agreement)


def _exponential_points(reader: InMemoryMetricReader) -> dict[str, ExponentialHistogramDataPoint]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, ExponentialHistogramDataPoint] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == sc.RELEASED.operation_duration:
                    for p in metric.data.data_points:
                        assert isinstance(p, ExponentialHistogramDataPoint)
                        out[str((p.attributes or {})["dist"])] = p
    return out


def _wait_scraped(port: int, samples: int, timeout: float = 30.0) -> None:
    """Until both jobs' every series holds all the samples."""
    want = samples * len(SHAPES) * len(EXPLICIT)
    deadline = time.monotonic() + timeout
    while (promql(port, f"sum({METRIC}_count)") or 0) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"Prometheus did not scrape all {want} samples within {timeout:.0f} s")
        time.sleep(0.2)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}" if seconds < 10 else f"{seconds * 1000:.0f}"


def _span(sizes: Sequence[int]) -> str:
    return f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]} to {sizes[-1]}"


def _pct(errors: Sequence[float]) -> str:
    return " / ".join(f"{e * 100:+.1f}" for e in errors)


def table(report: Report) -> str:
    """The report as Markdown: exact percentiles in ms, then each choice's errors in percent."""
    lines = [
        f"{report.samples:,} samples per distribution, seed {report.seed}. Errors: read-back / exact - 1, in %, "
        "for p50 / p95 / p99.",
        "",
        "| distribution | exact p50 / p95 / p99 (ms) | standard | fine | base2 (scale) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in report.rows:
        exact = " / ".join(_ms(v) for v in row.exact)
        cells = [_pct(row.error(c)) for c in CHOICES]
        lines.append(f"| {row.what} | {exact} | {cells[0]} | {cells[1]} | {cells[2]} ({row.scale}) |")
    worst = {c: max(abs(e) for row in report.rows for e in row.error(c)) for c in CHOICES}
    sizes = {c: sorted({row.size[c] for row in report.rows}) for c in CHOICES}
    lines += [
        f"| largest error | | {worst['standard'] * 100:.1f} | {worst['fine'] * 100:.1f} | {worst['base2'] * 100:.1f} |",
        f"| one series holds | | {_span(sizes['standard'])} lines | {_span(sizes['fine'])} lines "
        f"| up to {sizes['base2'][-1]} buckets |",
        "",
        "Prometheus' `histogram_quantile` and llmtap's own (`llmtap.analysis.stats`) agreed "
        + ("to the last digit." if report.prometheus_vs_llmtap == 0 else f"within {report.prometheus_vs_llmtap:.1e}."),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.probes.buckets [--samples N] [--seed S] [--json PATH]``."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.buckets", description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=10_000, help="values per distribution (10,000)")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    report = measure(args.samples, args.seed)
    print(table(report), end="")
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
