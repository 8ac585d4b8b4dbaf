"""``llmtap slo``: each route and request shape against its objective, from records or from Prometheus.

Reads the requests (``--record`` paths through ``llmtap.store``, ``--clickhouse``, or a Prometheus server's
copy of the proxy's metrics over its HTTP API), has ``llmtap.analysis.slo`` judge them, and prints the
verdicts as a table or as JSON. What the verdicts mean is in ``llmtap.analysis.slo``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from llmtap import store
from llmtap.analysis import costreport
from llmtap.analysis.burnrate import rule_groups
from llmtap.analysis.shapes import names as shape_names, needed, objective as shape_objective
from llmtap.analysis.slo import (
    INSUFFICIENT,
    MET,
    MISSED,
    NONE,
    RESAMPLES,
    Objectives,
    Report,
    attach_request_objectives,
    bucket_queries,
    config_objectives,
    judge_request_objectives,
    limits_of,
    prometheus_groups,
    prometheus_selector,
    request_objectives_query,
    requests_query,
    store_groups,
    verdicts,
)
from llmtap.analysis.stats import Estimate
from llmtap.analysis.units import parse_duration, parse_time, seconds
from llmtap.commands import cost
from llmtap.commands.prometheus import Prometheus
from llmtap.config.load import build
from llmtap.config.types import ConfigError, Settings
from llmtap.store.files import NoRecords

__all__ = [
    "describe_filter",
    "engine_note",
    "from_prometheus",
    "from_records",
    "main",
    "no_such_names",
    "open_source",
    "readable",
    "render",
    "rules_text",
    "source_name",
]

# -- record files ----------------------------------------------------------------------------------


def open_source(paths: Sequence[str | Path], engine: str | None) -> store.Source:
    """The record files ``paths`` name, read by ``engine`` (None: the default); ``ConfigError`` when there are
    none, or when the engine named is not installed."""
    try:
        return store.open_source([str(p) for p in paths], engine)
    except NoRecords as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def engine_note(engine: str | None) -> None:
    """Say on stderr that plain Python reads the records when no engine was named and DuckDB is not installed."""
    if engine is None and store.default_engine() != store.ENGINES[0]:
        print(
            f"llmtap: the records are read in plain Python (the embedded engine is not installed: "
            f"{store.ANALYSIS_EXTRA} for large record sets)",
            file=sys.stderr,
        )


def describe_filter(where: store.Filter) -> str:
    """How an answer names the filter (`` with route support between .. and ..``), or '' for none."""
    names = [f"{name} {value}" for name in ("route", "model", "shape") if (value := getattr(where, name)) is not None]
    parts = [f"with {', '.join(names)}"] if names else []
    moments = [datetime.fromtimestamp(v, UTC).isoformat(timespec="seconds") for v in (where.start, where.end) if v]
    if where.start is not None and where.end is not None:
        parts.append(f"between {moments[0]} and {moments[1]}")
    elif where.start is not None:
        parts.append(f"from {moments[0]}")
    elif where.end is not None:
        parts.append(f"until {moments[0]}")
    return "".join(f" {p}" for p in parts)


def no_such_names(source: store.Source, where: store.Filter, by: store.By) -> None:
    """When a route, model or shape filter matched nothing: ``ConfigError`` naming the ones the records hold
    (and their requests), from one more scan without those filters. Without such a filter, nothing."""
    asked = {name: v for name in ("route", "shape") if (v := getattr(where, name)) is not None}
    if not asked and where.model is None:
        return
    wide = replace(where, route=None, model=None, shape=None)
    seen: dict[str, dict[str, int]] = {"route": {}, "shape": {}}
    for g in source.scan(wide, by).groups:
        for name, value in (("route", g.route), ("shape", g.shape)):
            if value is not None:
                seen[name][value] = seen[name].get(value, 0) + g.requests
    known = "; ".join(
        f"{name}s seen: " + (", ".join(f"{v} ({n} requests)" for v, n in sorted(seen[name].items())) or "none")
        for name in ("route", "shape")
    )
    raise ConfigError(f"no requests{describe_filter(where)}; {known}")


def readable(scan: store.Scan, what: str) -> None:
    """Say on standard error what the scan passed over, one line per cause (files named, counts); when it read no
    record and passed something over, ``ConfigError`` saying so instead (nothing is left to answer from)."""
    said = scan.skips.lines()
    if scan.records == 0 and said:
        raise ConfigError(f"no record could be read from {what}: " + "; ".join(said))
    for line in said:
        print(f"llmtap: {line}", file=sys.stderr)


def source_name(paths: Sequence[str | Path], scan: store.Scan) -> str:
    """What a report says it read: the paths, the files and the records."""
    files = scan.files
    return f"{', '.join(str(p) for p in paths)} ({files} file{'s' if files != 1 else ''}, {scan.records} records)"


def from_records(
    path: str | Path | Sequence[str | Path],
    *,
    window: float | None = None,
    until: float | None = None,
    route: str | None = None,
    shape: str | None = None,
    objectives: Objectives | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
    engine: str | store.Source | None = None,
) -> Report:
    """The verdicts over record files (paths, globs, directories; rotated siblings included); ``engine`` names
    what reads them, or is a source of its own (ClickHouse: ``path`` is then unused)."""
    paths = [path] if isinstance(path, str | Path) else list(path)
    end = until if until is not None else (time.time() if window is not None else None)
    start = end - window if window is not None and end is not None else None
    where = store.Filter(route=route, shape=shape, start=start, end=end)
    given: store.Source | None = None
    if engine is None or isinstance(engine, str):
        source = open_source(paths, engine)
    else:
        given = source = engine
    try:
        scan = source.scan(where, None)
        readable(scan, scan.source)
        if not scan.groups:
            no_such_names(source, where, None)
        met = source.count_met(where, None, limits_of(scan.groups, objectives)) if objectives else None
    finally:
        source.close()
    groups = store_groups(scan.groups, objectives=objectives, met=met)
    judged = [f for f in scan.groups if f.route is not None and f.shape is not None]
    if start is not None and end is not None:
        span: float | None = end - start
    else:
        first = min((f.first for f in judged), default=math.inf)
        last = max((f.last for f in judged), default=-math.inf)
        span = last - first if last > first else None
    return Report(
        source=source_name(paths, scan) if given is None else f"{scan.source} ({scan.records} records)",
        window=_describe(window, until),
        seconds=span,
        verdicts=verdicts(groups, span, resamples=resamples, seed=seed),
        cost=costreport.by_route_and_shape(scan.groups),
    )


def _describe(window: float | None, until: float | None) -> str:
    end = "now" if until is None else datetime.fromtimestamp(until, UTC).isoformat(timespec="seconds")
    return f"the {window:g} s up to {end}" if window is not None else "every request"


# -- Prometheus ------------------------------------------------------------------------------------


def from_prometheus(
    url: str,
    objectives: Objectives,
    *,
    window: float | None = None,
    until: float | None = None,
    route: str | None = None,
    shape: str | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
    start: float | None = None,
    matchers: dict[str, str] | None = None,
) -> Report:
    """The verdicts from the proxy's metrics in Prometheus: the request counters by route, shape and SLO
    outcome, and the fine-bucket TTFT, TPOT, TTFOT and TTST histograms by route and shape (E2E has no histogram
    by route; an E2E objective reads as insufficient here)."""
    sel = prometheus_selector(route, shape, matchers)
    end = until if until is not None else time.time()
    if start is None and window is not None:
        start = end - window
    prom = Prometheus(url)
    try:
        counts = prom.increase(requests_query(sel), start, end)
        buckets = {figure: prom.increase(expr, start, end) for figure, expr in bucket_queries(sel).items()}
        asked = prom.increase(request_objectives_query(sel), start, end)
    finally:
        prom.close()
    judged = verdicts(prometheus_groups(counts, buckets, objectives), window, resamples=resamples, seed=seed)
    attach_request_objectives(judged, asked)
    judge_request_objectives(judged)
    return Report(source=f"Prometheus at {prom.url}", window=_describe(window, until), seconds=window, verdicts=judged)


# -- output ----------------------------------------------------------------------------------------


def _estimate(e: Estimate | None) -> str:
    if e is None:
        return "-"
    return f"{seconds(e.value)} [{seconds(e.low)}, {seconds(e.high)}]"


def render(report: Report) -> str:
    """The report as a table, one line per check."""
    lines = [f"SLO verdicts: {report.source}, {report.window}", ""]
    head = ("route", "shape", "requests", "errors", "met", "goodput/s", "objective", "value [95% CI]", "verdict")
    rows: list[tuple[str, ...]] = [head]
    for v in report.verdicts:
        share = "-" if v.met_share is None else f"{v.met_share:.0%}"
        goodput = "-" if v.goodput_per_s is None else f"{v.goodput_per_s:.2f}"
        counts = (v.route, v.shape, str(v.requests), str(v.errors), share, goodput)
        if not v.checks:
            rows.append((*counts, "none configured", "-", NONE))
        for i, c in enumerate(v.checks):
            lead = counts if i == 0 else ("",) * len(counts)
            value = _estimate(c.estimate)
            if c.verdict == INSUFFICIENT:
                value += f" ({c.requests} of {needed(c.percentile)} requests)"
            rows.append((*lead, c.describe(), value, c.verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not report.verdicts:
        lines.append("(no requests with a shape in the window)")
    lines += _request_objective_lines(report)
    past = [(v, s) for v in report.verdicts if v.verdict != MET for s in v.slowest]
    if past:
        lines += ["", "slowest requests past the TTFT limit (by trace id):"]
        for v, (ttft, trace) in past:
            lines.append(f"  {v.route} {v.shape}  {seconds(ttft):>8}  {trace or '(no trace id)'}")
    return "\n".join(lines)


def rules_text(settings: Settings | None, *, selector: str = "", by: str = "") -> str:
    """The burn-rate rule file (``llmtap.analysis.burnrate``), YAML; with ``settings``, the objectives each route
    and shape will export listed first (``ConfigError`` when there is none: the rules would never fire)."""
    lines = ["# Burn-rate alerts on llmtap's objectives, generated by `llmtap slo --rules`."]
    if settings is not None:
        listed = [
            f"#   route {route.name}, shape {shape}: {_pname(goal.percentile)} "
            + ", ".join(f"{k.upper()} <= {seconds(v)}" for k, v in goal.limits().items())
            + f" (budget {1 - goal.percentile:.4g})"
            for route in settings.routes
            for shape in shape_names(settings.shapes)
            if (goal := shape_objective(route, shape, settings.slo)) is not None
        ]
        if not listed:
            raise ConfigError("--rules: the config sets no objective (slo or routes[].slo): no alert could fire")
        lines += ["# The objectives this config exports (llmtap_slo_objective_ratio):", *listed]
    groups = rule_groups(selector=selector, by=", ".join(b.strip() for b in by.split(",") if b.strip()))
    return "\n".join(lines) + "\n" + yaml.dump({"groups": groups}, Dumper=_Blocks, sort_keys=False, width=120)


class _Blocks(yaml.SafeDumper):
    """Writes a string of several lines (a rule's expression) as a literal block, as people write rule files."""


def _block(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Blocks.add_representer(str, _block)


def _pname(percentile: float) -> str:
    return f"p{percentile * 100:g}"


def _request_objective_lines(report: Report) -> list[str]:
    """The per-request objectives (``x-slo-*`` headers) each route and shape's requests asked for, how many got
    what they asked, and the verdict on that share at the route's percentile (``judge_share``)."""
    rows = []
    for v in report.verdicts:
        for c in v.request_checks:
            verdict = c.verdict
            if verdict == INSUFFICIENT:
                verdict += f" ({c.asked} of {c.needed} requests)"
            rows.append(
                f"  {v.route} {v.shape}  {c.figure.upper()}: {c.met} of {c.asked} met ({c.share:.0%}), "
                f"{c.violated} violated; {_pname(c.percentile)} [{c.low:.0%}, {c.high:.0%}]  {verdict}"
            )
    head = "per-request objectives (x-slo-ttft-ms, x-slo-tpot-ms): the share met, at the route's percentile"
    return ["", head, *rows] if rows else []


def main(args: Any) -> int:
    """``llmtap slo``; bad input raises ``ConfigError`` (exit code 2). With ``--check``, 1 when any missed."""
    if args.rules:
        settings = build({"config": args.config}, env={}) if args.config else None
        print(rules_text(settings, selector=args.rules_selector, by=args.rules_by), end="")
        return 0
    if sum((bool(args.records), args.prometheus is not None, args.clickhouse is not None)) != 1:
        raise ConfigError("slo needs a record file or --prometheus URL or --clickhouse URL (one of them)")
    if args.resamples is not None and args.resamples < 100:
        raise ConfigError("--resamples must be at least 100")
    objectives = config_objectives(build({"config": args.config}, env={})) if args.config else None
    options: dict[str, Any] = {
        "window": parse_duration(args.window) if args.window else None,
        "until": parse_time(args.until) if args.until else None,
        "route": args.route,
        "shape": args.shape,
        "resamples": RESAMPLES if args.resamples is None else args.resamples,
        "seed": args.seed,
    }
    if args.records:
        engine_note(args.engine)
        report = from_records(args.records, objectives=objectives, engine=args.engine, **options)
    elif args.clickhouse is not None:
        # ClickHouse filters, groups and sorts; the statistics and the verdicts stay llmtap's.
        from llmtap.store.clickhouse import server_from_env
        from llmtap.store.clickhouse_read import ClickHouseSource

        source = ClickHouseSource(server_from_env(args.clickhouse), args.clickhouse_table)
        report = from_records([], objectives=objectives, engine=source, **options)
    else:
        if objectives is None:
            raise ConfigError("with --prometheus, give the proxy's --config FILE: the objectives are in its routes")
        report = from_prometheus(args.prometheus, objectives, **options)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render(report))
        for line in cost.slo_lines(report.cost):
            print(line)
    sys.stdout.flush()
    return 1 if args.check and any(v.verdict == MISSED for v in report.verdicts) else 0
