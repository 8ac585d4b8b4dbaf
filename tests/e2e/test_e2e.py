"""End to end through real sockets: official SDKs -> llmtap -> the scripted upstream."""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from llmtap.config.load import build
from llmtap.telemetry import semconv as sc
from llmtap.wire.tracestate import entry
from tests.conftest import PATIENCE, Running, Scripted, Telemetry

pytestmark = pytest.mark.e2e

TTFT, GAP, CHUNKS = 0.300, 0.020, 40
TOKENS = sum(3 if i % 4 == 3 else 1 for i in range(CHUNKS))
CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}


def root(t: Telemetry) -> ReadableSpan:
    """The last finished request span (the root of llmtap's tree)."""
    found = [s for s in t.finished() if sc.ROUTE in (s.attributes or {})]
    assert found, [s.name for s in t.finished()]
    return found[-1]


def children(t: Telemetry, parent: ReadableSpan, name: str) -> list[ReadableSpan]:
    pid = parent.context.span_id
    return [s for s in t.finished() if s.parent is not None and s.parent.span_id == pid and s.name == name]


@pytest.fixture
def proxy(proxy_factory: Any, scripted: Scripted) -> Running:
    running: Running = proxy_factory(
        build({"upstream": scripted.url, "read_timeout": 5, "chunk_detail_sample": 1.0}, env={}), admin=True
    )
    # Warm the upstream connection pool so the measured request pays no connect (a short answer of the
    # script's does: a whole stream would cost a second per test).
    assert httpx.get(running.url + "/echo-headers", timeout=10).status_code == 200
    running.flush()
    return running


def assert_ttft(attrs: Any, scripted: Scripted, client_ttft: float) -> None:
    """The proxy's TTFT against what the script really did (its first content chunk's offset) and what the
    client measured around it.

    Each clock runs inside the one before it: the client sends before the proxy receives, the proxy
    receives before it sends upstream, and that before the script receives; the script's first content
    chunk is written before the proxy reads it, and that before the client does. So the script's own
    offset <= the proxy's upstream TTFT <= its client-view TTFT <= the client's TTFT, on any machine however
    busy. A proxy that stopped its clock at the role-only chunk falls below the script; one that stopped it
    late (at the end of the stream, or after its own work) rises above the client. The tight, quiet-machine
    figures live in bench/, not in a timed unit test.
    """
    truth = httpx.get(scripted.url + "/active").json()["first_content_offset"]
    upstream = float(attrs[sc.UPSTREAM_TTFT])
    ttft = float(attrs[sc.RESPONSE_TIME_TO_FIRST_CHUNK])
    assert TTFT <= truth, truth  # the script sleeps until its deadline: never early
    assert truth - 0.001 <= upstream <= ttft <= client_ttft, (truth, upstream, ttft, client_ttft)


def test_openai_sdk_stream_timings_match_script(
    proxy: Running, scripted: Scripted, telemetry: Telemetry, closing: Any
) -> None:
    telemetry.spans.clear()
    client = closing(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0))
    sent = time.monotonic()
    stream = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Say something."}], stream=True
    )
    pieces, client_ttft = [], 0.0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            client_ttft = client_ttft or time.monotonic() - sent
            pieces.append(chunk.choices[0].delta.content)
    text = "".join(pieces)
    assert text.startswith(" alpha")
    proxy.flush()
    span = root(telemetry)
    attrs = span.attributes or {}
    assert span.name == "chat scripted"
    assert attrs[sc.OPERATION_NAME] == "chat" and attrs[sc.PROVIDER_NAME] == "openai"
    assert attrs[sc.USAGE_OUTPUT_TOKENS] == TOKENS
    assert attrs[sc.OUTPUT_TOKENS_SOURCE] == "usage"
    # TTFT ends at the first content chunk, not at the role-only chunk that arrived at once.
    ttfb = float(attrs[sc.TTFB])  # type: ignore[arg-type]
    assert_ttft(attrs, scripted, client_ttft)
    assert ttfb < 0.1
    chunk_spans = children(telemetry, children(telemetry, span, sc.SPAN_DECODE)[0], sc.SPAN_CHUNK)
    assert len(chunk_spans) == CHUNKS
    gaps = [float(s.attributes[sc.CHUNK_GAP]) for s in chunk_spans[1:]]  # type: ignore[index, arg-type]
    # Against the gaps the script really left (a busy machine wakes it late too, and it keeps to its
    # deadlines): one late read by the proxy stretches one gap and shortens the next; the median holds.
    written = httpx.get(scripted.url + "/active").json()["content_offsets"]
    script_gaps = [b - a for a, b in itertools.pairwise(written)]
    assert len(written) == CHUNKS and written[0] >= TTFT, written  # this stream's record
    assert statistics.median(abs(g - w) for g, w in zip(gaps, script_gaps, strict=True)) < 0.002, (gaps, script_gaps)
    tpot = float(attrs[sc.TPOT])  # type: ignore[arg-type]
    assert abs(tpot - (written[-1] - written[0]) / (TOKENS - 1)) < 0.005, (tpot, written)
    tokens = [s.attributes[sc.CHUNK_TOKENS] for s in chunk_spans]  # type: ignore[index]
    assert tokens == [3 if i % 4 == 3 else 1 for i in range(CHUNKS)]


def test_client_bytes_equal_direct_call(proxy: Running, scripted: Scripted, telemetry: Telemetry) -> None:
    def raw(base: str, body: dict[str, Any]) -> bytes:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as r:
            return b"".join(r.iter_raw())

    direct = raw(scripted.url, CHAT)
    via = raw(proxy.url, CHAT)
    # The proxy asked upstream for usage and removed that extra event: the client sees what it asked for.
    assert b'"usage"' not in via
    assert via == direct
    proxy.flush()
    assert root(telemetry).attributes[sc.USAGE_OUTPUT_TOKENS] == TOKENS  # type: ignore[index]
    with_usage = {**CHAT, "stream_options": {"include_usage": True}}
    assert raw(proxy.url, with_usage) == raw(scripted.url, with_usage)


def test_anthropic_sdk_stream(proxy: Running, scripted: Scripted, telemetry: Telemetry, closing: Any) -> None:
    telemetry.spans.clear()
    client = closing(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0))
    sent = time.monotonic()
    with client.messages.stream(
        model="scripted", max_tokens=100, messages=[{"role": "user", "content": "Say something."}]
    ) as stream:
        pieces, client_ttft = [], 0.0
        for piece in stream.text_stream:
            client_ttft = client_ttft or time.monotonic() - sent
            pieces.append(piece)
    text = "".join(pieces)
    assert text.startswith(" alpha")
    proxy.flush()
    span = root(telemetry)
    attrs = span.attributes or {}
    assert attrs[sc.PROVIDER_NAME] == "anthropic"
    assert attrs[sc.USAGE_INPUT_TOKENS] == 12 and attrs[sc.USAGE_OUTPUT_TOKENS] == TOKENS
    assert_ttft(attrs, scripted, client_ttft)
    assert attrs[sc.RESPONSE_FINISH_REASONS] == ("end_turn",)


def test_streamed_and_unary_telemetry_agree(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=10).raise_for_status()
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10) as r:
        r.read()
    proxy.flush()
    unary, streamed = [s for s in telemetry.finished() if s.name == "chat scripted"]
    for key in (
        sc.USAGE_INPUT_TOKENS,
        sc.USAGE_OUTPUT_TOKENS,
        sc.RESPONSE_MODEL,
        sc.RESPONSE_FINISH_REASONS,
        sc.RESPONSE_ID,
    ):
        assert unary.attributes[key] == streamed.attributes[key], key  # type: ignore[index]
    assert sc.RESPONSE_TIME_TO_FIRST_CHUNK not in (unary.attributes or {})


def test_traceparent_both_ways(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    incoming = f"00-{trace_id}-00f067aa0ba902b7-01"
    r = httpx.get(proxy.url + "/echo-headers", headers={"traceparent": incoming, "authorization": "Bearer sk-x"})
    seen = r.json()["headers"]
    proxy.flush()
    span = root(telemetry)
    assert span.name == "GET"
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    # Upstream sees the proxy's own span as its parent, in the same trace.
    assert seen["traceparent"] == f"00-{trace_id}-{span.context.span_id:016x}-01"
    assert seen["authorization"] == "Bearer sk-x"
    assert seen["host"].startswith("127.0.0.1:")


BAD_TRACEPARENT = "00-zzzz-bad-01"


@pytest.mark.parametrize("peer", [False, True], ids=["one-replica", "with-owner-entry"])
def test_an_invalid_traceparent_is_treated_as_none(
    proxy_factory: Any, scripted: Scripted, telemetry: Telemetry, peer: bool
) -> None:
    """A ``traceparent`` that does not parse starts a new trace in which llmtap's span is the generation, and the
    client's ``tracestate`` (state of a trace not continued) stays behind; a replica's own entry still goes.

    The control, a valid ``traceparent`` through the same proxy: the hop role and the client's state upstream."""
    extra = {"peer_address": "127.0.0.1:9464"} if peer else {}
    env = {"LLMTAP_PEER_TOKEN": "replicas-share-this"} if peer else {}
    running: Running = proxy_factory(build({"upstream": scripted.url, "read_timeout": 5, **extra}, env=env))
    own = entry("127.0.0.1:9464", "replicas-share-this") if peer else None
    body = {**CHAT, "stream": False}

    def call(traceparent: str) -> tuple[ReadableSpan, dict[str, str]]:
        telemetry.spans.clear()
        headers = {"traceparent": traceparent, "tracestate": "vendor=abc"}
        httpx.post(running.url + "/v1/chat/completions", json=body, headers=headers, timeout=10).raise_for_status()
        sent = httpx.get(scripted.url + "/last-headers", timeout=10).json()["headers"]
        running.flush()
        return root(telemetry), sent

    span, sent = call(BAD_TRACEPARENT)
    assert sent.get("tracestate") == own, sent
    assert (span.name, span.kind) == ("chat scripted", SpanKind.CLIENT)
    attrs = span.attributes or {}
    assert attrs[sc.OPERATION_NAME] == "chat" and attrs[sc.REQUEST_MODEL] == "scripted"
    tokens = attrs[sc.USAGE_INPUT_TOKENS]
    assert isinstance(tokens, int) and tokens > 0 and sc.HOP_REQUEST_MODEL not in attrs
    assert span.parent is None  # a new trace, as the upstream is told
    assert sent["traceparent"] == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    span, sent = call(f"00-{trace_id}-00f067aa0ba902b7-01")
    assert (span.name, span.kind) == ("POST /v1/chat/completions", SpanKind.SERVER)
    assert not [k for k in span.attributes or {} if k.startswith("gen_ai.")]
    assert format(span.context.trace_id, "032x") == trace_id
    assert sent["tracestate"] == (f"{own},vendor=abc" if own else "vendor=abc"), sent


def test_upstream_error_relayed(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    r = httpx.get(proxy.url + "/status/500")
    assert r.status_code == 500 and r.json()["error"]["message"] == "boom"
    proxy.flush()
    span = root(telemetry)
    assert span.attributes[sc.ERROR_TYPE] == "500"  # type: ignore[index]
    assert span.status.status_code.name == "ERROR"


def test_unreachable_gives_502_and_timeout_504(proxy_factory: Any, telemetry: Telemetry) -> None:
    import socket

    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    running = proxy_factory(build({"upstream": f"http://127.0.0.1:{dead_port}"}, env={}))
    r = httpx.post(running.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unreachable"
    # A listener that never answers: the read timeout gives 504.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        slow = proxy_factory(
            build({"upstream": f"http://127.0.0.1:{mute.getsockname()[1]}", "read_timeout": 0.3}, env={})
        )
        r = httpx.post(slow.url + "/v1/chat/completions", json=CHAT, timeout=5)
        assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout"
    slow.flush()
    running.flush()
    errors = sorted(
        str((s.attributes or {}).get(sc.ERROR_TYPE)) for s in telemetry.finished() if s.name.startswith("chat")
    )
    assert errors == ["timeout", "upstream_unreachable"]


def test_malformed_json_forwarded_unchanged(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    body = b'{"model": "scripted", "messages": [oops'
    r = httpx.post(
        proxy.url + "/echo-body/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.json() == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    proxy.flush()
    assert root(telemetry).attributes[sc.REQUEST_PARSE_ERROR]  # type: ignore[index]


def test_large_body_streamed_not_inspected(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    body = json.dumps(
        {"model": "scripted", "messages": [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]}
    ).encode()
    r = httpx.post(proxy.url + "/echo-body/v1/chat/completions", content=body, timeout=30)
    assert r.json() == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    proxy.flush()
    assert root(telemetry).attributes[sc.REQUEST_PARSE_ERROR] == "body_not_inspected"  # type: ignore[index]


def test_upstream_dies_mid_stream(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", proxy.url + "/special/truncate/v1/chat/completions", json=CHAT, timeout=10) as r:
            for part in r.iter_raw():
                received += part
    assert received.count(b"data: ") == 5
    proxy.flush()
    span = root(telemetry)
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[sc.ERROR_TYPE] == "upstream_closed"  # type: ignore[index]


def test_invalid_utf8_and_bare_cr(proxy: Running, scripted: Scripted, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    path = "/special/weird/v1/chat/completions"
    direct = httpx.post(scripted.url + path, json=CHAT).content
    via = httpx.post(proxy.url + path, json=CHAT).content
    assert via == direct and b"\xff" in via
    proxy.flush()
    attrs = root(telemetry).attributes or {}
    assert attrs[sc.OUTCOME] == "ok"
    assert attrs[sc.RESPONSE_FINISH_REASONS] == ("stop",)
    assert children(telemetry, children(telemetry, root(telemetry), sc.SPAN_DECODE)[0], sc.SPAN_CHUNK)


def test_anthropic_error_event_after_200(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    r = httpx.post(proxy.url + "/special/anthropic-error/v1/messages", json={**CHAT, "max_tokens": 10})
    assert r.status_code == 200 and b"overloaded_error" in r.content
    proxy.flush()
    span = root(telemetry)
    assert span.attributes[sc.ERROR_TYPE] == "overloaded_error"  # type: ignore[index]
    assert span.status.status_code.name == "ERROR"


def test_client_disconnect_cancels_upstream(proxy: Running, scripted: Scripted, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    before = httpx.get(scripted.url + "/active").json()
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10) as r:
        for _ in r.iter_raw():
            break
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        now = httpx.get(scripted.url + "/active").json()
        if now["active"] == before["active"]:
            break
        time.sleep(0.01)
    assert now["active"] == before["active"]
    proxy.flush()
    attrs = root(telemetry).attributes or {}
    assert attrs[sc.OUTCOME] == "cancelled" and attrs[sc.ERROR_TYPE] == "cancelled"


def _itl_buckets(telemetry: Telemetry) -> tuple[list[float], list[int]]:
    """The ITL histogram's bounds and counts so far; none yet when no stream has been recorded."""
    points = telemetry.metrics().get(sc.METRIC_ITL)
    if not points:
        return [], []
    point = max(points, key=lambda p: p.count)
    return list(point.explicit_bounds), list(point.bucket_counts)


def test_percentiles_from_histograms_within_10_percent(proxy: Running, telemetry: Telemetry) -> None:
    telemetry.spans.clear()
    # The histogram is cumulative and already holds the warm-up's samples: compare only what this test adds.
    _, before = _itl_buckets(telemetry)
    for _ in range(3):
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10) as r:
            r.read()
    proxy.flush()
    # llmtap's own ITL histogram (fine buckets): each chunk gap after the first chunk, shared by its tokens.
    chunks = [s.attributes or {} for s in telemetry.finished() if s.name == sc.SPAN_CHUNK]
    gaps = [(float(a[sc.CHUNK_GAP]), int(a[sc.CHUNK_TOKENS])) for a in chunks if a[sc.CHUNK_INDEX]]  # type: ignore[arg-type]
    exact_itl = sorted(gap / tokens for gap, tokens in gaps for _ in range(tokens))
    bounds, after = _itl_buckets(telemetry)
    counts = [a - b for a, b in zip(after, before or [0] * len(after), strict=True)]
    assert sum(counts) == len(exact_itl)
    for q in (0.5, 0.95, 0.99):
        exact = exact_itl[min(int(q * len(exact_itl)), len(exact_itl) - 1)]
        est = quantile(q, bounds, counts)
        assert abs(est - exact) / exact < 0.10, (q, est, exact)
    assert statistics.median(gap for gap, _ in gaps) == pytest.approx(GAP, abs=0.003)


def quantile(q: float, bounds: list[float], counts: list[int]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q*N."""
    total = sum(counts)
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if seen + c >= rank and c:
            lo = bounds[i - 1] if i else 0.0
            hi = bounds[i] if i < len(bounds) else bounds[-1]
            return lo + (hi - lo) * (rank - seen) / c
        seen += c
    return bounds[-1]


def test_admin_endpoints(proxy: Running) -> None:
    assert proxy.admin is not None
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10) as r:
        r.read()
    proxy.flush()
    assert httpx.get(proxy.admin.url + "/healthz").status_code == 200
    assert httpx.get(proxy.admin.url + "/readyz").status_code == 200
    text = httpx.get(proxy.admin.url + "/metrics").text
    assert "# TYPE gen_ai_client_operation_duration_seconds histogram" in text
    assert "llmtap_requests_total{" in text
