"""``llmtap compare``: did a prompt change make caching work, and what did it buy in TTFT?

Reads the requests (``--record`` paths through ``llmtap.store``, ``--clickhouse``, or a Prometheus server's
copy of the proxy's metrics over its HTTP API), splits them into before and after, has
``llmtap.analysis.compare`` compare the two sides (figures with intervals, verdicts per route and shape, the
mix, the slowest requests), and prints the comparison as a table or as JSON, or draws it (``--plot``).
What the verdicts mean is in ``llmtap.analysis.compare``.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmtap import store
from llmtap.analysis import slo as slo_report
from llmtap.analysis.compare import (
    FIRST_TOKENS,
    MIN_GAIN_MS,
    MIN_GAIN_SHARE,
    MIN_REQUESTS,
    QUANTILES,
    RESAMPLES,
    Comparison,
    Side,
    Sides,
    Split,
    by_versions,
    paired,
    percents,
    share_text,
    side_from_counters,
    side_from_groups,
    side_queries,
    strata_from_counters,
    strata_from_groups,
    strata_query,
    stratum_name,
)
from llmtap.analysis.slo import Objectives, Verdict
from llmtap.analysis.stats import Distribution, Estimate
from llmtap.analysis.units import parse_duration, parse_time, seconds
from llmtap.commands import cost, slo as slo_command
from llmtap.commands.prometheus import Prometheus
from llmtap.config.load import build
from llmtap.config.types import ConfigError

__all__ = ["compare_records", "main", "record_sides", "render"]

# -- record files ----------------------------------------------------------------------------------


def compare_records(
    path: str | Path | Sequence[str | Path],
    split: Split,
    *,
    route: str | None = None,
    model: str | None = None,
    shape: str | None = None,
    engine: str | None = None,
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
    engine: str | store.Source | None = None,
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
    given: store.Source | None = None
    if engine is None or isinstance(engine, str):
        source = slo_command.open_source(paths, engine)
    else:
        given = source = engine
    try:
        scan = source.scan(where, by)
        slo_command.readable(scan, scan.source)
        if not scan.groups:
            slo_command.no_such_names(source, where, by)
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
        source=slo_command.source_name(paths, scan) if given is None else f"{scan.source} ({scan.records} records)",
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
        f"no requests of prompt version {what}{slo_command.describe_filter(where)}; versions seen: {known or 'none'}"
    )


# -- Prometheus ------------------------------------------------------------------------------------


def side_from_prometheus(
    prom: Prometheus, label: str, matchers: dict[str, str], start: float | None, end: float
) -> Side:
    """A side from the proxy's metrics in Prometheus: TTFT, TTFOT, TTST and prefill histograms, token and request
    counters."""
    return side_from_counters(label, {k: prom.increase(q, start, end) for k, q in side_queries(matchers).items()})


def strata_from_prometheus(
    prom: Prometheus, label: str, matchers: dict[str, str], start: float | None, end: float
) -> dict[tuple[str | None, str | None], Side]:
    """One side's routes and shapes from the TTFT histogram by route and shape (its only series with both):
    TTFT alone, so a route and shape's verdict names no cause."""
    return strata_from_counters(label, prom.increase(strata_query(matchers), start, end))


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
            strata = paired(
                (before.label, strata_from_prometheus(prom, lb, wb[2], wb[0], wb[1])),
                (after.label, strata_from_prometheus(prom, la, wa[2], wa[0], wa[1])),
            )
    finally:
        prom.close()
    verdicts: dict[str, list[Verdict]] = {}
    if objectives is not None:
        for label, (first, last, matchers) in windows.items():
            report = slo_command.from_prometheus(
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


def _first_token_rows(c: Comparison) -> list[tuple[str, str, str, str]]:
    """The TTFOT and TTST rows, for the figures either side has (from records or from Prometheus' histograms)."""
    rows: list[tuple[str, str, str, str]] = []
    b, a = c.before, c.after
    for figure in FIRST_TOKENS:
        fb, fa = getattr(b, figure), getattr(a, figure)
        if not fb and not fa:
            continue
        for name, _ in QUANTILES:
            change = c.change.get(f"{figure}_{name}")
            rows.append(
                (f"{figure.upper()} {name}", _estimate(fb.get(name)), _estimate(fa.get(name)), _relative(change))
            )
    return rows


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
    rows += _first_token_rows(c)
    rows.append(
        (
            "prefill p50",
            _estimate(b.prefill_p50) + (f" ({b.prefill_source})" if b.prefill_source else ""),
            _estimate(a.prefill_p50) + (f" ({a.prefill_source})" if a.prefill_source else ""),
            "",
        )
    )
    rows.append(("cached share", share_text(b.cached_share), share_text(a.cached_share), ""))
    rows.append(("cache classes", _classes(b.classes), _classes(a.classes), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"llmtap compare: {c.source}", f"split: {c.split}"]
    skipped = {k: v for k, v in c.skipped.items() if v}
    if skipped:
        lines.append("skipped: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in skipped.items()))
    lines.append("")
    for r in rows:
        lines.append("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip())
    lines.append("  (95% bootstrap confidence intervals in brackets; TTFT of successful streams)")
    if any(side.ttfot_requests or side.ttst_requests for side in (b, a)):
        lines.append(
            f"  (TTFOT: to the answer's first chunk, after any reasoning, TTFT without reasoning; "
            f"{b.ttfot_requests} before, {a.ttfot_requests} after. TTST: the first content chunk to the second; "
            f"{b.ttst_requests} before, {a.ttst_requests} after: a stream of one chunk has none)"
        )
    few = [name for name, q in QUANTILES[1:] if min(b.ttft_requests, a.ttft_requests) < 2 / (1 - q)]
    if few:
        lines.append(f"  ({' and '.join(few)} rest on few requests: read them as rough)")
    if c.mix is not None and (len(c.strata) > 1 or c.mix.moved):
        lines += ["", f"mix of routes and shapes (requests with a TTFT, {b.label} to {a.label}): {c.mix.describe()}"]
        lines.append("by route and shape (TTFT p50; requests with a TTFT before/after):")
        names = [stratum_name(s.route, s.shape) for s in c.strata]
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
                lines.append(
                    f"    {seconds(x.ttft):>8}  {x.trace_id or '(no trace id)'}  {stratum_name(x.route, x.shape)}"
                )
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
        slo_command.engine_note(args.engine)
        sides = record_sides(args.records, split, engine=args.engine, **where)
    elif args.clickhouse is not None:
        # ClickHouse filters, groups and sorts; the statistics and the verdict stay llmtap's.
        from llmtap.store.clickhouse import server_from_env
        from llmtap.store.clickhouse_read import ClickHouseSource

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
        for line in cost.compare_lines(comparison.cost):
            print(line)
        if args.plot:
            print(f"\nplot: {args.plot}")
    sys.stdout.flush()
    return 0
