"""The upstream's own spans, forwarded from ``/v1/traces`` to llmtap's OTLP traces backend as they came."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from llmtap.config.otel import telemetry_from_env
from llmtap.config.types import ConfigError, Records as RecordSettings, Route, Settings, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.admin.server import AdminApp
from llmtap.telemetry.fleet import forward
from llmtap.telemetry.recorder import Recorder
from tests.conftest import PATIENCE, Scripted, ServerThread, Telemetry
from tests.e2e.test_otlp import OTEL_ENV, GRPCReceiver, HTTPReceiver, Received, attributes
from tests.support.procs import Llmtap
from tests.telemetry.test_serverspans import TRACE, UPSTREAM, counter, span_bytes, traced

PROTOBUF = {"content-type": "application/x-protobuf"}


def vllm_export(parent: str, trace: str = TRACE) -> bytes:
    """A vLLM-like export: its own resource and scope around the ``llm_request`` span under ``parent``."""
    request = ExportTraceServiceRequest.FromString(span_bytes(parent, trace=trace))
    resource_spans = request.resource_spans[0]
    resource_spans.resource.CopyFrom(
        Resource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value="vllm"))])
    )
    resource_spans.scope_spans[0].scope.CopyFrom(InstrumentationScope(name="vllm.llm_engine", version="0.9"))
    return bytes(request.SerializeToString())


class _Source:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.settings = recorder.settings
        self.ready = True


@contextlib.contextmanager
def admins(telemetry: Telemetry, prometheus: Any) -> Iterator[Callable[..., tuple[Recorder, str]]]:
    """Admin listeners, each over a recorder of the given record path and telemetry settings, made by the callable
    yielded (it gives the recorder and its /v1/traces URL); all closed on the way out."""
    opened: list[tuple[Recorder, ServerThread]] = []

    def make(record: str | None = None, **telemetry_settings: Any) -> tuple[Recorder, str]:
        settings = Settings(
            routes=(Route(prefix="/", upstream=UPSTREAM, name="default"),),
            telemetry=TelemetrySettings(**telemetry_settings),
            record=RecordSettings(path=record),
        )
        rec = Recorder(settings, tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
        server = ServerThread(AdminApp(_Source(rec), prometheus)).__enter__()
        opened.append((rec, server))
        return rec, server.url + "/v1/traces"

    try:
        yield make
    finally:
        for rec, server in opened:
            server.__exit__(None, None, None)
            rec.close(5)


@pytest.fixture
def make_admin(telemetry: Telemetry) -> Iterator[Callable[..., tuple[Recorder, str]]]:
    """An admin listener (with the Prometheus exposition) over a recorder with the given telemetry settings."""
    with admins(telemetry, telemetry.prometheus) as make:
        yield make


def wait_for(received: Received, count: int) -> None:
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        with received.lock:
            if len(received.traces) >= count:
                return
        time.sleep(0.01)


def test_a_span_posted_to_the_receiver_reaches_the_backend_unchanged(
    make_admin: Callable[..., tuple[Recorder, str]], telemetry: Telemetry
) -> None:
    backend = HTTPReceiver()
    try:
        recorder, admin = make_admin(
            traces_exporter="otlp",
            traces_endpoint=backend.url,
            traces_protocol="http/protobuf",
            traces_headers={"x-tenant": "abc"},
        )
        recorder.record_timeline(traced("b7ad6b7169203331"))  # the request this process relayed
        body = vllm_export("b7ad6b7169203331")
        with httpx.Client(timeout=10) as client:
            assert client.post(admin, content=body, headers=PROTOBUF).status_code == 200
        wait_for(backend.received, 1)
        (got,) = backend.received.traces
        assert got == ExportTraceServiceRequest.FromString(body)  # resource, scope, ids, parent, attributes
        (span, _) = got.resource_spans[0].scope_spans[0].spans
        assert span.parent_span_id.hex() == "b7ad6b7169203331" and span.span_id.hex() == "00f067aa0ba902b7"
        assert backend.received.headers[0]["x-tenant"] == "abc"
        assert backend.received.headers[0]["content-type"] == "application/x-protobuf"
        recorder.close(5)
        outcomes = counter(telemetry, sc.METRIC_OTLP_FORWARDED, sc.OTLP_FORWARD_OUTCOME)
        assert outcomes == {"sent": 2, "dropped": 0, "failed": 0, "unowned": 0}  # both spans, counted as spans
    finally:
        backend.close()


def test_grpc_backend_gets_the_spans_with_the_headers_as_metadata(
    make_admin: Callable[..., tuple[Recorder, str]],
) -> None:
    backend = GRPCReceiver()
    try:
        recorder, admin = make_admin(
            traces_exporter="otlp",
            traces_endpoint=backend.url,
            traces_protocol="grpc",
            traces_headers={"x-tenant": "abc"},
        )
        recorder.record_timeline(traced("b7ad6b7169203331"))
        body = vllm_export("b7ad6b7169203331")
        with httpx.Client(timeout=10) as client:
            assert client.post(admin, content=body, headers=PROTOBUF).status_code == 200
        wait_for(backend.received, 1)
        assert backend.received.traces == [ExportTraceServiceRequest.FromString(body)]
        assert backend.received.headers[0]["x-tenant"] == "abc"
    finally:
        backend.close()


def test_a_backend_that_never_answers_delays_no_answer_and_drops_are_counted(
    make_admin: Callable[..., tuple[Recorder, str]], telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forward, "MAX_QUEUED", 2)
    # Connections complete in the kernel's accept queue and are never accepted: an export sent there hangs.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    try:
        recorder, admin = make_admin(
            traces_exporter="otlp",
            traces_endpoint=f"http://127.0.0.1:{hole.getsockname()[1]}",
            traces_protocol="http/protobuf",
            traces_timeout=60.0,
        )
        forwarder = recorder.forwarder
        assert forwarder is not None
        recorder.record_timeline(traced("b7ad6b7169203331"))
        with httpx.Client(timeout=10) as client:
            assert client.post(admin, content=vllm_export("b7ad6b7169203331"), headers=PROTOBUF).status_code == 200
            deadline = time.monotonic() + PATIENCE
            while forwarder.queued and time.monotonic() < deadline:
                time.sleep(0.01)
            assert forwarder.queued == 0  # the sender took it and waits on the backend
            for _ in range(4):
                answer = client.post(admin, content=vllm_export("b7ad6b7169203331"), headers=PROTOBUF)
                assert answer.status_code == 200
        # Every answer came while the first export still hung (60 s): no answer waited for the backend.
        # Two bodies wait behind it; the other two found the queue full (two spans each). The recorder's worker
        # offers each body after its answer went out, so the count is awaited, not read at once.
        deadline = time.monotonic() + PATIENCE
        outcomes = counter(telemetry, sc.METRIC_OTLP_FORWARDED, sc.OTLP_FORWARD_OUTCOME)
        while outcomes.get("dropped", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
            outcomes = counter(telemetry, sc.METRIC_OTLP_FORWARDED, sc.OTLP_FORWARD_OUTCOME)
        assert outcomes == {"sent": 0, "dropped": 4, "failed": 0, "unowned": 0}
        assert forwarder.queued == 2
    finally:
        hole.close()  # resets the hanging connection: that export fails, and so do the two behind it
    recorder.close(10)
    outcomes = counter(telemetry, sc.METRIC_OTLP_FORWARDED, sc.OTLP_FORWARD_OUTCOME)
    assert outcomes == {"sent": 0, "dropped": 4, "failed": 6, "unowned": 0}


def test_forwarding_is_off_by_setting_and_without_otlp_traces(
    make_admin: Callable[..., tuple[Recorder, str]], telemetry: Telemetry
) -> None:
    backend = HTTPReceiver()
    try:
        off, admin = make_admin(
            traces_exporter="otlp",
            traces_endpoint=backend.url,
            traces_protocol="http/protobuf",
            forward_server_spans=False,
        )
        assert off.forwarder is None
        with httpx.Client(timeout=10) as client:
            assert client.post(admin, content=vllm_export("b7ad6b7169203331"), headers=PROTOBUF).status_code == 200
        off.close(5)
        assert backend.received.arrived == 0
        assert sc.METRIC_OTLP_FORWARDED not in telemetry.metrics()
        console, _ = make_admin(traces_exporter="console")
        assert console.forwarder is None
    finally:
        backend.close()


def test_the_setting_defaults_on_and_reads_from_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert telemetry_from_env(env).forward_server_spans is True
    assert telemetry_from_env({**env, "LLMTAP_FORWARD_SERVER_SPANS": "false"}).forward_server_spans is False
    assert telemetry_from_env(env, {"forward_server_spans": False}).forward_server_spans is False
    # The exporter's timeout, in seconds as the SDK reads it, is the forwarder's too.
    assert telemetry_from_env(env).traces_timeout == 10.0
    both = {"OTEL_EXPORTER_OTLP_TIMEOUT": "3", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5"}
    assert telemetry_from_env({**env, **both}).traces_timeout == 2.5
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        telemetry_from_env({**env, "OTEL_EXPORTER_OTLP_TIMEOUT": "soon"})


def test_llmtap_serve_shows_the_servers_span_under_its_own_at_the_backend(tmp_path: Path) -> None:
    upstream = Scripted(SCRIPT_TTFT="0.02", SCRIPT_GAP="0.005", SCRIPT_CHUNKS="4")
    backend = HTTPReceiver()
    env = {**OTEL_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": backend.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        chat = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
        with proxy.client.stream("POST", "/v1/chat/completions", json=chat) as answer:
            assert answer.status_code == 200
            answer.read()
        deadline = time.monotonic() + PATIENCE
        while not [s for _, s in backend.received.spans() if s.name == "chat scripted"]:
            assert time.monotonic() < deadline, proxy.logs()[-4000:]
            time.sleep(0.05)
        (root,) = [s for _, s in backend.received.spans() if s.name == "chat scripted"]
        # The model server's export of that request, sent where vLLM's --otlp-traces-endpoint would send it.
        export = vllm_export(root.span_id.hex(), trace=root.trace_id.hex())
        admin = f"http://127.0.0.1:{proxy.admin_port}/v1/traces"
        assert httpx.post(admin, content=export, headers=PROTOBUF, timeout=10).status_code == 200
        while not [s for _, s in backend.received.spans() if s.name == "llm_request"]:
            assert time.monotonic() < deadline + 20, proxy.logs()[-4000:]
            time.sleep(0.05)
        ((resource, server),) = [(r, s) for r, s in backend.received.spans() if s.name == "llm_request"]
        assert resource["service.name"] == "vllm"
        assert (server.trace_id, server.parent_span_id) == (root.trace_id, root.span_id)
        assert attributes(server.attributes)["gen_ai.latency.time_in_queue"] == 0.125
    finally:
        proxy.close()
        backend.close()
        upstream.close()
