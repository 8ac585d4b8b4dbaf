"""The live view's memory: figures per route and model over a recent window, and the last requests.

A recorder listener feeds it on the recorder's worker thread, after the request's telemetry is written,
so nothing here runs on a request's path. Memory is bounded: per route and model, one tally per
``SLOT`` seconds for ``HORIZON`` seconds plus one since start (models are already capped by the
recorder's label guard, ``llmtap.labels.LabelGuard``), and the last ``HISTORY`` requests.

Every figure counts exactly what the recorder's ``llmtap.*`` metrics count, under the same conditions (see
``samples``), and a series is one route, model, shape and prompt version (the split a prompt change is judged
by). Percentiles are exact: each latency's values are kept (``Samples``) and read with the quantile the demo's
tables, the records and ``llmtap compare`` use (``llmtap.analysis.stats.quantile``), so the page and the tables
agree on the same requests. The values kept are bounded (``SAMPLE_BUDGET`` over all series, the largest
series giving up its oldest first): a window reaching back past a dropped value reads its percentiles from
the same fine buckets as ``/metrics`` instead (Prometheus' ``histogram_quantile``), held between the
smallest and the largest value in the window, and says so (``exact: false``).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmtap.analysis.shapes import needed
from llmtap.analysis.stats import sorted_quantile
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import CANCELLED, ERROR, OK, Timeline
from llmtap.config.types import SLO
from llmtap.telemetry.admin.live.measures import HORIZON, QUANTILES, SLOT, TICK, Busy, Hist
from llmtap.telemetry.admin.live.waterfall import Facts, draw, facts
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS

__all__ = [
    "HISTORY",
    "HORIZON",
    "SAMPLE_BUDGET",
    "SLOT",
    "SLOWEST",
    "TICK",
    "WINDOWS",
    "Busy",
    "Counts",
    "Entry",
    "Hist",
    "Labels",
    "LiveWindow",
    "Samples",
    "Tally",
    "verdict",
]

#: The windows the page offers: a name and its length in seconds (None: since start).
WINDOWS: tuple[tuple[str, float | None], ...] = (("1m", 60.0), ("5m", 300.0), ("15m", 900.0), ("all", None))
#: Requests kept for waterfalls.
HISTORY = 200

#: The route, model and prompt version labels a request's metrics carry ("" for no version).
Labels = Callable[[Timeline, Summary], tuple[str, str, str]]
#: The latencies whose values are kept for exact percentiles.
LATENCIES = ("ttft", "itl", "tpot", "e2e", "ttfot", "ttst")
#: Latency values kept over all series at most (8 bytes each, 2 MB): past it the series holding the most gives
#: up its oldest quarter, and windows reaching back that far read their percentiles from buckets. It also bounds
#: a snapshot's sorting, which holds the GIL (the recorder's thread waits meanwhile).
SAMPLE_BUDGET = 250_000
#: Requests behind a percentile the page links to, slowest first.
SLOWEST = 5


def samples(tl: Timeline, s: Summary) -> dict[str, list[float]]:
    """A request's latency values, each under the condition its ``llmtap.*`` histogram records it
    (``MetricWriter.record``); E2E, which has no histogram of its own, for every request that has one."""
    stream = bool(tl.request and tl.request.stream)
    out: dict[str, list[float]] = {figure: [] for figure in LATENCIES}
    if stream and s.ttft is not None:  # llmtap.time_to_first_token
        out["ttft"].append(s.ttft)
        out["itl"].extend(s.itl_per_token)  # llmtap.inter_token_latency
        if s.ttfot is not None:  # llmtap.time_to_first_output_token
            out["ttfot"].append(s.ttfot)
        if s.ttst is not None:  # llmtap.time_to_second_token
            out["ttst"].append(s.ttst)
    if tl.outcome == OK and s.tpot is not None:  # llmtap.time_per_output_token
        out["tpot"].append(s.tpot)
    if s.e2e is not None:
        out["e2e"].append(s.e2e)
    return out


#: A request's outcome, SLO verdict, input, output and cache-read tokens (0 where unknown), and its own objectives'
#: outcomes (``x-slo-*`` headers: ``"ttft:met"``, ...), as ``Tally`` counts them.
Counts = tuple[str, str | None, int, int, int, tuple[str, ...]]


def counts(tl: Timeline, s: Summary) -> Counts:
    """What a request adds to a tally beside its latencies."""
    asked = tuple(f"{figure}:{outcome}" for figure, outcome in s.request_outcomes.items())
    return (tl.outcome, s.slo, s.input_tokens or 0, s.output_tokens or 0, s.cache_read_tokens or 0, asked)


#: One finished request as the window takes it, in plain values (``LiveWindow.entry``): it may come from another
#: telemetry process. Its series (route, model, shape, prompt version), its objective's fields, its ``counts``, its
#: ``samples``, when it was received and ended, and its waterfall.
Entry = tuple[
    tuple[str, str, str, str],
    tuple[Any, ...] | None,
    Counts,
    dict[str, list[float]],
    float,
    float,
    dict[str, Any],
]


@dataclass(slots=True)
class Samples:
    """One latency's values of one series in the order they came, each slot's run marked, the oldest droppable.

    ``starts`` holds, per slot that has values, the slot and the overall index of its first value; ``base`` is
    the overall index of ``values[0]``. A window starting at slot ``f`` holds every value it counts while
    ``dropped`` (the newest slot a dropped value came in) is before ``f``."""

    values: array[float] = field(default_factory=lambda: array("d"))
    starts: list[tuple[int, int]] = field(default_factory=list)
    base: int = 0
    dropped: int | None = None

    def add(self, slot: int, values: Sequence[float]) -> None:
        """Append a request's values, recorded in ``slot`` (slots only grow)."""
        if not values:
            return
        if not self.starts or self.starts[-1][0] != slot:
            self.starts.append((slot, self.base + len(self.values)))
        self.values.extend(values)

    def drop_oldest(self, n: int) -> int:
        """Forget the ``n`` oldest values (at least one); returns how many went."""
        n = min(max(n, 1), len(self.values))
        if n == 0:
            return 0
        cut = self.base + n  # the overall index of the first value kept
        # The slot of the last value dropped: the last run starting before the cut.
        i = bisect_left(self.starts, cut, key=lambda run: run[1]) - 1
        self.dropped = self.starts[i][0]
        del self.values[:n]
        self.base = cut
        # Runs wholly dropped go; a run cut in two keeps its slot, starting at the cut.
        if i + 1 < len(self.starts) and self.starts[i + 1][1] == cut:
            self.starts = self.starts[i + 1 :]
        else:
            self.starts = [(self.starts[i][0], cut), *self.starts[i + 1 :]]
        if not self.values:
            self.starts = []
        return n

    def since(self, first: int | None) -> array[float] | None:
        """A copy of the values recorded from slot ``first`` on (None: since start), in the order they came;
        None if some of them were dropped."""
        if self.dropped is not None and (first is None or self.dropped >= first):
            return None
        if first is None:
            return self.values[:]
        i = bisect_left(self.starts, first, key=lambda run: run[0])
        if i == len(self.starts):
            return array("d")
        return self.values[self.starts[i][1] - self.base :]


@dataclass(slots=True)
class Tally:
    """What one route and model did in one slot (or since start)."""

    requests: int = 0
    errors: int = 0
    cancelled: int = 0
    slo_met: int = 0
    #: Requests judged by their own objectives, by ``"figure:outcome"`` (``llmtap.objective.requests``).
    asked: dict[str, int] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    ttft: Hist = field(default_factory=Hist)
    itl: Hist = field(default_factory=Hist)
    tpot: Hist = field(default_factory=Hist)
    #: Every request's E2E (no ``llmtap.*`` histogram of its own: for E2E objectives only).
    e2e: Hist = field(default_factory=Hist)
    ttfot: Hist = field(default_factory=Hist)
    ttst: Hist = field(default_factory=Hist)

    def add_request(self, counts: Counts, values: dict[str, list[float]]) -> None:
        """Count one request exactly as ``MetricWriter.record`` records it; ``counts``: its ``counts``, ``values``:
        its ``samples``."""
        outcome, slo, input_tokens, output_tokens, cache_read_tokens, asked = counts
        self.requests += 1  # llmtap.requests
        for key in asked:
            self.asked[key] = self.asked.get(key, 0) + 1  # llmtap.objective.requests
        self.errors += outcome == ERROR
        self.cancelled += outcome == CANCELLED
        self.slo_met += slo == "met"
        for figure in LATENCIES:
            figure_values = values[figure]
            if figure_values:  # a short request has one or two of the six
                hist: Hist = getattr(self, figure)
                hist.add_many(figure_values)
        self.input_tokens += input_tokens  # llmtap.usage.input_tokens
        self.output_tokens += output_tokens  # llmtap.usage.output_tokens
        self.cache_read_tokens += cache_read_tokens  # llmtap.usage.cache_read.input_tokens

    def merge(self, other: Tally) -> None:
        """Add another tally."""
        self.requests += other.requests
        self.errors += other.errors
        self.cancelled += other.cancelled
        self.slo_met += other.slo_met
        for key, n in other.asked.items():
            self.asked[key] = self.asked.get(key, 0) + n
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cache_read_tokens += other.cache_read_tokens
        for figure in LATENCIES:
            mine: Hist = getattr(self, figure)
            mine.merge(getattr(other, figure))

    def figures(self, seconds: float, *, slo: bool, exact: dict[str, list[float] | None]) -> dict[str, Any]:
        """Counts, rates over ``seconds`` and percentiles (``exact``: each latency's values, as ``Samples.since``
        gives them), as the page shows them."""

        def per_s(n: int) -> float:
            return n / seconds if seconds > 0 else 0.0

        return {
            "requests": self.requests,
            "errors": self.errors,
            "cancelled": self.cancelled,
            "slo_met": self.slo_met if slo else None,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_tokens": self.cache_read_tokens,
            "requests_per_s": per_s(self.requests),
            "output_tokens_per_s": per_s(self.output_tokens),
            "goodput_per_s": per_s(self.slo_met) if slo else None,
            "cached_share": self.cache_read_tokens / self.input_tokens if self.input_tokens else None,
            "ttft": self.ttft.figures(exact["ttft"]),
            "itl": self.itl.figures(exact["itl"]),
            "tpot": self.tpot.figures(exact["tpot"]),
            "ttfot": self.ttfot.figures(exact["ttfot"]),
            "ttst": self.ttst.figures(exact["ttst"]),
            "request_objectives": self.request_objectives(),
        }

    def request_objectives(self) -> dict[str, dict[str, int]]:
        """The requests judged by their own objectives: ``{"ttft": {"met": 12, "violated": 3}}``."""
        out: dict[str, dict[str, int]] = {}
        for key, n in sorted(self.asked.items()):
            figure, _, outcome = key.partition(":")
            out.setdefault(figure, {})[outcome] = n
        return out


#: The figures whose objectives the page judges: those a tally keeps (every figure an objective can bound).
LIVE_FIGURES = ("ttft", "tpot", "e2e", "ttfot", "ttst")


def verdict(tally: Tally, objective: SLO | None, exact: dict[str, list[float] | None]) -> dict[str, Any] | None:
    """The objective's checks over a tally: each percentile (exact where ``exact`` holds the values, else read
    from the buckets as ``Hist.figures`` reads it) against its limit.

    ``met`` or ``missed`` by the percentile itself (the page has no intervals; ``llmtap slo`` gives them),
    ``insufficient`` below the requests the percentile needs (``llmtap.analysis.shapes.needed``), each check
    saying how many it has and needs."""
    if objective is None:
        return None
    checks = []
    for figure, limit in objective.limits().items():
        if figure not in LIVE_FIGURES:
            continue  # a figure no tally keeps
        hist: Hist = getattr(tally, figure)
        values = exact[figure]
        if values is not None:
            value = sorted_quantile(values, objective.percentile)
        else:
            value = hist.quantile(objective.percentile)
            value = None if value is None else min(max(value, hist.low), hist.high)
        if hist.count < needed(objective.percentile) or value is None:
            result = "insufficient"
        else:
            result = "met" if value <= limit else "missed"
        checks.append(
            {
                "figure": figure,
                "percentile": objective.percentile,
                "limit": limit,
                "value": value,
                "count": hist.count,
                # The requests the percentile needs to have a tail (p99: 100): the page says "8 of 100 requests".
                "needed": needed(objective.percentile),
                "exact": values is not None,
                "verdict": result,
            }
        )
    results = {c["verdict"] for c in checks}
    overall = next((v for v in ("missed", "insufficient", "met") if v in results), "none")
    return {"verdict": overall, "checks": checks}


#: ``Entry`` as this process's own requests are taken: the waterfall's ``Facts`` in place of the drawn waterfall.
_Local = tuple[
    tuple[str, str, str, str],
    tuple[Any, ...] | None,
    Counts,
    dict[str, list[float]],
    float,
    float,
    Facts,
]
#: A kept request: its slot, its series, its id, and its waterfall (drawn, or its facts until first read).
_Kept = list[Any]


def _drawn(kept: _Kept) -> dict[str, Any]:
    """A kept request's waterfall, drawn now if it was not yet (and kept drawn). Under the window's lock."""
    record = kept[3]
    if isinstance(record, dict):
        return record
    drawn = kept[3] = draw(kept[2], record)
    return drawn


@dataclass(slots=True)
class _Series:
    total: Tally = field(default_factory=Tally)
    slots: dict[int, Tally] = field(default_factory=dict)
    busy: Busy = field(default_factory=Busy)
    #: Each latency's values, for exact percentiles.
    samples: dict[str, Samples] = field(default_factory=lambda: {figure: Samples() for figure in LATENCIES})
    #: The objective the series' requests are judged by (the newest request's).
    objective: SLO | None = None
    #: ``objective``'s fields as an entry carries them: a request with the same makes none anew.
    objective_fields: tuple[Any, ...] | None = None


class Subscription:
    """One open event stream: woken (from any thread) when a request is recorded or the view closes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.event = asyncio.Event()
        self._loop = loop
        self._pending = False

    def notify(self) -> None:
        """Wake the stream's task; coalesces: at most one wake-up is queued on its loop at a time."""
        if self._pending:
            return
        self._pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            pass  # the loop is closed: the stream is gone and unsubscribes itself

    def _wake(self) -> None:
        self._pending = False
        self.event.set()


def floor_ms(value: float) -> float:
    """The lower bound, in ms, of the bucket a value falls in (``Hist.add``'s rule)."""
    i = bisect_left(DURATION_BUCKETS, value)
    return DURATION_BUCKETS[i - 1] * 1000 if i > 0 else 0.0


def _first_slot(now: float, window: float) -> int:
    """The oldest slot a window of ``window`` seconds ending now takes in (the current one counts)."""
    return math.floor(now / SLOT) - math.ceil(window / SLOT) + 1


def _slowest(row: dict[str, Any], mine: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """For each latency and percentile of a row, the kept requests (``mine``: the row's, in its window) it rests
    on, slowest first (their ids): those at the percentile or above, or, for a percentile read from buckets, in
    its bucket or above (such a reading may lie past every request in its bucket)."""
    out: dict[str, dict[str, list[int]]] = {}
    for figure in ("ttft", "tpot", "ttfot", "ttst"):
        timed = sorted((r for r in mine if r[figure] is not None), key=lambda r: r[figure], reverse=True)
        out[figure] = {}
        for q in QUANTILES:
            name = f"p{round(q * 100)}"
            value = row[figure][name]
            if value is None:
                continue
            if row[figure]["exact"]:
                # The waterfall's ms are rounded as this is: a request at the percentile stays at it.
                at = round(value * 1000, 3)
                behind = [r["id"] for r in timed if r[figure] >= at]
            else:
                behind = [r["id"] for r in timed if r[figure] > floor_ms(value)]
            out[figure][name] = behind[:SLOWEST]
    return out


class LiveWindow:
    """The recorder listener behind the live view, and the figures it serves.

    Rates divide by the seconds the window covers (what ``rate()`` over ``/metrics`` does), or, with ``busy``,
    by the seconds each series had requests in flight within it: a rate that holds while traffic pauses, as a
    benchmark's tables give it (``llmtap demo --serve``). ``skip`` leaves requests out (the demo's warm-ups).
    """

    def __init__(
        self,
        labels: Labels,
        *,
        slo: bool,
        traces: bool,
        clock: Callable[[], float] = time.monotonic,
        history: int = HISTORY,
        busy: bool = False,
        skip: Callable[[Timeline], bool] | None = None,
        budget: int = SAMPLE_BUDGET,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self._labels = labels
        self._on_drop = on_drop
        self.slo = slo
        self.traces = traces
        self.busy = busy
        self._skip = skip
        self._clock = clock
        self.started = clock()
        # The window's clock minus the requests' clock (``perf_counter``, maybe another process's), plus the
        # least delay seen between a request's end and its recording: the smallest such difference seen.
        self._lag = math.inf
        self._series: dict[tuple[str, str, str, str], _Series] = {}
        # Latency values kept over all series, and at most.
        self._kept = 0
        self._budget = budget
        # The kept requests, each with the slot it was recorded in, its series (for the requests behind a
        # percentile), its id, and its waterfall: drawn when first read, its ``facts`` until then (``_drawn``).
        self._requests: deque[_Kept] = deque(maxlen=history)
        self._seq = 0
        self._lock = threading.Lock()
        self._subscribers: set[Subscription] = set()
        self.closed = False

    # -- the recorder's worker thread ------------------------------------------------------------

    def __call__(self, tl: Timeline, s: Summary) -> None:
        """Count one finished request and keep its waterfall's facts, drawn when read (the listener; the recorder's
        thread)."""
        local = self._entry(tl, s)
        if local is not None:
            self.take(local)

    def entry(self, tl: Timeline, s: Summary) -> Entry | None:
        """What one finished request adds to the window (None: nothing), in values that can travel between
        processes: another telemetry process's requests reach the first one's window so (``take``)."""
        local = self._entry(tl, s)
        if local is None:
            return None
        key, objective, tally_counts, values, received, end, record = local
        return key, objective, tally_counts, values, received, end, draw(0, record)

    def _entry(self, tl: Timeline, s: Summary) -> _Local | None:
        """``entry``, the waterfall as its facts."""
        if tl.protocol is None:
            return None  # a plain relay: no LLM figures, and no metrics either
        if self._skip is not None and self._skip(tl):
            return None
        route, model, version = self._labels(tl, s)
        end = tl.end if tl.end is not None else tl.received
        objective = None
        if s.objective is not None:
            o = s.objective
            objective = (o.ttft, o.tpot, o.e2e, o.percentile, o.shape, o.ttfot, o.ttst)
        record = facts(tl, s, route=route, model=model, trace=self.traces)
        return ((route, model, s.shape, version), objective, counts(tl, s), samples(tl, s), tl.received, end, record)

    def take(self, entry: Entry | _Local) -> None:
        """Count one request's ``entry`` and keep its waterfall (the recorder's thread): drawn already (an entry of
        another process) or as its facts (this process's own, drawn when read)."""
        key, objective, tally_counts, values, received, end, record = entry
        now = self._clock()
        slot = math.floor(now / SLOT)
        with self._lock:
            self._lag = min(self._lag, now - end)
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series()
            # By value and type: an objective of 1 and one of 1.0 read alike in Python, not on the page.
            fields = None if objective is None else (*objective, *map(type, objective))
            if fields != series.objective_fields:
                series.objective = SLO(*objective) if objective is not None else None
                series.objective_fields = fields
            series.total.add_request(tally_counts, values)
            series.busy.add(received, end)
            tally = series.slots.get(slot)
            if tally is None:
                tally = series.slots[slot] = Tally()
                self._prune(series, slot)
            tally.add_request(tally_counts, values)
            for figure in LATENCIES:
                figure_values = values[figure]
                if figure_values:
                    series.samples[figure].add(slot, figure_values)
                    self._kept += len(figure_values)
            dropped = self._trim() if self._kept > self._budget else 0
            self._seq += 1
            if isinstance(record, dict):
                record["id"] = self._seq
            self._requests.append([slot, key, self._seq, record])
            subscribers = list(self._subscribers)
        if dropped and self._on_drop is not None:
            self._on_drop(dropped)
        for sub in subscribers:
            sub.notify()

    def _trim(self) -> int:
        """Within the budget again: the latencies holding the most values give up their oldest quarter. Returns
        how many values went."""
        dropped = 0
        while self._kept > self._budget:
            largest = max(
                (kept for series in self._series.values() for kept in series.samples.values()),
                key=lambda kept: len(kept.values),
            )
            n = largest.drop_oldest(max(len(largest.values) // 4, self._kept - self._budget))
            self._kept -= n
            dropped += n
        return dropped

    @staticmethod
    def _prune(series: _Series, slot: int) -> None:
        oldest = slot - math.ceil(HORIZON / SLOT)
        for old in [k for k in series.slots if k <= oldest]:
            del series.slots[old]

    # -- readers (any thread) --------------------------------------------------------------------

    def window_seconds(self, window: float | None, now: float | None = None) -> float:
        """The span a window really covers: from its first slot's start (or the start) to now."""
        now = self._clock() if now is None else now
        if window is None:
            return now - self.started
        return now - max(_first_slot(now, window) * SLOT, self.started)

    def snapshot(self, window: float | None) -> dict[str, Any]:
        """The figures of every route and model over the last ``window`` seconds (None: since start)."""
        now = self._clock()
        seconds = self.window_seconds(window, now)
        first = _first_slot(now, window) if window is not None else 0
        # Under the lock only what must be read there: each series' tally and copies of its values (a copy is
        # a memory copy; the sorting, which can take a while for many values, happens after the recorder's
        # thread may go on).
        taken: list[tuple[tuple[str, str, str, str], _Series, Tally, float, dict[str, array[float] | None]]] = []
        with self._lock:
            for key, series in sorted(self._series.items()):
                # A tally of its own: the recorder's thread goes on adding to the series' tallies.
                tally = Tally()
                if window is None:
                    tally.merge(series.total)
                else:
                    for k, part in series.slots.items():
                        if k >= first:
                            tally.merge(part)
                if tally.requests:
                    if self.busy:
                        # The window's start on the requests' clock; since start: all the series' busy time.
                        since = None if window is None else max(first * SLOT, self.started) - self._lag
                        rate_seconds = series.busy.seconds(since)
                    else:
                        rate_seconds = seconds
                    start = None if window is None else first
                    values = {f: kept.since(start) for f, kept in series.samples.items()}
                    taken.append((key, series, tally, rate_seconds, values))
            requests = [(kept[1], _drawn(kept)) for kept in self._requests if kept[0] >= first]
            last = self._seq
        rows: list[dict[str, Any]] = []
        for (route, model, shape, version), series, tally, rate_seconds, values in taken:
            exact = {f: None if v is None else sorted(v) for f, v in values.items()}
            figures = tally.figures(rate_seconds, slo=self.slo, exact=exact)
            row = {
                "route": route,
                "model": model,
                "shape": shape,
                "prompt_version": version or None,
                "rate_seconds": rate_seconds,
                **figures,
            }
            goal = series.objective
            row["objective"] = None if goal is None else {**goal.limits(), "percentile": goal.percentile}
            row["verdict"] = verdict(tally, goal, exact)
            mine = [r for key, r in requests if key == (route, model, shape, version)]
            row["slowest"] = _slowest(row, mine)
            rows.append(row)
        rates = "busy" if self.busy else "window"
        return {"window": window, "seconds": seconds, "last": last, "slo": self.slo, "rates": rates, "series": rows}

    def since(self, seq: int) -> list[dict[str, Any]]:
        """The kept requests recorded after ``seq``, oldest first."""
        with self._lock:
            return [_drawn(kept) for kept in self._requests if kept[2] > seq]

    def latest(self) -> int:
        """The id of the newest kept request (0: none yet)."""
        with self._lock:
            return self._requests[-1][2] if self._requests else 0

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscription:
        """A new stream's wake-up handle."""
        sub = Subscription(loop)
        with self._lock:
            self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """The stream ended."""
        with self._lock:
            self._subscribers.discard(sub)

    def close(self) -> None:
        """End every open stream now (a server waits for open responses before it stops)."""
        self.closed = True
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            sub.notify()
