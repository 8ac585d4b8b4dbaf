"""Time to first output token and time to second token beside TTFT, and the ITL rule for multi-token chunks.

A reasoning model's thinking arrives first: TTFT stops at it, TTFOT at the answer's first chunk. The providers mark
reasoning-only events (OpenAI-style ``reasoning_content`` and ``reasoning`` deltas, Anthropic ``thinking_delta``,
Responses reasoning events); ``llmtap serve`` in front of a scripted upstream that thinks for a set time, called with
the ``openai`` and ``anthropic`` SDKs, records both figures on the record, the span and the histograms; ``llmtap slo``
and ``llmtap compare`` read them from the records and from a real Prometheus alike. Last, the ITL rule (a gap spread
over its chunk's tokens, one sample per token) against each benchmark tool's definition.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from llmtap import cli
from llmtap.analysis.stats import quantile
from llmtap.analysis.summary import summarize
from llmtap.analysis.timeline import Timeline
from llmtap.providers import provider_for
from llmtap.providers.sse import Event
from llmtap.types import Usage
from tests.analysis.test_attribution import records
from tests.conftest import ServerThread
from tests.support.procs import Llmtap
from tests.telemetry.test_metrics_standard import total, wait_for

# --- providers: which events are reasoning alone ---------------------------------------------------------


def _chat_facts(delta: dict[str, Any]) -> Any:
    provider = provider_for("POST", "/v1/chat/completions")
    assert provider is not None
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return provider.stream_parser().feed(Event("", json.dumps(chunk)))


@pytest.mark.parametrize(
    ("delta", "reasoning"),
    [
        ({"reasoning_content": "Let me think"}, True),  # vLLM before 0.10, DeepSeek
        ({"reasoning": "Let me think"}, True),  # vLLM since
        ({"reasoning_content": "", "content": "Paris"}, False),
        ({"content": "Paris"}, False),
        ({"reasoning": "so", "content": "Paris"}, False),  # the answer has begun
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, False),
    ],
)
def test_openai_reasoning_deltas_are_marked(delta: dict[str, Any], reasoning: bool) -> None:
    facts = _chat_facts(delta)
    assert facts.has_content and facts.reasoning is reasoning


def test_anthropic_thinking_is_marked_and_text_is_not() -> None:
    provider = provider_for("POST", "/v1/messages")
    assert provider is not None
    parser = provider.stream_parser()

    def delta(kind: str, key: str) -> Any:
        body = {"type": "content_block_delta", "index": 0, "delta": {"type": kind, key: "x"}}
        return parser.feed(Event(event="content_block_delta", data=json.dumps(body)))

    assert delta("thinking_delta", "thinking").reasoning is True
    assert delta("text_delta", "text").reasoning is False
    assert delta("input_json_delta", "partial_json").reasoning is False


# --- the summary ----------------------------------------------------------------------------------------


def _timeline(chunks: list[tuple[float, int, bool]], *, output_tokens: int | None = None) -> Timeline:
    """A streamed chat request received at 0: each chunk's arrival, token count and whether it is answer content."""
    provider = provider_for("POST", "/v1/chat/completions")
    assert provider is not None
    tl = Timeline("POST", "/v1/chat/completions", "default", "u", "h", 1, provider.name, "openai", 0.0, 0)
    tl.request = provider.inspect(b'{"model":"gpt-4o","stream":true,"messages":[]}', inject_usage=False)
    tl.sent = tl.headers = tl.first_byte = 0.001
    tl.status_code = 200
    for t, tokens, output in chunks:
        tl.add_chunk(t, 10, " go" * tokens, output=output)
    tl.end = chunks[-1][0] + 0.001
    if output_tokens is not None:
        tl.usage = Usage(input_tokens=5, output_tokens=output_tokens)
    return tl


def test_ttfot_is_the_answers_first_chunk_and_ttst_the_second_chunk() -> None:
    thinking = summarize(_timeline([(0.2, 1, False), (0.25, 1, False), (0.7, 1, True), (0.75, 1, True)]))
    assert thinking.ttft == pytest.approx(0.2) and thinking.ttfot == pytest.approx(0.7)
    assert thinking.ttst == pytest.approx(0.05)
    plain = summarize(_timeline([(0.2, 1, True), (0.3, 1, True)]))
    assert plain.ttfot == plain.ttft == pytest.approx(0.2) and plain.ttst == pytest.approx(0.1)
    only = summarize(_timeline([(0.2, 1, False)]))  # reasoning alone, one chunk: neither
    assert only.ttft == pytest.approx(0.2) and only.ttfot is None and only.ttst is None


def test_an_objective_on_ttfot_or_ttst_judges_each_request_as_a_ttft_or_tpot_one_does() -> None:
    """TTFOT as TTFT: a stream that never reached its answer misses it. TTST as TPOT: a stream of one chunk has
    none, and that limit does not apply to it (absent, not a 0 that meets or misses by chance)."""
    from llmtap.analysis.summary import slo_outcome
    from llmtap.config.types import SLO

    def judged(chunks: list[tuple[float, int, bool]], slo: SLO) -> str:
        tl = _timeline(chunks)
        tl.outcome = "ok"
        return slo_outcome(tl, summarize(tl), slo)

    thinking = [(0.2, 1, False), (0.25, 1, False), (0.7, 1, True), (0.75, 1, True)]
    assert judged(thinking, SLO(ttft=0.5)) == "met"
    assert judged(thinking, SLO(ttfot=0.5)) == "missed" and judged(thinking, SLO(ttfot=0.8)) == "met"
    assert judged(thinking, SLO(ttst=0.01)) == "missed" and judged(thinking, SLO(ttst=0.1)) == "met"
    assert judged([(0.2, 1, False)], SLO(ttfot=5.0)) == "missed"  # reasoning alone: no answer at all
    assert judged([(0.2, 3, True)], SLO(ttst=0.001)) == "met"  # one chunk: no second token to judge
    assert SLO(ttfot=0.5).limits() == {"ttfot": 0.5} and SLO(ttst=0.1).configured


def test_the_itl_rule_against_each_benchmark_tools_definition() -> None:
    """One stream of multi-token chunks, each tool's ITL computed from the raw (arrival, tokens) list as its source
    computes it, against the llmtap figure that equals it."""
    raw = [(0.30, 1), (0.34, 3), (0.36, 1), (0.46, 5), (0.50, 2)]  # (arrival, tokens), request sent at 0
    n = sum(k for _, k in raw)
    s = summarize(_timeline([(t, k, True) for t, k in raw], output_tokens=n))
    ttft, first, last = raw[0][0], raw[0][0], raw[-1][0]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(raw)]
    # vllm bench serve: one ITL sample per chunk after the first; AIPerf's ICL the same: llmtap's chunk gaps.
    assert s.gaps == pytest.approx(gaps)
    # AIPerf and GenAI-Perf ITL, (latency - TTFT) / (OSL - 1), and guidellm's (last - first) / (n - 1): TPOT.
    assert s.tpot == pytest.approx((last - ttft) / (n - 1)) == pytest.approx((last - first) / (n - 1))
    # GenAI-Perf's chunked ITL, (t2 - t1) / tokens in the chunk, once per chunk; llmtap repeats it per token.
    chunked = [g / k for g, (_, k) in zip(gaps, raw[1:], strict=True)]
    repeated = [g / k for g, (_, k) in zip(gaps, raw[1:], strict=True) for _ in range(k)]
    assert s.itl_per_token == pytest.approx(repeated)
    assert sorted(set(round(v, 9) for v in s.itl_per_token)) == sorted(set(round(v, 9) for v in chunked))
    # The mean of llmtap's samples is the decode after the first chunk over the tokens after it.
    assert sum(s.itl_per_token) / len(s.itl_per_token) == pytest.approx((last - first) / (n - raw[0][1]))
    # LLMPerf: sum([ttft] + gaps) / output tokens, first token included: (TTFT + decode) / n from llmtap's figures.
    assert s.ttft is not None and s.decode is not None
    assert (ttft + sum(gaps)) / n == pytest.approx((s.ttft + s.decode) / n)


# --- end to end: a reasoning upstream, through llmtap serve ----------------------------------------------

THINK_S, ANSWER_AT_S = 0.05, 0.4  # two thinking chunks 50 ms apart, the answer 400 ms after the request


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


def _chat_stream(
    thoughts: Sequence[tuple[float, str]], answer: Sequence[tuple[float, str]]
) -> list[tuple[float, bytes]]:
    """An OpenAI-style chat stream: a role-only chunk at once, a reasoning delta at each of ``thoughts`` and an answer
    chunk at each of ``answer`` (offsets in seconds from the request, and their text), then the usage and ``[DONE]``."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse(
            {"id": "r", "object": "chat.completion.chunk", "created": 1, "model": "thinker", "choices": [choice]}
        )

    out = [(0.0, chunk({"role": "assistant", "content": ""}))]
    out += [(at, chunk({"reasoning_content": text})) for at, text in thoughts]
    out += [
        (at, chunk({"content": text}, "stop" if i == len(answer) - 1 else None)) for i, (at, text) in enumerate(answer)
    ]
    n = len(thoughts) + len(answer)
    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
    last = answer[-1][0]
    body = {
        "id": "r",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "thinker",
        "choices": [],
        "usage": usage,
    }
    return [*out, (last, _sse(body)), (last, b"data: [DONE]\n\n")]


def _openai_stream() -> list[tuple[float, bytes]]:
    return _chat_stream(
        [(0.1, "The user"), (0.1 + THINK_S, " asks.")], [(ANSWER_AT_S, "Paris"), (ANSWER_AT_S + 0.02, ".")]
    )


def _anthropic_stream() -> list[tuple[float, bytes]]:
    message: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": "thinker"}
    message |= {"content": [], "stop_reason": None, "stop_sequence": None}
    message["usage"] = {"input_tokens": 5, "output_tokens": 1}

    def delta(index: int, kind: str, key: str, text: str) -> bytes:
        body = {"type": "content_block_delta", "index": index, "delta": {"type": kind, key: text}}
        return _sse(body, "content_block_delta")

    thinking = {"type": "thinking", "thinking": "", "signature": ""}
    return [
        (0.0, _sse({"type": "message_start", "message": message}, "message_start")),
        (0.0, _sse({"type": "content_block_start", "index": 0, "content_block": thinking}, "content_block_start")),
        (0.1, delta(0, "thinking_delta", "thinking", "The user")),
        (0.1 + THINK_S, delta(0, "thinking_delta", "thinking", " asks.")),
        (0.1 + THINK_S, delta(0, "signature_delta", "signature", "sig")),
        (0.1 + THINK_S, _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")),
        (
            0.1 + THINK_S,
            _sse(
                {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            ),
        ),
        (ANSWER_AT_S, delta(1, "text_delta", "text", "Paris")),
        (ANSWER_AT_S + 0.02, delta(1, "text_delta", "text", ".")),
        (ANSWER_AT_S + 0.02, _sse({"type": "content_block_stop", "index": 1}, "content_block_stop")),
        (
            ANSWER_AT_S + 0.02,
            _sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": 4},
                },
                "message_delta",
            ),
        ),
        (ANSWER_AT_S + 0.02, _sse({"type": "message_stop"}, "message_stop")),
    ]


async def _play(plan: list[tuple[float, bytes]], send: Any, start: float) -> None:
    """Each event of ``plan`` at its set offset from ``start``, the request's arrival (absolute: no drift)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for at, data in plan:
        await asyncio.sleep(max(at - (time.perf_counter() - start), 0))
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _thinker(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A reasoning upstream, for OpenAI's chat and Anthropic's messages."""
    if scope["type"] != "http":
        return
    start = time.perf_counter()
    while (await receive()).get("more_body"):
        pass
    await _play(_anthropic_stream() if scope["path"].endswith("/messages") else _openai_stream(), send, start)


def test_reasoning_streams_through_serve_with_both_sdks(tmp_path: Path, closing: Any) -> None:
    folder = tmp_path / "records"
    with ServerThread(_thinker, lifespan="off") as upstream:
        proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--record", str(folder), "--no-inject-usage")
        try:
            chat = closing(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0))
            stream = chat.chat.completions.create(
                model="thinker", messages=[{"role": "user", "content": "Capital of France?"}], stream=True
            )
            answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert answer == "Paris."
            claude = closing(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0))
            with claude.messages.stream(
                model="thinker",
                max_tokens=64,
                thinking={"type": "enabled", "budget_tokens": 32},
                messages=[{"role": "user", "content": "Capital of France?"}],
            ) as events:
                assert events.get_final_text() == "Paris."
            got = sorted(records(folder, 2, proxy), key=lambda r: r["time"])
            for rec in got:
                # Thinking began 100 ms in, the answer 400 ms in: TTFOT waits for the answer (the upstream's sleeps
                # are floors, so these hold however busy the machine), and the second token was the second thought.
                assert rec["ttft"] >= 0.1 and rec["ttfot"] >= ANSWER_AT_S and rec["ttft"] < rec["ttfot"], rec
                # TTFT counts to when the first content was shown to the client, TTST between chunk arrivals: on a
                # busy machine the answer's head can go out after the first chunk arrived, so allow that gap.
                assert 0 < rec["ttst"] <= rec["ttfot"] - rec["ttft"] + 0.05, rec
            assert [r["protocol"] for r in got] == ["openai_chat", "anthropic"]
            wait_for(
                "both on /metrics",
                lambda: total(proxy.metrics(), "llmtap_time_to_first_output_token_seconds_count") == 2,
                proxy,
            )
            text = proxy.metrics()
            assert total(text, "llmtap_time_to_second_token_seconds_count") == 2
            assert total(text, "llmtap_time_to_first_output_token_seconds_sum") == pytest.approx(
                sum(r["ttfot"] for r in got), rel=1e-3
            )
        finally:
            proxy.close()


@pytest.mark.e2e
@pytest.mark.real
def test_ttfot_and_ttst_objectives_judge_requests_and_slo_reads_them_from_records_and_a_live_prometheus(
    tmp_path: Path, closing: Any
) -> None:
    """A route whose objectives bound TTFOT (200 ms: the answer comes 400 ms in, after thinking) and TTST (10 s):
    each request misses (its record says so, with the objective it was judged by), and ``llmtap slo`` reads the
    TTFOT objective missed and the TTST one met, from the records and from a Prometheus scraping the proxy."""
    import httpx

    from llmtap.analysis.slo import config_objectives
    from llmtap.commands.slo import from_prometheus, from_records, render
    from llmtap.config.load import build
    from tests.analysis.test_burnrate import _tool
    from tests.analysis.test_compare import wait_until_up
    from tests.conftest import free_port
    from tests.support.procs import stop

    binary = _tool("prometheus")
    folder, config = tmp_path / "records", tmp_path / "llmtap.yaml"
    sent = 8
    with ServerThread(_thinker, lifespan="off") as upstream:
        config.write_text(
            "routes:\n"
            f"  - {{prefix: /think, upstream: '{upstream.url}', strip_prefix: true, name: think,"
            " slo: {ttfot_ms: 200, ttst_ms: 10000, percentile: 0.5}}\n",
            encoding="utf-8",
        )
        proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--config", str(config), "--record", str(folder))
        port = free_port()
        prom_config = tmp_path / "prometheus.yml"
        target = proxy.admin_url.removeprefix("http://")
        prom_config.write_text(
            "global: {scrape_interval: 1s}\n"
            f"scrape_configs: [{{job_name: llmtap, static_configs: [{{targets: ['{target}']}}]}}]\n",
            encoding="utf-8",
        )
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={prom_config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url + "/-/ready", prom, "Prometheus")
            chat = closing(openai.OpenAI(base_url=proxy.url + "/think/v1", api_key="sk-test", max_retries=0))
            for _ in range(sent):
                stream = chat.chat.completions.create(
                    model="thinker", messages=[{"role": "user", "content": "Capital of France?"}], stream=True
                )
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Paris."
            got = records(folder, sent, proxy)
            assert {r["slo"] for r in got} == {"missed"}
            assert all(r["objective"]["ttfot"] == 0.2 and r["objective"]["ttst"] == 10.0 for r in got), got[0]
            assert all(r["ttfot"] >= ANSWER_AT_S and 0 < r["ttst"] < 10.0 for r in got)

            def judged(report: Any) -> dict[str, str]:
                (verdict,) = report.verdicts
                assert (verdict.route, verdict.requests) == ("think", sent)
                return {c.figure: c.verdict for c in verdict.checks}

            from_files = from_records([folder], resamples=200)
            assert judged(from_files) == {"ttfot": "missed", "ttst": "met"}
            assert "p50 TTFOT <= 200 ms" in render(from_files)

            def scraped() -> float:
                query = "sum(llmtap_time_to_second_token_seconds_count)"
                result = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=10).json()["data"]["result"]
                return float(result[0]["value"][1]) if result else 0.0

            wait_for("the histograms scraped", lambda: scraped() == sent, proxy)
            settings = build({"config": str(config)}, env={})
            from_prom = from_prometheus(url, config_objectives(settings), resamples=200)
            assert judged(from_prom) == {"ttfot": "missed", "ttst": "met"}
        finally:
            stop(prom)
            proxy.close()


# --- compare over Prometheus: TTFOT and TTST from the histograms, as from the records ----------------------


def test_a_side_read_from_prometheus_has_ttfot_and_ttst_and_lacks_what_no_stream_gave() -> None:
    """Each figure from its own histogram's buckets as grown in the window, under the side's matchers; a histogram
    that did not grow (no stream of two chunks) leaves its figure empty: ``-`` in the rows, never a 0."""
    from llmtap.analysis.compare import Sides, side_from_counters, side_queries
    from llmtap.analysis.promql import Grown
    from llmtap.commands.compare import render

    def buckets(*pairs: tuple[str, float]) -> Grown:
        return {(("le", le),): count for le, count in pairs}

    queries = side_queries({"llmtap_prompt_version": "v1"})
    for figure, name in (("ttfot", "first_output_token"), ("ttst", "second_token")):
        assert f'__name__="llmtap_time_to_{name}_seconds_bucket"' in queries[figure]
        assert 'llmtap_prompt_version="v1"' in queries[figure] and queries[figure].startswith("sum by (le)")
    grown: dict[str, Grown] = {key: {} for key in queries} | {"outcomes": {(("llmtap_outcome", "ok"),): 4.0}}
    quick = buckets(("0.1", 0.0), ("0.2", 4.0), ("+Inf", 4.0))
    before = side_from_counters(
        "v1",
        grown
        | {
            "ttft": quick,
            "ttfot": buckets(("0.4", 0.0), ("0.5", 4.0), ("+Inf", 4.0)),
            "ttst": buckets(("0.05", 0.0), ("0.06", 4.0), ("+Inf", 4.0)),
        },
    )
    after = side_from_counters(
        "v2", grown | {"ttft": quick, "ttfot": quick, "ttst": buckets(("0.06", 0.0), ("+Inf", 0.0))}
    )
    c = Sides(before, after, source="Prometheus", split="v1 against v2").compare(resamples=200)
    counts = (c.before.ttfot_requests, c.after.ttfot_requests, c.before.ttst_requests, c.after.ttst_requests)
    assert counts == (4, 4, 4, 0)
    p50 = c.before.ttfot["p50"]
    assert p50 is not None and p50.value == pytest.approx(0.45)  # rank 2 of 4, linear inside (0.4, 0.5]
    assert c.after.ttfot["p50"] is not None and c.after.ttfot["p50"].value == pytest.approx(0.15)
    assert c.after.ttst == {"p50": None, "p95": None, "p99": None} and c.change["ttst_p50"] is None
    assert c.change["ttfot_p50"] is not None
    rows = [line.strip() for line in render(c).splitlines() if line.strip().startswith("TTST ")]
    assert len(rows) == 3 and all(row.endswith("  -") for row in rows), rows


#: What the compare test's upstream plays for each model: ``thinker`` reasons first (TTFT 100 ms, TTST the 50 ms
#: between its two thoughts, TTFOT 400 ms); ``quick`` answers in one chunk at 200 ms (TTFOT = TTFT, and no TTST);
#: ``slow`` is a thinker at the far end of every figure (TTFT 1 s, TTST 500 ms, TTFOT 2 s).
PLANS: dict[str, Callable[[], list[tuple[float, bytes]]]] = {
    "thinker": _openai_stream,
    "quick": lambda: _chat_stream([], [(0.2, "Paris.")]),
    "slow": lambda: _chat_stream([(1.0, "Hm"), (1.5, " so.")], [(2.0, "Paris"), (2.02, ".")]),
}


async def _by_model(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A chat upstream that plays the ``PLANS`` entry of the model asked for."""
    if scope["type"] != "http":
        return
    start = time.perf_counter()
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await _play(PLANS[json.loads(body)["model"]](), send, start)


def _within_resolution(read: float, samples: Sequence[float], q: float) -> bool:
    """Whether a percentile read from the fine buckets lies inside the buckets of the two samples the exact one
    (linear between closest ranks) lies between: Prometheus interpolates inside the bucket of rank q * n, which is
    one of those two, so this is as close as buckets can tell."""
    from llmtap.telemetry.emit.instruments import DURATION_BUCKETS

    def bucket(value: float) -> tuple[float, float]:
        i = bisect.bisect_left(DURATION_BUCKETS, value)
        return (DURATION_BUCKETS[i - 1] if i else 0.0), (DURATION_BUCKETS[i] if i < len(DURATION_BUCKETS) else math.inf)

    ordered = sorted(samples)
    k = math.floor(q * (len(ordered) - 1))
    return bucket(ordered[k])[0] <= read <= bucket(ordered[min(k + 1, len(ordered) - 1)])[1]


@pytest.mark.e2e
@pytest.mark.real
def test_compare_over_prometheus_reads_ttfot_and_ttst_as_the_records_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], closing: Any
) -> None:
    """A reasoning version (v1) against a quick one (v2, one chunk: no TTST), through ``llmtap serve`` with records
    and a real Prometheus scraping it: ``compare --prometheus`` gives TTFOT and TTST rows beside TTFT, with the same
    names, counts and route filter as ``compare`` over the records, by version and at a moment in time, each
    percentile within the histogram's bucket resolution of the records' exact one, and the after side's TTST
    absent (none of its streams has a second chunk), never 0."""
    from llmtap.analysis.compare import QUANTILES
    from tests.analysis.test_burnrate import _tool
    from tests.support.prometheus import promql, start_prometheus

    _tool("prometheus")
    folder, config = tmp_path / "records", tmp_path / "llmtap.yaml"
    per_side = 6
    with ServerThread(_by_model, lifespan="off") as upstream:
        config.write_text(
            f"routes:\n  - {{prefix: /think, upstream: '{upstream.url}', strip_prefix: true, name: think}}\n",
            encoding="utf-8",
        )
        proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--config", str(config), "--record", str(folder))
        target = proxy.admin_url.removeprefix("http://")
        jobs = f"  - {{job_name: llmtap, static_configs: [{{targets: ['{target}']}}]}}\n"
        prom, port = start_prometheus(tmp_path / "prom", jobs, cpu=None, log=tmp_path / "prometheus.log")
        chat = closing(openai.OpenAI(base_url=proxy.url + "/think/v1", api_key="sk-test", max_retries=0))
        sent = 0

        def ask(model: str, version: str, times: int) -> None:
            """``times`` streams of ``model`` tagged ``version``, then their records written and scraped."""
            nonlocal sent
            for _ in range(times):
                stream = chat.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Capital of France?"}],
                    stream=True,
                    extra_headers={"x-llmtap-prompt-version": version},
                )
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Paris."
                sent += 1
            records(folder, sent, proxy)
            counts = ("sum(llmtap_requests_total)", "sum(llmtap_time_to_first_output_token_seconds_count)")
            wait_for("the requests scraped", lambda: all(promql(port, q) == sent for q in counts), proxy)

        def compare(*args: str, json_out: bool = True) -> Any:
            code = cli.main(["compare", *args, "--route", "think", *(["--json"] if json_out else [])])
            out = capsys.readouterr()
            assert code == 0, out.err
            return json.loads(out.out) if json_out else out.out

        try:
            # The far end of every histogram first: a bound first written inside a window hides the value that made
            # it appear from that window (llmtap.telemetry.exposition.prometheus), so the time split below must
            # not see one appear above what v1 set. No version split counts this request.
            ask("slow", "warmup", 1)
            ask("thinker", "v1", per_side)
            moment = time.time()  # every v1 request scraped by now
            time.sleep(2)  # and no scrape at or before the moment can have seen a v2 request
            ask("quick", "v2", per_side)
            got = records(folder, sent, proxy)
            url = f"http://127.0.0.1:{port}"
            at = datetime.fromtimestamp(moment, UTC).isoformat()
            # Each split and the models of each side's requests.
            splits = {
                "by version": (["--before", "v1", "--after", "v2"], {"before": {"thinker"}, "after": {"quick"}}),
                "at a moment": (
                    ["--split-at", at, "--window", "10m"],
                    {"before": {"slow", "thinker"}, "after": {"quick"}},
                ),
            }
            for name, (split, models) in splits.items():
                exact, read = compare(str(folder), *split), compare("--prometheus", url, *split)
                for side in ("before", "after"):
                    mine = [r for r in got if r["model"] in models[side]]
                    for figure in ("ttft", "ttfot", "ttst"):
                        samples = [r[figure] for r in mine if r[figure] is not None]
                        key = f"{figure}_requests"
                        assert read[side][key] == exact[side][key] == len(samples), (name, side, figure)
                        for q_name, q in QUANTILES:
                            e, p = exact[side][figure][q_name], read[side][figure][q_name]
                            if not samples:  # v2's streams have one chunk each: no TTST, absent from both
                                assert e is None and p is None, (name, side, figure, q_name, p)
                                continue
                            assert e["value"] == pytest.approx(quantile(samples, q), abs=1e-9)
                            assert _within_resolution(p["value"], samples, q), (name, side, figure, q_name, p, samples)
                assert exact["after"]["ttst_requests"] == 0 and exact["before"]["ttst_requests"] > 0, name
                for q_name, _ in QUANTILES:
                    assert read["change"][f"ttfot_{q_name}"] is not None, name
                    assert read["change"][f"ttst_{q_name}"] is None and exact["change"][f"ttst_{q_name}"] is None
            # The text: the same rows, and the same note with each side's counts; TTST after reads "-", not 0.
            by_version = splits["by version"][0]
            texts = [
                compare(str(folder), *by_version, json_out=False),
                compare("--prometheus", url, *by_version, json_out=False),
            ]
            print(texts[1])
            rows = [
                [line.strip() for line in text.splitlines() if line.strip().startswith(("TTFOT ", "TTST "))]
                for text in texts
            ]
            names = [[row.split("  ")[0] for row in found] for found in rows]
            assert names[0] == names[1] == [f"{f} {q}" for f in ("TTFOT", "TTST") for q, _ in QUANTILES], texts[1]
            assert all(row.endswith("  -") for row in rows[1] if row.startswith("TTST")), rows[1]
            notes = [[line for line in text.splitlines() if "(TTFOT:" in line] for text in texts]
            assert notes[0] == notes[1] and f"{per_side} before, 0 after" in notes[1][0], notes
        finally:
            prom.stop()
            proxy.close()
