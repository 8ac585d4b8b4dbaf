"""Hostile streams: a 100 MB line, a million tiny events, deep JSON, overflowing numbers, repeated usage;
and fuzzing of the decoders, the usage filter, the tap and every provider parser.

Whatever an upstream sends, the client gets exactly those bytes, no exception escapes the parsers, the
proxy's memory stays bounded, and usage is never counted twice.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import random
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings, strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from llmtap.analysis.timeline import Timeline
from llmtap.config.load import build
from llmtap.providers import PROVIDERS, UsageEventFilter
from llmtap.providers.base import Provider
from llmtap.providers.sse import Event, decoder_for
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.intake.tap import Tap
from tests.conftest import Running, Telemetry, require_real
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.procs import FaultUpstream, Llmtap, metric_value, upstream as upstream  # the fixture

CHAT = {
    "model": "fault",
    "stream": True,
    "messages": [{"role": "user", "content": "Say something."}],
    "stream_options": {"include_usage": True},
}
INT64_MAX = 2**63 - 1


# --- through a real proxy process: bytes, memory and the span -----------------------------------------


class Peak(threading.Thread):
    """Samples a process's resident memory every 10 ms; ``peak`` is the largest seen."""

    def __init__(self, proxy: Llmtap) -> None:
        super().__init__(daemon=True)
        self.proxy = proxy
        self.peak = proxy.rss()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, self.proxy.rss())

    def __enter__(self) -> Peak:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()


@pytest.fixture(scope="module")
def traced(upstream: FaultUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Llmtap, HTTPReceiver]]:
    receiver = HTTPReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    proxy = Llmtap(upstream.url, tmp_path_factory.mktemp("hostile") / "llmtap.log", "--log-level", "warning", env=env)
    yield proxy, receiver
    proxy.close()
    receiver.close()


def relay(proxy: Llmtap, upstream: FaultUpstream, fault: str, arg: int) -> tuple[str, float, int]:
    """One hostile stream through the proxy; checks the client got the upstream's exact bytes."""
    rid = uuid.uuid4().hex
    headers = {"x-request-id": rid, "x-fault": fault, "x-fault-arg": str(arg)}
    digest = hashlib.sha256()
    size = 0
    started = time.monotonic()
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        for part in r.iter_raw():
            digest.update(part)
            size += len(part)
    took = time.monotonic() - started
    assert digest.hexdigest() == upstream.sent(rid)["sha256"], "the client's bytes differ from the upstream's"
    return rid, took, size


def partial_tapes(proxy: Llmtap) -> float:
    """Streams whose timing reached the telemetry process without some of their bytes, so far."""
    prefix = 'llmtap_telemetry_tapes_dropped_total{llmtap_telemetry_reason="partial"}'
    lines = [line for line in proxy.metrics().splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def root_span(receiver: HTTPReceiver, count: int) -> dict[str, Any]:
    """The ``count``-th request span the receiver got (1-based), once it is there.

    A deadline for arrival, not a bound on speed: the niced telemetry process decodes a million events in
    seconds on a quiet machine, and several times that when busy loops at normal priority hold every core.
    """
    deadline = time.monotonic() + 120
    while True:
        roots = [attributes(s.attributes) for _, s in receiver.received.spans() if s.name == "chat fault"]
        if len(roots) >= count:
            return roots[count - 1]
        assert time.monotonic() < deadline, "span did not arrive"
        time.sleep(0.05)


def test_100mb_line_is_relayed_and_dropped_by_the_parser_with_bounded_memory(
    traced: tuple[Llmtap, HTTPReceiver], upstream: FaultUpstream
) -> None:
    proxy, receiver = traced
    seen = len([s for _, s in receiver.received.spans() if s.name == "chat fault"])
    before = proxy.rss()
    with Peak(proxy) as peak:
        _, took, size = relay(proxy, upstream, "big-line", 100 << 20)
    grew = peak.peak - before
    print(f"\n100 MB line: relayed {size >> 20} MiB in {took:.2f} s; RSS {before >> 20} MiB, peak +{grew >> 20} MiB")
    assert size > 100 << 20
    # One SSE decoder may hold an event up to its 16 MiB limit before giving up on it.
    assert grew < 48 << 20, grew
    attrs = root_span(receiver, seen + 1)
    # The relay outruns a niced telemetry process on a busy machine: past the channel's bound the rest of
    # the line goes as timing only, and the tape says so. Either way the usage after the line is read.
    if partial_tapes(proxy) == 0:
        assert attrs[sc.OVERSIZED_EVENTS] == 1
    assert attrs[sc.OUTCOME] == "ok" and attrs[sc.USAGE_OUTPUT_TOKENS] == 1


#: Tapes that reached the telemetry process without some of their bytes count here (reason ``partial``).
PARTIAL = "llmtap_telemetry_tapes_dropped_total"


def test_a_million_tiny_events(traced: tuple[Llmtap, HTTPReceiver], upstream: FaultUpstream) -> None:
    proxy, receiver = traced
    before = proxy.rss()
    # 54 MiB in a quarter of a second: on a busy machine the telemetry process can fall more than its 16 MiB
    # byte bound behind, and the stream's last bytes (its usage) then come as timing only, counted partial, as
    # designed. Such a try is said by the counter and the stream goes again, up to three times.
    for attempt in range(3):
        partial = metric_value(
            proxy.metrics(), "llmtap_telemetry_tapes_dropped_total", llmtap_telemetry_reason="partial"
        )
        seen = len([s for _, s in receiver.received.spans() if s.name == "chat fault"])
        with Peak(proxy) as peak:
            _, took, size = relay(proxy, upstream, "tiny-events", 1_000_000)
        print(
            f"\n1,000,000 events: {size >> 20} MiB relayed in {took:.2f} s ({1e6 / took:,.0f} events/s);"
            f" RSS peak +{(peak.peak - before) >> 20} MiB"
        )
        attrs = root_span(receiver, seen + 1)
        assert attrs[sc.OUTCOME] == "ok"
        if sc.USAGE_OUTPUT_TOKENS in attrs or attempt == 2:
            break
        now = metric_value(proxy.metrics(), PARTIAL, llmtap_telemetry_reason="partial")
        assert now == partial + 1, (partial, now)
    assert attrs[sc.USAGE_OUTPUT_TOKENS] == 1_000_000 and attrs[sc.OUTPUT_TOKENS_SOURCE] == "usage"
    assert sc.MALFORMED_EVENTS not in attrs
    assert peak.peak - before < 64 << 20


# --- in process: exact telemetry --------------------------------------------------------------------------


@pytest.fixture
def proxy(proxy_factory: Any, upstream: FaultUpstream) -> Running:
    running: Running = proxy_factory(build({"upstream": upstream.url}, env={}))
    return running


def one_request(proxy: Running, upstream: FaultUpstream, telemetry: Telemetry, fault: str, arg: int) -> dict[str, Any]:
    telemetry.spans.clear()
    rid = uuid.uuid4().hex
    headers = {"x-request-id": rid, "x-fault": fault, "x-fault-arg": str(arg)}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=30) as r:
        body = r.read()
    assert hashlib.sha256(body).hexdigest() == upstream.sent(rid)["sha256"]
    proxy.flush()
    spans = telemetry.finished()
    # Whatever the upstream sent, the spans encode to OTLP (no value outside int64, no NaN key trouble).
    assert encode_spans(spans).SerializeToString()
    (root,) = [s for s in spans if sc.ROUTE in (s.attributes or {})]
    return dict(root.attributes or {})


def _output_tokens_recorded(telemetry: Telemetry) -> float:
    points = telemetry.metrics()["gen_ai.client.token.usage"]
    return float(sum(p.sum for p in points if p.attributes.get(sc.TOKEN_TYPE) == "output"))


def test_deep_json_is_malformed_not_fatal(proxy: Running, upstream: FaultUpstream, telemetry: Telemetry) -> None:
    attrs = one_request(proxy, upstream, telemetry, "deep-json", 200_000)
    assert attrs[sc.MALFORMED_EVENTS] == 2
    assert attrs[sc.OUTCOME] == "ok" and attrs[sc.USAGE_OUTPUT_TOKENS] == 3


def test_overflowing_numbers_are_dropped_not_exported(
    proxy: Running, upstream: FaultUpstream, telemetry: Telemetry
) -> None:
    attrs = one_request(proxy, upstream, telemetry, "overflow", 0)
    # No usable usage: counted with tiktoken instead, and said so (llmtap's count, never shown as usage).
    assert attrs[sc.OUTPUT_TOKENS_SOURCE] != "usage"
    assert attrs[sc.OUTPUT_TOKENS] == 2 and sc.USAGE_OUTPUT_TOKENS not in attrs
    for key, value in attrs.items():
        if isinstance(value, int) and not isinstance(value, bool):
            assert 0 <= value <= INT64_MAX or key == sc.SERVER_PORT, (key, value)
        if isinstance(value, float):
            assert math.isfinite(value), (key, value)


@pytest.mark.parametrize("fault", ["dup-usage", "cumulative-usage"])
def test_repeated_usage_is_never_counted_twice(
    proxy: Running, upstream: FaultUpstream, telemetry: Telemetry, fault: str
) -> None:
    attrs = one_request(proxy, upstream, telemetry, fault, 5)
    assert attrs[sc.USAGE_OUTPUT_TOKENS] == 5 and attrs[sc.USAGE_INPUT_TOKENS] == 12
    assert _output_tokens_recorded(telemetry) == 5


# --- fuzzing -------------------------------------------------------------------------------------------

fuzz = settings(max_examples=200, deadline=None)

# Keys the providers read, so generated objects reach their code paths rather than being ignored.
KEYS = [
    "choices", "delta", "message", "content", "text", "role", "finish_reason", "usage", "prompt_tokens",
    "completion_tokens", "input_tokens", "output_tokens", "prompt_tokens_details", "cached_tokens", "type",
    "error", "id", "model", "index", "tool_calls", "function", "arguments", "response", "output", "item",
    "candidates", "parts", "usageMetadata", "promptTokenCount", "candidatesTokenCount", "done", "eval_count",
    "prompt_eval_count", "eval_duration", "metrics", "stats", "stop_reason", "cache_read_input_tokens",
    "cache_creation_input_tokens", "thinking", "reasoning_content", "stream", "stream_options",
    "include_usage", "messages", "system", "tools", "max_tokens", "temperature", "n", "stop", "prompt",
]  # fmt: skip
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["chat.completion.chunk", "message_delta", "content_block_delta", "error", "[DONE]", ""])
)
JSONISH = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=6),
    max_leaves=40,
)
# Text JSON cannot say in a standard way: NaN, infinities, 1e400, huge and deep values.
ODD_TEXT = st.sampled_from(
    ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 5000, "[" * 5000 + "]" * 5000, '{"a":' * 3000]
)


def _path(provider: Provider) -> str:
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/api/chat",
        "/api/generate",
        "/v1beta/models/m:streamGenerateContent",
        "/v1/projects/p/locations/l/publishers/google/models/m:streamGenerateContent",
        "/v1/embeddings",
        "/api/embed",
    ):
        if provider.matches("POST", path):
            return path
    raise AssertionError(f"no path for {provider.name}")


def _check_facts(facts: Any) -> None:
    usage = getattr(facts, "usage", None)
    if usage is not None:
        for name in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens"):
            value = getattr(usage, name)
            assert value is None or (isinstance(value, int) and 0 <= value <= INT64_MAX), (name, value)


@pytest.mark.parametrize("provider", PROVIDERS, ids=[f"{p.name}-{_path(p)}" for p in PROVIDERS])
@fuzz
@given(
    values=st.lists(JSONISH.map(json.dumps) | ODD_TEXT | st.text(max_size=50), max_size=8), event=st.text(max_size=20)
)
def test_fuzz_provider_parsers_never_raise(provider: Provider, values: list[str], event: str) -> None:
    parser = provider.stream_parser()
    for data in values:
        _check_facts(parser.feed(Event(event, data)))
    assert parser.malformed >= 0
    for data in values:
        _check_facts(provider.parse_body(data.encode()))
        info = provider.inspect(data.encode(), inject_usage=True, path=_path(provider))
        if info.rewritten_body is not None:
            json.loads(info.rewritten_body)  # a rewritten request is valid JSON


#: Event payloads clearly under the decoders' 256-byte limit in the fuzz below (with the framing's own bytes),
#: or over it: JSON objects of a plain alphabet, so that their size is known before encoding.
UNDER, OVER = st.integers(0, 200), st.integers(257, 1000)
PLAIN = "abcdefghijklmnopqrstuvwxyz0123456789 "


@fuzz
@given(
    sizes=st.lists(UNDER | OVER, min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
    cuts=st.lists(st.integers(0, 10_000), max_size=10),
    framing=st.sampled_from(["sse", "ndjson", "json-array"]),
)
def test_fuzz_decoders_bound_every_event(sizes: list[int], seed: int, cuts: list[int], framing: str) -> None:
    """Events on both sides of the limit, split anywhere: every one under it comes out whole and in order,
    every one over it is dropped and counted, and where the chunks were cut changes nothing."""
    rng = random.Random(seed)
    payloads = [json.dumps({"t": "".join(rng.choice(PLAIN) for _ in range(n))}) for n in sizes]
    if framing == "sse":
        data = b"".join(f"data: {p}\n\n".encode() for p in payloads)
    elif framing == "ndjson":
        data = b"".join(f"{p}\n".encode() for p in payloads)
    else:
        data = ("[" + ",".join(payloads) + "]").encode()
    decoder = decoder_for(framing, max_bytes=256)
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    events = [e for a, b in itertools.pairwise(bounds) for e in decoder.feed(data[a:b])]
    events += decoder.flush()
    kept = [p for p, n in zip(payloads, sizes, strict=True) if n <= 200]
    assert [e.data for e in events] == kept
    assert decoder.oversized == len(payloads) - len(kept)


@fuzz
@given(chunks=st.lists(st.binary(max_size=300), max_size=12))
def test_fuzz_usage_filter_loses_no_byte_it_should_keep(chunks: list[bytes]) -> None:
    f = UsageEventFilter(max_held=512)
    out = b"".join(f.feed(c) for c in chunks) + f.flush()
    whole = b"".join(chunks)
    if b'"choices"' not in whole:
        assert out == whole  # nothing is a usage event, so everything passes, in order
    else:
        assert len(out) <= len(whole)


@fuzz
@given(
    chunks=st.lists(
        st.binary(max_size=300) | JSONISH.map(lambda v: f"data: {json.dumps(v)}\n\n".encode()), max_size=10
    ),
    provider=st.sampled_from(PROVIDERS),
    content_type=st.sampled_from(["text/event-stream", "application/x-ndjson", "application/json", ""]),
)
def test_fuzz_tap_reads_any_bytes_without_raising(chunks: list[bytes], provider: Provider, content_type: str) -> None:
    tl = Timeline("POST", "/", "r", "http://u", "u", 80, provider.name, "p", received=0.0, received_wall_ns=0)
    tap = Tap(tl, provider, content_type=content_type, content_encoding="", stream_requested=True)
    for i, c in enumerate(chunks):
        tap.feed(c, float(i))
    tap.finish(99.0)
    assert tl.response_bytes == sum(len(c) for c in chunks)
    assert len(tl.chunk_times) <= len(chunks) + 1


def test_decoder_memory_stays_bounded_on_an_endless_line() -> None:
    for framing in ("sse", "ndjson", "json-array"):
        decoder = decoder_for(framing, max_bytes=1 << 20)
        prefix = {"sse": b"data: ", "ndjson": b"", "json-array": b'[{"a":"'}[framing]
        block = b"y" * 65536
        tracemalloc.start()
        decoder.feed(prefix)
        for _ in range(512):  # 32 MiB without a line end
            decoder.feed(block)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert decoder.oversized == 1, framing
        assert peak < 3 << 20, (framing, peak)


def test_atheris_fuzz_of_decoders_and_parsers() -> None:
    """Coverage-guided: 20,000 inputs through decoders, the usage filter and every provider
    (tests/support/fuzz_parsers.py)."""
    found = importlib.util.find_spec("atheris") is not None
    require_real(found, "atheris", "pyproject's test extra installs it on Linux x86_64 with Python below 3.14")
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.fuzz_parsers", "-runs=20000", "-max_len=4096", "-seed=1"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 20000 runs" in done.stderr
