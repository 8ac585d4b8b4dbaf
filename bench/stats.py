"""From raw records to the figures: what a path added to TTFT and to each chunk gap, request by request.

Client and upstream take their times on one clock (CLOCK_MONOTONIC), so for each request:

* added TTFT = (client's first content − client's start) − (upstream's first content write − upstream's arrival),
  the client's start being its send on a keep-alive connection, and the moment before its connect for a
  burst's request on a new connection (``start`` in the record);
* added gap of chunk i = (client's gap i) − (upstream's gap i), for every chunk after the first;
* merged chunks = content events that came in the same socket read as the one before, plus content
  events the upstream wrote that never reached the client as events of their own. A pair the upstream
  itself wrote less than half a gap apart (late, catching up: its core was busy) is counted apart, as
  merged by the upstream: no path keeps apart two events that leave the upstream together.

Percentiles are ``llmtap.analysis.stats.quantile``'s: linear between the closest ranks (numpy's default, and aiperf's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llmtap.analysis.stats import quantile


def percentile_ms(seconds: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of times in seconds, in ms; NaN (a missing figure) for no values."""
    value = quantile(seconds, q / 100.0)
    return math.nan if value is None else value * 1000.0


@dataclass
class PathFigures:
    """One path at one concurrency; times in ms."""

    path: str
    streams: int
    #: ``http`` or ``https``: the scheme of the upstream the path was pointed at.
    upstream: str = "http"
    #: ``staggered`` (keep-alive streams) or ``burst`` (new connections released at once).
    scenario: str = "staggered"
    requests: int = 0
    #: Requests that ended with status 200, no error, and every content chunk the upstream wrote.
    complete: int = 0
    failed: int = 0
    unmatched: int = 0
    chunks: int = 0
    seconds: float = 0.0
    chunks_per_s: float = 0.0
    ttft_ms_p50: float = math.nan
    ttft_ms_p99: float = math.nan
    added_ttft_ms_p50: float = math.nan
    added_ttft_ms_p99: float = math.nan
    added_gap_ms_p50: float = math.nan
    added_gap_ms_p99: float = math.nan
    added_gap_ms_max: float = math.nan
    merged: int = 0
    #: Pairs merged as above that the upstream wrote less than half a gap apart (not in ``merged``).
    merged_by_upstream: int = 0
    upstream_late_ms_p99: float = math.nan
    cpu_s: float | None = None
    cpu_system_share: float | None = None
    idle_cpu_ms_per_s: float | None = None
    cpu_s_per_1000_chunks: float | None = None
    rss_idle_mib: float | None = None
    rss_peak_mib: float | None = None
    rss_kib_per_stream: float | None = None
    #: CPU of the relay processes and of the telemetry process (``/proc/PID/comm``), and per 1,000 chunks.
    cpu_relay_s: float | None = None
    cpu_telemetry_s: float | None = None
    cpu_relay_s_per_1000_chunks: float | None = None
    cpu_telemetry_s_per_1000_chunks: float | None = None
    #: Processes of each role seen in the tree during the phase.
    procs: dict[str, int] = field(default_factory=dict)
    #: Relay processes' resident memory with every stream open (median of those samples) less idle, per stream.
    rss_relay_kib_per_stream: float | None = None
    #: ``llmtap_telemetry_tapes_dropped_total`` over the phase (None: the metric is absent).
    tapes_dropped: float | None = None
    client_cpu_s: float = 0.0
    #: The command that measures this figure again (``python -m bench ...``).
    command: str = ""
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, NaN as None."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def analyse(
    path: str,
    streams: int,
    client: Iterable[Mapping[str, Any]],
    upstream: Iterable[Mapping[str, Any]],
    *,
    gap: float,
) -> PathFigures:
    """Join client and upstream records by request id and compute the figures of one phase."""
    by_id = {str(r["id"]): r for r in upstream if r.get("id")}
    fig = PathFigures(path, streams)
    ttfts: list[float] = []
    added_ttft: list[float] = []
    added_gap: list[float] = []
    late: list[float] = []
    first_sent, last_end = math.inf, -math.inf
    for rec in client:
        fig.requests += 1
        first_sent, last_end = min(first_sent, rec.get("start", rec["sent"])), max(last_end, rec["end"])
        if rec.get("error") or rec.get("status") != 200:
            fig.failed += 1
            if len(fig.errors) < 5:
                fig.errors.append(str(rec.get("error") or f"status {rec.get('status')}"))
            continue
        up = by_id.get(str(rec["id"]))
        times: list[float] = rec["times"]
        if up is None or not times:
            fig.unmatched += 1
            continue
        sent: list[float] = up["sent"]
        fig.chunks += len(times)
        if not rec.get("error") and len(times) >= len(sent) > 0:
            fig.complete += 1
        ttft = times[0] - rec.get("start", rec["sent"])
        ttfts.append(ttft)
        added_ttft.append(ttft - (sent[0] - up["arrived"]))
        n = min(len(times), len(sent))
        added_gap.extend((times[i] - times[i - 1]) - (sent[i] - sent[i - 1]) for i in range(1, n))
        reads: list[int] = rec["reads"]
        together = [i for i in range(1, len(reads)) if reads[i] == reads[i - 1]]
        by_upstream = sum(1 for i in together if i < len(sent) and sent[i] - sent[i - 1] < gap / 2)
        fig.merged_by_upstream += by_upstream
        fig.merged += len(together) - by_upstream
        fig.merged += max(0, len(sent) - len(times))
        base = up["arrived"] + up["ttft"]
        late.extend(s - (base + i * gap) for i, s in enumerate(sent))
    if fig.requests:
        fig.seconds = max(last_end - first_sent, 1e-9)
        fig.chunks_per_s = fig.chunks / fig.seconds
    ms = 1000.0
    fig.ttft_ms_p50 = percentile_ms(ttfts, 50)
    fig.ttft_ms_p99 = percentile_ms(ttfts, 99)
    fig.added_ttft_ms_p50 = percentile_ms(added_ttft, 50)
    fig.added_ttft_ms_p99 = percentile_ms(added_ttft, 99)
    fig.added_gap_ms_p50 = percentile_ms(added_gap, 50)
    fig.added_gap_ms_p99 = percentile_ms(added_gap, 99)
    fig.added_gap_ms_max = max(added_gap) * ms if added_gap else math.nan
    fig.upstream_late_ms_p99 = percentile_ms(late, 99)
    return fig


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are numbers (None and NaN left out); None for none."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return quantile(kept, 0.5)


def open_streams(client: Iterable[Mapping[str, Any]], t: float) -> int:
    """How many of the requests were open (from their start to their end) at time ``t``."""
    return sum(1 for r in client if r.get("start", r["sent"]) <= t <= r["end"])


def crossing(points: Sequence[tuple[float, float]], limit: float) -> float | None:
    """The x at which y first passes ``limit``, interpolated between the two points around it.

    ``points`` are (x, y) in increasing x; None when y never passes; the first x when it already does.
    """
    for i, (x, y) in enumerate(points):
        if y > limit:
            if i == 0:
                return x
            x0, y0 = points[i - 1]
            return x0 + (x - x0) * (limit - y0) / (y - y0)
    return None
