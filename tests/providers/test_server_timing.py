"""Server-reported timings: TGI headers, vLLM ``metrics``, NIM ``stats``, and the checks that refuse bad ones.

Bad input (a wrong type, a negative, NaN or infinite value, an unknown unit, a phase longer than the
request) is refused and named, never raised and never turned into a negative duration.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from llmtap.providers import OpenAIChat, OpenAICompletions
from llmtap.providers.sse import Event
from llmtap.providers.timing import (
    MS,
    NS,
    TGI_HEADERS,
    TOLERANCE_FRACTION,
    TOLERANCE_S,
    from_body,
    from_headers,
    header_seconds,
    seconds,
    validate,
)
from llmtap.types import ServerTiming

CHAT = OpenAIChat()
fuzz = settings(max_examples=300, deadline=None)


def tgi(**values: str) -> dict[str, str]:
    """TGI-style headers from keyword names: queue="12" gives ``x-queue-time: 12``."""
    names = {"queue": "x-queue-time", "inference": "x-inference-time", "validation": "x-validation-time"}
    names |= {"total": "x-total-time", "per_token": "x-time-per-token"}
    return {names[k]: v for k, v in values.items()}


# TGI headers.


def test_tgi_headers_as_tgi_sends_them() -> None:
    # Whole milliseconds, as router/src/server.rs writes them; httpx's case-insensitive headers as input.
    headers = httpx.Headers(
        {
            "X-Total-Time": "1873",
            "X-Validation-Time": "2",
            "X-Queue-Time": "412",
            "X-Inference-Time": "1459",
            "X-Time-Per-Token": "29",
            "X-Compute-Time": "1.873",
        }
    )
    assert from_headers(headers) == (ServerTiming(queue=0.412), [])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("12", 0.012),
        (" 12 ", 0.012),
        ("0", 0.0),
        ("12ms", 0.012),
        ("12 ms", 0.012),
        ("12MS", 0.012),
        ("1.5s", 1.5),
        ("250µs", 0.00025),
        ("250μs", 0.00025),
        ("250us", 0.00025),
        ("5000000ns", 0.005),
        ("12furlongs", None),
        ("12m", None),
        ("12.5", None),  # a bare decimal is no format TGI writes: its unit is unknown
        ("-5", None),
        ("+5", None),
        ("1e3", None),
        ("NaN", None),
        ("inf", None),
        ("", None),
        ("ms", None),
        ("12, 13", None),  # a repeated header joined by a comma
        ("٣", None),  # a digit, but not an ASCII one
        ("9" * 400, None),  # overflows a float to infinity
        ("9" * 400 + ".5s", None),
    ],
)
def test_header_values(value: str, expected: float | None) -> None:
    parsed = header_seconds(value)
    assert parsed == (None if expected is None else pytest.approx(expected))


def test_bad_headers_are_named_and_the_rest_kept() -> None:
    timing, rejected = from_headers(tgi(queue="12furlongs", inference="-4", validation="abc", per_token="7"))
    assert timing is None and rejected == ["x-queue-time", "x-inference-time", "x-validation-time"]
    timing, rejected = from_headers(tgi(queue="12", inference="NaN"))
    assert timing == ServerTiming(queue=0.012) and rejected == ["x-inference-time"]


def test_no_tgi_headers_say_nothing() -> None:
    assert from_headers({"content-type": "application/json", "x-request-id": "abc"}) == (None, [])
    assert from_headers(tgi(inference="40", total="41")) == (None, [])


def test_parts_longer_than_the_total_make_the_report_inconsistent() -> None:
    timing, rejected = from_headers(tgi(total="100", queue="500", inference="40"))
    assert timing is None and rejected == ["x-queue-time", "x-inference-time"]
    # Each part fits, their sum does not: which one is wrong cannot be told, so none is used.
    timing, rejected = from_headers(tgi(total="100", validation="10", queue="60", inference="60"))
    assert timing is None and rejected == ["x-validation-time", "x-queue-time", "x-inference-time"]
    # Whole-millisecond truncation of each part is allowed for.
    assert from_headers(tgi(total="100", validation="1", queue="50", inference="51")) == (ServerTiming(queue=0.05), [])


def test_time_per_token_longer_than_inference_is_refused() -> None:
    assert from_headers(tgi(queue="5", inference="40", per_token="400")) == (
        ServerTiming(queue=0.005),
        ["x-time-per-token"],
    )


@fuzz
@given(st.dictionaries(st.sampled_from([*TGI_HEADERS, "X-Queue-Time", "other"]), st.text(max_size=30), max_size=6))
def test_fuzz_from_headers(headers: dict[str, str]) -> None:
    timing, rejected = from_headers(headers)
    assert set(rejected) <= set(TGI_HEADERS)
    if timing is not None:
        assert timing.queue is not None and math.isfinite(timing.queue) and timing.queue >= 0.0


@fuzz
@given(st.text(alphabet="0123456789.-+ eEnmsuµμ", max_size=12))
def test_fuzz_header_seconds(value: str) -> None:
    parsed = header_seconds(value)
    assert parsed is None or (math.isfinite(parsed) and parsed >= 0.0)


# Bodies: vLLM metrics and NIM stats.


def test_seconds() -> None:
    assert seconds(1500, MS) == 1.5 and seconds(2_500_000_000, NS) == 2.5 and seconds(0, MS) == 0.0
    for bad in (-1, -0.5, True, False, "12", None, [1], {"v": 1}, math.nan, math.inf, -math.inf, 10**400):
        assert seconds(bad, MS) is None, bad


def test_vllm_metrics_in_a_whole_body() -> None:
    metrics = {
        "time_to_first_token_ms": 85.25,
        "generation_time_ms": 1240.5,
        "queue_time_ms": 12.5,
        "mean_itl_ms": 9.1,
        "tokens_per_second": 103.2,
    }
    whole = {"id": "c", "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}
    facts = CHAT.parse_body(json.dumps({**whole, "metrics": metrics}).encode())
    assert facts.server_timing == ServerTiming(queue=0.0125, prefill=0.08525, decode=1.2405)
    assert CHAT.parse_body(json.dumps({**whole, "metrics": None}).encode()).server_timing is None


def test_vllm_metrics_of_the_wrong_type_are_refused() -> None:
    metrics = {"queue_time_ms": "12", "time_to_first_token_ms": -3, "generation_time_ms": True}
    facts = CHAT.parse_body(json.dumps({"choices": [], "metrics": metrics}).encode())
    assert facts.server_timing == ServerTiming(
        rejected=["queue_time_ms", "time_to_first_token_ms", "generation_time_ms"]
    )
    facts = CHAT.parse_body(b'{"choices": [], "metrics": {"queue_time_ms": 1e999, "time_to_first_token_ms": 4}}')
    assert facts.server_timing == ServerTiming(prefill=0.004, rejected=["queue_time_ms"])


def test_nim_stats_on_the_final_chunk() -> None:
    stats = {
        "type": "NIM LLM Model Stats",
        "version": "0.1.0",
        "llm_input_token_length": 12,
        "llm_output_token_length": 5,
        "generation_time_in_ms": 180.0,
        "time_in_queue_in_ms": 7.5,
        "response_tokens": {"response_token_length": 5, "time_to_first_token_in_ms": 41.0},
    }
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "stats": stats}
    for provider in (CHAT, OpenAICompletions()):
        facts = provider.stream_parser().feed(Event("", json.dumps(chunk)))
        # Only the queue is a documented phase; NIM's TTFT runs "from processing start", undefined.
        assert facts is not None and facts.server_timing == ServerTiming(queue=0.0075)
    assert CHAT.parse_body(
        json.dumps({"choices": [], "stats": {"time_in_queue_in_ms": -1}}).encode()
    ).server_timing == (ServerTiming(rejected=["time_in_queue_in_ms"]))


def test_from_body_says_nothing_without_fields() -> None:
    fields = {"queue": ("q", MS)}
    assert from_body(None, fields) is None and from_body([1], fields) is None and from_body({"x": 1}, fields) is None
    assert from_body({"q": None}, fields) is None


# validate: what can be right for a request that took `elapsed` seconds upstream.


def test_valid_timing_passes_unchanged() -> None:
    timing = ServerTiming(queue=0.1, prefill=0.2, decode=0.5)
    assert validate(timing, 1.0) == (timing, [])
    assert validate(ServerTiming(), 1.0) == (ServerTiming(), [])


@pytest.mark.parametrize(
    ("timing", "clean", "dropped"),
    [
        (ServerTiming(queue=-0.1, prefill=0.2), ServerTiming(prefill=0.2), ["queue"]),
        (ServerTiming(queue=math.nan, decode=math.inf), ServerTiming(), ["queue", "decode"]),
        (ServerTiming(prefill="0.2", decode=True), ServerTiming(), ["prefill", "decode"]),  # type: ignore[arg-type]
        (ServerTiming(queue=5.0, prefill=0.2), ServerTiming(prefill=0.2), ["queue"]),  # a queue longer than the request
        (ServerTiming(queue=0.6, prefill=0.6), ServerTiming(), ["queue", "prefill"]),  # together past it
        (ServerTiming(decode=1), ServerTiming(decode=1.0), []),  # an int is a number
    ],
)
def test_bad_phases_are_dropped(timing: ServerTiming, clean: ServerTiming, dropped: list[str]) -> None:
    result, names = validate(timing, 1.0)
    assert names == dropped
    assert result == ServerTiming(clean.queue, clean.prefill, clean.decode, rejected=dropped)
    for phase in (result.queue, result.prefill, result.decode):
        assert phase is None or (type(phase) is float and phase >= 0.0)


def test_tolerance() -> None:
    elapsed = 2.0
    bound = elapsed + TOLERANCE_S + TOLERANCE_FRACTION * elapsed
    assert validate(ServerTiming(decode=bound - 1e-9), elapsed)[1] == []
    assert validate(ServerTiming(decode=bound + 1e-6), elapsed)[1] == ["decode"]


def test_provider_rejections_are_carried_along() -> None:
    result, dropped = validate(ServerTiming(prefill=9.0, rejected=["load_duration"]), 1.0)
    assert dropped == ["prefill"] and result.rejected == ["load_duration", "prefill"]


@pytest.mark.parametrize("elapsed", [math.nan, -1.0, math.inf, "1"])
def test_an_unusable_elapsed_bounds_nothing(elapsed: Any) -> None:
    result, dropped = validate(ServerTiming(queue=50.0, prefill=-1.0), elapsed)
    assert result.queue == 50.0 and result.prefill is None and dropped == ["prefill"]


_ANY = (
    st.none()
    | st.floats()
    | st.integers(-(10**30), 10**30)
    | st.booleans()
    | st.text(max_size=4)
    | st.lists(st.integers(), max_size=2)
)


@fuzz
@given(queue=_ANY, prefill=_ANY, decode=_ANY, elapsed=st.floats(0, 1e6))
def test_fuzz_validate(queue: Any, prefill: Any, decode: Any, elapsed: float) -> None:
    result, dropped = validate(ServerTiming(queue, prefill, decode), elapsed)
    phases = [p for p in (result.queue, result.prefill, result.decode) if p is not None]
    for phase in phases:
        assert type(phase) is float and math.isfinite(phase) and phase >= 0.0
    bound = elapsed + TOLERANCE_S + TOLERANCE_FRACTION * elapsed
    assert sum(phases) <= bound
    assert len(phases) + len(dropped) == sum(v is not None for v in (queue, prefill, decode))
