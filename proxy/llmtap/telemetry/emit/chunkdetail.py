"""Which finished requests keep a span per chunk, decided in the proxy when the request is recorded.

A span per chunk is about 100 spans for a typical streamed answer: most backends bill per span, and a
collector that tail-samples can only drop them after they were built and shipped. The telemetry process holds
the whole request when it records it, so it decides here, for free, which requests keep their chunk spans:

- ``error`` and ``cancelled``: the request failed, or its client left;
- ``slo_missed``: it missed its route's objective (``routes[].slo``, else the global ``slo``);
- ``tail``: its time to first token or its largest chunk gap is above the ``chunk_detail_tail`` percentile of
  its route's recent requests (the last ``WINDOW`` that succeeded, once ``MIN_HISTORY`` of them were seen);
- ``sampled``: a ``chunk_detail_sample`` share of the rest, chosen by trace id (the same request is chosen
  whatever process records it, as a trace-id ratio sampler chooses).

Every other request keeps its root and phase spans, with its chunk statistics on the decode span
(``chunk_stats``). Metrics and records see every chunk of every request either way. Runs on the recorder's
worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmtap.analysis.stats import sorted_quantile
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import CANCELLED, OK, Timeline
from llmtap.config.types import TelemetrySettings
from llmtap.telemetry import semconv as sc

__all__ = ["MIN_HISTORY", "REASONS", "SUMMARY", "ChunkDetail", "chunk_stats", "largest_gap"]

#: Why a request kept its chunk spans (``llmtap.chunk.detail``); ``SUMMARY``: it did not.
REASONS = ("error", "cancelled", "slo_missed", "tail", "sampled")
SUMMARY = "summary"
#: Recent successful requests per route the tail is read from.
WINDOW = 512
#: Requests a route must have had before its tail means anything (before, no request is kept for its tail).
MIN_HISTORY = 50
#: Requests between two readings of a route's tail (a sort of ``WINDOW`` values each time).
REFRESH = 32
#: Trace ids are 128 bits; their low 64 decide the sampled share (W3C Trace Context level 2's random part).
_LOW = (1 << 64) - 1


class _Tail:
    """One route's recent time to first token and largest gap, and the thresholds read from them."""

    __slots__ = ("gap", "gaps", "seen", "ttft", "ttfts")

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.gaps: list[float] = []
        self.seen = 0
        self.ttft = self.gap = float("inf")

    def observe(self, ttft: float, gap: float, q: float) -> None:
        """Add one request's values (a ring of ``WINDOW``), reading the thresholds again every ``REFRESH``."""
        if len(self.ttfts) < WINDOW:
            self.ttfts.append(ttft)
            self.gaps.append(gap)
        else:
            self.ttfts[self.seen % WINDOW] = ttft
            self.gaps[self.seen % WINDOW] = gap
        self.seen += 1
        if self.seen >= MIN_HISTORY and (self.seen == MIN_HISTORY or self.seen % REFRESH == 0):
            # Never None here: the ring holds MIN_HISTORY values at least.
            self.ttft = sorted_quantile(sorted(self.ttfts), q) or 0.0
            self.gap = sorted_quantile(sorted(self.gaps), q) or 0.0


class ChunkDetail:
    """Decides, at each request's end, whether it keeps its chunk spans; the tails it reads are per route."""

    def __init__(self, telemetry: TelemetrySettings) -> None:
        self.sample = telemetry.chunk_detail_sample
        self.quantile = telemetry.chunk_detail_tail
        # Below this, a trace id's low 64 bits choose the request for the sampled share.
        self._bound = round(self.sample * (1 << 64))
        self._tails: dict[str, _Tail] = {}

    def decide(self, tl: Timeline, s: Summary, largest_gap: float) -> str | None:
        """The reason ``tl`` keeps its chunk spans (``REASONS``), or None; every request is seen, for the tail."""
        if tl.outcome == CANCELLED:
            return "cancelled"
        if tl.outcome != OK:
            return "error"
        tail = self._tails.get(tl.route)
        if tail is None:
            tail = self._tails[tl.route] = _Tail()
        ttft = s.ttft if s.ttft is not None else 0.0
        slow = ttft > tail.ttft or largest_gap > tail.gap
        tail.observe(ttft, largest_gap, self.quantile)
        if s.slo == "missed":
            return "slo_missed"
        if slow:
            return "tail"
        if self._bound and tl.trace_id is not None and (int(tl.trace_id, 16) & _LOW) < self._bound:
            return "sampled"
        return None


def chunk_stats(s: Summary, times: Sequence[float]) -> dict[str, Any]:
    """The decode span's chunk statistics: chunk gaps and inter-token latency (p50, p99), the largest gap and
    where it ended (chunk index, seconds after the first content chunk). Empty for fewer than two chunks."""
    gaps = s.gaps
    if not gaps or len(times) < 2:
        return {}
    largest = max(range(len(gaps)), key=gaps.__getitem__)
    attrs: dict[str, Any] = {
        sc.DECODE_GAP_P50: s.gap_p50,
        sc.DECODE_GAP_P99: s.gap_p99,
        sc.DECODE_GAP_MAX: gaps[largest],
        # gaps[i] is the gap that chunk i + 1 ended (``summarize``: from the first content chunk on).
        sc.DECODE_GAP_MAX_INDEX: largest + 1,
        sc.DECODE_GAP_MAX_AT: times[min(largest + 1, len(times) - 1)] - times[0],
    }
    if s.itl_p50 is not None:
        attrs[sc.DECODE_ITL_P50] = s.itl_p50
        attrs[sc.DECODE_ITL_P99] = s.itl_p99
    return attrs


def largest_gap(s: Summary) -> float:
    """The request's largest chunk gap (0 for fewer than two chunks)."""
    return max(s.gaps) if s.gaps else 0.0
