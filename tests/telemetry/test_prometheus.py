"""Prometheus text exposition: names, labels, histogram lines, and quantiles read back from the buckets."""

from __future__ import annotations

import bisect
import math
import random
import re
from collections.abc import Iterator
from itertools import pairwise

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from llmtap.analysis.stats import quantile
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS, TOKEN_BUCKETS, Instruments, create
from llmtap.telemetry.exposition.prometheus import PrometheusReader, merge_metrics, metric_name, render

LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


class Metrics:
    """A meter provider whose only reader is the Prometheus one, and llmtap's instruments on it."""

    def __init__(self, *, latest: bool = False) -> None:
        self.reader = PrometheusReader()
        self.provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.meter = self.provider.get_meter("llmtap-test")
        self.instruments: Instruments = create(self.meter, latest=latest)


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics()
    yield m
    m.provider.shutdown()


def unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample line of ``name`` as (labels, value)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = LINE.match(line)
        assert match is not None, line
        if match.group("name") != name:
            continue
        labels = {m.group("key"): unescape(m.group("value")) for m in LABEL.finditer(match.group("labels") or "")}
        out.append((labels, float(match.group("value"))))
    return out


def buckets(text: str, name: str, **match: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of one series, in the order rendered."""
    out = []
    for labels, value in samples(text, name + "_bucket"):
        if all(labels.get(k) == v for k, v in match.items()):
            out.append((float(labels["le"]), value))  # float("+Inf") is inf
    return out


def histogram_quantile(q: float, series: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile (promql/quantile.go): linear interpolation inside the bucket of rank q*N."""
    series = sorted(series)
    assert series and math.isinf(series[-1][0])
    rank = q * series[-1][1]
    for i, (upper, count) in enumerate(series):
        if count >= rank:
            if math.isinf(upper):
                return series[-2][0]
            lower, below = (0.0, 0.0) if i == 0 else series[i - 1]
            return lower + (upper - lower) * (rank - below) / (count - below)
    raise AssertionError("unreachable: the +Inf bucket holds every sample")


def exact_quantile(q: float, values: list[float]) -> float:
    """The quantile of the raw samples, as llmtap reads them (``llmtap.analysis.stats.quantile``)."""
    value = quantile(values, q)
    assert value is not None
    return value


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "unit", "counter", "expected"),
    [
        ("gen_ai.client.operation.duration", "s", False, "gen_ai_client_operation_duration_seconds"),
        ("gen_ai.client.token.usage", "{token}", False, "gen_ai_client_token_usage"),
        ("llmtap.usage.input_tokens", "{token}", True, "llmtap_usage_input_tokens_total"),
        ("llmtap.requests", "{request}", True, "llmtap_requests_total"),
        ("llmtap.streams.active", "{request}", False, "llmtap_streams_active"),
        ("llmtap.tokens.drift", "1", False, "llmtap_tokens_drift_ratio"),
        ("llmtap.response.size", "By", False, "llmtap_response_size_bytes"),
        ("llmtap.elapsed.seconds", "s", False, "llmtap_elapsed_seconds"),  # the unit is not said twice
        ("llmtap.events_total", "", True, "llmtap_events_total"),
        ("odd-name/with spaces", "ms", False, "odd_name_with_spaces_milliseconds"),
    ],
)
def test_metric_names(name: str, unit: str, counter: bool, expected: str) -> None:
    assert metric_name(name, unit, counter=counter) == expected


def test_rendered_names_and_types(metrics: Metrics) -> None:
    ins = metrics.instruments
    attrs = {sc.ROUTE: "default"}
    ins.operation_duration.record(0.5, attrs)
    assert ins.token_usage is not None
    ins.token_usage.record(42, {**attrs, sc.TOKEN_TYPE: "input"})
    ins.requests.add(1, attrs)
    ins.input_tokens.add(42, attrs)
    ins.active_streams.add(1, attrs)
    text = metrics.reader.render()
    lines = text.splitlines()
    assert "# TYPE gen_ai_client_operation_duration_seconds histogram" in lines
    assert "# TYPE gen_ai_client_token_usage histogram" in lines
    assert "# TYPE llmtap_requests_total counter" in lines
    assert "# TYPE llmtap_usage_input_tokens_total counter" in lines
    assert "# TYPE llmtap_streams_active gauge" in lines  # an up-down counter is no counter
    assert 'llmtap_requests_total{llmtap_route="default"} 1' in lines
    assert 'llmtap_streams_active{llmtap_route="default"} 1' in lines
    assert samples(text, "gen_ai_client_token_usage_sum") == [
        ({"gen_ai_token_type": "input", "llmtap_route": "default"}, 42)
    ]
    # Every sample line parses, and every name is a valid Prometheus name.
    for line in lines:
        assert line.startswith("# ") or LINE.match(line), line


def test_label_escaping(metrics: Metrics) -> None:
    counter = metrics.meter.create_counter("llmtap.test.escape", unit="{item}", description="one\ntwo \\ three")
    nasty = 'C:\\models\\"big"\nnext line'
    counter.add(3, {"llmtap.value": nasty, "flag": True})
    text = metrics.reader.render()
    lines = text.splitlines()
    expected = 'llmtap_test_escape_total{flag="true",llmtap_value="C:\\\\models\\\\\\"big\\"\\nnext line"} 3'
    assert expected in lines
    # The value reads back unchanged, and no label or help text broke a line.
    assert samples(text, "llmtap_test_escape_total") == [({"flag": "true", "llmtap_value": nasty}, 3.0)]
    (help_line,) = [line for line in lines if line.startswith("# HELP llmtap_test_escape_total")]
    assert "two" in help_line and "next line" not in help_line


# --- histograms ---------------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count(metrics: Metrics) -> None:
    hist = metrics.meter.create_histogram(
        "llmtap.test.latency", unit="s", explicit_bucket_boundaries_advisory=[0.1, 0.5, 1.0]
    )
    values = [0.05, 0.3, 0.3, 0.7, 5.0]
    for v in values:
        hist.record(v, {"route": "a"})
    hist.record(0.2, {"route": "b"})
    text = metrics.reader.render()
    lines = text.splitlines()
    name = "llmtap_test_latency_seconds"
    assert f"# TYPE {name} histogram" in lines
    assert buckets(text, name, route="a") == [(0.1, 1), (0.5, 3), (1.0, 4), (math.inf, 5)]
    assert f'{name}_bucket{{route="a",le="+Inf"}} 5' in lines
    assert f'{name}_bucket{{route="a",le="0.5"}} 3' in lines
    assert samples(text, f"{name}_count") == [({"route": "a"}, 5), ({"route": "b"}, 1)]
    ((_, total),) = [s for s in samples(text, f"{name}_sum") if s[0] == {"route": "a"}]
    assert total == pytest.approx(sum(values))
    assert buckets(text, name, route="b") == [(0.1, 0), (0.5, 1), (1.0, 1), (math.inf, 1)]


def test_render_without_data() -> None:
    assert render(None).startswith("# no metrics")


def test_llmtap_latency_histograms_use_fine_buckets(metrics: Metrics) -> None:
    metrics.instruments.itl.record(0.02, {sc.ROUTE: "default"})
    series = buckets(metrics.reader.render(full=True), "llmtap_inter_token_latency_seconds")
    assert [le for le, _ in series[:-1]] == list(DURATION_BUCKETS)
    # The page a scraper gets writes the bound of the value's bucket and the one below it, and +Inf.
    i = bisect.bisect_left(DURATION_BUCKETS, 0.02)
    sparse = buckets(metrics.reader.render(), "llmtap_inter_token_latency_seconds")
    assert sparse == [(DURATION_BUCKETS[i - 1], 0), (DURATION_BUCKETS[i], 1), (math.inf, 1)]


def test_sparse_buckets_read_every_quantile_as_all_bounds_do(metrics: Metrics) -> None:
    data = distributions()
    for dist, values in data.items():
        for v in values:
            metrics.instruments.ttft.record(v, {"dist": dist})
    full, sparse = metrics.reader.render(full=True), metrics.reader.render()
    name = "llmtap_time_to_first_token_seconds"
    assert len(sparse) < len(full) / 2
    for dist in data:
        for q in (0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999):
            want = histogram_quantile(q, buckets(full, name, dist=dist))
            assert histogram_quantile(q, buckets(sparse, name, dist=dist)) == pytest.approx(want, rel=1e-12)


def test_a_bound_once_written_stays(metrics: Metrics) -> None:
    """rate() over a bucket that came and went would read a history it never saw: bounds only ever join."""
    name = "llmtap_inter_token_latency_seconds"
    metrics.instruments.itl.record(0.02, {sc.ROUTE: "a"})
    first = [le for le, _ in buckets(metrics.reader.render(), name)]
    metrics.instruments.itl.record(3.0, {sc.ROUTE: "a"})
    second = [le for le, _ in buckets(metrics.reader.render(), name)]
    # One run of bounds, from below the lowest value's bucket to the highest's.
    assert set(first) < set(second) and second == [*DURATION_BUCKETS[34:94], math.inf]
    assert [le for le, _ in buckets(metrics.reader.render(), name)] == second


def test_a_value_inside_the_range_seen_writes_no_new_bound(metrics: Metrics) -> None:
    """A new bound's first sample already holds the value that made it appear, which rate() never sees as an
    increase: inside the range seen so far, no value makes one appear."""
    name = "llmtap_time_to_first_token_seconds"
    for v in (0.1, 0.2, 0.5):
        metrics.instruments.ttft.record(v, {sc.ROUTE: "a"})
    before = [le for le, _ in buckets(metrics.reader.render(), name)]
    for v in (0.11, 0.3, 0.45):
        metrics.instruments.ttft.record(v, {sc.ROUTE: "b"})
    assert [le for le, _ in buckets(metrics.reader.render(), name, llmtap_route="b")] == before


def test_duration_buckets_grow_by_at_most_9_1_percent() -> None:
    b = DURATION_BUCKETS
    assert all(hi > lo for lo, hi in pairwise(b))
    steps = [hi / lo for lo, hi in pairwise(b)]
    assert max(steps) <= 1.091 and min(steps) > 1.08
    # They reach from 1 ms gaps to multi-minute agent calls.
    assert b[0] <= 0.001 and b[-1] >= 120
    t = TOKEN_BUCKETS
    assert all(hi > lo for lo, hi in pairwise(t)) and t[0] == 1 and t[-1] >= 1_000_000


def distributions() -> dict[str, list[float]]:
    rng = random.Random(7)
    tight = [max(rng.gauss(0.78, 0.03), 0.01) for _ in range(1000)]  # TTFT of one prompt shape
    itl = [rng.lognormvariate(math.log(0.022), 0.3) for _ in range(1000)]  # inter-token gaps around 22 ms
    bimodal = [
        max(rng.gauss(0.035, 0.004), 0.005) if rng.random() < 0.8 else max(rng.gauss(1.6, 0.2), 0.5)
        for _ in range(1000)
    ]  # cache hits against misses
    return {"tight": tight, "itl": itl, "bimodal": bimodal}


def test_quantiles_read_back_within_10_percent(metrics: Metrics) -> None:
    data = distributions()
    for dist, values in data.items():
        for v in values:
            metrics.instruments.ttft.record(v, {"dist": dist})
    text = metrics.reader.render()
    for dist, values in data.items():
        series = buckets(text, "llmtap_time_to_first_token_seconds", dist=dist)
        assert series[-1] == (math.inf, 1000)
        for q in (0.5, 0.95, 0.99):
            exact = exact_quantile(q, values)
            estimate = histogram_quantile(q, series)
            assert abs(estimate - exact) / exact < 0.10, (dist, q, estimate, exact)


def test_conventions_advisory_buckets_would_not_do(metrics: Metrics) -> None:
    # The check above can fail: with the spec's doubling buckets the tight TTFT reads back >10% off.
    hist = metrics.meter.create_histogram(
        "llmtap.test.advisory",
        unit="s",
        explicit_bucket_boundaries_advisory=[0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12],
    )
    values = distributions()["tight"]
    for v in values:
        hist.record(v)
    series = buckets(metrics.reader.render(), "llmtap_test_advisory_seconds")
    errors = [
        abs(histogram_quantile(q, series) - exact_quantile(q, values)) / exact_quantile(q, values)
        for q in (0.5, 0.95, 0.99)
    ]
    assert max(errors) > 0.10


def test_every_series_of_a_histogram_carries_every_bound(metrics: Metrics) -> None:
    """``sum by (le)`` across label sets adds bucket by bucket: no series may leave a bound out."""
    metrics.instruments.itl.record(0.02, {sc.ROUTE: "a"})
    metrics.instruments.itl.record(3.0, {sc.ROUTE: "b"})
    name = "llmtap_inter_token_latency_seconds"
    for text in (metrics.reader.render(full=True), metrics.reader.render()):
        a, b = buckets(text, name, llmtap_route="a"), buckets(text, name, llmtap_route="b")
        assert [le for le, _ in a] == [le for le, _ in b]
    assert [le for le, _ in a] == [*DURATION_BUCKETS[34:94], math.inf]
    # Route b's bounds below 3 s, where it has no value, count what lies below them: nothing; a's above 0.02 s, 1.
    assert {n for le, n in b[:-2]} == {0} and {n for le, n in a[1:]} == {1}


def test_merged_sparse_pages_read_as_merged_full_ones() -> None:
    """Two telemetry processes write different sparse bounds; their merged page adds up bucket by bucket."""
    a, b = Metrics(), Metrics()
    rng = random.Random(3)
    for m, median in ((a, 0.05), (b, 0.8)):
        for _ in range(300):
            m.instruments.ttft.record(rng.lognormvariate(math.log(median), 0.3), {sc.ROUTE: "r"})
    a.instruments.ttft.record(0.3, {sc.ROUTE: "only-a"})
    name = "llmtap_time_to_first_token_seconds"
    full = merge_metrics([a.reader.render(full=True), b.reader.render(full=True)])
    sparse = merge_metrics([a.reader.render(), b.reader.render()])
    for route in ("r", "only-a"):
        f, s = buckets(full, name, llmtap_route=route), buckets(sparse, name, llmtap_route=route)
        assert s and set(s) <= set(f) and s[-1] == f[-1]
        for q in (0.1, 0.5, 0.9, 0.99):
            assert histogram_quantile(q, s) == pytest.approx(histogram_quantile(q, f), rel=1e-12), (route, q)
    # Both series of the merged page carry the same bounds.
    assert [le for le, _ in buckets(sparse, name, llmtap_route="r")] == [
        le for le, _ in buckets(sparse, name, llmtap_route="only-a")
    ]
    for m in (a, b):
        m.provider.shutdown()
