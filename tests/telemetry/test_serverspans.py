"""The upstream's own spans: the OTLP receiver, the join to llmtap's requests, and slot learning."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from llmtap.analysis.slots import FROM_METRICS, SlotLearner, Slots, load
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Route, Settings, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.admin.server import AdminApp
from llmtap.telemetry.emit.spans import wall_ns
from llmtap.telemetry.fleet.serverspans import (
    MAX_BODY_BYTES,
    PROBE,
    RATIO_FLOOR,
    BadBody,
    Join,
    ServerSpan,
    inflate,
    parse,
)
from llmtap.telemetry.fleet.upstreams import UpstreamWatch
from llmtap.telemetry.recorder import Recorder
from llmtap.types import ServerTiming
from llmtap.wire.messages import Stats, encode_stats
from tests.conftest import PATIENCE, ServerThread, Telemetry
from tests.telemetry.test_recorder import timeline

TRACE = "0af7651916cd43dd8448eb211c80319c"
UPSTREAM = "http://upstream:8000"


def span_bytes(
    parent: str, *, queue: float = 0.125, prefill: float = 0.25, decode: float = 0.5, trace: str = TRACE, **extra: Any
) -> bytes:
    """An OTLP export holding one vLLM-like ``llm_request`` span under ``parent``."""
    attrs = [
        KeyValue(key="gen_ai.latency.time_in_queue", value=AnyValue(double_value=queue)),
        KeyValue(key="gen_ai.latency.time_in_model_prefill", value=AnyValue(double_value=prefill)),
        KeyValue(key="gen_ai.latency.time_in_model_decode", value=AnyValue(double_value=decode)),
        KeyValue(key="gen_ai.usage.prompt_tokens", value=AnyValue(int_value=40)),
        *(KeyValue(key=k, value=AnyValue(**v)) for k, v in extra.items()),
    ]
    span = Span(
        trace_id=bytes.fromhex(trace),
        span_id=bytes.fromhex("00f067aa0ba902b7"),
        parent_span_id=bytes.fromhex(parent),
        name="llm_request",
        attributes=attrs,
    )
    other = Span(trace_id=bytes.fromhex(trace), span_id=b"\x01" * 8, name="no latency here")
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span, other])])])
    return bytes(request.SerializeToString())


def server_span(parent: str, queue: float = 1.25) -> ServerSpan:
    return ServerSpan(TRACE, "00f067aa0ba902b7", parent, "llm_request", ServerTiming(queue, 0.5, 0.75))


# --- parsing ----------------------------------------------------------------------------------------


def test_parse_reads_the_latency_attributes_of_a_server_span() -> None:
    (span,) = parse(span_bytes("b7ad6b7169203331"))
    assert (span.trace_id, span.parent_span_id, span.name) == (TRACE, "b7ad6b7169203331", "llm_request")
    assert (span.timing.queue, span.timing.prefill, span.timing.decode) == (0.125, 0.25, 0.5)
    assert span.timing.rejected == []


def test_parse_refuses_unusable_phases_and_non_otlp_bytes() -> None:
    (span,) = parse(span_bytes("b7ad6b7169203331", queue=-1.0, prefill=float("nan")))
    assert span.timing.queue is None and span.timing.prefill is None and span.timing.decode == 0.5
    assert span.timing.rejected == ["queue", "prefill"]
    with pytest.raises(BadBody) as bad:
        parse(b"\xff\xff\xff\xff not protobuf")
    assert bad.value.reason == "bad_body"


def test_inflate_bounds_and_encodings() -> None:
    body = span_bytes("b7ad6b7169203331")
    assert inflate(gzip.compress(body), "gzip") == body
    assert inflate(body, None) == body
    bomb = gzip.compress(b"\0" * (20 << 20))
    for data, encoding, reason in (
        (bomb, "gzip", "inflated_too_large"),
        (b"\0" * (MAX_BODY_BYTES + 1), None, "too_large"),
        (body, "br", "unsupported_type"),
        (b"not gzip", "gzip", "bad_body"),
        (gzip.compress(body)[:-12], "gzip", "bad_body"),
    ):
        with pytest.raises(BadBody) as bad:
            inflate(data, encoding)
        assert bad.value.reason == reason, (encoding, reason)


def test_inflate_bounds_the_ratio_above_its_floor() -> None:
    """A body may inflate to ``max_ratio`` times its size, or to ``RATIO_FLOOR`` bytes when that is more."""
    small = gzip.compress(b"\0" * (RATIO_FLOOR - 1024))  # about 1 KB sent: far over the ratio, under the floor
    assert len(inflate(small, "gzip", max_ratio=4)) == RATIO_FLOOR - 1024
    big = gzip.compress(b"\0" * (4 << 20))  # 4 MiB from about 4 KB: 1,000 times
    with pytest.raises(BadBody) as bad:
        inflate(big, "gzip", max_ratio=64)
    assert bad.value.reason == "inflated_too_large" and "64 times" in str(bad.value)
    assert len(inflate(big, "gzip", max_ratio=2000)) == 4 << 20
    with pytest.raises(BadBody) as bad:
        inflate(big, "gzip", max_ratio=2000, max_inflated=2 << 20)
    assert bad.value.reason == "inflated_too_large" and str(2 << 20) in str(bad.value)


# --- the join ---------------------------------------------------------------------------------------


class Counts:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, outcome: str, n: int) -> None:
        self.seen[outcome] = self.seen.get(outcome, 0) + n


def test_join_matches_a_waiting_request_by_its_span_id() -> None:
    counts = Counts()
    join: Join[str] = Join(10.0, counts)
    assert join.wants(UPSTREAM, compatible=True) and not join.wants(UPSTREAM, compatible=False)
    assert join.hold("aaaaaaaaaaaaaaaa", UPSTREAM, "request a", 0.0) == []
    assert join.hold("bbbbbbbbbbbbbbbb", UPSTREAM, "request b", 1.0) == []
    matched = join.spans([server_span("bbbbbbbbbbbbbbbb")], 2.0)
    assert [item for item, _ in matched] == ["request b"] and join.held == 1
    assert join.traced(UPSTREAM) and join.wants(UPSTREAM, compatible=False)
    assert join.next_deadline() == 10.0
    assert join.due(9.9) == [] and join.due(10.0) == ["request a"]
    assert counts.seen == {"matched": 1, "missing": 1}


def test_join_counts_late_and_unmatched_spans_and_keeps_early_ones() -> None:
    counts = Counts()
    join: Join[str] = Join(5.0, counts)
    join.recorded("cccccccccccccccc", UPSTREAM)  # recorded without waiting: its span is late
    assert join.spans([server_span("cccccccccccccccc")], 1.0) == []
    assert join.traced(UPSTREAM)  # ... and says the upstream traces
    # A span before its request finished waits for it, within the wait; past it, it joined nothing.
    assert join.spans([server_span("dddddddddddddddd"), server_span("eeeeeeeeeeeeeeee")], 1.0) == []
    span = join.early("dddddddddddddddd", 2.0)
    assert span is not None and span.timing.queue == 1.25
    assert join.due(7.0) == []
    assert join.early("eeeeeeeeeeeeeeee", 7.0) is None
    assert counts.seen == {"late": 1, "unmatched": 1}


def test_a_further_span_for_a_request_that_has_one_counts_as_a_duplicate() -> None:
    """Issue 44: a second (forged, or re-exported) span of one request was counted in no outcome."""
    counts = Counts()
    join: Join[str] = Join(5.0, counts)
    # Two in one batch for a waiting request: the first joins it, the second is a duplicate.
    join.hold("aaaaaaaaaaaaaaaa", UPSTREAM, "request a", 0.0)
    matched = join.spans([server_span("aaaaaaaaaaaaaaaa"), server_span("aaaaaaaaaaaaaaaa", queue=9.0)], 1.0)
    assert [(item, span.timing.queue) for item, span in matched] == [("request a", 1.25)]
    # One more in a later batch, after the join.
    assert join.spans([server_span("aaaaaaaaaaaaaaaa")], 2.0) == []
    # Two that came before their request finished: the first stands and joins it.
    assert join.spans([server_span("bbbbbbbbbbbbbbbb"), server_span("bbbbbbbbbbbbbbbb", queue=9.0)], 2.0) == []
    found = join.early("bbbbbbbbbbbbbbbb", 3.0)
    assert found is not None and found.timing.queue == 1.25
    assert join.spans([server_span("bbbbbbbbbbbbbbbb")], 3.0) == []
    # Late, then again.
    join.recorded("cccccccccccccccc", UPSTREAM)
    assert join.spans([server_span("cccccccccccccccc"), server_span("cccccccccccccccc")], 3.0) == []
    # An early span its request finds only past the wait joined nothing: counted, not lost.
    join.spans([server_span("dddddddddddddddd")], 3.0)
    assert join.early("dddddddddddddddd", 9.0) is None
    assert counts.seen == {"matched": 1, "late": 1, "duplicate": 5, "unmatched": 1}


def test_join_stops_waiting_for_an_upstream_that_sends_no_spans() -> None:
    join: Join[int] = Join(1.0, Counts())
    for i in range(PROBE):
        assert join.wants(UPSTREAM, compatible=True)
        join.hold(f"{i:016x}", UPSTREAM, i, float(i))
        assert join.due(float(i) + 1.0) == [i]
    assert not join.wants(UPSTREAM, compatible=True)
    assert not Join(0.0, Counts()).wants(UPSTREAM, compatible=True)  # a wait of 0: never


def test_requests_remembered_after_their_wait_are_bounded_when_an_upstream_traces_some() -> None:
    """An upstream that sends the span of every other request (its own sampling, or spans lost on the way) is still
    waited for, and each request whose span never came is remembered so that the span counts as late if it does:
    those memories stay within ``MAX_RECENT`` however long it goes on."""
    from llmtap.telemetry.fleet import serverspans

    counts = Counts()
    join: Join[int] = Join(1.0, counts)
    for i in range(2 * serverspans.MAX_RECENT + 10):
        join.hold(f"{i:016x}", UPSTREAM, i, float(i))
        if i % 2:
            assert [n for n, _ in join.spans([server_span(f"{i:016x}")], float(i))] == [i]
            assert join.wants(UPSTREAM, compatible=False)  # it traces: its requests wait
        else:
            assert join.due(float(i) + 1.0) == [i]
    for i in range(3):
        join.hold(f"{10**6 + i:016x}", UPSTREAM, i, 10**6)
    join.release()
    assert len(join._recent) == serverspans.MAX_RECENT
    assert counts.seen["missing"] == serverspans.MAX_RECENT + 5


def test_requests_waiting_for_their_span_are_bounded_by_their_prompts_size_too() -> None:
    """A waiting request keeps its prompt (the cache diagnosis needs it): long prompts at a high rate would fill
    ``MAX_HELD`` with gigabytes, so the prompts' characters are bounded too; the oldest is recorded at once."""
    from llmtap.telemetry.fleet import serverspans

    counts = Counts()
    join: Join[int] = Join(60.0, counts)
    prompt = serverspans.MAX_HELD_CHARS // 10 + 1
    out = [n for i in range(40) for n in join.hold(f"{i:016x}", UPSTREAM, i, float(i), prompt)]
    assert join.held == 9 and join.held_size == 9 * prompt <= serverspans.MAX_HELD_CHARS
    assert out == list(range(31)) and counts.seen == {"missing": 31}
    assert [n for n, _ in join.spans([server_span(f"{39:016x}")], 40.0)] == [39] and join.held_size == 8 * prompt
    assert join.hold("ffffffffffffffff", UPSTREAM, 99, 41.0, 10 * serverspans.MAX_HELD_CHARS)[-1] == 38
    assert join.held == 1 and join.release() == [99] and join.held_size == 0  # one alone waits, however large


def test_join_is_bounded_and_release_empties_it() -> None:
    join: Join[int] = Join(60.0, Counts())
    from llmtap.telemetry.fleet import serverspans

    for i in range(serverspans.MAX_HELD + 3):
        out = join.hold(f"{i:016x}", UPSTREAM, i, 0.0)
        assert out == ([i - serverspans.MAX_HELD] if i >= serverspans.MAX_HELD else [])
    assert join.held == serverspans.MAX_HELD
    assert len(join.release()) == serverspans.MAX_HELD and join.held == 0 and join.next_deadline() is None


# --- slot learning ----------------------------------------------------------------------------------

VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="medium"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="medium"}} {waiting}
vllm:num_requests_running_total_bogus 99
"""


def test_load_reads_running_and_waiting_of_vllm_and_sglang() -> None:
    assert load(VLLM_PAGE.format(running=2.0, waiting=7.0)) == (2, 7)
    assert load("sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n") == (4, 1)
    assert load("llmtap_sim_num_requests_running 3\n") is None
    assert load("vllm:num_requests_running NaN\n") is None


def test_slot_learner_takes_the_peak_once_requests_wait() -> None:
    learner = SlotLearner()
    for running, waiting in ((1, 0), (2, 0), (0, 4)):  # nothing queued while running: no count yet
        learner.observe(running, waiting)
    assert learner.slots is None
    # Queued with one running (a long prompt holds the step, or a new arrival waits out a step): the count
    # is still the peak ever seen, unconfirmed.
    learner.observe(1, 3)
    assert learner.slots == Slots(2, FROM_METRICS, 0.0)
    for running, waiting in ((2, 5), (1, 4), (2, 3), (2, 0), (2, 1)):
        learner.observe(running, waiting)
    assert learner.slots == Slots(2, FROM_METRICS, 0.875)
    learner.observe(3, 0)  # a higher peak starts over, unconfirmed
    assert learner.slots == Slots(3, FROM_METRICS, 0.0)


class _Page(BaseHTTPRequestHandler):
    page = ""

    def do_GET(self) -> None:
        body = self.page.encode() if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, type[_Page]]]:
    handler = type("Page", (_Page,), {"page": VLLM_PAGE.format(running=2, waiting=6)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_upstream_watch_learns_slots_from_the_upstreams_metrics(metrics_server: tuple[str, type[_Page]]) -> None:
    url, _ = metrics_server
    watch = UpstreamWatch()
    try:
        watch.watch(url)
        watch.watch("https://api.example.com")  # not read: hosted APIs have no such page
        deadline = time.monotonic() + PATIENCE
        while (watch.slots(url) is None or watch.slots(url).confidence < 0.75) and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        slots = watch.slots(url)
        assert watch.compatible(url) and slots is not None and slots.slots == 2 and slots.confidence >= 0.75
        assert not watch.compatible("https://api.example.com")
    finally:
        watch.close()


def test_a_first_request_waits_for_the_first_read(metrics_server: tuple[str, type[_Page]]) -> None:
    """An upstream nothing started watching is read when its first request is recorded, and the answer
    waited for: a fresh proxy's first requests may end before two are ever in flight."""
    url, _ = metrics_server
    watch = UpstreamWatch()
    try:
        assert not watch.compatible(url)  # without a wait: not read yet
        assert watch.compatible(url, wait=10)
        started = time.monotonic()
        assert not watch.compatible("https://api.example.com", wait=10)  # never read, so never waited for
        assert time.monotonic() - started < 5
    finally:
        watch.close()


def test_upstream_watch_says_a_server_without_the_gauges_is_not_compatible(
    metrics_server: tuple[str, type[_Page]],
) -> None:
    url, handler = metrics_server
    handler.page = "some_other_server_metric 1\n"
    watch = UpstreamWatch()
    try:
        watch.watch(url)
        deadline = time.monotonic() + PATIENCE
        while watch._watched[url].compatible is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch._watched[url].compatible is False and watch.slots(url) is None
    finally:
        watch.close()


# --- the recorder and the receiver ------------------------------------------------------------------


class _Watch(UpstreamWatch):
    """An upstream that shows vLLM's gauges, with two slots learned, without reading anything."""

    def compatible(self, upstream: str, wait: float = 0.0) -> bool:
        return True

    def slots(self, upstream: str) -> Slots | None:
        return Slots(2, FROM_METRICS, 0.75)


def traced(span_id: str, **kw: Any) -> Timeline:
    tl = timeline(**kw)
    tl.trace_id, tl.span_id, tl.upstream_seq = TRACE, span_id, 1
    return tl


@pytest.fixture
def recorder(telemetry: Telemetry) -> Iterator[Recorder]:
    settings = Settings(
        routes=(Route(prefix="/", upstream=UPSTREAM, name="default"),),
        telemetry=TelemetrySettings(server_spans_wait=30.0),
    )
    rec = Recorder(settings, tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    rec.upstreams = _Watch()
    yield rec
    rec.close()


def root_attributes(telemetry: Telemetry) -> list[dict[str, Any]]:
    return [dict(s.attributes or {}) for s in telemetry.finished() if sc.ROUTE in (s.attributes or {})]


def counter(telemetry: Telemetry, name: str, key: str) -> dict[str, int]:
    return {p.attributes[key]: p.value for p in telemetry.metrics().get(name, [])}


def test_recorder_waits_for_the_server_span_and_takes_its_phases(recorder: Recorder, telemetry: Telemetry) -> None:
    recorder.record_timeline(traced("b7ad6b7169203331"))
    deadline = time.monotonic() + PATIENCE
    while recorder.join.held == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.join.held == 1 and root_attributes(telemetry) == []  # waiting: nothing written yet
    assert recorder.submit_spans(parse(span_bytes("b7ad6b7169203331", queue=0.125, prefill=0.25)))
    assert recorder.flush(5)
    (attrs,) = root_attributes(telemetry)
    assert attrs[sc.QUEUE_SOURCE] == attrs[sc.PREFILL_SOURCE] == attrs[sc.QUEUE_UPSTREAM_SOURCE] == "server"
    assert attrs[sc.QUEUE_UPSTREAM_DURATION] == 0.125 and attrs[sc.PREFILL_DURATION] == 0.25
    assert attrs[sc.QUEUE_DURATION] == pytest.approx(0.125 + 1 / 128)  # the proxy's own line, then the server's
    assert attrs[sc.DECODE_SERVER_DURATION] == 0.5
    assert (attrs[sc.UPSTREAM_SLOTS], attrs[sc.UPSTREAM_SLOTS_SOURCE]) == (2, FROM_METRICS)
    prefill = [p for p in telemetry.metrics()[sc.METRIC_PREFILL] if p.attributes[sc.PREFILL_SOURCE] == "server"]
    assert len(prefill) == 1 and prefill[0].sum == 0.25
    outcomes = counter(telemetry, sc.METRIC_SERVER_SPANS, sc.SERVER_SPAN_OUTCOME)
    assert outcomes == {"matched": 1, "late": 0, "unmatched": 0, "missing": 0, "duplicate": 0}


def test_a_request_whose_span_never_comes_is_written_estimated_at_flush(
    recorder: Recorder, telemetry: Telemetry
) -> None:
    recorder.record_timeline(traced("b7ad6b7169203331"))
    assert recorder.flush(5)
    (attrs,) = root_attributes(telemetry)
    assert attrs[sc.PREFILL_SOURCE] == "estimated" and sc.DECODE_SERVER_DURATION not in attrs
    # Its span, coming now, is late: counted, and the request is not written twice.
    assert recorder.submit_spans(parse(span_bytes("b7ad6b7169203331")))
    assert recorder.flush(5)
    assert len(root_attributes(telemetry)) == 1
    assert counter(telemetry, sc.METRIC_SERVER_SPANS, sc.SERVER_SPAN_OUTCOME)["late"] == 1


def test_a_span_that_came_first_joins_its_request_at_once(recorder: Recorder, telemetry: Telemetry) -> None:
    assert recorder.submit_spans(parse(span_bytes("b7ad6b7169203331", queue=0.0625)))
    recorder.record_timeline(traced("b7ad6b7169203331"))
    assert recorder.flush(5)
    (attrs,) = root_attributes(telemetry)
    assert attrs[sc.QUEUE_UPSTREAM_SOURCE] == "server" and attrs[sc.QUEUE_UPSTREAM_DURATION] == 0.0625


class _Source:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.settings = recorder.settings
        self.ready = True


@pytest.fixture
def admin(recorder: Recorder, telemetry: Telemetry) -> Iterator[str]:
    server = ServerThread(AdminApp(_Source(recorder), telemetry.prometheus)).__enter__()
    yield server.url + "/v1/traces"
    server.__exit__(None, None, None)


def test_receiver_takes_otlp_protobuf_and_refuses_bad_bodies(
    admin: str, recorder: Recorder, telemetry: Telemetry
) -> None:
    recorder.record_timeline(traced("b7ad6b7169203331"))
    protobuf = {"content-type": "application/x-protobuf"}
    with httpx.Client(timeout=10) as client:
        body = gzip.compress(span_bytes("b7ad6b7169203331"))
        ok = client.post(admin, content=body, headers={**protobuf, "content-encoding": "gzip"})
        assert ok.status_code == 200 and ok.headers["content-type"] == "application/x-protobuf"
        assert client.post(admin, content=b"\xff\xff\xff\xff", headers=protobuf).status_code == 400
        assert client.post(admin, content=b"{}", headers={"content-type": "application/json"}).status_code == 415
        big = client.post(admin, content=b"\0" * (MAX_BODY_BYTES + 1), headers=protobuf)
        assert big.status_code == 413
        # Without a length the bound holds too (a chunked body).
        chunks = iter([b"\0" * (1 << 20)] * 5)
        assert client.post(admin, content=chunks, headers=protobuf).status_code == 413
        assert client.get(admin).status_code == 405
    assert recorder.flush(5)
    (attrs,) = root_attributes(telemetry)
    assert attrs[sc.PREFILL_SOURCE] == "server"
    rejected = counter(telemetry, sc.METRIC_OTLP_REJECTED, sc.OTLP_REJECT_REASON)
    zero = {"forbidden": 0, "inflated_too_large": 0, "unauthorized": 0}
    assert rejected == {"bad_body": 1, "too_large": 2, "unsupported_type": 1, **zero}


class _Calls(UpstreamWatch):
    def __init__(self) -> None:
        super().__init__()
        self.watched: list[str] = []

    def watch(self, upstream: str) -> None:
        self.watched.append(upstream)


def test_two_requests_in_flight_start_the_watch_of_their_upstream(telemetry: Telemetry) -> None:
    settings = Settings(routes=(Route(prefix="/", upstream=UPSTREAM, name="default"),))
    rec = Recorder(settings, tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    calls = rec.upstreams = _Calls()
    try:
        rec.take(0, encode_stats(Stats(True, 0, (("default", 1),), (), (), (), ())))
        assert calls.watched == []  # one at a time: slots do not matter
        rec.take(0, encode_stats(Stats(True, 0, (("default", 2),), (), (), (), ())))
        assert calls.watched == [UPSTREAM]
    finally:
        rec.close()


# --- time the server's own phases leave out ---------------------------------------------------------


def seconds_of(span: Any) -> float:
    return float(span.end_time - span.start_time) / 1e9


def test_time_the_servers_phases_leave_out_is_a_part_of_its_own(recorder: Recorder, telemetry: Telemetry) -> None:
    """Sent at +1/32, first content at +0.5: 0.46875 s upstream, of which the server's queue and prefill account
    for 0.375 s. The other 0.09375 s is a span, an attribute and a metric of its own; the queue and prefill spans
    last what the server said, neither stretched over it."""
    tl = traced("b7ad6b7169203331")
    recorder.record_timeline(tl)
    assert recorder.submit_spans(parse(span_bytes("b7ad6b7169203331", queue=0.125, prefill=0.25)))
    assert recorder.flush(5)
    (attrs,) = root_attributes(telemetry)
    assert attrs[sc.QUEUE_UPSTREAM_DURATION] == 0.125 and attrs[sc.PREFILL_DURATION] == 0.25
    assert attrs[sc.UPSTREAM_UNATTRIBUTED_DURATION] == 0.09375
    spans = {s.name: s for s in telemetry.finished()}
    queue, gap, prefill = spans[sc.SPAN_QUEUE], spans[sc.SPAN_UNATTRIBUTED], spans[sc.SPAN_PREFILL]
    assert (gap.attributes or {})[sc.UPSTREAM_UNATTRIBUTED_DURATION] == 0.09375
    # One after the other, from the request going upstream to its first content chunk.
    assert queue.end_time == gap.start_time and gap.end_time == prefill.start_time
    assert prefill.end_time == wall_ns(tl, 0.5 + tl.received)
    assert seconds_of(queue) == pytest.approx(1 / 32 + 0.125, abs=1e-6)  # received, sent, the server's queue
    assert seconds_of(gap) == pytest.approx(0.09375, abs=1e-6)
    assert seconds_of(prefill) == pytest.approx(0.25, abs=1e-6)
    (point,) = telemetry.metrics()[sc.METRIC_UNATTRIBUTED]
    assert (point.count, point.sum) == (1, 0.09375)


def test_a_server_that_reports_one_phase_leaves_nothing_unattributed(recorder: Recorder, telemetry: Telemetry) -> None:
    # Only the queue reported: prefill is the rest of the upstream TTFT, as before; no part of its own.
    recorder.record_timeline(traced("b7ad6b7169203331"))
    assert recorder.submit_spans(parse(span_bytes("b7ad6b7169203331", queue=0.125, prefill=-1.0)))
    assert recorder.flush(5)
    (attrs,) = root_attributes(telemetry)
    assert attrs[sc.PREFILL_DURATION] == pytest.approx(0.46875 - 0.125)
    assert sc.UPSTREAM_UNATTRIBUTED_DURATION not in attrs
    assert sc.SPAN_UNATTRIBUTED not in {s.name for s in telemetry.finished()}
    assert sc.METRIC_UNATTRIBUTED not in telemetry.metrics()


class _Forward(BaseHTTPRequestHandler):
    """Passes each OTLP export on to ``target`` (the proxy's receiver, known only once the proxy runs)."""

    target = ""
    #: Spans passed on so far.
    spans = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "content-encoding")}
        answer = httpx.post(type(self).target, content=body, headers=headers, timeout=10)
        export = ExportTraceServiceRequest.FromString(inflate(body, self.headers.get("content-encoding", "")))
        type(self).spans += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
        self.send_response(answer.status_code)
        self.send_header("content-type", answer.headers.get("content-type", "application/x-protobuf"))
        self.send_header("content-length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_traced_upstream_with_a_gap_shows_it_on_records_spans_and_the_live_view(
    proxy_factory: Any, telemetry: Telemetry, tmp_path: Any
) -> None:
    """The scripted upstream traces as vLLM does, its phases leaving 0.1 s of its TTFT out (as vLLM's front end
    does): every record, root span and waterfall carries that part as its own, queue and prefill stay the span's."""
    from llmtap.config.types import Records
    from tests.conftest import Scripted
    from tests.telemetry.test_live import view_of
    from tests.telemetry.test_records import records as read_back

    class Forward(_Forward):
        target = ""

    forwarder = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=forwarder.serve_forever, daemon=True).start()
    up = Scripted(
        SCRIPT_TTFT="0.3",
        SCRIPT_GAP="0.01",
        SCRIPT_CHUNKS="4",
        SCRIPT_QUEUE="0.05",
        SCRIPT_UNATTRIBUTED="0.1",
        SCRIPT_OTLP_TRACES=f"http://127.0.0.1:{forwarder.server_address[1]}/v1/traces",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    try:
        records = tmp_path / "records"
        settings = Settings(
            routes=(Route(prefix="/", upstream=up.url, name="default", provider="vllm"),),
            telemetry=TelemetrySettings(server_spans_wait=PATIENCE),
            record=Records(path=str(records)),
        )
        running = proxy_factory(settings, admin=True)
        Forward.target = running.admin.url + "/v1/traces"
        chat = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
        for _ in range(4):
            with httpx.stream("POST", running.url + "/v1/chat/completions", json=chat, timeout=30) as r:
                assert r.status_code == 200
                r.read()
        # The upstream exports its spans in batches: all four passed on before the flush, which writes what still
        # waits for its span at once.
        deadline = time.monotonic() + PATIENCE
        while Forward.spans < 4:
            assert time.monotonic() < deadline, Forward.spans
            time.sleep(0.02)
        running.flush()
        # The first request may finish before llmtap has read the upstream's /metrics (the sign that it traces):
        # then it is written without waiting for its span, estimated, and with no part left out.
        everything = root_attributes(telemetry)
        roots = [a for a in everything if a.get(sc.QUEUE_UPSTREAM_SOURCE) == "server"]
        assert len(everything) == 4 and len(roots) >= 3
        for attrs in everything:
            if attrs not in roots:
                assert sc.UPSTREAM_UNATTRIBUTED_DURATION not in attrs
        for attrs in roots:
            assert attrs[sc.PREFILL_SOURCE] == "server" and attrs[sc.QUEUE_UPSTREAM_DURATION] == 0.05
            left = attrs[sc.UPSTREAM_TTFT] - attrs[sc.QUEUE_UPSTREAM_DURATION] - attrs[sc.PREFILL_DURATION]
            assert attrs[sc.UPSTREAM_UNATTRIBUTED_DURATION] == pytest.approx(left, abs=1e-9)
            # The script's 0.1 s, and what the hop to it and back took.
            assert 0.1 - 0.005 <= attrs[sc.UPSTREAM_UNATTRIBUTED_DURATION] < 0.1 + 0.25
        # Each prefill span lasts the server's prefill, not the rest of the upstream's TTFT.
        prefills = sorted(seconds_of(s) for s in telemetry.finished() if s.name == sc.SPAN_PREFILL)
        assert prefills == pytest.approx(sorted(a[sc.PREFILL_DURATION] for a in everything), abs=1e-6)
        lines = [r["upstream_unattributed"] for r in read_back(records) if r["upstream_unattributed"] is not None]
        assert sorted(lines) == pytest.approx(sorted(a[sc.UPSTREAM_UNATTRIBUTED_DURATION] for a in roots), abs=1e-6)
        window = view_of(running).window
        shown = [r for r in window.since(0) if r["upstream_unattributed"] is not None]
        assert len(window.since(0)) == 4 and len(shown) == len(roots)
        for w in shown:
            (gap,) = [p for p in w["phases"] if p["phase"] == "unattributed"]
            assert gap["length"] == pytest.approx(w["upstream_unattributed"], abs=0.002)
            (prefill,) = [p for p in w["phases"] if p["phase"] == "prefill"]
            assert gap["start"] + gap["length"] == pytest.approx(prefill["start"], abs=0.002)
    finally:
        up.close()
        forwarder.shutdown()
        forwarder.server_close()
