"""Derived figures of one request, from hand-built timelines with exact (dyadic) timestamps."""

from __future__ import annotations

import random
from typing import Any

import pytest

from llmtap.analysis import tokens
from llmtap.analysis.summary import PROXY, SERVER, UPSTREAM_TTFT, USAGE, apportion, input_size_class, summarize
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import SLO
from llmtap.types import RequestInfo, ServerTiming, Usage

T0 = 1000.0  # every offset below is a multiple of 1/1024 s, so differences are exact in binary
WORDS = [" alpha", " beta gamma", " delta river sigma"]  # 1, 2 and 3 tokens in o200k_base and cl100k_base


def make(*, model: str | None = "gpt-4o", stream: bool = True, prompt: str = "", **kw: Any) -> Timeline:
    """A timeline of a streamed chat request received at ``T0``."""
    fields: dict[str, Any] = {
        "method": "POST",
        "path": "/v1/chat/completions",
        "route": "default",
        "upstream": "http://upstream:8000",
        "server_address": "upstream",
        "server_port": 8000,
        "protocol": "openai_chat",
        "provider_name": "openai",
        "received": T0,
        "received_wall_ns": 1_700_000_000_000_000_000,
        "request": RequestInfo(operation="chat", model=model, stream=stream, prompt_text=prompt),
    }
    fields.update(kw)
    return Timeline(**fields)


def streamed(texts: list[str], *, first: float = 0.5, gap: float = 0.0625, **kw: Any) -> Timeline:
    """Received at T0, body read +1/128, admitted +1/64, sent +1/32, first byte +1/8, chunks from +first."""
    kw.setdefault("status_code", 200)
    tl = make(body_read=T0 + 1 / 128, admitted=T0 + 1 / 64, sent=T0 + 1 / 32, first_byte=T0 + 0.125, **kw)
    for i, text in enumerate(texts):
        tl.add_chunk(T0 + first + i * gap, len(text.encode()) + 40, text)
    tl.end = T0 + first + (len(texts) - 1) * gap + 0.25
    return tl


def test_timings_from_timestamps() -> None:
    tl = streamed([" alpha"] * 9, usage=Usage(input_tokens=20, output_tokens=9))
    s = summarize(tl)
    assert s.ttft == 0.5
    assert s.ttfb == 0.125
    assert s.upstream_ttft == 0.5 - 1 / 32
    assert s.decode == 8 * 0.0625
    assert s.e2e == 0.5 + 8 * 0.0625 + 0.25
    assert s.gaps == [0.0625] * 8
    # No server timing: the proxy's own queue (body read -> admitted), prefill = upstream TTFT.
    assert (s.queue, s.queue_source) == (1 / 64 - 1 / 128, PROXY)
    assert (s.prefill, s.prefill_source) == (0.5 - 1 / 32, UPSTREAM_TTFT)


def test_nothing_streamed_leaves_stream_timings_unset() -> None:
    tl = make(sent=T0 + 0.25, end=T0 + 2.0)
    tl.fail("timeout", "upstream timed out")
    s = summarize(tl)
    assert s.e2e == 2.0
    assert s.ttft is None and s.ttfb is None and s.upstream_ttft is None and s.decode is None and s.tpot is None
    assert s.gaps == [] and s.itl_per_token == []
    assert s.output_tokens is None  # nothing counted for a failed request that produced nothing


def test_tpot_uses_usage_output_tokens() -> None:
    # 5 chunks over 1 s but 33 tokens by usage: TPOT divides by tokens, not chunks.
    tl = streamed([" alpha"] * 5, gap=0.25, usage=Usage(input_tokens=10, output_tokens=33))
    s = summarize(tl)
    assert s.decode == 1.0
    assert s.output_tokens == 33 and s.output_source == USAGE
    assert s.tpot == 1.0 / 32
    assert sum(s.chunk_tokens) == 33 and len(s.chunk_tokens) == 5
    assert s.chunk_tokens_source == f"{USAGE}+tiktoken:o200k_base"


def test_tpot_unset_for_a_single_token() -> None:
    s = summarize(streamed([" alpha"], usage=Usage(output_tokens=1)))
    assert s.decode == 0.0 and s.tpot is None


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (6, [1, 2, 3], [1, 2, 3]),  # usage agrees with tiktoken: the counts are kept
        (24, [2, 4, 6], [4, 8, 12]),  # twice as many tokens: twice as many per chunk
        (12, [1, 1, 1, 1], [3, 3, 3, 3]),
        (4, [0, 0, 10, 0], [1, 1, 1, 1]),  # every chunk carried at least one token
        (2, [1, 6, 1], [0, 2, 0]),  # fewer tokens than chunks: no floor of one
        (5, [0, 0, 0], [2, 2, 1]),  # no weights: an even split
        (0, [3, 3], [0, 0]),
        (7, [], []),
    ],
)
def test_apportion_examples(total: int, weights: list[int], expected: list[int]) -> None:
    assert apportion(total, weights) == expected


def test_apportion_properties() -> None:
    rng = random.Random(20240611)
    for _ in range(2000):
        k = rng.randint(1, 40)
        weights = [rng.choice([0, 1, 1, 1, 2, 3, rng.randint(1, 30)]) for _ in range(k)]
        total = rng.randint(0, 4 * sum(weights) + 2 * k)
        out = apportion(total, weights)
        assert len(out) == k and sum(out) == total, (total, weights, out)
        assert min(out) >= 0
        if total >= k:
            assert min(out) >= 1, (total, weights, out)
        wsum = sum(weights)
        shares = [total * w / wsum for w in weights] if wsum else []
        if shares and min(shares) >= 1:
            # Largest remainder: each chunk gets its exact share rounded down or up, never further off.
            assert all(abs(o - q) < 1 for o, q in zip(out, shares, strict=True)), (total, weights, out)


def test_apportion_scales_every_chunk_alike() -> None:
    # A server tokenizer that counts ~18% more than tiktoken: 1-token chunks must not stay at 1 while
    # 2-token chunks absorb all the difference.
    out = apportion(130, [1] * 90 + [2] * 10)
    assert sum(out) == 130
    assert set(out[90:]) <= {2, 3}
    assert set(out[:90]) <= {1, 2}


def test_itl_per_token_samples() -> None:
    # Tokens per chunk 1, 2, 3 (tiktoken and usage agree); gaps 1/16 and 1/8.
    tl = make()
    tl.add_chunk(T0 + 0.5, 10, WORDS[0])
    tl.add_chunk(T0 + 0.5 + 1 / 16, 10, WORDS[1])
    tl.add_chunk(T0 + 0.5 + 1 / 16 + 1 / 8, 10, WORDS[2])
    tl.end = T0 + 1.0
    tl.usage = Usage(output_tokens=6)
    s = summarize(tl)
    assert s.chunk_tokens == [1, 2, 3]
    assert s.gaps == [1 / 16, 1 / 8]
    assert s.itl_per_token == [1 / 32, 1 / 32, 1 / 24, 1 / 24, 1 / 24]
    assert s.tpot == (1 / 16 + 1 / 8) / 5


def test_tiktoken_fallback_without_usage() -> None:
    prompt = "Привет, как дела? Это тест."
    tl = streamed(WORDS, prompt=prompt)
    s = summarize(tl)
    assert s.output_tokens == 6 and s.output_source == "tiktoken:o200k_base"
    assert s.chunk_tokens == [1, 2, 3] and s.chunk_tokens_source == "tiktoken:o200k_base"
    assert s.input_tokens == tokens.count(prompt, "o200k_base") == 9
    assert s.input_source == "tiktoken:o200k_base"
    assert s.input_drift is None and s.output_drift is None  # nothing to drift from
    assert s.tpot == 2 * 0.0625 / 5


def test_tiktoken_fallback_uses_cl100k_for_gpt4() -> None:
    prompt = "Привет, как дела? Это тест."
    s = summarize(streamed(WORDS, prompt=prompt, model="gpt-4"))
    assert s.input_source == s.output_source == "tiktoken:cl100k_base"
    assert s.input_tokens == tokens.count(prompt, "cl100k_base") == 13
    # The response's model names the encoding when it is known.
    s = summarize(streamed(WORDS, prompt=prompt, model="my-alias", response_model="gpt-4-0613"))
    assert s.input_source == "tiktoken:cl100k_base" and s.input_tokens == 13
    # An unknown model falls back to o200k_base.
    s = summarize(streamed(WORDS, prompt=prompt, model="llama-3.1-8b"))
    assert s.input_source == "tiktoken:o200k_base" and s.input_tokens == 9


def test_drift_sign_and_size() -> None:
    prompt = "The quick brown fox jumps over the lazy dog."  # 10 tokens
    # tiktoken counts 6 output tokens; the server says 8 -> counted 25% under; input 8 -> 25% over.
    s = summarize(streamed(WORDS, prompt=prompt, usage=Usage(input_tokens=8, output_tokens=8)))
    assert s.output_tokens == 8 and s.output_source == USAGE
    assert s.input_tokens == 8 and s.input_source == USAGE
    assert s.output_drift == pytest.approx(-0.25)
    assert s.input_drift == pytest.approx(0.25)
    s = summarize(streamed(WORDS, prompt=prompt, usage=Usage(input_tokens=10, output_tokens=6)))
    assert s.output_drift == 0.0 and s.input_drift == 0.0
    # No usage for one side: that side has no drift.
    s = summarize(streamed(WORDS, prompt=prompt, usage=Usage(output_tokens=3)))
    assert s.output_drift == pytest.approx(1.0) and s.input_drift is None
    assert s.input_source == "tiktoken:o200k_base"


def test_without_the_drift_the_whole_output_is_counted_only_where_usage_does_not_report_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``drift=False`` (the recorder's choice on all but a request a second per route): with usage the whole output is
    never counted (the figures are usage's, per-chunk counts apportion it); without usage it is, as before."""
    from llmtap.analysis.timeline import Output

    counted: list[int] = []
    whole = Output.tokens

    def tokens_counted(self: Output) -> int:
        counted.append(1)
        return whole(self)

    monkeypatch.setattr(Output, "tokens", tokens_counted)
    prompt = "The quick brown fox jumps over the lazy dog."
    reported = Usage(input_tokens=8, output_tokens=8)
    with_drift = summarize(streamed(WORDS, prompt=prompt, usage=reported))
    assert counted == [1]
    s = summarize(streamed(WORDS, prompt=prompt, usage=reported), drift=False)
    assert counted == [1]
    assert (s.output_tokens, s.output_source, s.input_tokens, s.input_source) == (8, USAGE, 8, USAGE)
    assert s.output_drift is None and s.input_drift is None
    assert (s.chunk_tokens, s.chunk_tokens_source) == (with_drift.chunk_tokens, with_drift.chunk_tokens_source)
    alone = summarize(streamed(WORDS, prompt=prompt), drift=False)
    assert counted == [1, 1]
    assert (alone.output_tokens, alone.output_source) == (6, "tiktoken:o200k_base")
    assert (alone.input_tokens, alone.input_source) == (10, "tiktoken:o200k_base")


@pytest.mark.parametrize(
    ("n", "label"),
    [
        (None, "unknown"),
        (0, "le_256"),
        (256, "le_256"),
        (257, "le_1k"),
        (1024, "le_1k"),
        (1025, "le_4k"),
        (4096, "le_4k"),
        (16384, "le_16k"),
        (16385, "le_64k"),
        (65536, "le_64k"),
        (65537, "gt_64k"),
    ],
)
def test_input_size_classes(n: int | None, label: str) -> None:
    assert input_size_class(n) == label
    s = summarize(streamed(WORDS, usage=Usage(input_tokens=n, output_tokens=6)))
    assert s.input_size == label


def test_cache_and_reasoning_tokens_from_usage() -> None:
    usage = Usage(input_tokens=900, output_tokens=6, cache_read_tokens=512, cache_write_tokens=64, reasoning_tokens=2)
    s = summarize(streamed(WORDS, usage=usage))
    assert (s.cache_read_tokens, s.cache_write_tokens, s.reasoning_tokens) == (512, 64, 2)
    assert s.input_size == "le_1k"


# The base request below: TTFT 0.5 s, TPOT 1/16 s (5 chunks, 5 tokens), E2E 1 s.
SLOS = SLO(ttft=0.5, tpot=0.1, e2e=2.0)


def slo_request(first: float = 0.5, gap: float = 0.0625) -> Timeline:
    return streamed([" alpha"] * 5, first=first, gap=gap, usage=Usage(output_tokens=5))


def test_slo_met_and_missed() -> None:
    assert summarize(slo_request(), SLOS).slo == "met"  # TTFT exactly at the limit meets it
    assert summarize(slo_request(first=0.5 + 1 / 1024), SLOS).slo == "missed"  # TTFT over
    assert summarize(slo_request(gap=0.125), SLOS).slo == "missed"  # TPOT 0.125 > 0.1
    assert summarize(slo_request(first=1.5, gap=0.0625), SLO(e2e=2.0)).slo == "met"  # e2e 2.0
    assert summarize(slo_request(first=1.5 + 1 / 1024), SLO(e2e=2.0)).slo == "missed"
    assert summarize(slo_request(first=1.5), SLO(tpot=0.1)).slo == "met"  # only TPOT configured


def test_slo_no_first_chunk_misses_ttft() -> None:
    tl = make(end=T0 + 0.25)
    assert summarize(tl, SLO(ttft=1.0)).slo == "missed"


def test_errors_and_cancellations_always_miss() -> None:
    failed = slo_request()
    failed.fail("upstream_closed", "connection reset")
    assert summarize(failed, SLOS).slo == "missed"
    cancelled = slo_request()
    cancelled.fail("cancelled", cancelled=True)
    assert summarize(cancelled, SLOS).slo == "missed"
    in_stream = slo_request()
    in_stream.error_type, in_stream.outcome = "overloaded_error", "error"
    assert summarize(in_stream, SLO(e2e=100.0)).slo == "missed"


def test_no_slo_is_none() -> None:
    tl = slo_request()
    assert summarize(tl).slo == "none"
    assert summarize(tl, SLO()).slo == "none"
    tl.fail("cancelled", cancelled=True)
    assert summarize(tl, SLO()).slo == "none"


def test_server_reported_phases_win() -> None:
    tl = streamed(WORDS, server_timing=ServerTiming(queue=0.25, prefill=0.125, decode=0.0625))
    s = summarize(tl)
    assert (s.upstream_queue, s.upstream_queue_source) == (0.25, SERVER)
    # The queue is the proxy's own line (measured) and then the server's (reported).
    assert s.proxy_queue == 1 / 64 - 1 / 128
    assert (s.queue, s.queue_source) == (s.proxy_queue + 0.25, SERVER)
    assert (s.prefill, s.prefill_source) == (0.125, SERVER)
    # What the proxy measured itself is unchanged beside them.
    assert s.upstream_ttft == 0.5 - 1 / 32 and s.decode == 0.125


def test_server_reports_one_phase_only() -> None:
    s = summarize(streamed(WORDS, server_timing=ServerTiming(prefill=0.125)))
    assert (s.queue, s.queue_source) == (1 / 64 - 1 / 128, PROXY)
    assert (s.prefill, s.prefill_source) == (0.125, SERVER)
    s = summarize(streamed(WORDS, server_timing=ServerTiming(queue=0.0)))
    assert (s.upstream_queue, s.queue, s.queue_source) == (0.0, 1 / 64 - 1 / 128, SERVER)
    # A reported queue leaves the rest of the upstream TTFT to prefill, on the server's word.
    assert (s.prefill, s.prefill_source) == (0.5 - 1 / 32, SERVER)


@pytest.mark.parametrize(("sent", "status"), [(None, None), (T0 + 1 / 32, 404), (T0 + 1 / 32, None)])
def test_a_request_that_never_reached_the_model_counts_no_input(sent: float | None, status: int | None) -> None:
    """Refused by llmtap (never sent), by the upstream (an error status), or cut before any response."""
    tl = make(prompt="Where is my order?", sent=sent, status_code=status)
    tl.end = T0 + 0.25
    s = summarize(tl)
    assert s.input_tokens is None and s.input_source == "" and s.input_size == "unknown"


def test_a_whole_body_has_no_time_per_output_token() -> None:
    """One content chunk: no decode was timed, so TPOT is unknown, not 0 (which would drag percentiles down)."""
    tl = streamed([" alpha beta gamma"], stream=False, usage=Usage(input_tokens=5, output_tokens=3))
    s = summarize(tl)
    assert s.decode == 0.0 and s.tpot is None
