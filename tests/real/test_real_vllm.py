"""The proxy's queue, prefill, TTFT, cached tokens and trace context against a real vLLM's own figures.

vLLM (CPU build) serves the medium model (dummy weights) with two sequence slots, so a burst of ten
requests queues inside the server. vLLM is the truth here: its ``/metrics`` histograms summed over the
burst, and its per-request ``llm_request`` spans (received over OTLP, matched to the proxy's requests
by trace id). Each run prints a per-request table of both sides (``pytest -s`` shows it).

The workload: three unloaded requests of different lengths (so a learning estimator has an envelope),
one request that puts a 768-token shared prefix in vLLM's prefix cache, then the burst: five prompts
of 300 to 1500 tokens that share nothing, and five that start with the cached prefix, interleaved,
shortest first. Two runs, each through its own proxy: one told vLLM's batch capacity
(``server_slots``), one left to learn.

vLLM starts its queue clock only when its engine loop picks a request up, between two model steps, so
a request that arrives during a step waits that step out in neither vLLM's queue nor its prefill
(the table's ``unseen``), while the proxy counts it as queueing. The burst arrives during its first,
shortest prefill (about 0.4 s), which kept that difference at 3 to 7% of the summed queue when measured.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan

from llmtap.config.load import build
from llmtap.telemetry import semconv as sc
from tests.conftest import Running, Telemetry, start_proxy
from tests.support.vllm_server import (
    Scrape,
    ServerSpan,
    VllmServer,
    vllm_medium as vllm_medium,  # the fixture: one server, shared with the other real-vLLM modules
)

pytestmark = pytest.mark.real

MODEL = "medium"
SLOTS = 2  # --max-num-seqs of the vllm_medium fixture
MAX_TOKENS = 12
# Each of these is one token for the model's tokenizer, so N words make a prompt of about N tokens.
WORDS = ("def", "return", "self", "import", "class", "if", "else", "for", "in", "None")
SHARED_PREFIX = 768  # words; 24 blocks of 32, all cacheable
UNIQUE = (300, 600, 900, 1200, 1500)
TAILS = (100, 250, 400, 550, 700)
CALIBRATION = (300, 900, 1500)
# Between two requests of the burst. vLLM's front end takes 5 to 80 ms (under load) before its engine sees
# a request; closer arrivals can swap places there, and no replay of a first-come-first-served line from
# outside can know that. The burst still lasts under 0.4 s, against seconds of queueing.
STAGGER = 0.040
# The bar for summed queue and prefill against vLLM's own histograms.
SUM_TOLERANCE = 0.15
# Two processes' timestamps of one wall clock, one of them rounded to whole nanoseconds of a float.
CLOCK = 0.002


@dataclass(frozen=True, slots=True)
class Ask:
    """One request of the workload."""

    label: str
    prompt: str
    cached_prefix: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """What the client got back, and the trace it sent the request in."""

    ask: Ask
    trace_id: str
    prompt_tokens: int
    cached_tokens: int
    # Wall-clock seconds: the request sent, and its first chunk with text received.
    sent: float
    first_text: float


@dataclass(frozen=True, slots=True)
class Row:
    """One burst request seen from both sides, in seconds."""

    answer: Answer
    proxy: dict[str, Any]
    proxy_start: float  # the proxy's request span, seconds since the epoch (the clock vLLM's spans use)
    proxy_read: float  # when the relay read the first text from vLLM: its decode span's start, same clock
    server: ServerSpan

    def p(self, key: str) -> float:
        """A proxy figure; a missing one reads as NaN, so the table still prints and the checks fail."""
        value = self.proxy.get(key)
        return math.nan if value is None else float(value)

    def s(self, key: str) -> float:
        return self.server.seconds(f"gen_ai.latency.{key}")


class Workload:
    """Prompts made of one-token words; a per-run salt at the front keeps runs out of each other's cache."""

    def __init__(self, salt: str) -> None:
        self.rng = random.Random(salt)
        self.salt = salt

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def unique(self, label: str, n: int) -> Ask:
        return Ask(label, f"{self.salt} {label} {self.text(n)}")

    def shared(self, prefix: str, label: str, tail: int) -> Ask:
        return Ask(label, f"{prefix} {label} {self.text(tail)}", cached_prefix=True)

    def build(self, *, calibrate: bool = True) -> tuple[list[Ask], list[Ask]]:
        """The sequential part (calibration, unless not ``calibrate``, and cache warm-up) and the burst, interleaved."""
        prefix = f"{self.salt} shared {self.text(SHARED_PREFIX)}"
        calibration = [self.unique(f"cal{n}", n) for n in CALIBRATION] if calibrate else []
        before = [*calibration, self.shared(prefix, "warm", 10)]
        burst: list[Ask] = []
        for n, tail in zip(UNIQUE, TAILS, strict=True):
            burst += [self.unique(f"u{n}", n), self.shared(prefix, f"p+{tail}", tail)]
        return before, burst


async def chat(client: httpx.AsyncClient, url: str, ask: Ask, delay: float, words: list[int]) -> Answer:
    """One streamed chat request in a fresh trace; usage asked for so the client sees cached tokens.

    The model may only answer with ``words`` (token ids of whole words): with random weights it would
    otherwise now and then start with a lone byte of a UTF-8 character, which vLLM holds back, so the
    first visible text (the proxy's TTFT) would come a decode step after vLLM's first token (its TTFT).
    """
    await asyncio.sleep(delay)
    trace_id = os.urandom(16).hex()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ask.prompt}],
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "allowed_token_ids": words,
        "stream_options": {"include_usage": True},
    }
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    usage: dict[str, Any] = {}
    first_text = math.nan
    sent = time.time()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, (ask.label, await r.aread())
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                if math.isnan(first_text) and any((c.get("delta") or {}).get("content") for c in event["choices"]):
                    first_text = time.time()
                usage = event.get("usage") or usage
    assert usage, f"{ask.label}: no usage in the stream"
    assert not math.isnan(first_text), f"{ask.label}: no text in the stream"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Answer(ask, trace_id, int(usage["prompt_tokens"]), int(cached), sent, first_text)


async def send(url: str, asks: Sequence[Ask], words: list[int], *, concurrent: bool) -> list[Answer]:
    """The asks one after another, or all at once, ``STAGGER`` apart so they reach vLLM's engine in order."""
    async with httpx.AsyncClient(timeout=600) as client:
        if concurrent:
            return list(await asyncio.gather(*(chat(client, url, a, STAGGER * i, words) for i, a in enumerate(asks))))
        return [await chat(client, url, a, 0.0, words) for a in asks]


def roots(telemetry: Telemetry) -> dict[str, ReadableSpan]:
    """The proxy's request spans by trace id."""
    return {format(s.context.trace_id, "032x"): s for s in telemetry.finished() if sc.ROUTE in (s.attributes or {})}


def decodes(telemetry: Telemetry) -> dict[str, ReadableSpan]:
    """The proxy's decode spans by trace id."""
    return {format(s.context.trace_id, "032x"): s for s in telemetry.finished() if s.name == sc.SPAN_DECODE}


@dataclass(frozen=True, slots=True)
class Run:
    """One workload through the proxy: the burst's rows and vLLM's histograms over exactly the burst."""

    rows: list[Row]
    before: Scrape
    after: Scrape
    spans: list[ReadableSpan]

    def delta(self, name: str) -> float:
        return self.after.delta(self.before, name)


def run_workload(vllm: VllmServer, proxy: Running, telemetry: Telemetry, salt: str, *, calibrate: bool = True) -> Run:
    """Calibrate (unless not ``calibrate``: a cold burst) and warm sequentially, then send the burst; pair
    each request with vLLM's span of it."""
    # The proxy runs in this test worker, whose heap holds what every earlier test left: freeze it, as
    # llmtap's own processes freeze theirs after start-up, so the collector's pauses stay short.
    gc.collect()
    gc.freeze()
    try:
        return _run_workload(vllm, proxy, telemetry, salt, calibrate=calibrate)
    finally:
        gc.unfreeze()


def _run_workload(vllm: VllmServer, proxy: Running, telemetry: Telemetry, salt: str, *, calibrate: bool) -> Run:
    start = vllm.scrape()
    before_asks, burst_asks = Workload(salt).build(calibrate=calibrate)
    words = sorted(set(vllm.tokenize(" " + " ".join(WORDS))))
    asyncio.run(send(proxy.url, before_asks, words, concurrent=False))
    before = vllm.scrape_after(start, len(before_asks))
    answers = asyncio.run(send(proxy.url, burst_asks, words, concurrent=True))
    after = vllm.scrape_after(before, len(burst_asks))
    # vLLM's spans first: when they go on to llmtap, they are in its queue before the flush writes everything.
    server = vllm.request_spans([a.trace_id for a in answers])
    proxy.flush()
    mine = roots(telemetry)
    missing = [a.ask.label for a in answers if a.trace_id not in mine]
    assert not missing, f"no proxy span (in the client's trace) for {missing}"
    decoding = decodes(telemetry)
    rows = [
        Row(
            a,
            dict(mine[a.trace_id].attributes or {}),
            start_of(mine[a.trace_id]),
            start_of(decoding[a.trace_id]),
            server[a.trace_id],
        )
        for a in answers
    ]
    print_table(
        rows,
        after.delta(before, "vllm:request_queue_time_seconds_sum"),
        after.delta(before, "vllm:request_prefill_time_seconds_sum"),
    )
    return Run(rows, before, after, telemetry.finished())


def start_of(span: ReadableSpan) -> float:
    assert span.start_time is not None
    return span.start_time / 1e9


def ms(x: float) -> str:
    return "   -" if math.isnan(x) else f"{x * 1000:5.0f}"


def print_table(rows: Sequence[Row], queue_sum: float, prefill_sum: float) -> None:
    """Both sides per request, then the sums (milliseconds).

    ``unseen`` is vLLM's TTFT minus its queue and prefill: time vLLM counts in neither (its HTTP and
    tokenizing front end, and a new request waiting for the engine step in progress before the engine
    even queues it). ``hop`` is the proxy's TTFT minus vLLM's; ``in`` is when vLLM's clock started, after
    the proxy's (the same machine's wall clock); ``at`` is when the proxy took the request, in the burst.
    """
    print(
        "\nrequest  prompt cached |    at    in | queue proxy vLLM   err  source    "
        "| prefill proxy vLLM   err  source    | TTFT proxy vLLM unseen   hop"
    )
    t0 = min(r.proxy_start for r in rows)
    for r in rows:
        q, vq = r.p(sc.QUEUE_DURATION), r.s("time_in_queue")
        f, vf = r.p(sc.PREFILL_DURATION), r.s("time_in_model_prefill")
        t, vt = r.p(sc.RESPONSE_TIME_TO_FIRST_CHUNK), r.s("time_to_first_token")
        print(
            f"{r.answer.ask.label:8} {r.answer.prompt_tokens:6} {r.answer.cached_tokens:6} |"
            f" {ms(r.proxy_start - t0)} {ms(r.server.start - r.proxy_start)} |"
            f"       {ms(q)} {ms(vq)} {ms(q - vq)}  {r.proxy.get(sc.QUEUE_SOURCE, '-')!s:9} |"
            f"         {ms(f)} {ms(vf)} {ms(f - vf)}  {r.proxy.get(sc.PREFILL_SOURCE, '-')!s:9} |"
            f"      {ms(t)} {ms(vt)}  {ms(vt - vq - vf)} {ms(t - vt)}"
        )
    pq, pf = proxy_sum(rows, sc.QUEUE_DURATION), proxy_sum(rows, sc.PREFILL_DURATION)
    vt = math.fsum(r.s("time_to_first_token") for r in rows)
    print(f"sum queue:   proxy {pq:7.3f} s  vLLM /metrics {queue_sum:7.3f} s  error {relative(pq, queue_sum):+.1%}")
    print(f"sum prefill: proxy {pf:7.3f} s  vLLM /metrics {prefill_sum:7.3f} s  error {relative(pf, prefill_sum):+.1%}")
    both, vboth = pq + pf, queue_sum + prefill_sum
    print(f"sum both:    proxy {both:7.3f} s  vLLM /metrics {vboth:7.3f} s  error {relative(both, vboth):+.1%}")
    print(f"sum vLLM TTFT {vt:7.3f} s, of which unseen {vt - vboth:6.3f} s ({(vt - vboth) / vt:.1%})")
    # What the proxy's queue means (sent until the server starts on it), from vLLM's own figures.
    waited = vt - prefill_sum
    print(f"queue vs vLLM TTFT - prefill: proxy {pq:7.3f} s  vLLM {waited:7.3f} s  error {relative(pq, waited):+.1%}")


def proxy_sum(rows: Sequence[Row], key: str) -> float:
    return math.fsum(r.p(key) for r in rows)


def relative(measured: float, truth: float) -> float:
    return (measured - truth) / truth


def nearest_rank(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def start_run(
    vllm: VllmServer, route: dict[str, Any], name: str, *, calibrate: bool = True, spans: bool = False
) -> Iterator[Run]:
    """A fresh proxy (and fresh estimator) in front of the shared vLLM, the workload through it, then closed.

    ``spans``: vLLM's spans go on to the proxy's ``/v1/traces`` too (its admin listener), as they would with
    ``--otlp-traces-endpoint`` pointing at it.
    """
    telemetry = Telemetry()
    # The client sends a traceparent only to find vLLM's own span of each request: llmtap's span stays the
    # generation being compared with it (under span_role auto, a traceparent would make it the hop).
    flags = {"upstream": vllm.url, "provider": "vllm", "read_timeout": 300, "span_role": "generation", **route}
    settings = build(flags, env={})
    running, threads = start_proxy(settings, telemetry, admin=spans)
    if spans:
        assert running.admin is not None
        vllm.receiver.forward_to = running.admin.url + "/v1/traces"
    try:
        # The salt starts every prompt, so one run's prompts never hit the cache another run filled.
        yield run_workload(vllm, running, telemetry, f"{name} {os.urandom(4).hex()}", calibrate=calibrate)
    finally:
        vllm.receiver.forward_to = None
        for thread in reversed(threads):
            thread.__exit__(None, None, None)
        telemetry.tracer_provider.shutdown()
        telemetry.meter_provider.shutdown()


@pytest.fixture(scope="module")
def slots_run(vllm_medium: VllmServer) -> Iterator[Run]:
    """The route knows the server's batch capacity (``server_slots``, vLLM's ``--max-num-seqs``)."""
    yield from start_run(vllm_medium, {"server_slots": SLOTS}, "slots")


@pytest.fixture(scope="module")
def learned_run(vllm_medium: VllmServer) -> Iterator[Run]:
    """Nothing configured: the estimator learns the unloaded envelope from what it sees."""
    yield from start_run(vllm_medium, {}, "learned")


@pytest.fixture(scope="module")
def spans_run(vllm_medium: VllmServer) -> Iterator[Run]:
    """Nothing configured, a cold burst, and vLLM's spans sent to the proxy: the server's own truth."""
    yield from start_run(vllm_medium, {}, "spans", calibrate=False, spans=True)


@pytest.fixture(scope="module")
def cold_run(vllm_medium: VllmServer) -> Iterator[Run]:
    """Nothing configured, a cold burst, no spans: the slot count learned from vLLM's ``/metrics``."""
    yield from start_run(vllm_medium, {}, "cold", calibrate=False)


def test_vllm_truth_is_consistent(slots_run: Run) -> None:
    """vLLM's spans and its histograms describe the same requests, and vLLM really queued them."""
    n = len(slots_run.rows)
    assert slots_run.delta("vllm:request_queue_time_seconds_count") == n
    for metric, key in (("queue", "time_in_queue"), ("prefill", "time_in_model_prefill")):
        spans = math.fsum(r.s(key) for r in slots_run.rows)
        total = slots_run.delta(f"vllm:request_{metric}_time_seconds_sum")
        assert spans == pytest.approx(total, rel=1e-6, abs=1e-6), metric
    # Two slots and ten requests: a proxy that reported no queue could not pass the sums below.
    assert slots_run.delta("vllm:request_queue_time_seconds_sum") > 1.0


def assert_sums_cover_vllms(run: Run, tolerance: float, *, of_both: bool = False) -> None:
    """Summed over the burst, queue and prefill each against vLLM's histogram: within ``tolerance`` of it,
    past which only the time vLLM counted in neither may go, to either side.

    That time (``unseen`` in the table, and the hop: vLLM's front end before its clock and its engine's
    queue, the loopback both ways, the proxy's own line, any stall of the machine) is in the proxy's
    upstream TTFT, and the proxy cannot know which side of the split vLLM would have put it on; the slot
    replay can even move prefill into queue when a stall makes a request look as if it waited. It is
    measured per request, here, from vLLM's span and the proxy's upstream TTFT: a few percent of the queue on
    a quiet machine, much more on a busy one (2.2 s of 6 s in one run of the cold burst, the whole machine
    stalled for 150 ms at a time, seen by a process of its own), where a fixed bar would hold only while the
    box is quiet.

    With ``of_both`` the tolerance is a share of vLLM's queue and prefill together, not of each. The proxy's
    queue and prefill add up to the time it saw, so past the unseen time their errors are one error, the time
    the split put on the wrong side, seen twice with opposite signs; scaled by the queue alone, it depends on
    how long vLLM's engine queue happened to be, which a starved front end shortens (it holds the requests back
    and they wait there, unseen: 3.8 s of engine queue in a cold burst under two busy loops, 13 s quiet).
    """
    unseen = math.fsum(
        r.p(sc.QUEUE_PROXY_DURATION)
        + max(r.p(sc.UPSTREAM_TTFT) - r.s("time_in_queue") - r.s("time_in_model_prefill"), 0.0)
        for r in run.rows
    )
    both = run.delta("vllm:request_queue_time_seconds_sum") + run.delta("vllm:request_prefill_time_seconds_sum")
    for key, metric in ((sc.QUEUE_DURATION, "queue"), (sc.PREFILL_DURATION, "prefill")):
        missing = [r.answer.ask.label for r in run.rows if r.proxy.get(key) is None]
        assert not missing, f"no {key} on {missing}"
        mine, truth = proxy_sum(run.rows, key), run.delta(f"vllm:request_{metric}_time_seconds_sum")
        print(
            f"{metric}: proxy {mine:.3f} s, vLLM {truth:.3f} s ({relative(mine, truth):+.1%}),"
            f" uncounted {unseen:.3f} s ({unseen / truth:.1%})"
        )
        scale = both if of_both else truth
        assert abs(mine - truth) <= tolerance * scale + unseen, (key, mine, truth, scale, unseen)


def test_queue_and_prefill_sums_agree_with_vllm(slots_run: Run) -> None:
    """The issue's bar: summed over the burst, queue and prefill each within 15% of vLLM's histograms, past
    which only the time vLLM counted in neither may go (``assert_sums_cover_vllms``)."""
    assert_sums_cover_vllms(slots_run, SUM_TOLERANCE)


def test_ttft_lies_between_vllms_and_the_clients(slots_run: Run) -> None:
    """The proxy's TTFT against vLLM's and the client's, per request, on the machine's one wall clock.

    The proxy took each request after the client sent it and before vLLM's clock started; it read the first
    text after vLLM's first token and before the client read it. A proxy that timed the wrong event lands
    outside: a role-only chunk comes before vLLM's first token, the end of the stream after the client's
    first text. That holds on any machine, however busy; how far apart the three are depends on the machine
    (vLLM's engine and front end, the proxy and the client share two cores), so the hop is printed here and
    measured in the benchmark (``python -m bench``: TTFT through llmtap against direct).

    The proxy's TTFT ends later, when the relay had handed the text to the client's socket, a moment it
    can only stamp once the write has returned. The client, in this process (the relay runs in a thread of
    it), may read the text first: once the write is done, the thread that runs next holds the interpreter
    for up to its switch interval (5 ms; CI saw the client read 2.7 ms before the stamp). So the order to
    the client is taken from the read; the TTFT is bounded, over the whole burst, by the client's and
    that interval.
    """
    rows = slots_run.rows
    proxy = [r.p(sc.RESPONSE_TIME_TO_FIRST_CHUNK) for r in rows]
    server = [r.s("time_to_first_token") for r in rows]
    client = [r.answer.first_text - r.answer.sent for r in rows]
    hops = [p - s for p, s in zip(proxy, server, strict=True)]
    inbound = [r.server.start - r.proxy_start for r in rows]
    outbound = [h - i for h, i in zip(hops, inbound, strict=True)]
    delivered = [r.answer.first_text - r.proxy_read for r in rows]
    stamped = [r.proxy_start + p - r.proxy_read for r, p in zip(rows, proxy, strict=True)]
    taken = [r.proxy_start - r.answer.sent for r in rows]
    quantiles = {q: (nearest_rank(proxy, q), nearest_rank(server, q)) for q in (0.5, 0.9, 1.0)}
    print("TTFT p50/p90/max, proxy vs vLLM (ms):", {q: (ms(p), ms(s)) for q, (p, s) in quantiles.items()})
    print(f"hop median {ms(statistics.median(hops))} ms, max {ms(max(hops))} ms")
    print("hop in (ms): ", " ".join(ms(x) for x in inbound))
    print("hop out (ms):", " ".join(ms(x) for x in outbound))
    print("proxy read to client (ms):", " ".join(ms(x) for x in delivered))
    print("proxy read to its TTFT stamp (ms):", " ".join(ms(x) for x in stamped))
    for name, gaps in (
        ("client to proxy", taken),
        ("in", inbound),
        ("out", outbound),
        ("to client", delivered),
        ("read to stamp", stamped),
    ):
        assert min(gaps) >= -CLOCK, (name, gaps)
    # The same order over the whole burst, with vLLM's own histogram for its side.
    mean = slots_run.delta("vllm:time_to_first_token_seconds_sum") / len(rows)
    # The stamp may follow the client's read by the interpreter's switch interval (above).
    late = CLOCK + sys.getswitchinterval()
    assert mean - 2 * CLOCK <= statistics.fmean(proxy) <= statistics.fmean(client) + late, (mean, proxy, client)


def test_cached_tokens_equal_what_vllm_reported(slots_run: Run) -> None:
    """Input and cached tokens on the proxy's spans are exactly the usage vLLM sent the client."""
    for r in slots_run.rows:
        label = r.answer.ask.label
        assert r.proxy.get(sc.USAGE_INPUT_TOKENS) == r.answer.prompt_tokens, label
        assert r.server.attributes["gen_ai.usage.prompt_tokens"] == r.answer.prompt_tokens, label
        assert r.proxy.get(sc.USAGE_CACHE_READ, 0) == r.answer.cached_tokens, label
        if r.answer.ask.cached_prefix:
            # Whole 32-token blocks of the shared prefix, which the warm-up request left in the cache.
            assert r.answer.cached_tokens >= SHARED_PREFIX - 32, (label, r.answer.cached_tokens)
        else:
            assert r.answer.cached_tokens == 0, (label, r.answer.cached_tokens)


def test_traceparent_reaches_vllm(slots_run: Run) -> None:
    """vLLM's span sits in the client's trace, as a child of the proxy's request span (the root)."""
    by_id = {format(s.context.span_id, "016x"): s for s in slots_run.spans}
    for r in slots_run.rows:
        parent = by_id.get(r.server.parent_span_id)
        assert parent is not None, (r.answer.ask.label, r.server.parent_span_id)
        assert format(parent.context.trace_id, "032x") == r.server.trace_id == r.answer.trace_id
        assert sc.ROUTE in (parent.attributes or {}), parent.name  # not a queue, prefill or decode span


def test_learned_envelope_splits_inside_ttft(learned_run: Run) -> None:
    """Without ``server_slots`` the split is only printed (the table shows its errors against vLLM's).

    What holds whatever the split: every value is marked estimated, is non-negative and lies inside the
    TTFT, and queue plus prefill (the upstream's part of TTFT and the proxy's own moment) cover vLLM's
    TTFT of the request. How much more they cover is the hop, which depends on the machine alone (a CI run
    saw a median of 232 ms while other work shared the two cores, against 15 ms when quiet), so it is
    printed (``test_ttft_lies_between_vllms_and_the_clients`` checks its order, never its size).
    """
    extra = []
    for r in learned_run.rows:
        label = r.answer.ask.label
        queue, prefill = r.p(sc.QUEUE_DURATION), r.p(sc.PREFILL_DURATION)
        assert r.proxy.get(sc.QUEUE_SOURCE) == r.proxy.get(sc.PREFILL_SOURCE) == "estimated", label
        assert queue >= 0 and prefill >= 0, (label, queue, prefill)
        assert queue + prefill <= r.p(sc.RESPONSE_TIME_TO_FIRST_CHUNK), (label, queue, prefill)
        extra.append(queue + prefill - r.s("time_to_first_token"))
    assert min(extra) >= -2 * CLOCK, extra


# Without spans, summed over a cold burst, against vLLM's histograms.
COLD_SUM_TOLERANCE = 0.25


def test_server_spans_make_queue_and_prefill_the_servers_own(spans_run: Run) -> None:
    """The issue's bar with vLLM exporting to llmtap: per request, the upstream's queue and the prefill are
    vLLM's span's own figures, marked ``server``, and so are their sums over the burst, which vLLM's histograms
    hold too; every burst span joined its request.

    The queue is the proxy's own line (body read to admitted, measured; microseconds with no concurrency
    limit) plus the server's. The proxy's part is what the proxy's clock saw: a CI run, the proxy in the test's
    process beside a second test worker, measured 277 ms there for one request (the process did not run), and
    that is the proxy's time, not vLLM's; so the parts are checked each, not their sum against vLLM's queue.
    """
    for r in spans_run.rows:
        label = r.answer.ask.label
        assert r.proxy.get(sc.QUEUE_SOURCE) == r.proxy.get(sc.PREFILL_SOURCE) == "server", (label, r.proxy)
        assert r.proxy.get(sc.QUEUE_UPSTREAM_SOURCE) == "server", (label, r.proxy)
        assert r.p(sc.QUEUE_UPSTREAM_DURATION) == pytest.approx(r.s("time_in_queue"), abs=1e-9), label
        assert r.p(sc.QUEUE_PROXY_DURATION) >= 0, label
        own = r.p(sc.QUEUE_PROXY_DURATION) + r.p(sc.QUEUE_UPSTREAM_DURATION)
        assert r.p(sc.QUEUE_DURATION) == pytest.approx(own, abs=1e-9), label
        assert r.p(sc.PREFILL_DURATION) == pytest.approx(r.s("time_in_model_prefill"), abs=1e-9), label
        assert r.p(sc.DECODE_SERVER_DURATION) == pytest.approx(r.s("time_in_model_decode"), abs=1e-9), label
    for key, metric in ((sc.QUEUE_UPSTREAM_DURATION, "queue"), (sc.PREFILL_DURATION, "prefill")):
        mine, truth = proxy_sum(spans_run.rows, key), spans_run.delta(f"vllm:request_{metric}_time_seconds_sum")
        assert mine == pytest.approx(truth, rel=1e-6, abs=1e-6), (key, mine, truth)


def test_cold_burst_without_spans_learns_the_slots(cold_run: Run) -> None:
    """No spans, nothing configured, no history: the slots come from vLLM's ``/metrics``, every value after they
    are learned is marked estimated, and queue and prefill summed over the burst are each within 25% of vLLM's
    two histograms together, past which only the time vLLM counted in neither may go (``assert_sums_cover_vllms``
    with ``of_both``: seven of ten requests may end before the slots are known, and their split rests on the
    unloaded envelope alone; a run under two busy loops put 1.2 s of vLLM's 8.9 s of prefill in the queue, when
    vLLM's queue was 3.8 s).

    The slots are learned once a request waits while others run; a request of the first batch may end before
    that (the model reads 300 tokens in 0.1 to 0.4 s, by CPU). It then says what is known: no upstream queue and
    prefill the upstream's TTFT (source ``upstream_ttft``), true for a request nobody was ahead of; or, once an
    unloaded request taught the envelope, the envelope's split (``estimated``); either without a slot count.
    """
    unknown = []
    for r in cold_run.rows:
        label = r.answer.ask.label
        if r.proxy.get(sc.PREFILL_SOURCE) == "upstream_ttft":
            assert r.proxy.get(sc.QUEUE_SOURCE) == "proxy", (label, r.proxy)
        else:
            assert r.proxy.get(sc.QUEUE_SOURCE) == r.proxy.get(sc.PREFILL_SOURCE) == "estimated", (label, r.proxy)
        if sc.UPSTREAM_SLOTS not in r.proxy:
            assert sc.UPSTREAM_SLOTS_SOURCE not in r.proxy, (label, r.proxy)
            unknown.append(label)
        else:
            assert r.proxy.get(sc.UPSTREAM_SLOTS_SOURCE) == "server_metrics", (label, r.proxy)
    # Once learned, the count stays: in the order the requests ended, none without one after one with it.
    ended = sorted(cold_run.rows, key=lambda r: r.proxy_start + r.p(sc.E2E))
    known = [sc.UPSTREAM_SLOTS in r.proxy for r in ended]
    assert known == sorted(known), [(r.answer.ask.label, k) for r, k in zip(ended, known, strict=True)]
    # Learned as the burst began: never more than vLLM's --max-num-seqs, and that by the burst's later requests.
    learned = [(r.proxy.get(sc.UPSTREAM_SLOTS), r.proxy.get(sc.UPSTREAM_SLOTS_CONFIDENCE)) for r in cold_run.rows]
    print("slots learned (count, confidence) per request:", learned)
    assert max(int(n or 0) for n, _ in learned) == SLOTS, learned
    assert_sums_cover_vllms(cold_run, COLD_SUM_TOLERANCE, of_both=True)


def test_time_vllm_does_not_attribute_is_a_part_of_its_own(spans_run: Run) -> None:
    """vLLM's queue and prefill leave part of its TTFT out (its front end before its engine queues the request,
    handing out the first token), and the hop adds to it. Per request, that rest of the upstream's TTFT is a part
    of its own (``llmtap.upstream.unattributed``, its span, its attribute), and the queue and prefill spans last
    what vLLM said: the prefill span is vLLM's prefill, not stretched to the first chunk over the rest."""
    mine: dict[str, dict[str, ReadableSpan]] = {}
    for span in spans_run.spans:
        if span.context is not None:
            mine.setdefault(format(span.context.trace_id, "032x"), {})[span.name] = span

    def seconds(span: ReadableSpan) -> float:
        assert span.start_time is not None and span.end_time is not None
        return (span.end_time - span.start_time) / 1e9

    left_out = []
    for r in spans_run.rows:
        label = r.answer.ask.label
        spans = mine[r.answer.trace_id]
        assert seconds(spans[sc.SPAN_PREFILL]) == pytest.approx(r.s("time_in_model_prefill"), abs=1e-6), label
        rest = r.p(sc.UPSTREAM_TTFT) - r.s("time_in_queue") - r.s("time_in_model_prefill")
        assert r.p(sc.UPSTREAM_UNATTRIBUTED_DURATION) == pytest.approx(max(rest, 0.0), abs=1e-9), label
        queue, gap, prefill = spans[sc.SPAN_QUEUE], spans[sc.SPAN_UNATTRIBUTED], spans[sc.SPAN_PREFILL]
        assert seconds(gap) == pytest.approx(r.p(sc.UPSTREAM_UNATTRIBUTED_DURATION), abs=1e-6), label
        assert queue.end_time == gap.start_time and gap.end_time == prefill.start_time, label
        left_out.append(r.p(sc.UPSTREAM_UNATTRIBUTED_DURATION))
    ttft = math.fsum(r.p(sc.UPSTREAM_TTFT) for r in spans_run.rows)
    queued = math.fsum(r.s("time_in_queue") for r in spans_run.rows)
    read = math.fsum(r.s("time_in_model_prefill") for r in spans_run.rows)
    print(
        f"\nupstream TTFT {ttft:.3f} s over the burst: vLLM's queue {queued:.3f} s, prefill {read:.3f} s, left out"
        f" {math.fsum(left_out):.3f} s (largest {max(left_out):.3f} s)"
    )
    # vLLM leaves time out (its front end and the hop at the least): never nothing, over a burst.
    assert math.fsum(left_out) > 0
