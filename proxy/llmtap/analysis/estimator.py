"""Queue against prefill inside the upstream, estimated from outside (DESIGN, "Estimating queue against prefill").

A server that reports neither leaves the proxy one figure: the upstream TTFT, from sending the request
to its first content chunk, which is the server's queueing plus its prefill (plus the hop). Two
estimates split it, and every value they give is marked ``estimated``:

- **Slots.** When the route says how many sequences the server runs at once (vLLM's
  ``--max-num-seqs``, TGI's ``--max-concurrent-requests``), a first-come-first-served server admits a
  request once fewer than that many of the requests sent before it are unfinished. The proxy sees
  every request it sends and when each one ends, so it can replay the server's admissions: a request
  sent with ``ahead`` requests in flight and ``slots`` slots waits for the ``ahead - slots + 1``-th of
  them to end. Prefill is then the rest of the upstream TTFT. Requests are ordered by when each was
  written onto its upstream connection, on the one monotonic clock every process of the machine reads, and
  ``ahead`` counts every relay's requests in flight at that moment (``llmtap.relay.shared``): with
  ``--workers N`` each relay sends some of an upstream's. Written, not begun: a request that had to open
  a connection first reaches the server after one begun a few milliseconds later on a connection already
  open (a CI run's burst over two relays had one begin 1 ms before another and arrive 4.5 ms after it,
  and the replay gave the later one's slot to it).
- **Envelope.** Otherwise, the unloaded TTFT of each upstream and model is learned as a line in
  uncached input tokens, ``base + tokens / rate``, from the lower envelope of what requests sent to an
  idle upstream saw (or with the rate from config). A request's prefill is that line at its uncached
  tokens; whatever its upstream TTFT has beyond it is queueing.

All state is bounded: a fixed number of token bins per upstream and model, a capped number of models,
and a bounded log of recent completions per upstream. Runs on the recorder's worker thread.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort_right
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, TypeAlias

from llmtap.analysis.timeline import Timeline
from llmtap.wire.lessons import Decoding, Ended, Idle

__all__ = ["ESTIMATED", "MAX_COMPLETIONS", "MAX_MODELS", "Envelope", "Estimator", "Lesson", "QueuePrefill", "SlotLog"]

ESTIMATED = "estimated"

#: Token bins are half-octaves: 0, 1, 2-3, ... up to 2^24 tokens; enough resolution for a line.
_BINS = 50
#: Samples kept per bin; the lower envelope is the minimum over them.
_PER_BIN = 16
#: Upstream-and-model pairs whose envelope is kept; the least recently used is forgotten first.
MAX_MODELS = 64
#: Completions remembered per upstream, for the slot replay.
MAX_COMPLETIONS = 4096


@dataclass(frozen=True, slots=True)
class QueuePrefill:
    """The upstream TTFT split into queueing inside the server and prefill; both estimated."""

    queue: float
    prefill: float
    method: str  # "slots" or "envelope"


def _bin(tokens: int) -> int:
    return min(int(2 * math.log2(tokens + 1)), _BINS - 1)


class Envelope:
    """The unloaded TTFT of one upstream and model as ``base + tokens / rate``, from its lower envelope."""

    def __init__(self, rate: float | None = None) -> None:
        self.fixed_rate = rate
        self._bins: list[deque[tuple[int, float]]] = [deque(maxlen=_PER_BIN) for _ in range(_BINS)]
        self._line: tuple[float, float] | None = None  # (base seconds, seconds per token)
        self._dirty = False

    def add(self, tokens: int, ttft: float) -> None:
        """One request that found the upstream idle: its uncached input tokens and upstream TTFT."""
        self._bins[_bin(tokens)].append((tokens, ttft))
        self._dirty = True

    @property
    def samples(self) -> int:
        """How many samples the envelope holds now."""
        return sum(len(b) for b in self._bins)

    def line(self) -> tuple[float, float] | None:
        """``(base, seconds_per_token)``, or None while the samples cannot support a line."""
        if self._dirty:
            self._line = self._fit()
            self._dirty = False
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        points = sorted(p for b in self._bins for p in b)
        if not points:
            return None
        if self.fixed_rate is not None:
            per_token = 1.0 / self.fixed_rate
            return max(min(t - n * per_token for n, t in points), 0.0), per_token
        hull = _lower_hull(points)
        if len(hull) < 2:
            return None
        # Queueing and interference only ever add time, so the line lies under every point. Of those
        # lines, the one closest to the points overall (least summed distance) is the lower hull's
        # edge over the mean token count.
        mean = sum(p[0] for p in points) / len(points)
        edge = next((i for i in range(1, len(hull)) if hull[i][0] >= mean), len(hull) - 1)
        (x0, t0), (x1, t1) = hull[edge - 1], hull[edge]
        slope = max((t1 - t0) / (x1 - x0), 0.0)
        return max(min(t - x * slope for x, t in points), 0.0), slope

    def prefill(self, tokens: int) -> float | None:
        """The unloaded prefill of ``tokens`` uncached input tokens, or None while unknown."""
        line = self.line()
        if line is None:
            return None
        return line[0] + tokens * line[1]


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull of points sorted by x, one point per distinct x."""
    hull: list[tuple[int, float]] = []
    for p in points:
        if hull and hull[-1][0] == p[0]:
            continue  # sorted: the first point at each x is its lowest
        while len(hull) >= 2:
            (ax, at), (bx, bt) = hull[-2], hull[-1]
            # Drop b when it lies on or above the segment from a to p.
            if (bt - at) * (p[0] - ax) >= (p[1] - at) * (bx - ax):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


class SlotLog:
    """When recent requests to one upstream ended, to replay a slot-limited server's admissions.

    Both logs are kept in the order of the requests' ends, however late one is told (a sibling telemetry
    process's request, ``Estimator.learn``, may come after hundreds that ended later): each is found by bisection,
    and a full log lets its oldest go.
    """

    def __init__(self, maxlen: int = MAX_COMPLETIONS) -> None:
        self.maxlen = maxlen
        # (sent, end) of each request, by end time.
        self._ends: list[tuple[float, float]] = []
        # (first content, end) of the same requests, by end: when each was decoding, so held in the server's batch.
        self._decoding: list[tuple[float, float]] = []
        #: The most requests seen decoding at one moment: never more than the server's slots.
        self.decoding_peak = 0

    def decoding(self, first: float, end: float, *, count: bool = True) -> None:
        """A request that streamed from ``first`` to ``end``: the peak rises to how many (itself too) were
        decoding as it began (``count``; a request another telemetry process recorded is only logged, so the
        peak is taken where this one's requests began: a floor all the same, and a walk per request saved).

        A request between its first content chunk and its end holds one of the server's slots, so this is a
        floor under the slot count that llmtap's own clock gives, as soon as two requests overlap; the
        server's gauges (``llmtap.analysis.slots``) may be sampled too seldom to catch that. Only requests
        already logged count (one told later misses this overlap, which only keeps the floor lower).
        """
        log = self._decoding
        if count:
            together = 1 + sum(1 for f, _ in log[bisect_left(log, first, key=_end) :] if f <= first)
            self.decoding_peak = max(self.decoding_peak, together)
        _insert(log, (first, end), self.maxlen)

    def add(self, sent: float, end: float) -> None:
        """A request to this upstream, sent at ``sent``, ended (its slot is free again)."""
        _insert(self._ends, (sent, end), self.maxlen)

    def admitted(self, sent: float, ahead: int, slots: int, first: float) -> float | None:
        """When the server admitted the request sent at ``sent``, or None when the log cannot tell.

        ``ahead`` requests were in flight when it was sent; it is admitted once at most ``slots - 1``
        of them are unfinished, so at the end of the ``ahead - slots + 1``-th of them. An answer
        after the request's own first content chunk means the server has more slots than configured
        or admits out of order: the log cannot tell then.

        ``ahead`` is at least the logged requests sent before it and ended after: two relays that send within
        microseconds of each other may each count before the other's request is counted (a CI run's burst over
        two relays put a request at 6 ahead where the log held 7, and its queue 64 ms short).
        """
        log = self._ends
        # The ends after it was sent, in order, of the requests sent before it.
        ends = [end for other, end in log[bisect_right(log, sent, key=_end) :] if other < sent]
        ahead = max(ahead, len(ends))
        if ahead < slots:
            return sent
        needed = ahead - slots + 1
        if len(ends) < needed:
            return None
        at = ends[needed - 1]
        return at if at <= first else None


def _end(item: tuple[Any, float]) -> float:
    return item[1]


def _insert(log: list[tuple[Any, float]], item: tuple[Any, float], maxlen: int) -> None:
    """Put ``item`` into ``log`` in the order of its end (after equal ones); a full log lets its oldest go first,
    and takes nothing older than all it keeps."""
    if len(log) >= maxlen:
        if item[1] < log[0][1]:
            return
        del log[0]
    if not log or log[-1][1] <= item[1]:
        log.append(item)
    else:
        insort_right(log, item, key=_end)


@dataclass(slots=True)
class _Upstream:
    log: SlotLog
    envelopes: OrderedDict[str, Envelope]


#: What a request taught the estimator, as ``Estimator.learned`` holds it for the other telemetry processes (named
#: lessons, ``llmtap.wire.lessons``: they travel encoded in ``llmtap.wire.messages.Facts``).
Lesson: TypeAlias = Decoding | Ended | Idle


class Estimator:
    """Bounded per-upstream state for splitting upstream TTFT; one per recorder, used on its thread.

    Where several telemetry processes share an upstream's requests (``llmtap.telemetry.fleet.siblings``), ``learned``
    is a list: each lesson a request taught goes there too, and the other processes ``learn`` it, so every
    process's slot log and envelopes hold all the upstream's requests.
    """

    def __init__(self) -> None:
        self._upstreams: dict[str, _Upstream] = {}
        self._models = 0
        #: Lessons for the other processes, when there are any (None: nobody to tell).
        self.learned: list[Lesson] | None = None

    def _upstream(self, key: str) -> _Upstream:
        up = self._upstreams.get(key)
        if up is None:
            up = self._upstreams[key] = _Upstream(SlotLog(), OrderedDict())
        return up

    def decoding_peak(self, tl: Timeline) -> int:
        """Record ``tl``'s decode (first content to end) and return the most requests to its upstream seen
        decoding at once (``SlotLog.decoding``); 0 when nothing was timed yet."""
        up = self._upstream(tl.upstream)
        if tl.first_content is not None and tl.end is not None:
            up.log.decoding(tl.first_content, tl.end)
            if self.learned is not None:
                self.learned.append(Decoding(tl.upstream, tl.first_content, tl.end))
        return up.log.decoding_peak

    def learn(self, lesson: Lesson) -> None:
        """What a request another telemetry process recorded taught its estimator (``learned``).

        Raises ``ValueError`` for a lesson this build cannot read.
        """
        if type(lesson) is Decoding:
            self._upstream(lesson.upstream).log.decoding(float(lesson.first), float(lesson.end), count=False)
        elif type(lesson) is Ended:
            self._upstream(lesson.upstream).log.add(float(lesson.written), float(lesson.end))
        elif type(lesson) is Idle:
            rate = None if lesson.rate is None else float(lesson.rate)
            self.envelope(lesson.upstream, lesson.model, rate).add(int(lesson.tokens), float(lesson.ttft))
        else:
            raise ValueError(f"not a lesson of the estimator: {type(lesson).__name__}")

    def envelope(self, upstream: str, model: str, rate: float | None = None) -> Envelope:
        """The envelope of one upstream and model, created on first use; least recently used forgotten."""
        up = self._upstream(upstream)
        env = up.envelopes.get(model)
        if env is not None:
            up.envelopes.move_to_end(model)
            return env
        if self._models >= MAX_MODELS:
            self._forget_one()
        env = up.envelopes[model] = Envelope(rate)
        self._models += 1
        return env

    def _forget_one(self) -> None:
        # The upstream with the most models gives up its least recently used one.
        up = max(self._upstreams.values(), key=lambda u: len(u.envelopes))
        up.envelopes.popitem(last=False)
        self._models -= 1

    @property
    def models(self) -> int:
        """Envelopes held, across upstreams (never more than ``MAX_MODELS``)."""
        return self._models

    def observe(
        self,
        tl: Timeline,
        uncached_tokens: int | None,
        *,
        slots: int | None,
        rate: float | None,
    ) -> QueuePrefill | None:
        """Learn from one finished request and split its upstream TTFT; None when it cannot be split.

        Must be called for every request that reached the upstream, in the order they ended, so the
        slot replay sees every slot that freed.
        """
        if tl.sent is None or tl.upstream_seq is None:
            return None
        up = self._upstream(tl.upstream)
        # Where the replay puts the request: as it went onto the wire, its connect behind it.
        written = tl.written if tl.written is not None else tl.sent
        if tl.end is not None:
            up.log.add(written, tl.end)
            if self.learned is not None:
                self.learned.append(Ended(tl.upstream, written, tl.end))
        first = tl.first_content
        if first is None or uncached_tokens is None:
            return None
        ttft = first - tl.sent
        model = tl.response_model or (tl.request.model if tl.request and tl.request.model else "_unknown")
        env = self.envelope(tl.upstream, model, rate)
        idle = tl.upstream_ahead == 0
        split: QueuePrefill | None = None
        if slots is not None:
            admitted = up.log.admitted(written, tl.upstream_ahead, slots, first)
            if admitted is not None:
                # The connect is the hop's, not the server's line: it stays with prefill, as when nothing queued.
                queue = min(max(admitted - written, 0.0), ttft)
                split = QueuePrefill(queue, ttft - queue, "slots")
        if split is None:
            predicted = env.prefill(uncached_tokens)
            if predicted is not None:
                prefill = min(predicted, ttft)
                split = QueuePrefill(ttft - prefill, prefill, "envelope")
        if idle:
            env.add(uncached_tokens, ttft)
            if self.learned is not None:
                self.learned.append(Idle(tl.upstream, model, uncached_tokens, ttft, rate))
        return split
