"""The two sides ``llmtap compare`` weighs: the requests before and after, each reduced to what the comparison
needs (``Side``), from a source's facts (``side_from_groups``, ``strata_from_groups``) or from the answers to
the PromQL queries written here (``side_queries``, ``strata_query``; ``side_from_counters``,
``strata_from_counters``).

Apart from ``llmtap.analysis.compare`` so the reading of sides and the weighing of them stay one concern each;
``llmtap.analysis.compare`` offers these names too, where its callers take them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmtap.analysis import slo as slo_report
from llmtap.analysis.promql import Grown, selector
from llmtap.analysis.stats import Distribution, merged

if TYPE_CHECKING:  # the facts a source gives (analysis reads them; it never opens a source)
    from llmtap import store

__all__ = [
    "SLOWEST",
    "Side",
    "Slow",
    "paired",
    "side_from_counters",
    "side_from_groups",
    "side_queries",
    "strata_from_counters",
    "strata_from_groups",
    "strata_query",
]

#: The slowest requests a side names by trace id (at most ``llmtap.store.SLOWEST``: what each group keeps).
SLOWEST = 5


@dataclass(frozen=True, slots=True)
class Slow:
    """One of the slowest requests of a side: its TTFT, trace id, route and shape."""

    ttft: float
    trace_id: str
    route: str | None
    shape: str | None


@dataclass(slots=True)
class Side:
    """The requests of one side, reduced to what the comparison needs."""

    label: str
    requests: int = 0
    errors: int = 0
    ttft: Distribution = field(default_factory=Distribution)
    #: Time to the first output token and to the second token of successful streams that have them (a stream
    #: of one content chunk has no TTST: absent, never 0).
    ttfot: Distribution = field(default_factory=Distribution)
    ttst: Distribution = field(default_factory=Distribution)
    prefill: Distribution = field(default_factory=Distribution)
    prefill_sources: set[str] = field(default_factory=set)
    input_tokens: int = 0
    cached_tokens: int = 0
    classes: Counter[str] = field(default_factory=Counter)
    slowest: list[Slow] = field(default_factory=list)
    #: Records with a cost, and its sum (``llmtap.analysis.costreport``).
    priced: int = 0
    cost: float = 0.0

    @property
    def cached_share(self) -> float | None:
        """Cached input tokens over all input tokens; None when no input tokens were reported."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else None


def side_from_groups(label: str, groups: Iterable[store.Group]) -> Side:
    """A side from a source's groups: TTFT, TTFOT, TTST and prefill of successful streams, tokens of successful
    requests."""
    groups = list(groups)
    side = Side(label)
    for g in groups:
        side.requests += g.requests
        side.errors += g.errors
        side.classes.update(g.classes)
        side.prefill_sources |= g.prefill_sources
        side.input_tokens += g.input_tokens
        side.cached_tokens += g.cached_tokens
        side.priced += g.priced
        side.cost += g.cost
    side.ttft = Distribution.of_sorted(merged([g.ttft_ok for g in groups]))
    side.prefill = Distribution.of_sorted(merged([g.prefill for g in groups]))
    side.ttfot = Distribution.of_sorted(merged([g.ttfot for g in groups]))
    side.ttst = Distribution.of_sorted(merged([g.ttst for g in groups]))
    slow = [Slow(v, trace, g.route, g.shape) for g in groups for v, trace in g.slowest]
    side.slowest = sorted(slow, key=lambda s: (-s.ttft, s.trace_id, s.route or "", s.shape or ""))[:SLOWEST]
    return side


def strata_from_groups(
    label_before: str, before: Sequence[store.Group], label_after: str, after: Sequence[store.Group]
) -> dict[tuple[str | None, str | None], tuple[Side, Side]]:
    """Each route and shape's two sides, in order of route and shape."""
    keys = sorted({(g.route, g.shape) for g in (*before, *after)}, key=lambda k: (k[0] or "", k[1] or ""))
    return {
        k: (
            side_from_groups(label_before, [g for g in before if (g.route, g.shape) == k]),
            side_from_groups(label_after, [g for g in after if (g.route, g.shape) == k]),
        )
        for k in keys
    }


# -- Prometheus ------------------------------------------------------------------------------------

#: The proxy's metric names as Prometheus stores them: llmtap's own, which carry the route and prompt version
#: and have fine buckets (the ``gen_ai.*`` ones carry neither, and have the conventions' coarse buckets).
PROM_TTFT = "llmtap_time_to_first_token_seconds_bucket"
PROM_PREFILL = "llmtap_prefill_duration_seconds_bucket"
PROM_INPUT = "llmtap_usage_input_tokens_total"
PROM_CACHED = "llmtap_usage_cache_read_input_tokens_total"
PROM_CLASSES = "llmtap_cache_requests_total"
PROM_REQUESTS = "llmtap_requests_total"
#: The histograms of the figures read beside TTFT, by figure: the same labels as TTFT's (route, shape, version).
PROM_FIRST_TOKENS = {figure: slo_report.PROM_BUCKETS[figure] for figure in ("ttfot", "ttst")}


def side_queries(matchers: Mapping[str, str]) -> dict[str, str]:
    """The queries a side's figures are read from (``side_from_counters``), by what each answers."""
    sel = selector(matchers)

    def buckets(name_matcher: str) -> str:
        return f"sum by (le) ({{{name_matcher}{',' + sel if sel else ''}}})"

    def total(metric: str, by: str | None = None) -> str:
        grouping = f" by ({by})" if by else ""
        return f"sum{grouping} ({metric}{{{sel}}})"

    return {
        "ttft": buckets(f'__name__="{PROM_TTFT}"'),
        **{figure: buckets(f'__name__="{name}"') for figure, name in PROM_FIRST_TOKENS.items()},
        "prefill": buckets(f'__name__="{PROM_PREFILL}"'),
        "prefill_sources": total("llmtap_prefill_duration_seconds_count", "llmtap_prefill_source"),
        "input": total(PROM_INPUT),
        "cached": total(PROM_CACHED),
        "classes": total(PROM_CLASSES, "llmtap_cache_class"),
        "outcomes": total(PROM_REQUESTS, "llmtap_outcome"),
    }


def side_from_counters(label: str, grown: Mapping[str, Grown]) -> Side:
    """A side from what each of ``side_queries`` grew by in its window: TTFT, TTFOT, TTST and prefill histograms,
    token and request counters. A histogram that grew by nothing (no stream of two chunks: no TTST) leaves its
    figure empty, so it reads as absent, never as 0."""

    def buckets(found: Grown) -> Distribution:
        pairs = [(float(dict(k)["le"]), v) for k, v in found.items() if "le" in dict(k)]
        return Distribution(buckets=pairs) if pairs and max(v for _, v in pairs) > 0 else Distribution()

    def total(found: Grown, by: str | None = None) -> dict[str, float]:
        return {dict(k).get(by, "") if by else "": v for k, v in found.items()}

    side = Side(label)
    side.ttft = buckets(grown["ttft"])
    side.ttfot = buckets(grown["ttfot"])
    side.ttst = buckets(grown["ttst"])
    side.prefill = buckets(grown["prefill"])
    sources = total(grown["prefill_sources"], "llmtap_prefill_source")
    side.prefill_sources = {k for k, v in sources.items() if v > 0 and k}
    side.input_tokens = round(sum(total(grown["input"]).values()))
    side.cached_tokens = round(sum(total(grown["cached"]).values()))
    side.classes = Counter({k: round(v) for k, v in total(grown["classes"], "llmtap_cache_class").items() if v >= 0.5})
    outcomes = total(grown["outcomes"], "llmtap_outcome")
    side.requests = round(sum(outcomes.values()))
    side.errors = side.requests - round(outcomes.get("ok", 0.0))
    return side


def strata_query(matchers: Mapping[str, str]) -> str:
    """The TTFT histogram by route and shape (the only series with both) of one side."""
    sel = selector(matchers)
    by = f"le, {slo_report.ROUTE_LABEL}, {slo_report.SHAPE_LABEL}"
    return f'sum by ({by}) ({{__name__="{PROM_TTFT}"{"," + sel if sel else ""}}})'


def strata_from_counters(label: str, grown: Grown) -> dict[tuple[str | None, str | None], Side]:
    """One side's routes and shapes from what ``strata_query`` grew by: TTFT alone, so a route and shape's
    verdict names no cause."""
    buckets: dict[tuple[str | None, str | None], list[tuple[float, float]]] = {}
    for key, value in grown.items():
        labels = dict(key)
        if "le" in labels:
            k = (labels.get(slo_report.ROUTE_LABEL) or None, labels.get(slo_report.SHAPE_LABEL) or None)
            buckets.setdefault(k, []).append((float(labels["le"]), value))
    out: dict[tuple[str | None, str | None], Side] = {}
    for k, pairs in buckets.items():
        if max(v for _, v in pairs) > 0:
            side = Side(label, ttft=Distribution(buckets=pairs))
            side.requests = side.ttft.n
            out[k] = side
    return out


def paired(
    before: tuple[str, dict[tuple[str | None, str | None], Side]],
    after: tuple[str, dict[tuple[str | None, str | None], Side]],
) -> dict[tuple[str | None, str | None], tuple[Side, Side]]:
    """Each route and shape's two sides (an empty side where one has none), in order of route and shape."""
    keys = sorted({*before[1], *after[1]}, key=lambda k: (k[0] or "", k[1] or ""))
    return {k: (before[1].get(k) or Side(before[0]), after[1].get(k) or Side(after[0])) for k in keys}
