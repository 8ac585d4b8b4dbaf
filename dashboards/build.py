"""Builds llmtap's Grafana dashboards from code: ``python -m dashboards.build`` writes them, ``--check`` compares.

Metric and label names are derived from ``llmtap.telemetry.semconv`` through the same OpenTelemetry to
Prometheus rules as the proxy's ``/metrics`` (``llmtap.telemetry.exposition.prometheus.metric_name``), which are also
what a collector's Prometheus remote-write exporter produces, so one set of queries serves both paths and a
renamed metric changes the dashboards in the same commit. The JSON is built with grafana-foundation-sdk;
CI runs ``--check``, which fails when the checked-in files differ from what this code builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb, dashboard as db, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm, dashboard as dm

from llmtap.telemetry import semconv as sc
from llmtap.telemetry.exposition.prometheus import metric_name

HERE = Path(__file__).resolve().parent
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.95, 0.99)
REFS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # Grafana query ids


def label(attribute: str) -> str:
    """The Prometheus label of an OpenTelemetry attribute (dots become underscores)."""
    return attribute.replace(".", "_")


def seconds(metric: str) -> str:
    """A histogram in seconds: ``_seconds`` is added (then ``_bucket``, ``_sum``, ``_count`` in queries)."""
    return metric_name(metric, "s")


def total(metric: str) -> str:
    """A counter: ``_total`` is added; units in braces (``{token}``, ``{request}``) add nothing."""
    return metric_name(metric, "{count}", counter=True)


# Metrics, by their Prometheus names. Percentiles come from llmtap's own histograms: they carry the route,
# request shape and prompt version the panels group by, and fine buckets whatever telemetry.histogram_buckets
# says (the gen_ai.* ones carry the conventions' attributes only; with histogram_buckets: standard, their
# coarse buckets).
TTFT = seconds(sc.METRIC_TTFT)
ITL = seconds(sc.METRIC_ITL)
TPOT = seconds(sc.METRIC_TPOT)
QUEUE = seconds(sc.METRIC_QUEUE)
PREFILL = seconds(sc.METRIC_PREFILL)
DECODE = seconds(sc.METRIC_DECODE)
OVERHEAD = seconds(sc.METRIC_OVERHEAD)
DRIFT = metric_name(sc.METRIC_TOKEN_DRIFT, "1")
REQUESTS = total(sc.METRIC_REQUESTS)
INPUT_TOKENS = total(sc.METRIC_INPUT_TOKENS)
OUTPUT_TOKENS = total(sc.METRIC_OUTPUT_TOKENS)
CACHE_READ = total(sc.METRIC_CACHE_READ)
CACHE_REQUESTS = total(sc.METRIC_CACHE_REQUESTS)
QUEUE_REJECTED = total(sc.METRIC_QUEUE_REJECTED)
TIMING_REJECTED = total(sc.METRIC_TIMING_REJECTED)
COST = total(sc.METRIC_COST)
UNPRICED = total(sc.METRIC_COST_UNPRICED)
ACTIVE = metric_name(sc.METRIC_ACTIVE_STREAMS, "{request}")
WAITING = metric_name(sc.METRIC_QUEUE_WAITING, "{request}")

# Labels.
MODEL = label(sc.REQUEST_MODEL)
ROUTE = label(sc.ROUTE)
VERSION = label(sc.PROMPT_VERSION)
SHAPE = label(sc.SHAPE)
INPUT_SIZE = label(sc.INPUT_SIZE)
OUTCOME = label(sc.OUTCOME)
SLO = label(sc.SLO_OUTCOME)
ERROR = label(sc.ERROR_TYPE)
CACHE_CLASS = label(sc.CACHE_CLASS)
QUEUE_SOURCE = label(sc.QUEUE_SOURCE)
PREFILL_SOURCE = label(sc.PREFILL_SOURCE)
TOKEN_TYPE = label(sc.TOKEN_TYPE)
TIMING_FIELD = label(sc.TIMING_FIELD)
TENANT = label(sc.TENANT)
COST_STATUS = label(sc.COST_STATUS)

# Every query filters on the template variables; "All" is ".*", which also matches a missing label.
ON_ROUTE = f'{ROUTE}=~"$route"'
SELECTED = f'{MODEL}=~"$model", {ON_ROUTE}'
SELECTED_SHAPE = f'{SELECTED}, {SHAPE}=~"$shape"'
SELECTED_VERSION = f'{SELECTED}, {VERSION}=~"$version"'


# --- queries and panels ---------------------------------------------------------------------------


def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def quantile(q: float, metric: str, selector: str, by: Sequence[str] = ()) -> str:
    groups = ", ".join(["le", *by])
    return f"histogram_quantile({q}, sum by ({groups}) (rate({metric}_bucket{{{selector}}}{RATE})))"


def mean(metric: str, selector: str, by: Sequence[str] = ()) -> str:
    """Mean per observation: unlike percentiles, means of the phases add up to the mean request."""
    groups = f" by ({', '.join(by)})" if by else ""
    return (
        f"sum{groups} (rate({metric}_sum{{{selector}}}{RATE})) / sum{groups} (rate({metric}_count{{{selector}}}{RATE}))"
    )


def percentile_queries(metric: str, selector: str, by: Sequence[str] = ()) -> list[prometheus.Dataquery]:
    """p50, p95 and p99, optionally one series per value of the ``by`` labels; with exemplars, so a point
    links to the trace of a request in its bucket (the proxy's OpenMetrics exemplars)."""
    out = []
    for ref, q in zip(REFS, QUANTILES, strict=False):
        name = f"p{round(q * 100)}"
        legend = " ".join([*(f"{{{{{b}}}}}" for b in by), name])
        out.append(query(quantile(q, metric, selector, by), legend, ref).exemplar(True))
    return out


def graph(title: str, description: str, unit: str, targets: Sequence[prometheus.Dataquery]) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(8)
        .span(12)
        .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def single(title: str, description: str, unit: str, expr: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(4)
        .span(6)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(expr, title, "A"))
    )


def variable(name: str, title: str, metric: str, lbl: str) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(title)
        .datasource(DATASOURCE)
        .query(f"label_values({metric}, {lbl})")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def variables() -> list[Builder[dm.VariableModel]]:
    """Data source, model, route, request shape and prompt version: the same five on every llmtap dashboard."""
    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        variable("model", "Model", REQUESTS, MODEL),
        variable("route", "Route", REQUESTS, ROUTE),
        variable("shape", "Request shape", REQUESTS, SHAPE),
        variable("version", "Prompt version", CACHE_REQUESTS, VERSION),
    ]


def dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    out = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["llmtap", "llm", "opentelemetry"])
        .editable()
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
    )
    for v in variables():
        out = out.with_variable(v)
    return out


def latency_panels() -> list[Builder[dm.Panel]]:
    """TTFT, ITL and TPOT at p50/p95/p99, once by model and once by request shape."""
    figures = (
        ("TTFT", TTFT, "Request received to the first chunk carrying generated content (streams)."),
        ("ITL", ITL, "Inter-token latency: each chunk gap divided over the tokens it carried."),
        ("TPOT", TPOT, "Time per output token: first to last content chunk over (output tokens - 1)."),
    )
    panels: list[Builder[dm.Panel]] = []
    for name, metric, what in figures:
        panels.append(graph(f"{name} by model", what, "s", percentile_queries(metric, SELECTED_SHAPE, [MODEL])))
        shape = (
            f"{what} By route and request shape ({sc.SHAPE}: the configured classes by input and output tokens), "
            "the split objectives are set for. Exemplars link a bucket to a request's trace."
        )
        split = percentile_queries(metric, SELECTED_SHAPE, [ROUTE, SHAPE])
        panels.append(graph(f"{name} by route and request shape", shape, "s", split))
    return panels


def throughput_panels() -> list[Builder[dm.Panel]]:
    requests = f"sum by ({OUTCOME}) (rate({REQUESTS}{{{SELECTED_SHAPE}}}{RATE}))"
    met = f'sum(rate({REQUESTS}{{{SELECTED_SHAPE}, {SLO}="met"}}{RATE}))'
    judged = f'sum(rate({REQUESTS}{{{SELECTED_SHAPE}, {SLO}!="none"}}{RATE}))'
    by_shape = f"sum by ({ROUTE}, {SHAPE})"
    shape_met = f'{by_shape} (rate({REQUESTS}{{{SELECTED_SHAPE}, {SLO}="met"}}{RATE}))'
    shape_judged = f'{by_shape} (rate({REQUESTS}{{{SELECTED_SHAPE}, {SLO}!="none"}}{RATE}))'
    return [
        graph(
            "Tokens per second",
            "Input and output tokens through the proxy, from upstream usage where reported.",
            "short",
            [
                query(f"sum(rate({OUTPUT_TOKENS}{{{SELECTED}}}{RATE}))", "output tokens/s", "A"),
                query(f"sum(rate({INPUT_TOKENS}{{{SELECTED}}}{RATE}))", "input tokens/s", "B"),
            ],
        ),
        graph(
            "Requests per second",
            "Finished requests by outcome (ok, error, cancelled).",
            "reqps",
            [query(requests, f"{{{{{OUTCOME}}}}}", "A")],
        ),
        graph(
            "Goodput",
            "Requests per second that met every configured SLO (errors and cancellations count as missed), "
            "beside all requests judged. Empty when the proxy runs without SLOs (--slo-ttft-ms, --slo-tpot-ms).",
            "reqps",
            [query(met, "goodput", "A"), query(judged, "judged", "B")],
        ),
        graph(
            "Goodput by route and request shape",
            "Requests per second that met their objective (routes[].slo for their shape, else the global slo), "
            "and the share met, per route and shape. llmtap slo gives each its verdict at the percentile that "
            "counts, with intervals.",
            "reqps",
            [
                query(shape_met, f"{{{{{ROUTE}}}}} {{{{{SHAPE}}}}} goodput", "A"),
                query(f"{shape_met} / {shape_judged}", f"{{{{{ROUTE}}}}} {{{{{SHAPE}}}}} share met", "B"),
            ],
        ),
        single(
            "Share meeting SLO",
            "Goodput over all requests judged against the SLOs.",
            "percentunit",
            f"{met} / {judged}",
        ),
    ]


def phase_panels() -> list[Builder[dm.Panel]]:
    """Queue, prefill and decode, each with its source (server-reported, estimated or measured at the proxy)."""
    split = [
        query(mean(QUEUE, SELECTED, [QUEUE_SOURCE]), f"queue ({{{{{QUEUE_SOURCE}}}}})", "A"),
        query(mean(PREFILL, SELECTED, [PREFILL_SOURCE]), f"prefill ({{{{{PREFILL_SOURCE}}}}})", "B"),
        query(mean(DECODE, SELECTED), "decode (proxy)", "C"),
    ]
    tails = [
        query(quantile(0.95, QUEUE, SELECTED, [QUEUE_SOURCE]), f"queue p95 ({{{{{QUEUE_SOURCE}}}}})", "A"),
        query(quantile(0.95, PREFILL, SELECTED, [PREFILL_SOURCE]), f"prefill p95 ({{{{{PREFILL_SOURCE}}}}})", "B"),
        query(quantile(0.95, DECODE, SELECTED), "decode p95 (proxy)", "C"),
    ]
    admission = [
        query(f"sum by ({ROUTE}) ({WAITING}{{{ON_ROUTE}}})", f"waiting ({{{{{ROUTE}}}}})", "A"),
        query(f"sum by ({ERROR}) (rate({QUEUE_REJECTED}{{{ON_ROUTE}}}{RATE}))", f"rejected/s ({{{{{ERROR}}}}})", "B"),
    ]
    rejected = f"sum by ({TIMING_FIELD}) (rate({TIMING_REJECTED}{{{ON_ROUTE}}}{RATE}))"
    return [
        graph(
            "Where the time goes: mean queue, prefill and decode",
            "Mean seconds per request in each phase; the legend names each figure's source: server (reported by "
            "the model server), estimated (from the unloaded TTFT envelope), proxy or upstream_ttft (measured).",
            "s",
            split,
        ),
        graph("Queue, prefill and decode p95", "The slow tail of each phase, by source.", "s", tails),
        graph(
            "Admission queue",
            "Requests waiting for a slot in a route's concurrency limit, and those refused (queue full or timed out).",
            "short",
            admission,
        ),
        graph(
            "Server timings rejected",
            "Timing fields a server reported that could not be true (negative, longer than the request); the "
            "proxy's own measurement was used instead.",
            "short",
            [query(rejected, f"{{{{{TIMING_FIELD}}}}}", "A")],
        ),
    ]


def health_panels() -> list[Builder[dm.Panel]]:
    errors = f'sum by ({ERROR}) (rate({REQUESTS}{{{SELECTED}, {OUTCOME}!="ok"}}{RATE}))'
    overhead = [
        query(quantile(q, OVERHEAD, ON_ROUTE), f"p{round(q * 100)}", ref)
        for ref, q in zip(REFS, QUANTILES, strict=False)
    ]
    drift = quantile(0.95, DRIFT, ON_ROUTE, [TOKEN_TYPE])
    return [
        graph(
            "Errors by type",
            "Failed and cancelled requests per second, by error.type.",
            "reqps",
            [query(errors, f"{{{{{ERROR}}}}}", "A")],
        ),
        graph(
            "Streams in flight",
            "Requests between arrival and the end of their stream, by route.",
            "short",
            [query(f"sum by ({ROUTE}) ({ACTIVE}{{{ON_ROUTE}}})", f"{{{{{ROUTE}}}}}", "A")],
        ),
        graph(
            "Proxy overhead",
            "Time llmtap itself spent between admitting a request and sending it upstream.",
            "s",
            overhead,
        ),
        graph(
            "Token count drift, p95",
            "|tiktoken count - reported usage| / reported usage: how far the proxy's own counts (per chunk, and "
            "the fallback) are from the server's.",
            "percentunit",
            [query(drift, f"{{{{{TOKEN_TYPE}}}}}", "A")],
        ),
    ]


def caching_panels() -> list[Builder[dm.Panel]]:
    """Did the prompt change pay off: cached-token share, TTFT and cache classes, by prompt version."""
    by_version = f"sum by ({VERSION})"
    share = (
        f"{by_version} (rate({CACHE_READ}{{{SELECTED_VERSION}}}{RATE})) / "
        f"{by_version} (rate({INPUT_TOKENS}{{{SELECTED_VERSION}}}{RATE}))"
    )
    hits = (
        f'{by_version} (rate({CACHE_REQUESTS}{{{SELECTED_VERSION}, {CACHE_CLASS}="hit"}}{RATE})) / '
        f"{by_version} (rate({CACHE_REQUESTS}{{{SELECTED_VERSION}}}{RATE}))"
    )
    classes = f"sum by ({CACHE_CLASS}) (rate({CACHE_REQUESTS}{{{SELECTED_VERSION}}}{RATE}))"
    ttft = [
        query(quantile(q, TTFT, SELECTED_VERSION, [VERSION]), f"{{{{{VERSION}}}}} p{round(q * 100)}", ref)
        for ref, q in zip(REFS, QUANTILES, strict=False)
    ]
    return [
        graph(
            "Cached-token share by prompt version",
            "Input tokens read from the server's prompt cache over all input tokens. Tag requests with the "
            "x-llmtap-prompt-version header to compare prompt layouts before and after a change.",
            "percentunit",
            [query(share, f"{{{{{VERSION}}}}}", "A")],
        ),
        graph(
            "TTFT by prompt version", "What users feel of the cache: TTFT percentiles per prompt version.", "s", ttft
        ),
        graph(
            "Cache classes",
            "Requests per second by what the prompt cache did: hit, cold (first sight), miss_changed (the "
            "prefix changed), miss_evicted (seen before, evicted since), too_short (below the cache minimum) "
            "or unknown.",
            "reqps",
            [query(classes, f"{{{{{CACHE_CLASS}}}}}", "A")],
        ),
        graph(
            "Cache hit ratio by prompt version",
            "Requests classed hit over all classified requests.",
            "percentunit",
            [query(hits, f"{{{{{VERSION}}}}}", "A")],
        ),
    ]


def cost_panels() -> list[Builder[dm.Panel]]:
    """What requests cost and who sent them. Tenants appear when ``metric_dimensions`` allows them
    (their most used values; the rest read _OTHER); cost is reported tokens at the price table's prices."""
    by_model = f"sum by ({MODEL}) (rate({COST}{{{SELECTED}}}{RATE})) * 3600"
    by_tenant = f"sum by ({TENANT}) (rate({COST}{{{SELECTED}}}{RATE})) * 3600"
    per_request = f"sum(rate({COST}{{{SELECTED}}}{RATE})) / sum(rate({REQUESTS}{{{SELECTED}}}{RATE}))"
    tenants = f"sum by ({TENANT}) (rate({REQUESTS}{{{SELECTED}}}{RATE}))"
    unpriced = f"sum by ({COST_STATUS}) (rate({UNPRICED}{{{SELECTED}}}{RATE}))"
    return [
        graph(
            "Cost per hour by model",
            "USD an hour at the current rate: each request's reported tokens at the price table's prices (the "
            "shipped, dated table, or --prices). Requests without a price are counted apart, never as 0.",
            "currencyUSD",
            [query(by_model, f"{{{{{MODEL}}}}}", "A")],
        ),
        graph(
            "Cost per hour by tenant",
            "USD an hour by x-llmtap-tenant; needs attribution.metric_dimensions to include tenant (the most used "
            "tenants keep their own series, the rest read _OTHER).",
            "currencyUSD",
            [query(by_tenant, f"{{{{{TENANT}}}}}", "A")],
        ),
        graph(
            "Requests per second by tenant",
            "Finished requests by x-llmtap-tenant (with tenant in attribution.metric_dimensions).",
            "reqps",
            [query(tenants, f"{{{{{TENANT}}}}}", "A")],
        ),
        single(
            "Mean cost per request",
            "USD per finished request: priced requests' cost over all requests (unpriced ones count as requests).",
            "currencyUSD",
            per_request,
        ),
        graph(
            "Requests without a price",
            "Requests whose cost is unknown, by llmtap.cost.status: unknown_model (add the model to --prices) or "
            "no_usage (the upstream reported no tokens).",
            "reqps",
            [query(unpriced, f"{{{{{COST_STATUS}}}}}", "A")],
        ),
    ]


def rows(dash: db.Dashboard, sections: Sequence[tuple[str, list[Builder[dm.Panel]]]]) -> db.Dashboard:
    for title, panels in sections:
        dash = dash.with_row(db.Row(title))
        for panel in panels:
            dash = dash.with_panel(panel)
    return dash


def overview() -> db.Dashboard:
    dash = dashboard(
        "llmtap-overview",
        "llmtap: LLM inference as users feel it",
        "TTFT, ITL and TPOT percentiles, throughput, goodput, the queue/prefill/decode split, errors and the "
        "proxy's own overhead, from llmtap's metrics.",
    )
    return rows(
        dash,
        [
            ("Latency users feel", latency_panels()),
            ("Throughput and goodput", throughput_panels()),
            ("Where the time goes", phase_panels()),
            ("Errors, load and the proxy itself", health_panels()),
            ("Cost and who sent it", cost_panels()),
        ],
    )


def caching() -> db.Dashboard:
    dash = dashboard(
        "llmtap-caching",
        "llmtap: prompt caching",
        "Cached-token share, TTFT and cache classes by prompt version: verify a prompt change's caching gain.",
    )
    return rows(dash, [("Prompt caching", caching_panels())])


DASHBOARDS = {"llmtap-overview.json": overview, "llmtap-caching.json": caching}


def _number_panels(data: dict[str, Any]) -> dict[str, Any]:
    """Stable panel ids in layout order (Grafana needs them unique; the SDK leaves them unset)."""
    for index, panel in enumerate(data.get("panels", []), start=1):
        panel["id"] = index
    return data


def render(build: db.Dashboard) -> str:
    """The dashboard as the JSON file it is checked in as."""
    data = json.loads(json.dumps(build.build(), cls=JSONEncoder))
    return json.dumps(_number_panels(data), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def stale(directory: Path) -> list[str]:
    """Names of the dashboard files in ``directory`` that differ from what this code builds."""
    out = []
    for name, make in DASHBOARDS.items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != render(make()):
            out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a checked-in file is stale; write nothing")
    parser.add_argument("--out", type=Path, default=HERE, help="folder of the JSON files (default: dashboards/)")
    args = parser.parse_args(argv)
    if args.check:
        names = stale(args.out)
        for name in names:
            print(f"{args.out / name}: stale; regenerate with python -m dashboards.build", file=sys.stderr)
        return 1 if names else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in DASHBOARDS.items():
        (args.out / name).write_text(render(make()), encoding="utf-8")
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
