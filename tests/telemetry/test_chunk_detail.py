"""Chunk detail decided in the proxy, and per-chunk samples recorded in bulk.

End to end against real OTLP receivers (``tests/e2e/test_otlp.py``): with default settings a normal streamed
request exports at most 6 spans, its chunk statistics on the decode span; a failed one keeps a span for
every chunk it got. Then the decision's rules one by one, and the bulk histogram path against the SDK's own.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import Histogram as SdkHistogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ExponentialHistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.kinds import Invalid, share
from llmtap.config.types import TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.bulk import record_many
from llmtap.telemetry.emit.chunkdetail import MIN_HISTORY, ChunkDetail
from tests.e2e.test_otlp import OTEL_ENV, HTTPReceiver, Received, attributes, wait_for
from tests.support.procs import FaultUpstream, Llmtap, upstream as upstream  # the fixture

CHAT: dict[str, Any] = {
    "model": "fault",
    "stream": True,
    "messages": [{"role": "user", "content": "Say something."}],
    "stream_options": {"include_usage": True},
}
CHUNKS = 24


def _stream(proxy: Llmtap, rid: str, **headers: str) -> None:
    sent = {"x-request-id": rid, "x-chunks": str(CHUNKS), "x-gap-ms": "2", **headers}
    try:
        with proxy.client.stream("POST", "/v1/chat/completions", json=CHAT, headers=sent) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                pass
    except httpx.HTTPError:
        pass  # the failed one: its upstream reset the connection mid-stream


def _trees(received: Received) -> dict[bytes, list[Any]]:
    out: dict[bytes, list[Any]] = {}
    for _, span in received.spans():
        out.setdefault(span.trace_id, []).append(span)
    return out


def _root(tree: list[Any]) -> Any:
    (root,) = [s for s in tree if s.parent_span_id == b""]
    return root


def test_normal_requests_export_at_most_six_spans_and_a_failed_one_every_chunk_span(
    upstream: FaultUpstream, tmp_path: Path
) -> None:
    receiver = HTTPReceiver()
    defaults = {k: v for k, v in OTEL_ENV.items() if not k.startswith("LLMTAP_")}  # llmtap's own settings: defaults
    env = {**defaults, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        normal = 8
        for i in range(normal):
            _stream(proxy, f"normal-{i}")
        _stream(proxy, "failed", **{"x-fault": "reset-mid-stream", "x-fault-arg": "10"})
        received = receiver.received
        wait_for("every root span", lambda: sum(1 for t in _trees(received).values() if len(t) >= 4) >= 9, proxy)
        trees = list(_trees(received).values())
        failed = [t for t in trees if attributes(_root(t).attributes).get("error.type")]
        normal_trees = [t for t in trees if t not in failed]
        assert len(failed) == 1 and len(normal_trees) == normal

        (tree,) = failed
        decode = next(s for s in tree if s.name == sc.SPAN_DECODE)
        chunk_spans = [s for s in tree if s.name == sc.SPAN_CHUNK]
        decode_attrs = attributes(decode.attributes)
        assert decode_attrs[sc.CHUNK_DETAIL] == "error"
        # Every content chunk the client got before the reset has its span.
        assert len(chunk_spans) == decode_attrs[sc.CHUNK_COUNT] == 10
        assert all(s.parent_span_id == decode.span_id for s in chunk_spans)

        # With default settings the sampled share is 5%, by trace id: the few sampled keep theirs, with the reason.
        for tree in normal_trees:
            decode = next(s for s in tree if s.name == sc.SPAN_DECODE)
            decode_attrs = attributes(decode.attributes)
            if decode_attrs[sc.CHUNK_DETAIL] == "sampled":
                assert len([s for s in tree if s.name == sc.SPAN_CHUNK]) == CHUNKS
                continue
            assert decode_attrs[sc.CHUNK_DETAIL] == "summary"
            assert len(tree) <= 6, sorted(s.name for s in tree)
            assert not [s for s in tree if s.name == sc.SPAN_CHUNK]
            # The chunk statistics stand in for the chunk spans.
            assert decode_attrs[sc.CHUNK_COUNT] == CHUNKS
            # Gaps may be 0: on a busy machine several chunks arrive in one read and share its stamp.
            assert 0 <= decode_attrs[sc.DECODE_GAP_P50] <= decode_attrs[sc.DECODE_GAP_P99]
            assert decode_attrs[sc.DECODE_GAP_P99] <= decode_attrs[sc.DECODE_GAP_MAX]
            assert 1 <= decode_attrs[sc.DECODE_GAP_MAX_INDEX] < CHUNKS
            assert 0 <= decode_attrs[sc.DECODE_GAP_MAX_AT] <= (decode.end_time_unix_nano - decode.start_time_unix_nano)
            assert decode_attrs[sc.DECODE_ITL_P50] >= 0
        assert sum(1 for t in normal_trees if len(t) <= 6) >= normal - 2, [len(t) for t in normal_trees]
    finally:
        proxy.close()
        receiver.close()


# --- the decision, rule by rule -----------------------------------------------------------------


def _request(route: str = "r", *, ttft: float = 0.1, gap: float = 0.02, trace: int = 0, outcome: str = "ok") -> Any:
    tl = Timeline("POST", "/v1/chat/completions", route, "u", "h", 80, "openai_chat", "openai", 0.0, 0)
    tl.trace_id = format(trace, "032x")
    if outcome == "cancelled":
        tl.fail("cancelled", cancelled=True)
    elif outcome == "error":
        tl.fail("upstream_closed")
    s = Summary(ttft=ttft)
    return tl, s, gap


def test_failed_cancelled_and_missed_requests_keep_detail_others_do_not_unless_sampled() -> None:
    detail = ChunkDetail(TelemetrySettings(chunk_detail_sample=0.0))
    assert detail.decide(*_request(outcome="error")) == "error"
    assert detail.decide(*_request(outcome="cancelled")) == "cancelled"
    tl, s, gap = _request()
    s.slo = "missed"
    assert detail.decide(tl, s, gap) == "slo_missed"
    assert detail.decide(*_request()) is None
    every = ChunkDetail(TelemetrySettings(chunk_detail_sample=1.0))
    assert every.decide(*_request(trace=(1 << 128) - 1)) == "sampled"


def test_the_sampled_share_follows_the_trace_id() -> None:
    detail = ChunkDetail(TelemetrySettings(chunk_detail_sample=0.1, chunk_detail_tail=0.999))
    rng = random.Random(31)
    traces = [rng.getrandbits(128) for _ in range(4000)]
    kept = [t for t in traces if detail.decide(*_request(trace=t)) == "sampled"]
    assert 300 < len(kept) < 500
    # The same trace is chosen again, whatever decides it (another process, a restart).
    again = ChunkDetail(TelemetrySettings(chunk_detail_sample=0.1, chunk_detail_tail=0.999))
    assert all(again.decide(*_request(trace=t)) == "sampled" for t in kept[:50])


def test_a_request_slower_than_its_routes_recent_tail_keeps_detail() -> None:
    detail = ChunkDetail(TelemetrySettings(chunk_detail_sample=0.0, chunk_detail_tail=0.99))
    rng = random.Random(7)
    # Before MIN_HISTORY requests the route has no tail: a slow one is not kept for it.
    assert detail.decide(*_request(ttft=9.0)) is None
    for _ in range(MIN_HISTORY + 10):
        assert detail.decide(*_request(ttft=rng.uniform(0.1, 0.2), gap=rng.uniform(0.01, 0.02))) in (None, "tail")
    assert detail.decide(*_request(ttft=0.5)) == "tail"
    assert detail.decide(*_request(gap=0.5)) == "tail"
    assert detail.decide(*_request(ttft=0.15, gap=0.015)) is None
    # Another route has its own tail (none yet).
    assert detail.decide(*_request("other", ttft=0.5)) is None
    # A route whose answers are one chunk (no gap at all): the first one with a gap is above its tail.
    for _ in range(MIN_HISTORY):
        detail.decide(*_request("whole", ttft=0.1, gap=0.0))
    assert detail.decide(*_request("whole", ttft=0.1, gap=0.0)) is None
    assert detail.decide(*_request("whole", ttft=0.1, gap=0.3)) == "tail"


def test_share_accepts_fractions_and_percentages_and_refuses_the_rest() -> None:
    kind = share()
    assert kind.parse("0.05") == 0.05 and kind.parse("5%") == 0.05 and kind.parse(1) == 1.0 and kind.parse(0) == 0.0
    for bad in ("1.5", "-0.1", "x", True, "nan"):
        with pytest.raises(Invalid):
            kind.parse(bad)


# --- many samples at once, equal to one at a time ---------------------------------------------


def _points(temporality: AggregationTemporality, exponential: bool, bulk: bool) -> list[Any]:
    views = [View(instrument_name="h", aggregation=ExponentialBucketHistogramAggregation())] if exponential else []
    # A second view that keeps one attribute only: its series add up both attribute sets.
    views.append(View(instrument_name="h", name="h.by_a", attribute_keys={"a"}))
    reader = InMemoryMetricReader(preferred_temporality={SdkHistogram: temporality})
    # And a second reader of the other temporality: every reader's storage gets every sample.
    other = AggregationTemporality.DELTA if temporality == AggregationTemporality.CUMULATIVE else temporality
    second = InMemoryMetricReader(preferred_temporality={SdkHistogram: other})
    provider = MeterProvider(metric_readers=[reader, second], views=views, shutdown_on_exit=False)
    hist = provider.get_meter("t").create_histogram("h", explicit_bucket_boundaries_advisory=[0.01, 0.02, 0.05])
    rng = random.Random(3)
    points: list[Any] = []
    for _round in range(2):  # two collections: delta resets between them
        for attrs in ({"a": "x", "n": 1}, {"a": "y", "n": 2}):
            values = [rng.uniform(0, 0.08) for _ in range(50)]
            if bulk:
                record_many(hist, values, attrs, context=Context())
            else:
                for v in values:
                    hist.record(v, attrs)  # type: ignore[arg-type]
        for data in (reader.get_metrics_data(), second.get_metrics_data()):
            assert data is not None
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        for p in m.data.data_points:
                            assert not isinstance(p, NumberDataPoint) and p.attributes is not None
                            buckets = (
                                (p.scale, p.positive.offset, tuple(p.positive.bucket_counts))
                                if isinstance(p, ExponentialHistogramDataPoint)
                                else tuple(p.bucket_counts)
                            )
                            points.append(
                                (m.name, tuple(sorted(p.attributes.items())), p.count, round(p.sum, 9), buckets)
                            )
    provider.shutdown()
    return sorted(points)


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
@pytest.mark.parametrize("exponential", [False, True], ids=["explicit", "exponential"])
def test_bulk_samples_aggregate_as_one_record_each(temporality: AggregationTemporality, exponential: bool) -> None:
    one_by_one = _points(temporality, exponential, bulk=False)
    assert len(one_by_one) >= 8 and all(p[2] in (50, 100) for p in one_by_one), one_by_one
    assert _points(temporality, exponential, bulk=True) == one_by_one
