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
that got a first token; TPOT: successful streams of two tokens or more). TTFOT (time to the first output token:
the answer's first chunk, after any reasoning; TTFT for a request without reasoning) and TTST (time to the second
token: the first content chunk to the second) read the successful streams that have them from records, and every
stream that has them from Prometheus (as the histograms record them); a stream of one content chunk has no TTST:
it is absent from the percentile, never counted as 0. Goodput counts every request, and
errors and cancellations count as missed. Records carry the objective each request was judged by, so a
record file needs no configuration; ``--config`` judges them by another.

Pure: the groups come from a source's facts (``store_groups``) or from the answers to PromQL queries this
module writes (``prometheus_groups``); reading them, and printing the verdicts, is ``llmtap.commands.slo``'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from llmtap.analysis import shapes as shape_classes
from llmtap.analysis.promql import Grown, selector
from llmtap.analysis.shapes import needed
from llmtap.analysis.stats import Distribution, Estimate, merged, quantile_estimate
from llmtap.analysis.units import seconds
from llmtap.config.types import SLO, Settings

if TYPE_CHECKING:  # the facts a source gives (analysis reads them; it never opens a source)
    from llmtap import store

__all__ = [
    "INSUFFICIENT",
    "MET",
    "MISSED",
    "NONE",
    "PROM_BUCKETS",
    "RESAMPLES",
    "ROUTE_LABEL",
    "SHAPE_LABEL",
    "UNCERTAIN",
    "Objectives",
    "Report",
    "RequestCheck",
    "Verdict",
    "attach_request_objectives",
    "bucket_queries",
    "config_objectives",
    "judge",
    "judge_request_objectives",
    "judge_share",
    "limits_of",
    "prometheus_groups",
    "prometheus_selector",
    "request_objectives_query",
    "requests_query",
    "store_groups",
    "verdicts",
]

#: The figures an objective can bound, as records and reports name them.
FIGURES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E", "ttfot": "TTFOT", "ttst": "TTST"}
MET, MISSED, UNCERTAIN, INSUFFICIENT, NONE = "met", "missed", "uncertain", "insufficient", "none"
#: The verdict of several checks: the worst of them, in this order.
_WORST = (MISSED, UNCERTAIN, INSUFFICIENT, MET)
RESAMPLES = 2000
#: The proxy's metrics as Prometheus stores them (llmtap's own: they carry the route and the shape).
PROM_BUCKETS = {
    "ttft": "llmtap_time_to_first_token_seconds_bucket",
    "tpot": "llmtap_time_per_output_token_seconds_bucket",
    "ttfot": "llmtap_time_to_first_output_token_seconds_bucket",
    "ttst": "llmtap_time_to_second_token_seconds_bucket",
}
PROM_REQUESTS = "llmtap_requests_total"
PROM_REQUEST_OBJECTIVES = "llmtap_objective_requests_total"
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
class RouteShape:
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
    #: Requests judged by their own objectives, by figure and outcome (``Verdict.request_objectives``).
    request_objectives: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestCheck:
    """One figure of the requests' own objectives (``x-slo-*``) over a route and shape: how many asked, how many
    got what they asked, and whether that share reaches the percentile the route's tail is held to."""

    figure: str
    asked: int
    met: int
    violated: int
    #: The share that met, with its 95% interval (Wilson's score interval).
    share: float
    low: float
    high: float
    #: The share asked for: the route and shape's objective percentile (without one, the default percentile).
    percentile: float
    #: Requests the percentile needs before a verdict (``llmtap.analysis.shapes.needed``).
    needed: int
    verdict: str


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
    #: Requests judged by their own objectives (``x-slo-*`` headers), by figure and outcome: ``{"ttft": {"met": 12,
    #: "violated": 3}}`` (from records: ``request_objective``; from Prometheus: ``llmtap_objective_requests_total``).
    request_objectives: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Each figure of ``request_objectives`` judged (``judge_request_objectives``), TTFT first.
    request_checks: list[RequestCheck] = field(default_factory=list)


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
    groups: Iterable[RouteShape], window: float | None, *, resamples: int = RESAMPLES, seed: int = 0
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
                request_objectives={k: dict(c) for k, c in g.request_objectives.items()},
            )
        )
    judge_request_objectives(out)
    return out


# -- per-request objectives ------------------------------------------------------------------------

#: The normal quantile of a two-sided 95% interval.
_Z95 = 1.959963984540054


def _wilson(met: int, n: int) -> tuple[float, float]:
    """The 95% score interval of a share of ``met`` in ``n`` (Wilson): within [0, 1] and never empty at 0 or n."""
    p = met / n
    centre = (p + _Z95**2 / (2 * n)) / (1 + _Z95**2 / n)
    half = _Z95 * math.sqrt(p * (1 - p) / n + _Z95**2 / (4 * n * n)) / (1 + _Z95**2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def judge_share(figure: str, met: int, violated: int, percentile: float) -> RequestCheck:
    """The requests that asked for a limit on ``figure``, judged as a percentile objective is: ``met`` when the
    whole interval of the share that got what it asked is at or above ``percentile``, ``missed`` when the whole
    interval is below it, ``uncertain`` when it holds it, ``insufficient`` below the requests the percentile needs
    (a share of 19 in 20 can only tell p95 apart from 100%)."""
    asked, want = met + violated, needed(percentile)
    share = met / asked if asked else 0.0
    low, high = _wilson(met, asked) if asked else (0.0, 1.0)
    if asked < want:
        verdict = INSUFFICIENT
    else:
        verdict = MET if low >= percentile else MISSED if high < percentile else UNCERTAIN
    return RequestCheck(figure, asked, met, violated, share, low, high, percentile, want, verdict)


def judge_request_objectives(judged: Iterable[Verdict]) -> None:
    """Each verdict's per-request objective counts judged (``Verdict.request_checks``) at its objective's percentile
    (a route and shape without one: the default percentile); records and Prometheus both end here."""
    fallback = SLO().percentile
    for v in judged:
        percentile = v.checks[0].percentile if v.checks else fallback
        v.request_checks = [
            judge_share(figure, counts.get("met", 0), counts.get("violated", 0), percentile)
            for figure, counts in sorted(v.request_objectives.items(), key=lambda kv: (kv[0] != "ttft", kv[0]))
            if sum(counts.values()) > 0
        ]


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
) -> list[RouteShape]:
    """A source's groups of one side as SLO groups by route and shape (records without either left out).

    Each record says what it was judged by, and the newest objective is what the proxy judges by now;
    with ``objectives`` (``--config``), each group is judged by those instead, its ``met`` counted by
    the source (``met``) as the proxy would have judged each request."""
    out: list[RouteShape] = []
    for f in facts:
        if f.route is None or f.shape is None:
            continue
        g = RouteShape(f.route, f.shape, requests=f.requests, errors=f.errors)
        if objectives is None:
            g.objective, g.met = _slo(f.objective), f.met
        else:
            g.objective = objectives(f.route, f.shape)
            g.met = (met or {}).get((f.key, f.route, f.shape), 0) if g.objective is not None else 0
        # As the histograms record them: TTFT of streams, TPOT of successful ones, E2E of all.
        g.figures = {
            "ttft": Distribution.of_sorted(merged([f.ttft_ok, f.ttft_failed])),
            "tpot": Distribution.of_sorted(f.tpot),
            "e2e": Distribution.of_sorted(f.e2e),
            "ttfot": Distribution.of_sorted(f.ttfot),
            "ttst": Distribution.of_sorted(f.ttst),
        }
        g.slowest = list(f.slowest)
        g.request_objectives = {k: dict(c) for k, c in f.request_objectives.items()}
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


# -- Prometheus ------------------------------------------------------------------------------------


def prometheus_selector(
    route: str | None = None, shape: str | None = None, matchers: Mapping[str, str] | None = None
) -> str:
    """The label matchers of the queries: ``matchers`` with the route and shape asked for."""
    given = {k: v for k, v in ((ROUTE_LABEL, route), (SHAPE_LABEL, shape)) if v is not None}
    return selector({**(matchers or {}), **given})


def requests_query(sel: str) -> str:
    """The request counters by route, shape, SLO outcome and outcome."""
    return f"sum by ({ROUTE_LABEL}, {SHAPE_LABEL}, llmtap_slo, llmtap_outcome) ({PROM_REQUESTS}{{{sel}}})"


def request_objectives_query(sel: str) -> str:
    """The per-request objective counters (``x-slo-*`` headers) by route, shape, figure and outcome."""
    keys = f"{ROUTE_LABEL}, {SHAPE_LABEL}, llmtap_objective_figure, llmtap_objective_outcome"
    return f"sum by ({keys}) ({PROM_REQUEST_OBJECTIVES}{{{sel}}})"


def attach_request_objectives(verdicts: Iterable[Verdict], grown: Grown) -> None:
    """Each verdict's per-request objective counts, from what ``request_objectives_query``'s counters grew by."""
    by_key = {(v.route, v.shape): v for v in verdicts}
    for key, value in grown.items():
        labels = dict(key)
        v = by_key.get((labels.get(ROUTE_LABEL, ""), labels.get(SHAPE_LABEL, "")))
        figure, outcome = labels.get("llmtap_objective_figure"), labels.get("llmtap_objective_outcome")
        if v is None or figure is None or outcome is None or round(value) <= 0:
            continue
        counts = v.request_objectives.setdefault(figure, {})
        counts[outcome] = counts.get(outcome, 0) + round(value)


def bucket_queries(sel: str) -> dict[str, str]:
    """Each figure's fine-bucket histogram by route and shape (TTFT, TPOT, TTFOT, TTST: E2E has none by route)."""
    return {
        figure: f"sum by (le, {ROUTE_LABEL}, {SHAPE_LABEL}) ({metric}{{{sel}}})"
        for figure, metric in PROM_BUCKETS.items()
    }


def prometheus_groups(counts: Grown, buckets: Mapping[str, Grown], objectives: Objectives) -> list[RouteShape]:
    """The groups by route and shape from what the request counters (``requests_query``) and each figure's
    buckets (``bucket_queries``) grew by in the window; a series without a route or a shape is left out."""
    groups: dict[tuple[str, str], RouteShape] = {}
    for key, value in counts.items():
        labels = dict(key)
        r, sh = labels.get(ROUTE_LABEL, ""), labels.get(SHAPE_LABEL, "")
        if not r or not sh:
            continue
        g = groups.get((r, sh))
        if g is None:
            g = groups[(r, sh)] = RouteShape(r, sh, objective=objectives(r, sh))
        n = round(value)
        g.requests += n
        g.errors += n if labels.get("llmtap_outcome") != "ok" else 0
        g.met += n if labels.get("llmtap_slo") == "met" else 0
    for figure, grown in buckets.items():
        found: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for key, value in grown.items():
            labels = dict(key)
            if "le" in labels:
                found.setdefault((labels.get(ROUTE_LABEL, ""), labels.get(SHAPE_LABEL, "")), []).append(
                    (float(labels["le"]), value)
                )
        for k, pairs in found.items():
            if k in groups and max(v for _, v in pairs) > 0:
                groups[k].figures[figure] = Distribution(buckets=pairs)
    return list(groups.values())


def config_objectives(settings: Settings) -> Objectives:
    """The objectives a configuration gives each route and shape (a route it does not name: the global)."""
    routes = {r.name: r for r in settings.routes}

    def lookup(route: str, shape: str) -> SLO | None:
        return shape_classes.objective(routes.get(route), shape, settings.slo)

    return lookup
