"""OTLP end to end: ``llmtap serve`` exports to real OTLP/HTTP and OTLP/gRPC receivers written here.

No exporter is mocked: the receivers decode the protobuf bodies the SDK's exporters put on the wire.
The last test points telemetry at a dead and a slow collector and checks that the request path does
not notice.
"""

from __future__ import annotations

import gzip
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import httpx
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.conftest import PATIENCE, Scripted, free_port
from tests.support.net import LoopbackHTTPServer, answer
from tests.support.procs import Llmtap
from tests.support.scripted_upstream import script

ROOT = Path(__file__).resolve().parents[2]
CHUNKS = 8
PLAN = script(0.0, 0.0, CHUNKS)
TEXT = "".join(t for _, toks in PLAN for t in toks)
TOKENS = sum(len(toks) for _, toks in PLAN)
CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
OTEL_ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_SERVICE_NAME": "llmtap-test",
    "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci",
    "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=abc",
    "OTEL_METRIC_EXPORT_INTERVAL": "300",
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    # Every request keeps its chunk spans here; tests/telemetry/test_chunk_detail.py checks the default decision.
    "LLMTAP_CHUNK_DETAIL_SAMPLE": "1",
}


# --- what the receivers decoded -----------------------------------------------------------------


def value(v: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as a Python value."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


@dataclass
class Received:
    """Every export request a receiver accepted, with the headers (or gRPC metadata) it came with."""

    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    logs: list[ExportLogsServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    arrived: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        request: ExportTraceServiceRequest | ExportMetricsServiceRequest | ExportLogsServiceRequest,
        headers: dict[str, str],
    ) -> None:
        with self.lock:
            if isinstance(request, ExportTraceServiceRequest):
                self.traces.append(request)
            elif isinstance(request, ExportLogsServiceRequest):
                self.logs.append(request)
            else:
                self.metrics.append(request)
            self.headers.append({k.lower(): v for k, v in headers.items()})

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """(resource attributes, span) for every span received."""
        with self.lock:
            return [
                (attributes(rs.resource.attributes), span)
                for request in self.traces
                for rs in request.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def log_records(self) -> list[LogRecord]:
        """Every log record received."""
        with self.lock:
            return [
                lr
                for request in self.logs
                for rl in request.resource_logs
                for sl in rl.scope_logs
                for lr in sl.log_records
            ]

    def latest_metrics(self) -> dict[str, tuple[dict[str, Any], Metric]]:
        """(resource attributes, metric) by name, from the newest export that had it."""
        out: dict[str, tuple[dict[str, Any], Metric]] = {}
        with self.lock:
            for request in self.metrics:
                for rm in request.resource_metrics:
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            out[metric.name] = (attributes(rm.resource.attributes), metric)
        return out


# --- the receivers ------------------------------------------------------------------------------


class _OTLPHandler(BaseHTTPRequestHandler):
    server: HTTPReceiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        with self.server.received.lock:
            self.server.received.arrived += 1
        if self.server.delay:
            time.sleep(self.server.delay)
        if self.path == "/v1/traces":
            self.server.received.add(ExportTraceServiceRequest.FromString(body), dict(self.headers.items()))
            reply = ExportTraceServiceResponse().SerializeToString()
        elif self.path == "/v1/metrics":
            self.server.received.add(ExportMetricsServiceRequest.FromString(body), dict(self.headers.items()))
            reply = ExportMetricsServiceResponse().SerializeToString()
        elif self.path == "/v1/logs":
            self.server.received.add(ExportLogsServiceRequest.FromString(body), dict(self.headers.items()))
            reply = ExportLogsServiceResponse().SerializeToString()
        else:
            self.send_error(404)
            return
        answer(self, reply, "application/x-protobuf")

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class HTTPReceiver(LoopbackHTTPServer):
    """OTLP/HTTP (protobuf) on a free port: POST /v1/traces, /v1/metrics and /v1/logs."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.received = Received()
        super().__init__(_OTLPHandler)


@pytest.fixture
def receiver() -> Iterator[HTTPReceiver]:
    """An OTLP/HTTP receiver for one test."""
    r = HTTPReceiver()
    yield r
    r.close()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
        self.received.add(request, dict(context.invocation_metadata()))
        return ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: ExportMetricsServiceRequest, context: Any) -> ExportMetricsServiceResponse:
        self.received.add(request, dict(context.invocation_metadata()))
        return ExportMetricsServiceResponse()


class GRPCReceiver:
    """OTLP/gRPC on a free port: the trace and metrics services."""

    def __init__(self) -> None:
        self.received = Received()
        self.pool = futures.ThreadPoolExecutor(max_workers=4)
        self.server = grpc.server(self.pool)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self.received), self.server)  # type: ignore[no-untyped-call]
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self.received), self.server)  # type: ignore[no-untyped-call]
        self.port = int(self.server.add_insecure_port("127.0.0.1:0"))
        self.server.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.stop(None).wait(5)
        self.pool.shutdown(wait=True)


# --- llmtap as a child process ------------------------------------------------------------------


def chat(proxy: Llmtap) -> float:
    """One streamed chat request; checks the answer is complete and returns its wall time."""
    start = time.perf_counter()
    with proxy.client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    elapsed = time.perf_counter() - start
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    return elapsed


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    up = Scripted(SCRIPT_TTFT="0.02", SCRIPT_GAP="0.005", SCRIPT_CHUNKS=str(CHUNKS))
    yield up
    up.close()


def wait_for(what: str, check: Callable[[], bool], proxy: Llmtap, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout}s:\n" + proxy.logs()[-4000:])
        time.sleep(0.05)


# --- (a), (b): what arrives at a real collector ---------------------------------------------------


@pytest.mark.parametrize(
    ("protocol", "latest"), [("http/protobuf", False), ("grpc", False), ("grpc", True)], ids=["http", "grpc", "latest"]
)
def test_otlp_export(protocol: str, latest: bool, upstream: Scripted, tmp_path: Path) -> None:
    receiver: HTTPReceiver | GRPCReceiver = HTTPReceiver() if protocol == "http/protobuf" else GRPCReceiver()
    env = {**OTEL_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    if latest:
        env["OTEL_SEMCONV_STABILITY_OPT_IN"] = "gen_ai_latest_experimental"
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        chat(proxy)
        received = receiver.received
        flavour = "inference" if latest else "operation"
        duration, ttfc = f"gen_ai.client.{flavour}.duration", f"gen_ai.client.{flavour}.time_to_first_chunk"
        wait_for("root span", lambda: any(s.name == "chat scripted" for _, s in received.spans()), proxy)
        wait_for("metrics", lambda: {duration, ttfc} <= set(received.latest_metrics()), proxy)

        # Resource and headers, as the OTEL_* variables asked.
        spans = received.spans()
        (resource, root), *more = [(res, s) for res, s in spans if s.name == "chat scripted"]
        assert not more
        assert resource["service.name"] == "llmtap-test"
        assert resource["deployment.environment"] == "ci"
        assert received.headers and all(h.get("x-tenant") == "abc" for h in received.headers)

        # The span tree of one request.
        assert root.kind == Span.SPAN_KIND_CLIENT
        assert root.parent_span_id == b""
        attrs = attributes(root.attributes)
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == "openai"
        assert attrs["gen_ai.request.model"] == "scripted"
        assert attrs["gen_ai.usage.output_tokens"] == TOKENS
        # The proxy's own cost: its overhead, and the delay it added to each chunk, p99 and most.
        assert 0 < attrs["llmtap.proxy.overhead"] < attrs["llmtap.duration"]
        assert 0 <= attrs["llmtap.relay.chunk_delay.p99"] <= attrs["llmtap.relay.chunk_delay.max"]
        assert attrs["llmtap.relay.chunk_delay.max"] < attrs["llmtap.duration"]
        tree = [s for _, s in spans if s.trace_id == root.trace_id]
        children = {s.name: s for s in tree if s.parent_span_id == root.span_id}
        assert {"llmtap.queue", "llmtap.prefill", "llmtap.decode"} <= set(children)
        decode = children["llmtap.decode"]
        chunk_spans = [s for s in tree if s.parent_span_id == decode.span_id and s.name == "llmtap.decode.chunk"]
        assert len(chunk_spans) == CHUNKS
        assert all(root.start_time_unix_nano <= s.start_time_unix_nano <= root.end_time_unix_nano for s in tree)

        # Metrics: names by the semconv flavour, seconds, one observation each.
        metrics = received.latest_metrics()
        for name in (duration, ttfc):
            resource, metric = metrics[name]
            assert metric.unit == "s", name
            assert metric.WhichOneof("data") == "histogram", name
            assert sum(p.count for p in metric.histogram.data_points) == 1, name
            assert resource["service.name"] == "llmtap-test"
        other = "gen_ai.client.operation.duration" if latest else "gen_ai.client.inference.duration"
        assert other not in metrics
    finally:
        proxy.close()
        receiver.close()


# --- (c): a dead and a slow collector stay off the request path -----------------------------------


def test_collector_down_does_not_slow_requests(upstream: Scripted, tmp_path: Path) -> None:
    slow = HTTPReceiver(delay=2.0)
    dead = free_port()
    telemetry_env = {
        **OTEL_ENV,
        "OTEL_METRIC_EXPORT_INTERVAL": "100",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{dead}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": slow.url + "/v1/metrics",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
    }
    exporting = Llmtap(upstream.url, tmp_path / "exporting.log", env=telemetry_env)
    try:
        quiet = Llmtap(upstream.url, tmp_path / "quiet.log", env={"OTEL_TRACES_EXPORTER": "none"})
    except BaseException:
        exporting.close()
        raise
    try:
        chat(exporting)  # warm both connection pools
        chat(quiet)
        with_export: list[float] = []
        without: list[float] = []
        for _ in range(20):  # interleaved, so both see the same machine
            with_export.append(chat(exporting))
            without.append(chat(quiet))
        median_with, median_without = statistics.median(with_export), statistics.median(without)
        assert abs(median_with - median_without) < 0.050, (median_with, median_without)
        # The slow collector was really being called while the requests ran.
        assert slow.received.arrived >= 1
        assert exporting.proc.poll() is None, exporting.logs()[-4000:]
        assert httpx.get(f"http://127.0.0.1:{exporting.admin_port}/healthz", timeout=2).status_code == 200
    finally:
        exporting.close()
        quiet.close()
        slow.close()
