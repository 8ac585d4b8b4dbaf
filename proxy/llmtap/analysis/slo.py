"""``llmtap slo``: does each route and request shape meet its objective, at the percentile that counts?

An objective (``routes[].slo``, or the global ``slo``) says which figure, which percentile and what limit:
``p95 TTFT <= 800 ms`` for the long-prompt support assistant, ``p99 TTFT <= 60 ms`` for code completion.
Over a window of request records (``--record``: any number of files, globs and directories, read by
the embedded engine, ``llmtap.store``) or a Prometheus server's copy of the proxy's metrics,
this groups the requests by route and shape, reads each objective's percentile with its bootstrap 95%
interval (``llmtap.analysis.stats``), and says for each:

- ``met``: the whole interval is within the limit; ``missed``: the whole interval is past it;
- ``uncertain``: the interval holds the limit (more requests would tell);
- ``insufficient``: fewer requests than the percentile needs to have a tail at all (20 for p95, 100 for p99).

A percentile reads the requests that have the figure, as the latency histograms record them (TTFT: streams
that got a first token; TPOT: successful streams of two tokens or more). Goodput counts every request, and
errors and cancellations count as missed. Records carry the objective each request was judged by, so a
record file needs no configuration; ``--config`` judges them by another.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmtap import store
from llmtap.analysis import costreport, shapes as shape_classes
from llmtap.analysis.promql import Prometheus, quote
from llmtap.analysis.shapes import needed
from llmtap.analysis.stats import Distribution, Estimate, quantile_estimate
from llmtap.analysis.units import parse_duration, parse_time, seconds
from llmtap.config.load import build
from llmtap.config.types import SLO, ConfigError, Settings
from llmtap.store.files import NoRecords

#: The figures an objective can bound, as records and reports name them.
FIGURES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E"}
MET, MISSED, UNCERTAIN, INSUFFICIENT, NONE = "met", "missed", "uncertain", "insufficient", "none"
#: The verdict of several checks: the worst of them, in this order.
_WORST = (MISSED, UNCERTAIN, INSUFFICIENT, MET)
RESAMPLES = 2000
#: The proxy's metrics as Prometheus stores them (llmtap's own: they carry the route and the shape).
PROM_BUCKETS = {
    "ttft": "llmtap_time_to_first_token_seconds_bucket",
    "tpot": "llmtap_time_per_output_token_seconds_bucket",
}
PROM_REQUESTS = "llmtap_requests_total"
ROUTE_LABEL, SHAPE_LABEL = "llmtap_route", "llmtap_request_shape"

#: The objective of one route and shape (None: none applies).
Objectives = Callable[[str, str], SLO | None]


@dataclass(slots=True)
class Check:
    """One figure of an objective: its percentile with the interval, against the limit."""

    figure: str
    percentile: float
    limit: float
    requests: int
    estimate: Estimate | None
    verdict: str

    def describe(self) -> str:
        """``p95 TTFT <= 800 ms``."""
        return f"{_pname(self.percentile)} {FIGURES[self.figure]} <= {seconds(self.limit)}"


@dataclass(slots=True)
class Group:
    """The requests of one route and shape in the window."""

    route: str
    shape: str
    requests: int = 0
    errors: int = 0
    met: int = 0
    objective: SLO | None = None
    figures: dict[str, Distribution] = field(default_factory=dict)
    #: The slowest successful streams by TTFT, as (ttft, trace id) (records only: ``store.Group.slowest``).
    slowest: list[tuple[float, str]] = field(default_factory=list)


@dataclass(slots=True)
class Verdict:
    """One route and shape: counts, goodput, each check and the verdict."""

    route: str
    shape: str
    requests: int
    errors: int
    met: int
    met_share: float | None
    goodput_per_s: float | None
    checks: list[Check]
    verdict: str
    #: The slowest successful streams past the TTFT limit, as (ttft, trace id), slowest first (records only).
    slowest: list[tuple[float, str]] = field(default_factory=list)


@dataclass(slots=True)
class Report:
    """Everything ``llmtap slo`` prints."""

    source: str
    window: str
    seconds: float | None
    verdicts: list[Verdict]
    #: Cost per request by route and shape (``llmtap.analysis.costreport``), from records.
    cost: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The same figures for scripts (an interval past every bound reads null)."""
        out: dict[str, Any] = _finite(asdict(self))
        return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _pname(percentile: float) -> str:
    return f"p{percentile * 100:g}"


def judge(
    figure: str, dist: Distribution, percentile: float, limit: float, rng: random.Random, resamples: int
) -> Check:
    """The check of one figure: ``met`` when the percentile's whole interval is within the limit."""
    n = dist.n
    if n < needed(percentile):
        estimate = quantile_estimate(dist, percentile, rng, resamples) if n else None
        return Check(figure, percentile, limit, n, estimate, INSUFFICIENT)
    estimate = quantile_estimate(dist, percentile, rng, resamples)
    assert estimate is not None  # not empty
    verdict = MET if estimate.high <= limit else MISSED if estimate.low > limit else UNCERTAIN
    return Check(figure, percentile, limit, n, estimate, verdict)


def _past(slowest: list[tuple[float, str]], limit: float | None) -> list[tuple[float, str]]:
    return [s for s in slowest if limit is not None and s[0] > limit]


def verdicts(
    groups: Iterable[Group], window: float | None, *, resamples: int = RESAMPLES, seed: int = 0
) -> list[Verdict]:
    """Each group's checks and verdict, by route and shape."""
    rng = random.Random(seed)
    out: list[Verdict] = []
    for g in sorted(groups, key=lambda g: (g.route, g.shape)):
        checks: list[Check] = []
        if g.objective is not None:
            for figure, limit in g.objective.limits().items():
                dist = g.figures.get(figure, Distribution())
                checks.append(judge(figure, dist, g.objective.percentile, limit, rng, resamples))
        verdict = next((v for v in _WORST if any(c.verdict == v for c in checks)), NONE)
        judged = g.objective is not None
        out.append(
            Verdict(
                route=g.route,
                shape=g.shape,
                requests=g.requests,
                errors=g.errors,
                met=g.met if judged else 0,
                met_share=g.met / g.requests if judged and g.requests else None,
                goodput_per_s=g.met / window if judged and window else None,
                checks=checks,
                verdict=verdict,
                slowest=_past(g.slowest, g.objective.ttft if g.objective is not None else None),
            )
        )
    return out


# -- record files ----------------------------------------------------------------------------------


def _slo(objective: store.Objective | None) -> SLO | None:
    """The objective a record carries, as the proxy's settings hold it."""
    if objective is None:
        return None
    limits = {k: v for k in FIGURES if (v := getattr(objective, k)) is not None}
    return SLO(**limits, percentile=objective.percentile, shape=objective.shape)


def store_groups(
    facts: Iterable[store.Group],
    *,
    objectives: Objectives | None = None,
    met: dict[tuple[str | None, str, str], int] | None = None,
) -> list[Group]:
    """A source's groups of one side as SLO groups by route and shape (records without either left out).

    Each record says what it was judged by, and the newest objective is what the proxy judges by now;
    with ``objectives`` (``--config``), each group is judged by those instead, its ``met`` counted by
    the source (``met``) as the proxy would have judged each request."""
    out: list[Group] = []
    for f in facts:
        if f.route is None or f.shape is None:
            continue
        g = Group(f.route, f.shape, requests=f.requests, errors=f.errors)
        if objectives is None:
            g.objective, g.met = _slo(f.objective), f.met
        else:
            g.objective = objectives(f.route, f.shape)
            g.met = (met or {}).get((f.key, f.route, f.shape), 0) if g.objective is not None else 0
        # As the histograms record them: TTFT of streams, TPOT of successful ones, E2E of all.
        g.figures = {
            "ttft": Distribution.of_sorted(store.merged([f.ttft_ok, f.ttft_failed])),
            "tpot": Distribution.of_sorted(f.tpot),
            "e2e": Distribution.of_sorted(f.e2e),
        }
        g.slowest = list(f.slowest)
        out.append(g)
    return out


def limits_of(facts: Iterable[store.Group], objectives: Objectives | None) -> dict[tuple[str, str], dict[str, float]]:
    """The limits ``--config`` sets for each route and shape of ``facts`` (what a source counts ``met`` by)."""
    if objectives is None:
        return {}
    out: dict[tuple[str, str], dict[str, float]] = {}
    for f in facts:
        if f.route is not None and f.shape is not None and (o := objectives(f.route, f.shape)) is not None:
            out[(f.route, f.shape)] = o.limits()
    return out


def open_source(paths: Sequence[str | Path], engine: str) -> store.Source:
    """The record files ``paths`` name, read by ``engine``; ``ConfigError`` when there are none."""
    try:
        return store.open_source([str(p) for p in paths], engine)
    except NoRecords as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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
    engine: str | store.Source = store.ENGINES[0],
) -> Report:
    """The verdicts over record files (paths, globs, directories; rotated siblings included); ``engine`` names
    what reads them, or is a source of its own (ClickHouse: ``path`` is then unused)."""
    paths = [path] if isinstance(path, str | Path) else list(path)
    end = until if until is not None else (time.time() if window is not None else None)
    start = end - window if window is not None and end is not None else None
    where = store.Filter(route=route, shape=shape, start=start, end=end)
    given = None if isinstance(engine, str) else engine
    source = open_source(paths, engine) if isinstance(engine, str) else engine
    try:
        scan = source.scan(where, None)
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
    outcome, and the fine-bucket TTFT and TPOT histograms by route and shape (E2E has no histogram by
    route; an E2E objective reads as insufficient here)."""
    given = {k: v for k, v in ((ROUTE_LABEL, route), (SHAPE_LABEL, shape)) if v is not None}
    sel = ",".join(f"{k}={quote(v)}" for k, v in sorted({**(matchers or {}), **given}.items()))
    end = until if until is not None else time.time()
    if start is None and window is not None:
        start = end - window
    prom = Prometheus(url)
    groups: dict[tuple[str, str], Group] = {}
    try:
        by = f"{ROUTE_LABEL}, {SHAPE_LABEL}"
        counts = prom.increase(f"sum by ({by}, llmtap_slo, llmtap_outcome) ({PROM_REQUESTS}{{{sel}}})", start, end)
        for key, value in counts.items():
            labels = dict(key)
            r, sh = labels.get(ROUTE_LABEL, ""), labels.get(SHAPE_LABEL, "")
            if not r or not sh:
                continue
            g = groups.get((r, sh))
            if g is None:
                g = groups[(r, sh)] = Group(r, sh, objective=objectives(r, sh))
            n = round(value)
            g.requests += n
            g.errors += n if labels.get("llmtap_outcome") != "ok" else 0
            g.met += n if labels.get("llmtap_slo") == "met" else 0
        for figure, metric in PROM_BUCKETS.items():
            grown = prom.increase(f"sum by (le, {by}) ({metric}{{{sel}}})", start, end)
            buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for key, value in grown.items():
                labels = dict(key)
                if "le" in labels:
                    buckets.setdefault((labels.get(ROUTE_LABEL, ""), labels.get(SHAPE_LABEL, "")), []).append(
                        (float(labels["le"]), value)
                    )
            for k, pairs in buckets.items():
                if k in groups and max(v for _, v in pairs) > 0:
                    groups[k].figures[figure] = Distribution(buckets=pairs)
    finally:
        prom.close()
    return Report(
        source=f"Prometheus at {prom.url}",
        window=_describe(window, until),
        seconds=window,
        verdicts=verdicts(groups.values(), window, resamples=resamples, seed=seed),
    )


def config_objectives(settings: Settings) -> Objectives:
    """The objectives a configuration gives each route and shape (a route it does not name: the global)."""
    routes = {r.name: r for r in settings.routes}

    def lookup(route: str, shape: str) -> SLO | None:
        return shape_classes.objective(routes.get(route), shape, settings.slo)

    return lookup


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
    past = [(v, s) for v in report.verdicts if v.verdict != MET for s in v.slowest]
    if past:
        lines += ["", "slowest requests past the TTFT limit (by trace id):"]
        for v, (ttft, trace) in past:
            lines.append(f"  {v.route} {v.shape}  {seconds(ttft):>8}  {trace or '(no trace id)'}")
    return "\n".join(lines)


def main(args: Any) -> int:
    """``llmtap slo``; bad input raises ``ConfigError`` (exit code 2). With ``--check``, 1 when any missed."""
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
        report = from_records(args.records, objectives=objectives, engine=args.engine, **options)
    elif args.clickhouse is not None:
        # ClickHouse filters, groups and sorts; the statistics and the verdicts stay llmtap's.
        from llmtap.store.clickhouse import ClickHouseSource, server_from_env

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
        for line in costreport.slo_lines(report.cost):
            print(line)
    sys.stdout.flush()
    return 1 if args.check and any(v.verdict == MISSED for v in report.verdicts) else 0
