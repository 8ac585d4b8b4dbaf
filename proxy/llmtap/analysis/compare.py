"""``llmtap compare``: did a prompt change make caching work, and what did it buy in TTFT?

Reads request records (``--record``: any number of files, globs and directories, read by the embedded
engine, ``llmtap.store``) or a Prometheus server's HTTP API, splits the requests into
before and after (by prompt version, or at a moment in time) and prints, for each side, TTFT
p50/p95/p99 with bootstrap 95% confidence intervals, prefill time, the cached-token share, the cache
classes and the request counts, then a one-line verdict. The verdict rests on the confidence interval
of the change in TTFT p50: a gain must be real (the interval excludes zero) and large enough to
matter (a share of the before side's p50, ``--min-gain-share``, and at least ``--min-gain-ms``); with
too few requests it says there is no verdict.

Like with like: each route and request shape gets a verdict of its own, and the mix of routes and shapes
on each side is compared (``Mix``). When it moved (a chi-square test of homogeneity says the two sides'
mixes differ beyond chance, p < ``MIX_P``, and at least ``MIX_SHIFT`` of the requests moved between
classes), there is no pooled verdict: a p50 over 0 long prompts before and 24 after is not a comparison.
The slowest requests of each side (at or above its p99 TTFT) are named by trace id.

The intervals come from ``llmtap.analysis.stats`` (an exact percentile bootstrap, numpy-free).
"""

from __future__ import annotations

import json
import math
import random
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmtap import store
from llmtap.analysis import costreport, slo as slo_report
from llmtap.analysis.promql import Prometheus, quote
from llmtap.analysis.slo import Objectives, Verdict
from llmtap.analysis.stats import Distribution, Estimate, change_estimates, homogeneity, quantile_estimate
from llmtap.analysis.units import parse_duration, parse_time, seconds
from llmtap.config.load import build
from llmtap.config.types import ConfigError

QUANTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))
MIN_REQUESTS = 3
#: The least TTFT p50 change that counts, as a share of the before side's p50 (``--min-gain-share``): a tenth.
#: Relative, so a 30 ms route can show a real 10 ms gain, and a 5 s route's 50 ms wobble is no gain.
MIN_GAIN_SHARE = 0.10
#: The least TTFT p50 change that counts in ms besides (``--min-gain-ms``): none unless asked.
MIN_GAIN_MS = 0.0
#: The mix of routes and shapes moved when a chi-square test of homogeneity rejects one mix for both sides
#: at this level, and at least ``MIX_SHIFT`` of the requests moved between classes (the total variation
#: distance of the two sides' shares: half the sum of each class's share change). The test says the change
#: is beyond chance; the shift says it is large enough to move a pooled percentile.
MIX_P = 0.05
MIX_SHIFT = 0.05
RESAMPLES = 2000
#: A rise in cached share below this does not make a TTFT gain a caching gain.
CACHED_SHARE_RISE = 0.05


# -- the two sides ---------------------------------------------------------------------------------


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


@dataclass(slots=True)
class SideFigures:
    """One side's figures as printed."""

    label: str
    requests: int
    errors: int
    ttft_requests: int
    ttft: dict[str, Estimate | None]
    prefill_p50: Estimate | None
    prefill_source: str
    cached_share: float | None
    input_tokens: int
    cached_tokens: int
    classes: dict[str, int]
    #: The requests at or above the side's TTFT p99, slowest first (at most ``store.SLOWEST``), and how many.
    slowest: list[Slow] = field(default_factory=list)
    at_or_above_p99: int = 0


@dataclass(slots=True)
class Share:
    """One route and shape's requests with a TTFT on each side, and their shares of the side."""

    route: str | None
    shape: str | None
    before: int
    after: int
    before_share: float | None
    after_share: float | None


@dataclass(slots=True)
class Mix:
    """The mix of routes and shapes on the two sides (of requests with a TTFT), and whether it moved."""

    shares: list[Share]
    #: The share of requests that moved between classes (total variation distance), None with a side empty.
    shift: float | None
    chi_square: float | None
    p_value: float | None
    moved: bool

    def describe(self) -> str:
        """``support long 0% to 50%, support short 100% to 50%: moved (chi-square p < 0.001, 50% shifted)``."""
        parts = [
            f"{_stratum(s.route, s.shape)} {_share(s.before_share)} to {_share(s.after_share)}" for s in self.shares
        ]
        if self.p_value is None:
            return ", ".join(parts) + ": no test (one class, or a side without requests)"
        p = "p < 0.001" if self.p_value < 0.001 else f"p = {self.p_value:.3f}"
        held = "moved" if self.moved else "held"
        return ", ".join(parts) + f": {held} (chi-square {p}, {_share(self.shift)} of requests shifted)"


@dataclass(slots=True)
class Stratum:
    """One route and shape: its requests with a TTFT on each side, p50s, the change and its verdict."""

    route: str | None
    shape: str | None
    before: int
    after: int
    before_p50: Estimate | None
    after_p50: Estimate | None
    change: dict[str, Estimate] | None
    kind: str
    verdict: str


@dataclass(slots=True)
class Comparison:
    """Everything ``llmtap compare`` reports."""

    source: str
    split: str
    before: SideFigures
    after: SideFigures
    change: dict[str, dict[str, Estimate] | None]
    verdict: str
    kind: str
    skipped: dict[str, int] = field(default_factory=dict)
    #: Each side's SLO verdicts by route and shape (``llmtap.analysis.slo``), when objectives are known.
    slo: dict[str, list[Verdict]] = field(default_factory=dict)
    #: The mix of routes and shapes on each side, and each one's own verdict (like with like).
    mix: Mix | None = None
    strata: list[Stratum] = field(default_factory=list)
    #: The least TTFT p50 change that counted, in seconds, and why (the share of the before p50, or --min-gain-ms).
    min_gain: float = 0.0
    min_gain_reason: str = ""
    #: Cost per request before and after (``llmtap.analysis.costreport.change``); None: not from records.
    cost: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The same figures for scripts."""
        return asdict(self)


def side_from_groups(label: str, groups: Iterable[store.Group]) -> Side:
    """A side from a source's groups: TTFT and prefill of successful streams, tokens of successful requests."""
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
    side.ttft = Distribution.of_sorted(store.merged([g.ttft_ok for g in groups]))
    side.prefill = Distribution.of_sorted(store.merged([g.prefill for g in groups]))
    slow = [Slow(v, trace, g.route, g.shape) for g in groups for v, trace in g.slowest]
    side.slowest = sorted(slow, key=lambda s: (-s.ttft, s.trace_id, s.route or "", s.shape or ""))[: store.SLOWEST]
    return side


def _stratum(route: str | None, shape: str | None) -> str:
    return f"{route or '(no route)'} {shape or '(no shape)'}"


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


def figures(
    side: Side, rng: random.Random, resamples: int, quantiles: Sequence[tuple[str, float]] = QUANTILES
) -> SideFigures:
    """Percentiles with intervals, shares and counts of one side (a stratum's: its p50 alone)."""
    whole = quantiles == QUANTILES
    p99 = side.ttft.quantile(0.99) if whole else None
    at_or_above = side.ttft.at_or_above(p99) if p99 is not None else 0
    return SideFigures(
        label=side.label,
        requests=side.requests,
        errors=side.errors,
        ttft_requests=side.ttft.n,
        ttft={name: quantile_estimate(side.ttft, q, rng, resamples) for name, q in quantiles},
        prefill_p50=quantile_estimate(side.prefill, 0.5, rng, resamples) if whole else None,
        prefill_source=",".join(sorted(side.prefill_sources)),
        cached_share=side.cached_share,
        input_tokens=side.input_tokens,
        cached_tokens=side.cached_tokens,
        # Most first, ties by name: the same order whichever source read the records.
        classes=dict(sorted(side.classes.items(), key=lambda kv: (-kv[1], kv[0]))),
        slowest=[s for s in side.slowest if p99 is not None and s.ttft >= p99],
        at_or_above_p99=at_or_above,
    )


# -- the verdict -----------------------------------------------------------------------------------


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def percents(*values: float) -> list[str]:
    """Relative changes with one decimal, or more where two different values would read the same.

    An interval printed as "-84% to -84%" looks broken; one decimal tells its bounds apart in practice.
    """
    texts: list[str] = []
    for digits in (1, 2, 3):
        texts = [f"{v:+.{digits}%}" for v in values]
        if len(set(texts)) == len(set(values)):
            break
    return texts


def _ms(v: float) -> str:
    """Milliseconds as a verdict says them: whole ones, or one decimal below 10 ms."""
    return f"{v * 1000:.1f} ms" if v < 0.00995 else f"{v * 1000:.0f} ms"


def threshold(before_p50: float, min_gain: float, min_gain_share: float) -> tuple[float, str]:
    """The least change that counts, in seconds, and what set it."""
    relative = min_gain_share * before_p50
    if min_gain > relative:
        return min_gain, "--min-gain-ms"
    return relative, f"{min_gain_share:.0%} of the before p50, --min-gain-share"


def verdict(
    before: SideFigures,
    after: SideFigures,
    p50: tuple[Estimate, Estimate] | None,
    *,
    min_requests: int = MIN_REQUESTS,
    min_gain: float = MIN_GAIN_MS / 1000,
    min_gain_share: float = MIN_GAIN_SHARE,
) -> tuple[str, str]:
    """The kind (gain, no_gain, no_change, regression, insufficient) and the one-line verdict.

    A change counts when its interval excludes zero and it is at least the larger of ``min_gain`` (seconds)
    and ``min_gain_share`` of the before side's p50."""
    if p50 is None or min(before.ttft_requests, after.ttft_requests) < min_requests:
        return "insufficient", (
            f"no verdict: too few requests with a TTFT ({before.ttft_requests} before, {after.ttft_requests} after; "
            f"at least {min_requests} a side needed)"
        )
    diff, rel = p50
    b, a = before.ttft["p50"], after.ttft["p50"]
    assert b is not None and a is not None
    shares = f"cached share {_share(before.cached_share)} to {_share(after.cached_share)}"
    value, low, high = percents(rel.value, rel.low, rel.high)
    moved = f"TTFT p50 {seconds(b.value)} to {seconds(a.value)} ({value}, CI {low} to {high}"
    kind = "no_gain" if diff.value < 0 else "no_change"
    none = f"no significant {kind[3:]}"
    if diff.low <= 0 <= diff.high:
        return kind, f"{none}: {moved}, which includes no change), {shares}"
    least, why = threshold(b.value, min_gain, min_gain_share)
    if abs(diff.value) < least:
        # The interval excludes zero, so the change is real: what it lacks is size, and the verdict says so.
        what = "gain" if diff.value < 0 else "rise"
        return kind, (
            f"{none}: {moved}): a real {_ms(abs(diff.value))} {what}, but below the "
            f"{_ms(least)} threshold ({why}); {shares}"
        )
    if diff.value > 0:
        return "regression", f"regression: {moved}), {shares}"
    rise = (after.cached_share or 0.0) - (before.cached_share or 0.0)
    label = "caching gain" if rise >= CACHED_SHARE_RISE else "TTFT gain, not from caching"
    if before.cached_share is None and after.cached_share is None:
        label = "TTFT gain"  # no input tokens known (a route and shape read from Prometheus): no cause named
    return "gain", f"{label}: {moved}), {shares}"


def analyze(
    before: Side,
    after: Side,
    *,
    source: str,
    split: str,
    min_requests: int = MIN_REQUESTS,
    min_gain_ms: float = MIN_GAIN_MS,
    min_gain_share: float = MIN_GAIN_SHARE,
    resamples: int = RESAMPLES,
    seed: int | None = 0,
    skipped: dict[str, int] | None = None,
    strata: dict[tuple[str | None, str | None], tuple[Side, Side]] | None = None,
) -> Comparison:
    """Compare two sides: figures with intervals, the change of each percentile, the verdict; with ``strata``
    (each route and shape's two sides), each one's verdict and the mix, and no pooled verdict when it moved."""
    rng = random.Random(seed)
    fb, fa = figures(before, rng, resamples), figures(after, rng, resamples)
    change: dict[str, dict[str, Estimate] | None] = {}
    p50: tuple[Estimate, Estimate] | None = None
    for name, q in QUANTILES:
        est = change_estimates(before.ttft, after.ttft, q, rng, resamples)
        change[f"ttft_{name}"] = None if est is None else {"seconds": est[0], "relative": est[1]}
        if name == "p50":
            p50 = est
    rules: dict[str, Any] = {
        "min_requests": min_requests,
        "min_gain": min_gain_ms / 1000,
        "min_gain_share": min_gain_share,
    }
    kind, text = verdict(fb, fa, p50, **rules)
    b50 = fb.ttft["p50"]
    least, why = threshold(b50.value, min_gain_ms / 1000, min_gain_share) if b50 is not None else (0.0, "")
    c = Comparison(
        source=source,
        split=split,
        before=fb,
        after=fa,
        change=change,
        verdict=text,
        kind=kind,
        skipped=skipped or {},
        min_gain=least,
        min_gain_reason=why,
    )
    if strata:
        c.mix = mix_of(strata)
        for (route, shape), (sb, sa) in strata.items():
            xb, xa = figures(sb, rng, resamples, QUANTILES[:1]), figures(sa, rng, resamples, QUANTILES[:1])
            est = change_estimates(sb.ttft, sa.ttft, 0.5, rng, resamples)
            k, v = verdict(xb, xa, est, **rules)
            c.strata.append(
                Stratum(
                    route,
                    shape,
                    xb.ttft_requests,
                    xa.ttft_requests,
                    xb.ttft["p50"],
                    xa.ttft["p50"],
                    None if est is None else {"seconds": est[0], "relative": est[1]},
                    k,
                    v,
                )
            )
        if c.mix.moved:
            moved = ", ".join(
                f"{_stratum(s.route, s.shape)} {_share(s.before_share)} to {_share(s.after_share)}"
                for s in c.mix.shares
                if s.before_share != s.after_share
            )
            c.kind = "mix_moved"
            c.verdict = (
                f"no pooled verdict: the mix of routes and shapes moved ({moved} of requests with a TTFT): "
                "the verdicts by route and shape compare like with like"
            )
    return c


def mix_of(strata: dict[tuple[str | None, str | None], tuple[Side, Side]]) -> Mix:
    """Each route and shape's share of each side's requests with a TTFT, and whether the mix moved (``MIX_P``,
    ``MIX_SHIFT``)."""
    counts = [(k, sb.ttft.n, sa.ttft.n) for k, (sb, sa) in strata.items()]
    nb, na = sum(b for _, b, _ in counts), sum(a for _, _, a in counts)
    shares = [
        Share(route, shape, b, a, b / nb if nb else None, a / na if na else None) for (route, shape), b, a in counts
    ]
    shift = sum(abs(b / nb - a / na) for _, b, a in counts) / 2 if nb and na else None
    test = homogeneity([b for _, b, _ in counts], [a for _, _, a in counts])
    if test is None or shift is None:
        return Mix(shares, shift, None, None, moved=False)
    statistic, _, p = test
    return Mix(shares, shift, statistic, p, moved=p < MIX_P and shift >= MIX_SHIFT)


# -- record files ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Split:
    """How requests are split: by version (``before``/``after``) or at ``at`` (epoch seconds), within a window."""

    before: str | None = None
    after: str | None = None
    at: float | None = None
    window: float | None = None
    until: float | None = None

    def describe(self) -> str:
        """How the split reads in a report."""
        if self.at is not None:
            moment = datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds")
            return f"at {moment}" + (f", {self.window:g} s each side" if self.window else "")
        return f"prompt version {self.before} against {self.after}" + (
            f", the last {self.window:g} s" if self.window else ""
        )


def by_versions(groups: Sequence[store.Group], split: Split) -> Split:
    """The split as given; with neither versions nor a time, the two versions the records hold, oldest first
    (by each version's first request)."""
    if split.at is not None or (split.before is not None and split.after is not None):
        return split
    if split.before is not None or split.after is not None:
        raise ConfigError("--before and --after go together")
    seen: dict[str, float] = {}
    for g in groups:
        if g.key is not None:
            seen[g.key] = min(seen.get(g.key, math.inf), g.first)
    if len(seen) != 2:
        names = ", ".join(sorted(seen, key=lambda v: (seen[v], v))) or "none"
        raise ConfigError(f"say how to split: --before V1 --after V2, or --split-at TIME (versions seen: {names})")
    first, second = sorted(seen, key=lambda v: (seen[v], v))
    return Split(first, second, window=split.window, until=split.until)


@dataclass(slots=True)
class Sides:
    """The two sides as read from a source, ready for ``analyze``."""

    before: Side
    after: Side
    source: str
    split: str
    skipped: dict[str, int] = field(default_factory=dict)
    slo: dict[str, list[Verdict]] = field(default_factory=dict)

    #: Each route and shape's two sides (like with like), when the source tells them apart.
    strata: dict[tuple[str | None, str | None], tuple[Side, Side]] = field(default_factory=dict)

    def compare(self, **options: Any) -> Comparison:
        """``analyze`` the two sides."""
        c = analyze(
            self.before,
            self.after,
            source=self.source,
            split=self.split,
            skipped=self.skipped,
            strata=self.strata,
            **options,
        )
        c.slo = self.slo
        c.cost = cost_change(self.before, self.after)
        return c


def cost_change(before: Side, after: Side) -> dict[str, Any] | None:
    """Cost per request before and after (issue 31), when records were read (Prometheus sides have none)."""
    if not before.priced and not after.priced:
        return None
    of = costreport.CostFigures.of_counts
    return costreport.change(
        of(before.requests, before.priced, before.cost), of(after.requests, after.priced, after.cost)
    )


def compare_records(
    path: str | Path | Sequence[str | Path],
    split: Split,
    *,
    route: str | None = None,
    model: str | None = None,
    shape: str | None = None,
    engine: str = store.ENGINES[0],
    **options: Any,
) -> Comparison:
    """Compare over record files (what the demo's verdict comes from)."""
    return record_sides(path, split, route=route, model=model, shape=shape, engine=engine).compare(**options)


def record_sides(
    path: str | Path | Sequence[str | Path],
    split: Split,
    *,
    route: str | None = None,
    model: str | None = None,
    shape: str | None = None,
    objectives: Objectives | None = None,
    engine: str | store.Source = store.ENGINES[0],
) -> Sides:
    """Read record files (paths, globs, directories; rotated siblings included) and split their requests;
    ``engine`` names what reads them, or is a source of its own (ClickHouse: ``path`` is then unused).

    One scan of the source: the records that pass the filter, grouped by side (prompt version, or before
    and after ``--split-at``), route and shape, each figure's values sorted by the source."""
    paths = [path] if isinstance(path, str | Path) else list(path)
    where = store.Filter(route=route, model=model, shape=shape)
    by: store.By
    if split.at is not None:
        by = split.at
        if split.window is not None:
            where = replace(where, start=split.at - split.window, end=split.at + split.window, open_end=True)
    else:
        by = store.VERSION
        if split.window is not None:
            # A version split over a window: the last ``window`` seconds before ``until`` (or now).
            end = split.until if split.until is not None else time.time()
            where = replace(where, start=end - split.window, end=end)
    given = None if isinstance(engine, str) else engine
    source = slo_report.open_source(paths, engine) if isinstance(engine, str) else engine
    try:
        scan = source.scan(where, by)
        if not scan.groups:
            slo_report.no_such_names(source, where, by)
        split = by_versions(scan.groups, split)
        if split.at is None:
            unknown_versions(scan.groups, split, where)
        keys = ("before", "after") if split.at is not None else (split.before, split.after)
        sides = [[g for g in scan.groups if g.key == k] for k in keys]
        met = None
        if objectives is not None:
            met = source.count_met(where, by, slo_report.limits_of(sides[0] + sides[1], objectives))
    finally:
        source.close()
    before = side_from_groups(split.before or "before", sides[0])
    after = side_from_groups(split.after or "after", sides[1])
    verdicts: dict[str, list[Verdict]] = {}
    for side, groups in ((before, sides[0]), (after, sides[1])):
        span = None
        if side.requests > 1:
            span = max(g.last for g in groups) - min(g.first for g in groups)
        judged = slo_report.store_groups(groups, objectives=objectives, met=met)
        verdicts[side.label] = slo_report.verdicts(judged, span)
    return Sides(
        before,
        after,
        source=slo_report.source_name(paths, scan) if given is None else f"{scan.source} ({scan.records} records)",
        split=split.describe(),
        skipped=scan.skipped,
        slo=verdicts,
        strata=strata_from_groups(before.label, sides[0], after.label, sides[1]),
    )


def unknown_versions(groups: Sequence[store.Group], split: Split, where: store.Filter) -> None:
    """``ConfigError`` naming the versions the records hold (and their requests) when a side's is not among them."""
    seen: Counter[str] = Counter()
    for g in groups:
        if g.key is not None:
            seen[g.key] += g.requests
    missing = [v for v in (split.before, split.after) if v is not None and v not in seen]
    if not missing:
        return
    known = ", ".join(f"{v} ({n} requests)" for v, n in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0])))
    what = " and ".join(missing)
    raise ConfigError(
        f"no requests of prompt version {what}{slo_report.describe_filter(where)}; versions seen: {known or 'none'}"
    )


# -- Prometheus ------------------------------------------------------------------------------------

#: The proxy's metric names as Prometheus stores them: llmtap's own, which carry the route and prompt version
#: and have fine buckets (the ``gen_ai.*`` ones carry neither, and have the conventions' coarse buckets).
PROM_TTFT = "llmtap_time_to_first_token_seconds_bucket"
PROM_PREFILL = "llmtap_prefill_duration_seconds_bucket"
PROM_INPUT = "llmtap_usage_input_tokens_total"
PROM_CACHED = "llmtap_usage_cache_read_input_tokens_total"
PROM_CLASSES = "llmtap_cache_requests_total"
PROM_REQUESTS = "llmtap_requests_total"


def _selector(matchers: dict[str, str]) -> str:
    return ",".join(f"{k}={quote(v)}" for k, v in sorted(matchers.items()))


def side_from_prometheus(
    prom: Prometheus, label: str, matchers: dict[str, str], start: float | None, end: float
) -> Side:
    """A side from the proxy's metrics in Prometheus: TTFT and prefill histograms, token and request counters."""
    sel = _selector(matchers)
    side = Side(label)

    def buckets(name_matcher: str) -> Distribution:
        grown = prom.increase(f"sum by (le) ({{{name_matcher}{',' + sel if sel else ''}}})", start, end)
        pairs = [(float(dict(k)["le"]), v) for k, v in grown.items() if "le" in dict(k)]
        return Distribution(buckets=pairs) if pairs and max(v for _, v in pairs) > 0 else Distribution()

    def total(metric: str, by: str | None = None) -> dict[str, float]:
        grouping = f" by ({by})" if by else ""
        grown = prom.increase(f"sum{grouping} ({metric}{{{sel}}})", start, end)
        return {dict(k).get(by, "") if by else "": v for k, v in grown.items()}

    side.ttft = buckets(f'__name__="{PROM_TTFT}"')
    side.prefill = buckets(f'__name__="{PROM_PREFILL}"')
    sources = total("llmtap_prefill_duration_seconds_count", "llmtap_prefill_source")
    side.prefill_sources = {k for k, v in sources.items() if v > 0 and k}
    side.input_tokens = round(sum(total(PROM_INPUT).values()))
    side.cached_tokens = round(sum(total(PROM_CACHED).values()))
    side.classes = Counter({k: round(v) for k, v in total(PROM_CLASSES, "llmtap_cache_class").items() if v >= 0.5})
    outcomes = total(PROM_REQUESTS, "llmtap_outcome")
    side.requests = round(sum(outcomes.values()))
    side.errors = side.requests - round(outcomes.get("ok", 0.0))
    return side


def strata_from_prometheus(
    prom: Prometheus, label: str, matchers: dict[str, str], start: float | None, end: float
) -> dict[tuple[str | None, str | None], Side]:
    """One side's routes and shapes from the TTFT histogram by route and shape (its only series with both):
    TTFT alone, so a route and shape's verdict names no cause."""
    sel = _selector(matchers)
    by = f"le, {slo_report.ROUTE_LABEL}, {slo_report.SHAPE_LABEL}"
    grown = prom.increase(f'sum by ({by}) ({{__name__="{PROM_TTFT}"{"," + sel if sel else ""}}})', start, end)
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


def _paired(
    before: tuple[str, dict[tuple[str | None, str | None], Side]],
    after: tuple[str, dict[tuple[str | None, str | None], Side]],
) -> dict[tuple[str | None, str | None], tuple[Side, Side]]:
    """Each route and shape's two sides (an empty side where one has none), in order of route and shape."""
    keys = sorted({*before[1], *after[1]}, key=lambda k: (k[0] or "", k[1] or ""))
    return {k: (before[1].get(k) or Side(before[0]), after[1].get(k) or Side(after[0])) for k in keys}


def prometheus_sides(
    url: str,
    split: Split,
    *,
    route: str | None = None,
    model: str | None = None,
    shape: str | None = None,
    objectives: Objectives | None = None,
) -> Sides:
    """The two sides from the proxy's metrics in Prometheus: by version label, or at a time, over a window.

    A version split without ``--window`` reads what the counters hold at the end (since the proxy last
    started); a time split compares equal windows on either side of the moment, up to ``--until`` or now.
    """
    base: dict[str, str] = {}
    if route is not None:
        base["llmtap_route"] = route
    if model is not None:
        base["gen_ai_request_model"] = model
    if shape is not None:
        base[slo_report.SHAPE_LABEL] = shape
    end = split.until if split.until is not None else time.time()
    prom = Prometheus(url)
    # The same windows and matchers per side, for the SLO verdicts (when the objectives are known).
    windows: dict[str, tuple[float | None, float, dict[str, str]]] = {}
    try:
        if split.at is not None:
            window = split.window if split.window is not None else max(end - split.at, 1.0)
            before = side_from_prometheus(prom, "before", base, split.at - window, split.at)
            after = side_from_prometheus(prom, "after", base, split.at, min(split.at + window, end))
            windows = {
                "before": (split.at - window, split.at, base),
                "after": (split.at, min(split.at + window, end), base),
            }
        else:
            if split.before is None or split.after is None:
                raise ConfigError("with --prometheus, say how to split: --before V1 --after V2, or --split-at TIME")
            start = end - split.window if split.window is not None else None
            before = side_from_prometheus(
                prom, split.before, {**base, "llmtap_prompt_version": split.before}, start, end
            )
            after = side_from_prometheus(prom, split.after, {**base, "llmtap_prompt_version": split.after}, start, end)
            windows = {
                split.before: (start, end, {**base, "llmtap_prompt_version": split.before}),
                split.after: (start, end, {**base, "llmtap_prompt_version": split.after}),
            }
        # Like with like: each route and shape's TTFT on each side, from the same windows.
        strata: dict[tuple[str | None, str | None], tuple[Side, Side]] = {}
        if len(windows) == 2:
            (lb, wb), (la, wa) = windows.items()
            strata = _paired(
                (before.label, strata_from_prometheus(prom, lb, wb[2], wb[0], wb[1])),
                (after.label, strata_from_prometheus(prom, la, wa[2], wa[0], wa[1])),
            )
    finally:
        prom.close()
    verdicts: dict[str, list[Verdict]] = {}
    if objectives is not None:
        for label, (first, last, matchers) in windows.items():
            report = slo_report.from_prometheus(
                url,
                objectives,
                until=last,
                start=first,
                window=None if first is None else last - first,
                matchers=matchers,
            )
            verdicts[label] = report.verdicts
    return Sides(before, after, source=f"Prometheus at {prom.url}", split=split.describe(), slo=verdicts, strata=strata)


# -- output ----------------------------------------------------------------------------------------


def _estimate(e: Estimate | None) -> str:
    if e is None:
        return "-"
    return f"{seconds(e.value)} [{seconds(e.low)}, {seconds(e.high)}]"


def _relative(change: dict[str, Estimate] | None) -> str:
    if change is None:
        return ""
    value, low, high = percents(change["relative"].value, change["relative"].low, change["relative"].high)
    return f"{value} [{low}, {high}]"


def _classes(classes: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in classes.items()) or "-"


def render(c: Comparison) -> str:
    """The report: what was read, a table of both sides and the change, and the verdict."""
    b, a = c.before, c.after
    rows: list[tuple[str, str, str, str]] = [
        ("", f"before ({b.label})", f"after ({a.label})", "change"),
        ("requests", f"{b.requests} ({b.errors} errors)", f"{a.requests} ({a.errors} errors)", ""),
    ]
    for name, _ in QUANTILES:
        rows.append(
            (f"TTFT {name}", _estimate(b.ttft[name]), _estimate(a.ttft[name]), _relative(c.change[f"ttft_{name}"]))
        )
    rows.append(
        (
            "prefill p50",
            _estimate(b.prefill_p50) + (f" ({b.prefill_source})" if b.prefill_source else ""),
            _estimate(a.prefill_p50) + (f" ({a.prefill_source})" if a.prefill_source else ""),
            "",
        )
    )
    rows.append(("cached share", _share(b.cached_share), _share(a.cached_share), ""))
    rows.append(("cache classes", _classes(b.classes), _classes(a.classes), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"llmtap compare: {c.source}", f"split: {c.split}"]
    skipped = {k: v for k, v in c.skipped.items() if v}
    if skipped:
        lines.append("skipped lines: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in skipped.items()))
    lines.append("")
    for r in rows:
        lines.append("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip())
    lines.append("  (95% bootstrap confidence intervals in brackets; TTFT of successful streams)")
    few = [name for name, q in QUANTILES[1:] if min(b.ttft_requests, a.ttft_requests) < 2 / (1 - q)]
    if few:
        lines.append(f"  ({' and '.join(few)} rest on few requests: read them as rough)")
    if c.mix is not None and (len(c.strata) > 1 or c.mix.moved):
        lines += ["", f"mix of routes and shapes (requests with a TTFT, {b.label} to {a.label}): {c.mix.describe()}"]
        lines.append("by route and shape (TTFT p50; requests with a TTFT before/after):")
        names = [_stratum(s.route, s.shape) for s in c.strata]
        counts = [f"{s.before}/{s.after}" for s in c.strata]
        wide, wide_n = max(map(len, names)), max(map(len, counts))
        for s, name, n in zip(c.strata, names, counts, strict=True):
            lines.append(f"  {name.ljust(wide)}  {n.rjust(wide_n)}  {s.verdict}")
    slow = [(f, f.slowest) for f in (b, a) if f.slowest]
    if slow:
        lines += ["", "slowest requests (TTFT at or above each side's p99, by trace id):"]
        for f, listed in slow:
            p99 = f.ttft["p99"]
            more = f", the slowest {len(listed)} shown" if f.at_or_above_p99 > len(listed) else ""
            head = f"  {f.label}: {f.at_or_above_p99} at or above p99 {seconds(p99.value) if p99 else '-'}{more}"
            lines.append(head)
            for x in listed:
                lines.append(f"    {seconds(x.ttft):>8}  {x.trace_id or '(no trace id)'}  {_stratum(x.route, x.shape)}")
    lines += ["", c.verdict]
    slo = [
        f"  {label}: {v.route} {v.shape}: {check.describe()}: {_estimate(check.estimate)} {check.verdict}"
        for label, verdicts in c.slo.items()
        for v in verdicts
        for check in v.checks
    ]
    if slo:  # a header only over rows: a route judged by no objective has none
        lines += ["", "SLO by route and shape (the percentile that counts, 95% CI):", *slo]
    return "\n".join(lines)


def plot(c: Comparison, before: Distribution, after: Distribution, path: str | Path) -> None:
    """Draw the two TTFT distributions (cumulative) and the cached share of each side into a PNG."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        hint = "pip install matplotlib (in a checkout of llmtap: pip install -e '.[plot]')"
        raise ConfigError(f"--plot needs matplotlib: {hint}") from None
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 1])
    for dist, side, color in ((before, c.before, "tab:red"), (after, c.after, "tab:blue")):
        xs, ys = dist.cdf()
        if not xs:
            continue
        # From 0 at the smallest value, so the first step is drawn too.
        left.step([xs[0], *xs], [0.0, *ys], where="post", color=color, label=f"{side.label} (n={side.ttft_requests})")
        p50 = side.ttft["p50"]
        if p50 is not None:
            left.axvline(p50.value, color=color, linestyle=":", linewidth=1)
    values = [v for dist in (before, after) for v in dist.cdf()[0] if v > 0]
    wide = bool(values) and max(values) > 10 * min(values)
    if wide:
        # A caching gain spans a decade or more: a log scale shows both sides' spread.
        left.set_xscale("log")
        left.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        left.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: seconds(v)))
    left.set_xlabel(f"TTFT{' (log scale)' if wide else ''}; dotted: p50")
    left.set_ylabel("share of requests")
    left.set_ylim(0, 1.02)
    left.grid(True, which="both", alpha=0.3)
    left.legend(loc="lower right")
    shares = [(c.before.cached_share or 0.0) * 100, (c.after.cached_share or 0.0) * 100]
    bars = right.bar([c.before.label, c.after.label], shares, color=["tab:red", "tab:blue"])
    right.bar_label(bars, labels=[f"{v:.0f}%" for v in shares])
    right.set_ylim(0, 105)
    right.set_ylabel("cached share of input tokens (%)")
    fig.suptitle("\n".join(textwrap.wrap(c.verdict, 110)), fontsize=9)
    try:
        fig.savefig(str(path), dpi=100)
    except OSError as exc:
        raise ConfigError(f"--plot {str(path)!r}: {exc.strerror or exc}") from None


def parse_share(text: str) -> float:
    """``10%`` or ``0.1``: a share of the before side's p50, from 0 up to 1 (100%)."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise ConfigError(f"--min-gain-share {text!r}: expected a share such as 10% or 0.1 (0 to 100%)")
    return value


def main(args: Any) -> int:
    """``llmtap compare``; bad input raises ``ConfigError`` (exit code 2 in the CLI)."""
    if sum((bool(args.records), args.prometheus is not None, args.clickhouse is not None)) != 1:
        raise ConfigError("compare needs a record file or --prometheus URL or --clickhouse URL (one of them)")
    if args.split_at is not None and (args.before is not None or args.after is not None):
        raise ConfigError("split by version (--before/--after) or by time (--split-at), not both")
    if args.resamples is not None and args.resamples < 100:
        raise ConfigError("--resamples must be at least 100")
    if args.min_requests is not None and args.min_requests < 1:
        raise ConfigError("--min-requests must be at least 1")
    if args.min_gain_ms is not None and not args.min_gain_ms >= 0:
        raise ConfigError("--min-gain-ms must be a duration in ms >= 0")
    share = MIN_GAIN_SHARE if args.min_gain_share is None else parse_share(args.min_gain_share)
    split = Split(
        before=args.before,
        after=args.after,
        at=parse_time(args.split_at) if args.split_at else None,
        window=parse_duration(args.window) if args.window else None,
        until=parse_time(args.until) if args.until else None,
    )
    objectives = slo_report.config_objectives(build({"config": args.config}, env={})) if args.config else None
    where = {"route": args.route, "model": args.model, "shape": args.shape, "objectives": objectives}
    if args.records:
        sides = record_sides(args.records, split, engine=args.engine, **where)
    elif args.clickhouse is not None:
        # ClickHouse filters, groups and sorts; the statistics and the verdict stay llmtap's.
        from llmtap.store.clickhouse import ClickHouseSource, server_from_env

        source = ClickHouseSource(server_from_env(args.clickhouse), args.clickhouse_table)
        sides = record_sides([], split, engine=source, **where)
    else:
        sides = prometheus_sides(args.prometheus, split, **where)
    comparison = sides.compare(
        min_requests=MIN_REQUESTS if args.min_requests is None else args.min_requests,
        min_gain_ms=MIN_GAIN_MS if args.min_gain_ms is None else args.min_gain_ms,
        min_gain_share=share,
        resamples=RESAMPLES if args.resamples is None else args.resamples,
        seed=args.seed,
    )
    if args.plot:
        plot(comparison, sides.before.ttft, sides.after.ttft, args.plot)
    if args.json:
        print(json.dumps(comparison.to_json(), indent=2))
    else:
        print(render(comparison))
        for line in costreport.compare_lines(comparison.cost):
            print(line)
        if args.plot:
            print(f"\nplot: {args.plot}")
    sys.stdout.flush()
    return 0
