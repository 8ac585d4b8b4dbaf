"""Prometheus text exposition of the proxy's own metrics, from a pull-based OpenTelemetry reader.

A reader of our own rather than the global ``prometheus_client`` registry: several apps (tests, the
demo) can live in one process, and nothing global is touched. Names follow the OpenTelemetry to
Prometheus compatibility rules: dots become underscores, ``s`` adds ``_seconds``, counters get
``_total``, and units in braces (``{token}``) are annotations that add nothing. The text format has no
native (exponential) histograms: this reader always takes explicit buckets, the instruments' advisory ones,
whatever ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION`` asks of the OTLP exporter, and writes
them sparse (below).

A scraper that asks for OpenMetrics (``Accept: application/openmetrics-text``, as Prometheus does) gets
it, with exemplars: each histogram bucket carries the trace and span id of the last request the SDK's
reservoir kept for it (``# {trace_id="...",span_id="..."} value timestamp``), so a dashboard can go from a
p99 bucket to that request's trace. Each collection empties the SDK's reservoirs, so the reader keeps each
bucket's exemplar until a newer one replaces it or its series goes away: every scrape (an HA pair of
Prometheus servers, a ``curl`` in between) sees it. The plain text format has no exemplars.

Sparse buckets. A histogram's fine bounds (140 of them) would each be a line on every series, and most
buckets of a series stay empty: its values span a few of them. The page writes the bounds of the range the
metric's values span: from the bound below its lowest non-empty bucket (the lower edge
``histogram_quantile`` interpolates from) to the bound of its highest. A bound left out counts what the
bound written below it counts (nothing, or everything), so every quantile reads exactly as from all the
bounds. Every series of a metric carries the same bounds (the union
over its series: ``sum by (le)`` across label sets adds bucket by bucket), and a bound once written stays
in every later scrape. One cost: ``rate()`` or ``increase()`` over a window in which a bound first appears
does not see the value that made it appear (it was in the bound's first sample). A value inside the range
seen so far never makes one appear; one beyond it does, and within that window counts in the next bound
up (above the highest: ``+Inf``, read as the highest bound written, its own); windows after it read exactly.
``full=True`` writes every bound.

One aggregation for both. When llmtap also exports metrics over OTLP and the exporter wants what this reader
collects (cumulative sums, explicit buckets: the defaults), the exporter is fed from this reader's own
collections (``feed``) rather than from a second reader: the SDK then aggregates each sample once, not once per
reader (a second reader cost the telemetry process 1.7 to 2 µs of its 21 a chunk, ``bench.probes.telemetry``). Each
collection, a scrape's or an export's, empties the SDK's reservoirs, so the exemplars a scrape took wait here
for the next export (the newest per bucket): both see every exemplar.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value
from opentelemetry.sdk.metrics import Counter, Histogram, ObservableCounter, UpDownCounter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram as HistogramData,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation, ExplicitBucketHistogramAggregation

# Several processes' pages merged (``--telemetry-workers``): offered here too, beside the page they merge.
from llmtap.telemetry.exposition.merge import merge_metrics

__all__ = [
    "CONTENT_TYPE",
    "OPENMETRICS_CONTENT_TYPE",
    "PrometheusReader",
    "merge_metrics",
    "metric_name",
    "render",
    "wants_openmetrics",
    "with_exemplars",
]

log = logging.getLogger("llmtap.telemetry")

#: How long one export may take (the SDK's periodic reader's default, ``OTEL_METRIC_EXPORT_TIMEOUT``'s).
EXPORT_TIMEOUT_MS = 30_000

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": "ratio"}


class PrometheusReader(MetricReader):
    """Collects on demand and renders the Prometheus text format."""

    def __init__(self) -> None:
        cumulative = AggregationTemporality.CUMULATIVE
        super().__init__(
            preferred_temporality={
                Counter: cumulative,
                UpDownCounter: cumulative,
                Histogram: cumulative,
                ObservableCounter: cumulative,
            },
            preferred_aggregation={Histogram: ExplicitBucketHistogramAggregation()},
        )
        self._latest: MetricsData | None = None
        self._lock = threading.Lock()
        #: Each histogram series' kept exemplars: (metric name, labels) -> bucket index -> (time, line tail).
        self._kept: dict[tuple[str, str], dict[int, tuple[int, str]]] = {}
        #: Each histogram's written bounds (indices), kept from scrape to scrape: a bound once written stays.
        self._shown: dict[str, set[int]] = {}
        #: The exporter fed from this reader's collections (``feed``), its interval, and the thread that ticks.
        self._exporter: MetricExporter | None = None
        self._every = 60.0
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._exporting = threading.Lock()
        #: Exemplars collected since the last export, by series (metric name, labels), each by bucket index.
        self._unsent: dict[tuple[str, str], dict[int, Any]] = {}

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        self._latest = metrics_data

    def shares(self, exporter: MetricExporter) -> bool:
        """Whether ``exporter`` asks for what this reader collects: every instrument cumulative, histograms in
        the instruments' explicit buckets (so ``feed`` may serve it)."""
        temporality = getattr(exporter, "_preferred_temporality", None) or {}
        if any(t != AggregationTemporality.CUMULATIVE for t in temporality.values()):
            return False
        aggregation = getattr(exporter, "_preferred_aggregation", None) or {}
        for kind, agg in aggregation.items():
            explicit = type(agg) is ExplicitBucketHistogramAggregation and getattr(agg, "_boundaries", None) is None
            if not (type(agg) is DefaultAggregation or (kind is Histogram and explicit)):
                return False
        return True

    def feed(self, exporter: MetricExporter, interval_millis: float) -> None:
        """Export every ``interval_millis`` to ``exporter`` from this reader's collections (one the reader
        ``shares``), once more at ``shutdown``, and at ``force_flush``. Call once the meter provider has it."""
        self._exporter = exporter
        self._every = interval_millis / 1e3
        self._ticker = threading.Thread(target=self._tick, name="llmtap-metrics-export", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.export(timeout_millis=EXPORT_TIMEOUT_MS)
            except Exception:
                log.warning("telemetry: metric collection for export failed", exc_info=True)

    def export(self, timeout_millis: float = 10_000) -> bool:
        """Collect now and hand the collection, with every exemplar since the last export, to the exporter."""
        exporter = self._exporter
        if exporter is None:
            return True
        with self._exporting:
            with self._lock:
                self._latest = None
                self.collect(timeout_millis=timeout_millis)
                data = self._latest
                self._keep(data)
                unsent, self._unsent = self._unsent, {}
            if data is None:
                return True
            # As the SDK's own export: whatever the exporter calls is not itself instrumented.
            token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
            try:
                return exporter.export(with_exemplars(data, unsent), timeout_millis=timeout_millis) == (
                    MetricExportResult.SUCCESS
                )
            finally:
                detach(token)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Export now, where this reader feeds an exporter."""
        if self._exporter is None:
            return super().force_flush(timeout_millis=timeout_millis)
        self.export(timeout_millis=timeout_millis)
        return self._exporter.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Where this reader feeds an exporter: stop its ticks, export once more, and shut the exporter down."""
        exporter = self._exporter
        if exporter is None:
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout_millis / 1e3)
        try:
            self.export(timeout_millis=timeout_millis)
        finally:
            exporter.shutdown(timeout_millis=timeout_millis)

    def render(self, *, openmetrics: bool = False, full: bool = False) -> str:
        """Collect now and return the exposition text (OpenMetrics, with exemplars, when asked; every bound
        of every histogram when ``full``, else the sparse buckets)."""
        with self._lock:  # one collection at a time: the kept exemplars and bounds are updated from each
            self._latest = None
            self.collect()
            data = self._latest
            self._keep(data)
            for name, shown in shown_bounds(data).items():
                self._shown.setdefault(name, set()).update(shown)
            return render(data, openmetrics=openmetrics, exemplars=self._kept, shown=None if full else self._shown)

    def _keep(self, data: MetricsData | None) -> None:
        """Update the kept exemplars from a collection's fresh ones; forget the series it no longer has."""
        kept: dict[tuple[str, str], dict[int, tuple[int, str]]] = {}
        for metric in _metrics(data):
            if not isinstance(metric.data, HistogramData):
                continue
            for p in metric.data.data_points:
                key = (metric.name, _labels(p.attributes))
                marks = self._kept.get(key, {})
                for i, fresh in _bucket_exemplars(p.explicit_bounds, p.exemplars).items():
                    if i not in marks or marks[i][0] <= fresh[0]:
                        marks[i] = fresh
                kept[key] = marks
        self._kept = kept
        if self._exporter is not None:
            self._hold(data)

    def _hold(self, data: MetricsData | None) -> None:
        """Keep a collection's fresh exemplars for the next export: the newest per bucket of a histogram, the
        newest set of any other point."""
        for metric in _metrics(data):
            histogram = isinstance(metric.data, HistogramData)
            for p in metric.data.data_points:
                fresh = getattr(p, "exemplars", None)
                if not fresh:
                    continue
                held = self._unsent.setdefault((metric.name, _labels(p.attributes)), {})
                if not histogram:
                    held.clear()
                    held.update(enumerate(fresh))
                    continue
                for e in fresh:
                    i = bisect_left(p.explicit_bounds, e.value)
                    if i not in held or held[i].time_unix_nano <= e.time_unix_nano:
                        held[i] = e


def with_exemplars(data: MetricsData, exemplars: Mapping[tuple[str, str], Mapping[int, Any]]) -> MetricsData:
    """``data`` with each point's exemplars those of its series (metric name, labels) in ``exemplars``, by index."""

    def point(name: str, p: Any) -> Any:
        held = exemplars.get((name, _labels(p.attributes)), {})
        return replace(p, exemplars=[held[i] for i in sorted(held)])

    def metric(m: Any) -> Any:
        return replace(m, data=replace(m.data, data_points=[point(m.name, p) for p in m.data.data_points]))

    return replace(
        data,
        resource_metrics=[
            replace(
                rm,
                scope_metrics=[
                    replace(
                        sm,
                        metrics=[metric(m) for m in sm.metrics],
                    )
                    for sm in rm.scope_metrics
                ],
            )
            for rm in data.resource_metrics
        ],
    )


def wants_openmetrics(accept: str) -> bool:
    """True when an ``Accept`` header prefers OpenMetrics to the plain text format (a q of 0 refuses it)."""
    best: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        best[media.lower()] = max(best.get(media.lower(), 0.0), q)
    om = best.get("application/openmetrics-text", 0.0)
    return om > 0 and om >= best.get("text/plain", 0.0)


def metric_name(name: str, unit: str, *, counter: bool = False) -> str:
    """The Prometheus name of an OpenTelemetry metric."""
    out = _INVALID.sub("_", name)
    suffix = _UNITS.get(unit) if unit and not unit.startswith("{") else None
    if suffix is None and unit and not unit.startswith("{"):
        suffix = _INVALID.sub("_", unit)
    if suffix and not out.endswith("_" + suffix):
        out += "_" + suffix
    if counter and not out.endswith("_total"):
        out += "_total"
    return out


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, list | tuple):
        text = ",".join(str(v) for v in value)
    else:
        text = str(value)
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(attrs: Any, extra: tuple[str, str] | None = None) -> str:
    parts = [f'{_INVALID.sub("_", str(k))}="{_label_value(v)}"' for k, v in sorted((attrs or {}).items())]
    if extra is not None:
        parts.append(f'{extra[0]}="{extra[1]}"')
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _exemplar(exemplar: Any) -> str:
    """An OpenMetrics exemplar: `` # {trace_id="...",span_id="..."} value timestamp``."""
    labels = f'trace_id="{exemplar.trace_id:032x}",span_id="{exemplar.span_id:016x}"'
    when = exemplar.time_unix_nano / 1e9
    return f" # {{{labels}}} {_number(exemplar.value)} {when:.3f}"


def _bucket_exemplars(bounds: Sequence[float], exemplars: Any) -> dict[int, tuple[int, str]]:
    """Each bucket's exemplar (the newest of the values that fell in it), by bucket index, with its time."""
    out: dict[int, tuple[int, str]] = {}
    for e in exemplars or ():
        if not e.trace_id or not e.span_id:
            continue
        i = bisect_left(bounds, e.value)  # the SDK's rule: a value goes in the first bucket whose bound >= it
        if i not in out or out[i][0] < e.time_unix_nano:
            out[i] = (e.time_unix_nano, _exemplar(e))
    return out


def shown_bounds(data: MetricsData | None) -> dict[str, set[int]]:
    """Per histogram (metric name), the bounds (indices) a sparse page writes: over all its series, every bound
    from the one below the lowest non-empty bucket (the lower edge a quantile interpolates from) to the upper
    bound of the highest. One run, no gaps: a value that later falls between two values seen before lands in a
    bucket whose bound is already written, so ``rate()`` counts it where it belongs (``render``)."""
    out: dict[str, set[int]] = {}
    for metric in _metrics(data):
        if not isinstance(metric.data, HistogramData):
            continue
        low, high = None, None
        for p in metric.data.data_points:
            last = len(p.explicit_bounds) - 1
            filled = [i for i, count in enumerate(p.bucket_counts) if count]
            if filled:
                # Bucket i is (bound[i-1], bound[i]]; the overflow bucket (i = len) has only its lower bound.
                first, top = max(filled[0] - 1, 0), min(filled[-1], last)
                low = first if low is None else min(low, first)
                high = top if high is None else max(high, top)
        out[metric.name] = set(range(low, high + 1)) if low is not None and high is not None else set()
    return out


def _buckets(
    name: str,
    attrs: Any,
    bounds: Any,
    counts: Any,
    total: int,
    exemplars: dict[int, str] | None = None,
    shown: set[int] | None = None,
) -> list[str]:
    """The ``_bucket`` lines of one histogram point, cumulative: every bound, or those in ``shown``.

    Every series of a histogram must carry the same bounds: ``sum by (le)`` across label sets, which
    every dashboard does, adds bucket by bucket, and a bound left out of one series would break it.
    ``shown`` is the metric's, the same for all its series.
    """
    labels = _labels(attrs)
    prefix = f"{name}_bucket{{{labels[1:-1]},le=" if labels else f"{name}_bucket{{le="
    marks = exemplars or {}
    out: list[str] = []
    running = 0
    for i, (bound, count) in enumerate(zip(bounds, counts, strict=False)):
        running += count
        if shown is None or i in shown:
            out.append(f'{prefix}"{_number(bound)}"}} {running}{marks.get(i, "")}')
    out.append(f'{prefix}"+Inf"}} {total}{marks.get(len(bounds), "")}')
    return out


def _metrics(data: MetricsData | None) -> Iterator[Any]:
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            yield from sm.metrics


def render(
    data: MetricsData | None,
    *,
    openmetrics: bool = False,
    exemplars: Mapping[tuple[str, str], Mapping[int, tuple[int, str]]] | None = None,
    shown: Mapping[str, set[int]] | None = None,
) -> str:
    """Prometheus text for one collection; OpenMetrics (families named without ``_total``, bucket exemplars,
    ``# EOF``) when asked. ``exemplars`` are the kept ones by (metric name, labels); without them, the
    collection's own. ``shown``: the bounds (indices) written per histogram, a superset of this collection's
    ``shown_bounds``; None writes every bound. One pass over the collection, the format's cases (counter,
    gauge, histogram) side by side, as the exposition format lists them."""
    lines: list[str] = []
    end = "# EOF\n" if openmetrics else ""
    if data is None:
        return end or "# no metrics (OpenTelemetry SDK disabled or nothing recorded yet)\n"
    for metric in _metrics(data):
        points = metric.data
        help_text = _help(metric, openmetrics)
        if isinstance(points, HistogramData):
            shown_here = None if shown is None else shown.get(metric.name, set())
            _histogram_lines(lines, metric, help_text, openmetrics, exemplars, shown_here)
        elif isinstance(points, Sum):
            _sum_lines(lines, metric, help_text, openmetrics)
        elif isinstance(points, Gauge):
            name = metric_name(metric.name, metric.unit or "")
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} gauge")
            for gp in points.data_points:
                lines.append(f"{name}{_labels(gp.attributes)} {_number(gp.value)}")
    return "\n".join(lines) + "\n" + end


def _help(metric: Any, openmetrics: bool) -> str:
    """A metric's ``# HELP`` text, escaped as the format asks (OpenMetrics escapes quotes too)."""
    help_text: str = (metric.description or metric.name).replace("\\", "\\\\").replace("\n", " ")
    if openmetrics:
        help_text = help_text.replace('"', '\\"')
    return help_text


def _histogram_lines(
    lines: list[str],
    metric: Any,
    help_text: str,
    openmetrics: bool,
    exemplars: Mapping[tuple[str, str], Mapping[int, tuple[int, str]]] | None,
    shown: set[int] | None,
) -> None:
    """A histogram's family: its buckets (with exemplars in OpenMetrics), sum and count per series."""
    name = metric_name(metric.name, metric.unit or "")
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    for p in metric.data.data_points:
        marks = None
        if openmetrics:
            kept = (
                exemplars.get((metric.name, _labels(p.attributes)), {})
                if exemplars is not None
                else _bucket_exemplars(p.explicit_bounds, p.exemplars)
            )
            marks = {i: text for i, (_, text) in kept.items()}
        lines.extend(_buckets(name, p.attributes, p.explicit_bounds, p.bucket_counts, p.count, marks, shown))
        lines.append(f"{name}_sum{_labels(p.attributes)} {_number(p.sum)}")
        lines.append(f"{name}_count{_labels(p.attributes)} {p.count}")


def _sum_lines(lines: list[str], metric: Any, help_text: str, openmetrics: bool) -> None:
    """A sum's family: a counter when monotonic, else a gauge."""
    counter = metric.data.is_monotonic
    name = metric_name(metric.name, metric.unit or "", counter=counter)
    # OpenMetrics names a counter's family without the ``_total`` its samples carry.
    family = name.removesuffix("_total") if openmetrics and counter else name
    lines.append(f"# HELP {family} {help_text}")
    lines.append(f"# TYPE {family} {'counter' if counter else 'gauge'}")
    for sp in metric.data.data_points:
        lines.append(f"{name}{_labels(sp.attributes)} {_number(sp.value)}")
