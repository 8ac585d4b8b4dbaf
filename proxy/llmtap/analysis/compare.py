"""``llmtap compare``: did a prompt change make caching work, and what did it buy in TTFT?

Reads request records (``--record``: any number of files, globs and directories, read by the embedded
engine, ``llmtap.store``) or a Prometheus server's HTTP API, splits the requests into
before and after (by prompt version, or at a moment in time) and prints, for each side, TTFT
p50/p95/p99 with bootstrap 95% confidence intervals (and beside it, where the requests have them, the time to
the first output token, TTFOT, and to the second token, TTST), prefill time, the cached-token share, the cache
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

Pure: the sides come from a source's facts (``side_from_groups``) or from the answers to PromQL queries
``llmtap.analysis.sides`` writes (``side_queries``, ``strata_query``), and are offered here too; reading them,
and printing and drawing the comparison, is ``llmtap.commands.compare``'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from llmtap.analysis import costreport
from llmtap.analysis.sides import (
    SLOWEST,
    Side,
    Slow,
    paired,
    side_from_counters,
    side_from_groups,
    side_queries,
    strata_from_counters,
    strata_from_groups,
    strata_query,
)
from llmtap.analysis.slo import Verdict
from llmtap.analysis.stats import Distribution, Estimate, change_estimates, homogeneity, quantile_estimate
from llmtap.analysis.units import seconds
from llmtap.config.types import ConfigError

if TYPE_CHECKING:  # the facts a source gives (analysis reads them; it never opens a source)
    from llmtap import store

__all__ = [
    "CACHED_SHARE_RISE",
    "FIRST_TOKENS",
    "MIN_GAIN_MS",
    "MIN_GAIN_SHARE",
    "MIN_REQUESTS",
    "QUANTILES",
    "RESAMPLES",
    "SLOWEST",
    "Comparison",
    "Side",
    "Sides",
    "Split",
    "analyze",
    "by_versions",
    "paired",
    "percents",
    "share_text",
    "side_from_counters",
    "side_from_groups",
    "side_queries",
    "strata_from_counters",
    "strata_from_groups",
    "strata_query",
    "stratum_name",
]

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


# -- each side's figures ---------------------------------------------------------------------------


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
    #: The requests at or above the side's TTFT p99, slowest first (at most ``SLOWEST``), and how many.
    slowest: list[Slow] = field(default_factory=list)
    at_or_above_p99: int = 0
    #: TTFOT and TTST percentiles (``QUANTILES``) of the successful streams that have them, and how many have them
    #: (``first_tokens``); from Prometheus, read from their histograms as TTFT is.
    ttfot_requests: int = 0
    ttfot: dict[str, Estimate | None] = field(default_factory=dict)
    ttst_requests: int = 0
    ttst: dict[str, Estimate | None] = field(default_factory=dict)


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
            f"{stratum_name(s.route, s.shape)} {share_text(s.before_share)} to {share_text(s.after_share)}"
            for s in self.shares
        ]
        if self.p_value is None:
            return ", ".join(parts) + ": no test (one class, or a side without requests)"
        p = "p < 0.001" if self.p_value < 0.001 else f"p = {self.p_value:.3f}"
        held = "moved" if self.moved else "held"
        return ", ".join(parts) + f": {held} (chi-square {p}, {share_text(self.shift)} of requests shifted)"


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


def stratum_name(route: str | None, shape: str | None) -> str:
    """How a route and shape read: ``support long``, or ``(no route) (no shape)``."""
    return f"{route or '(no route)'} {shape or '(no shape)'}"


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


def share_text(v: float | None) -> str:
    """A share as a whole percent, or ``-`` when there is none."""
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
    shares = f"cached share {share_text(before.cached_share)} to {share_text(after.cached_share)}"
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
    first_tokens(c, before, after, seed=seed, resamples=resamples)
    if strata:
        c.mix = mix_of(strata)
        c.strata = [stratum_verdict(k, sb, sa, rng, resamples, rules) for k, (sb, sa) in strata.items()]
        if c.mix.moved:
            c.kind, c.verdict = "mix_moved", _mix_moved(c.mix)
    return c


#: The figures read beside TTFT (no verdict rests on them), as ``SideFigures`` and ``Comparison.change`` name them.
FIRST_TOKENS = ("ttfot", "ttst")


def first_tokens(c: Comparison, before: Side, after: Side, *, seed: int | None, resamples: int) -> None:
    """Each side's TTFOT and TTST percentiles, and their changes, where either side has them. Drawn from a
    generator of their own, so the TTFT figures and the verdict are the same with or without them."""
    rng = random.Random(seed)
    for figure in FIRST_TOKENS:
        dists: tuple[Distribution, Distribution] = (getattr(before, figure), getattr(after, figure))
        if not any(d.n for d in dists):
            continue
        for side, dist in zip((c.before, c.after), dists, strict=True):
            setattr(side, f"{figure}_requests", dist.n)
            setattr(side, figure, {name: quantile_estimate(dist, q, rng, resamples) for name, q in QUANTILES})
        for name, q in QUANTILES:
            est = change_estimates(*dists, q, rng, resamples)
            c.change[f"{figure}_{name}"] = None if est is None else {"seconds": est[0], "relative": est[1]}


def stratum_verdict(
    key: tuple[str | None, str | None],
    before: Side,
    after: Side,
    rng: random.Random,
    resamples: int,
    rules: dict[str, Any],
) -> Stratum:
    """One route and shape's own verdict: its p50 on each side and the change, by the same ``rules``."""
    xb, xa = figures(before, rng, resamples, QUANTILES[:1]), figures(after, rng, resamples, QUANTILES[:1])
    est = change_estimates(before.ttft, after.ttft, 0.5, rng, resamples)
    k, v = verdict(xb, xa, est, **rules)
    return Stratum(
        key[0],
        key[1],
        xb.ttft_requests,
        xa.ttft_requests,
        xb.ttft["p50"],
        xa.ttft["p50"],
        None if est is None else {"seconds": est[0], "relative": est[1]},
        k,
        v,
    )


def _mix_moved(mix: Mix) -> str:
    """The verdict in place of a pooled one when the mix moved: which routes and shapes moved, by how much."""
    moved = ", ".join(
        f"{stratum_name(s.route, s.shape)} {share_text(s.before_share)} to {share_text(s.after_share)}"
        for s in mix.shares
        if s.before_share != s.after_share
    )
    return (
        f"no pooled verdict: the mix of routes and shapes moved ({moved} of requests with a TTFT): "
        "the verdicts by route and shape compare like with like"
    )


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


# -- the split -------------------------------------------------------------------------------------


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
    """Cost per request before and after, when records were read (Prometheus sides have none)."""
    if not before.priced and not after.priced:
        return None
    of = costreport.CostFigures.of_counts
    return costreport.change(
        of(before.requests, before.priced, before.cost), of(after.requests, after.priced, after.cost)
    )
