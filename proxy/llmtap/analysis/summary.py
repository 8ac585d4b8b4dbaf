"""Derived figures of one request (TTFT, chunk gaps, TPOT, tokens and their sources, SLO outcome).

Pure functions over a finished ``Timeline``; the recorder, the demo and request records all read the
same ``Summary``, so every consumer agrees on what TTFT or TPOT means (DESIGN, "Timing definitions").
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from llmtap.analysis import tokens
from llmtap.analysis.cost import Cost
from llmtap.analysis.estimator import ESTIMATED, Estimator, QueuePrefill
from llmtap.analysis.objectives import judge_request
from llmtap.analysis.shapes import classify, configured_slo, objective
from llmtap.analysis.slots import CONFIGURED, Slots
from llmtap.analysis.stats import sorted_quantile
from llmtap.analysis.timeline import OK, Timeline
from llmtap.config.types import DEFAULT_SHAPES, OTHER_SHAPE, SLO, Route, Shape
from llmtap.providers.timing import validate
from llmtap.types import ServerTiming

__all__ = [
    "MAX_SAMPLES",
    "PROXY",
    "SERVER",
    "UPSTREAM_TTFT",
    "USAGE",
    "Summary",
    "adopt_server_timing",
    "apportion",
    "drift_possible",
    "first_output_and_second_token",
    "input_size_class",
    "itl_samples",
    "proxy_added",
    "reached_model",
    "settle",
    "slo_outcome",
    "spread",
    "summarize",
]

USAGE = "usage"
PROXY = "proxy"
SERVER = "server"
# Prefill when the server says nothing: request sent upstream to first content chunk. It includes any
# queueing inside the server, and says so.
UPSTREAM_TTFT = "upstream_ttft"

#: Samples one request gives each per-chunk and per-token histogram at most. Past it they are spread evenly
#: over the stream: its distribution stays, and its cost stays bounded (a histogram sample costs tens of
#: microseconds; a stream of a million tokens would hold the telemetry process for half a minute).
MAX_SAMPLES = 8192

_SIZE_CLASSES = ((256, "le_256"), (1024, "le_1k"), (4096, "le_4k"), (16384, "le_16k"), (65536, "le_64k"))


@dataclass(slots=True)
class Summary:
    """Every figure the telemetry reports about one request, in seconds and tokens."""

    ttft: float | None = None
    #: Time to the first output token: to the first chunk of the answer itself, after any reasoning (a reasoning
    #: model's thinking arrives first and ends TTFT; AIPerf's and guidellm's TTFOT). Equals TTFT without reasoning.
    ttfot: float | None = None
    #: Time to the second token: the first content chunk to the second (AIPerf's TTST): the first decode step.
    ttst: float | None = None
    ttfb: float | None = None
    upstream_ttft: float | None = None
    e2e: float | None = None
    decode: float | None = None
    tpot: float | None = None
    queue: float | None = None  # the proxy's own queue plus the upstream's
    queue_source: str = PROXY  # the upstream part's source when there is one
    proxy_queue: float | None = None
    upstream_queue: float | None = None
    upstream_queue_source: str | None = None
    prefill: float | None = None
    prefill_source: str = UPSTREAM_TTFT
    #: The server's own decode time, when it reported one (``decode`` is always the proxy's measurement).
    server_decode: float | None = None
    #: The upstream TTFT of a stream that the server's own queue and prefill, both reported, leave out: its
    #: request handling before its queue, handing out its first token, the network. Its own part: never
    #: folded into queue or prefill, which stay the server's figures.
    upstream_unattributed: float | None = None
    #: The upstream's slot count the estimator replayed with (configured or learned), when it had one.
    slots: Slots | None = None
    gaps: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_tokens_source: str = ""
    input_tokens: int | None = None
    input_source: str = ""
    output_tokens: int | None = None
    output_source: str = ""
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None
    input_drift: float | None = None
    output_drift: float | None = None
    input_size: str = "unknown"
    #: The request's shape class (``llmtap.analysis.shapes``), from its input and output tokens.
    shape: str = OTHER_SHAPE
    slo: str = "none"
    #: The objective ``slo`` judged the request by (its route's for its shape, else the global one).
    objective: SLO | None = None
    #: The request's own objectives judged (``llmtap.analysis.objectives``): figure to ``met`` or ``violated``.
    request_outcomes: dict[str, str] = field(default_factory=dict)
    #: Server timing fields ignored as malformed or absurd: the relay's (headers), the provider's and validation's.
    rejected_timings: list[str] = field(default_factory=list)
    #: ``llmtap.cache.class`` of the prompt-cache diagnosis, when one was made (``llmtap.analysis.finish``).
    cache_class: str | None = None
    #: What the request cost (``llmtap.analysis.cost``), when the request was priced (``llmtap.analysis.finish``).
    cost: Cost | None = None
    #: The proxy's own time in the user's TTFT (``proxy_added``), once the request was sent upstream.
    proxy_added: float | None = None

    #: The figures the emitters read, made here once so that they only read (``settle``): the chunk gaps a
    #: histogram records (all, or ``MAX_SAMPLES`` spread evenly over them), their p50, p95 and p99.
    gap_samples: list[float] = field(default_factory=list)
    gap_p50: float | None = None
    gap_p95: float | None = None
    gap_p99: float | None = None
    #: Each chunk gap divided over the tokens its chunk carried, one sample per token (``itl_samples``), and
    #: their p50 and p99.
    itl_per_token: list[float] = field(default_factory=list)
    itl_p50: float | None = None
    itl_p99: float | None = None
    #: The relay's delay of each read that a histogram records (all, or ``MAX_SAMPLES`` spread evenly over them),
    #: and their p99.
    relay_delay_samples: list[float] = field(default_factory=list)
    relay_delay_p99: float | None = None
    #: Whether the request reached the model (``reached_model``).
    reached_model: bool = False


def itl_samples(gaps: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Each chunk gap divided over the tokens its chunk carried, one sample per token; past ``MAX_SAMPLES``
    tokens, the samples of tokens spread evenly over the stream (usage may claim millions)."""
    per_chunk = [(gap / n, n) for gap, n in zip(gaps, chunk_tokens[1:], strict=False) if n > 0]
    total = sum(n for _, n in per_chunk)
    if total <= MAX_SAMPLES:
        return [itl for itl, n in per_chunk for _ in range(n)]
    ends = list(accumulate(n for _, n in per_chunk))
    step = total / MAX_SAMPLES
    return [per_chunk[bisect_right(ends, int(k * step))][0] for k in range(MAX_SAMPLES)]


def settle(tl: Timeline, s: Summary) -> None:
    """Fill in the samples and quantiles the emitters read, once per request: the emitters then call nothing of
    the analysis (each of them sorted or spread the same samples again before)."""
    gaps = s.gaps
    if gaps:
        s.gap_samples = list(spread(gaps)) if len(gaps) > MAX_SAMPLES else gaps
        ordered = sorted(gaps)
        s.gap_p50 = sorted_quantile(ordered, 0.5)
        s.gap_p95 = sorted_quantile(ordered, 0.95)
        s.gap_p99 = sorted_quantile(ordered, 0.99)
        s.itl_per_token = itl = itl_samples(gaps, s.chunk_tokens)
        if itl:
            ordered = sorted(itl)
            s.itl_p50 = sorted_quantile(ordered, 0.5)
            s.itl_p99 = sorted_quantile(ordered, 0.99)
    if len(tl.relay_delays) == 1:
        # One read (a short answer, whole): its delay is the sample and every quantile of it.
        delay = tl.relay_delays[0]
        s.relay_delay_samples, s.relay_delay_p99 = [delay], delay
    elif tl.relay_delays:
        s.relay_delay_samples = delays = list(spread(tl.relay_delays))
        s.relay_delay_p99 = sorted_quantile(sorted(delays), 0.99)
    s.reached_model = reached_model(tl)


def input_size_class(n: int | None) -> str:
    """A bounded label for the prompt's size: the request shape metrics are split by."""
    if n is None:
        return "unknown"
    for limit, label in _SIZE_CLASSES:
        if n <= limit:
            return label
    return "gt_64k"


def apportion(total: int, weights: list[int]) -> list[int]:
    """Split ``total`` tokens over chunks in proportion to ``weights`` (largest remainder), >= 1 each if possible."""
    k = len(weights)
    if k == 0:
        return []
    w = [max(x, 0) for x in weights]
    wsum = sum(w)
    if wsum == 0:
        w, wsum = [1] * k, k
    shares = [total * x / wsum for x in w]
    out = [int(s) for s in shares]
    left = total - sum(out)
    order = sorted(range(k), key=lambda i: shares[i] - out[i], reverse=True)
    for i in order[:left]:
        out[i] += 1
    if total >= k:
        # Every content chunk carried at least one token: give the empty ones one, taken from the largest.
        empty = [i for i in range(k) if out[i] == 0]
        if empty:
            largest = [(-n, i) for i, n in enumerate(out) if n > 1]
            heapq.heapify(largest)
            for i in empty:
                n, j = heapq.heappop(largest)
                out[j] -= 1
                out[i] = 1
                if -n - 1 > 1:
                    heapq.heappush(largest, (n + 1, j))
    return out


def _drift(counted: int, reported: int | None) -> float | None:
    if reported is None or reported <= 0:
        return None
    return (counted - reported) / reported


def proxy_added(tl: Timeline) -> float:
    """The proxy's own time in the user's TTFT: from the request's first byte to its send upstream (less the
    admission line, a measured queue of its own), plus from the first content's arrival to its hand-over
    to the client. A saturated proxy shows here, in its own numbers."""
    start = tl.admitted if tl.admitted is not None else tl.received
    added = max((tl.sent or start) - start, 0.0)
    if tl.admitted is not None and tl.body_read is not None:
        added += max(tl.body_read - tl.received, 0.0)
    if tl.first_content is not None and tl.first_content_delivered is not None:
        added += max(tl.first_content_delivered - tl.first_content, 0.0)
    return added


def spread(samples: Sequence[float]) -> Sequence[float]:
    """All of ``samples``, or ``MAX_SAMPLES`` of them spread evenly (a stream of a million reads would hold the
    telemetry process for half a minute, at tens of microseconds a histogram sample)."""
    if len(samples) <= MAX_SAMPLES:
        return samples
    step = len(samples) / MAX_SAMPLES
    return [samples[int(k * step)] for k in range(MAX_SAMPLES)]


def drift_possible(tl: Timeline) -> bool:
    """Whether ``summarize`` can measure tiktoken's drift on ``tl``: usage reports the input and there is a prompt,
    or it reports the output and there is generated text."""
    usage, req = tl.usage, tl.request
    if usage is None:
        return False
    if usage.input_tokens is not None and req is not None and req.prompt_text:
        return True
    return usage.output_tokens is not None and tl.output is not None


def summarize(
    tl: Timeline,
    slo: SLO | None = None,
    *,
    estimator: Estimator | None = None,
    route: Route | None = None,
    shapes: Sequence[Shape] = DEFAULT_SHAPES,
    slots: Slots | None = None,
    drift: bool = True,
) -> Summary:
    """Compute the summary; counts tokens with tiktoken, so call it off the event loop.

    With an ``estimator``, call it for every request in the order they end (it replays admissions).
    ``slots``: the upstream's slot count as learned, used when the route configures none.
    ``drift``: where usage reports the input or the output, count the prompt or the whole output anyway to
    measure tiktoken's drift from it (a whole prompt's count, about 1 ms for 6,000 tokens, and the output's, 0.1 ms
    for 100 tokens: the token figures do not need them, and the caller may ask for them on a share of requests).
    """
    s = Summary(rejected_timings=list(tl.rejected_timings))
    # A non-streamed answer arrives whole: its "first chunk" is the whole body, so it has no TTFT (the
    # conventions' time_to_first_chunk "SHOULD NOT be reported" for it). Its E2E is its latency.
    streamed = bool(tl.request is not None and tl.request.stream)
    if tl.first_content is not None and streamed:
        # As the client sees it: until the first content was handed to its socket, when the relay knows.
        shown = tl.first_content_delivered if tl.first_content_delivered is not None else tl.first_content
        s.ttft = max(shown, tl.first_content) - tl.received
        if tl.sent is not None:
            s.upstream_ttft = tl.first_content - tl.sent
    first_output_and_second_token(tl, s, streamed)
    if tl.first_byte is not None:
        s.ttfb = tl.first_byte - tl.received
    if tl.sent is not None:
        s.proxy_added = proxy_added(tl)
    if tl.end is not None:
        s.e2e = tl.end - tl.received
    times = tl.chunk_times
    if len(times) > 1:  # else none: a whole body, or a stream of one chunk
        s.gaps = [times[i] - times[i - 1] for i in range(1, len(times))]
    if tl.first_content is not None and tl.last_content is not None:
        s.decode = tl.last_content - tl.first_content

    # Tokens: upstream usage is the truth; tiktoken fills in what it cannot tell, counted as the content came.
    req = tl.request
    enc = tokens.encoding_for_model(tl.response_model or (req.model if req else None))
    src = tokens.source(enc)
    out = tl.output
    counted_chunks = list(tl.chunk_tokens)
    usage = tl.usage
    reported_out = usage is not None and usage.output_tokens is not None
    # The whole output as one string: the output's count where usage does not report it, else the drift's only.
    counted_out = out.tokens() if out is not None and (drift or not reported_out) else 0
    # Past the count limit (``timeline.COUNT_CHARS``) the output's count is an estimate, and says so.
    if out is None:
        out_src = src
    else:
        out_src = ESTIMATED if out.estimated else tokens.source(out.encoding)
    if usage is not None and usage.output_tokens is not None:
        s.output_tokens, s.output_source = usage.output_tokens, USAGE
        if drift and out is not None and not out.estimated:
            s.output_drift = _drift(counted_out, usage.output_tokens)
        s.chunk_tokens = apportion(usage.output_tokens, counted_chunks)
        s.chunk_tokens_source = f"{USAGE}+{out_src}"
    elif tl.chunk_times or tl.outcome == OK:
        s.output_tokens, s.output_source = counted_out, out_src
        s.chunk_tokens, s.chunk_tokens_source = counted_chunks, out_src
    prompt = req.prompt_text if req else ""
    if usage is not None and usage.input_tokens is not None:
        s.input_tokens, s.input_source = usage.input_tokens, USAGE
        if drift and prompt:
            s.input_drift = _drift(tokens.count(prompt, enc), usage.input_tokens)
    elif prompt and reached_model(tl):
        s.input_tokens, s.input_source = tokens.count(prompt, enc), src
    if usage is not None:
        s.cache_read_tokens = usage.cache_read_tokens
        s.cache_write_tokens = usage.cache_write_tokens
        s.reasoning_tokens = usage.reasoning_tokens
    s.input_size = input_size_class(s.input_tokens)
    _phases(tl, s, estimator, route, slots)
    if s.output_tokens is not None and s.output_tokens > 1 and s.decode is not None and len(tl.chunk_times) > 1:
        # Only where a decode was timed: two content chunks or more (a whole body arrives as one).
        s.tpot = s.decode / (s.output_tokens - 1)
    s.shape = classify(shapes, s.input_tokens, s.output_tokens)
    s.objective = objective(route, s.shape, slo)
    s.slo = slo_outcome(tl, s, s.objective)
    s.request_outcomes = judge_request(
        tl.request_objective, ok=tl.outcome == OK, streamed=streamed, ttft=s.ttft, tpot=s.tpot
    )
    settle(tl, s)
    return s


def first_output_and_second_token(tl: Timeline, s: Summary, streamed: bool) -> None:
    """TTFOT and TTST of a stream (a whole body has neither, as it has no TTFT). TTFOT is TTFT when the first
    content was answer content; after reasoning it is the answer's first chunk's arrival. TTST is the gap between
    the first two content chunks, reasoning or not, as AIPerf reads it: a first chunk of several tokens brought the
    second token with it, and TTST then times the chunk after it, as the client sees it."""
    if not streamed or s.ttft is None:
        return
    first, output = tl.first_content, tl.first_output
    if output is not None:
        s.ttfot = s.ttft if output == first else output - tl.received
    times = tl.chunk_times
    if len(times) > 1:
        s.ttst = times[1] - times[0]


def reached_model(tl: Timeline) -> bool:
    """True unless the request never reached the model: refused by llmtap (never sent) or by the upstream
    (an error status). Such a request processed no input, so none is counted for it."""
    return tl.sent is not None and tl.status_code is not None and tl.status_code < 400


def _phases(tl: Timeline, s: Summary, estimator: Estimator | None, route: Route | None, learned: Slots | None) -> None:
    """Queue and prefill, from the best source each: server-reported, then measured, then estimated."""
    if tl.admitted is not None and tl.body_read is not None:
        s.proxy_queue = max(tl.admitted - tl.body_read, 0.0)
    uncached = None if s.input_tokens is None else max(s.input_tokens - (s.cache_read_tokens or 0), 0)
    split = None
    if estimator is not None:
        # Always observed, even when the server reports its timings: the slot replay needs every end.
        configured = route.server_slots if route is not None else None
        peak = estimator.decoding_peak(tl)
        if configured is None and learned is not None and peak > learned.slots:
            # The gauges' peak, raised to the most requests llmtap saw decoding at once (a floor as well; not
            # confirmed by the gauges at that count, so no confidence).
            learned = Slots(peak, learned.source, 0.0)
        s.slots = Slots(configured, CONFIGURED, 1.0) if configured is not None else learned
        rate = route.prefill_rate if route is not None else None
        split = estimator.observe(tl, uncached, slots=s.slots.slots if s.slots else None, rate=rate)
    _server_phases(tl, s, split)


def adopt_server_timing(tl: Timeline, s: Summary, timing: ServerTiming) -> None:
    """The server's own report of the request's phases (its span), over the estimate ``s`` holds.

    Only where the stream itself reported no phase; checked like every server timing (``validate``).
    """
    if tl.server_timing is not None and (tl.server_timing.queue is not None or tl.server_timing.prefill is not None):
        return
    # What the estimate said stands in for any phase the check refuses.
    estimate = None
    if s.prefill_source == ESTIMATED and s.prefill is not None and s.upstream_queue is not None:
        estimate = QueuePrefill(s.upstream_queue, s.prefill, "estimate")
    tl.server_timing = timing
    s.upstream_queue = s.upstream_queue_source = None
    s.prefill, s.prefill_source = None, UPSTREAM_TTFT
    _server_phases(tl, s, estimate)


def _server_phases(tl: Timeline, s: Summary, split: QueuePrefill | None) -> None:
    st = tl.server_timing
    if st is not None:
        # Wrong types, negative or absurd values (a queue longer than the request) are dropped and
        # counted; the estimate stands in for them.
        elapsed = (tl.end - tl.sent) if tl.end is not None and tl.sent is not None else math.inf
        st, _ = validate(st, elapsed)
        s.rejected_timings.extend(st.rejected)
    if st is not None:
        s.server_decode = st.decode
    s.upstream_unattributed = None
    if st is not None and st.queue is not None:
        s.upstream_queue, s.upstream_queue_source = st.queue, SERVER
    if st is not None and st.prefill is not None:
        s.prefill, s.prefill_source = st.prefill, SERVER
    ttft = s.upstream_ttft
    if ttft is not None:
        if s.prefill is None and s.upstream_queue is not None:
            s.prefill, s.prefill_source = max(ttft - s.upstream_queue, 0.0), SERVER
        elif s.prefill is None and split is not None:
            s.upstream_queue, s.upstream_queue_source = split.queue, ESTIMATED
            s.prefill, s.prefill_source = split.prefill, ESTIMATED
        elif s.prefill is None:
            s.prefill, s.prefill_source = ttft, UPSTREAM_TTFT
        stream = tl.request is not None and tl.request.stream
        if stream and st is not None and st.queue is not None and st.prefill is not None:
            # Reported to the server's own rounding: a sum past the upstream TTFT leaves nothing out.
            s.upstream_unattributed = max(ttft - st.queue - st.prefill, 0.0)
    if s.upstream_queue is not None:
        s.queue = (s.proxy_queue or 0.0) + s.upstream_queue
        s.queue_source = s.upstream_queue_source or PROXY
    else:
        s.queue, s.queue_source = s.proxy_queue, PROXY


def slo_outcome(tl: Timeline, s: Summary, slo: SLO | None) -> str:
    """``met`` when every configured SLO holds, ``missed`` otherwise (errors and cancellations miss; a
    non-streamed request's TTFT limit does not apply)."""
    if slo is None or not configured_slo(slo):
        return "none"
    if tl.outcome != OK:
        return "missed"
    # A non-streamed request has no TTFT to judge (as a single chunk has no TPOT): its E2E limit judges it.
    streamed = bool(tl.request is not None and tl.request.stream)
    ttft = s.ttft if s.ttft is not None or streamed else 0.0
    # TTFOT as TTFT (a stream that never reached its answer misses it); no second token (one chunk) as no TPOT.
    ttfot = s.ttfot if s.ttfot is not None or streamed else 0.0
    checks = (
        (slo.ttft, ttft),
        (slo.tpot, s.tpot if s.tpot is not None else 0.0),
        (slo.e2e, s.e2e),
        (slo.ttfot, ttfot),
        (slo.ttst, s.ttst if s.ttst is not None else 0.0),
    )
    for limit, value in checks:
        if limit is not None and (value is None or value > limit):
            return "missed"
    return "met"
