"""Upstream faults, slow clients, clients that leave, and a collector that fails: on real sockets.

Each fault has one documented client outcome (README, "Failure behaviour") and one ``error.type`` on the
request's span. Every byte the upstream wrote before it failed reaches the client unchanged: the fault
upstream publishes the sha256 of what it wrote, and the client's bytes must match it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from llmtap.config.load import build
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.setup import ExportGate
from tests.conftest import Running, Telemetry, free_port, unanswered_port
from tests.support.fault_upstream import SMUGGLED
from tests.support.procs import (  # the fixture
    FaultUpstream,
    Llmtap,
    Simulator,
    metric_value,
    tcp_queues,
    upstream as upstream,
)

pytestmark = pytest.mark.e2e

READ, IDLE = 1.0, 0.3
#: The read timeout of the proxy a stalled body meets: far past the idle timeout, so the bound that cut the stall is
#: told by its error type and by a time that a busy machine cannot blur (the stall holds until the client leaves, and
#: the client's own timeout, 10 s, comes later still).
STALL_READ = 8.0
CHAT: dict[str, Any] = {
    "model": "fault",
    "stream": True,
    "messages": [{"role": "user", "content": "Say something."}],
    "stream_options": {"include_usage": True},
}


@pytest.fixture
def proxy(proxy_factory: Any, upstream: FaultUpstream) -> Running:
    flags = {"upstream": upstream.url, "read_timeout": READ, "idle_timeout": IDLE, "slo_ttft_ms": 5000}
    running: Running = proxy_factory(build(flags, env={}))
    return running


def root(t: Telemetry) -> ReadableSpan:
    """The one request span recorded since the exporter was cleared."""
    found = [s for s in t.finished() if sc.ROUTE in (s.attributes or {})]
    assert len(found) == 1, [s.name for s in found]
    return found[0]


def request(
    url: str, fault: str = "", arg: int = 0, *, body: dict[str, Any] | None = None, **headers: str
) -> tuple[int | None, bytes, Exception | None, str]:
    """One chat request named by a fresh id: its status, the body bytes received, the error that ended it."""
    rid = uuid.uuid4().hex
    sent = {"x-request-id": rid, "x-fault": fault, "x-fault-arg": str(arg), **headers}
    status: int | None = None
    received = b""
    error: Exception | None = None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body or CHAT, headers=sent, timeout=10) as r:
            status = r.status_code
            for part in r.iter_raw():
                received += part
    except httpx.HTTPError as exc:
        error = exc
    return status, received, error, rid


# --- upstream faults --------------------------------------------------------------------------------

FAULTS = [
    # fault, status the client sees, whether its body is cut, error.type on the span
    ("reset-before-headers", 502, False, "upstream_closed"),
    ("close-before-headers", 502, False, "upstream_closed"),
    ("stall-headers", 504, False, "timeout"),
    ("stall-body", 200, True, "idle_timeout"),
    ("reset-mid-stream", 200, True, "upstream_closed"),
    ("close-mid-stream", 200, True, "upstream_closed"),
    ("cl-long", 200, True, "upstream_closed"),
]


@pytest.mark.parametrize("usage", ["asked", "injected"])
@pytest.mark.parametrize(("fault", "status", "cut", "error_type"), FAULTS, ids=[f[0] for f in FAULTS])
def test_upstream_fault(
    proxy: Running,
    proxy_factory: Any,
    upstream: FaultUpstream,
    telemetry: Telemetry,
    fault: str,
    status: int,
    cut: bool,
    error_type: str,
    usage: str,
) -> None:
    """With usage "injected" the proxy asked for usage itself, so its usage filter holds partial events."""
    telemetry.spans.clear()
    body = CHAT if usage == "asked" else {k: v for k, v in CHAT.items() if k != "stream_options"}
    if fault == "stall-body":
        flags = {"upstream": upstream.url, "read_timeout": STALL_READ, "idle_timeout": IDLE, "slo_ttft_ms": 5000}
        proxy = proxy_factory(build(flags, env={}))
    started = time.monotonic()
    got, received, error, rid = request(proxy.url, fault, 3, body=body)
    elapsed = time.monotonic() - started
    assert got == status
    if cut:
        # The proxy ends the client's response the way the upstream ended its own: without a clean end.
        assert isinstance(error, httpx.RemoteProtocolError), error
        # Zero bytes lost or altered: the client holds exactly what the upstream wrote before it failed.
        assert hashlib.sha256(received).hexdigest() == upstream.sent(rid)["sha256_without_usage"]
        assert received
    else:
        assert error is None
        assert json.loads(received)["error"]["type"] == {502: "upstream_closed", 504: "upstream_timeout"}[status]
    if fault == "stall-headers":
        # The wait for headers is bounded by the read timeout, not by the (shorter) idle one; the upper bound is the
        # next bound in line, the client's own 10 s, with room left for a machine whose load stalls the loop.
        assert READ <= elapsed < READ + 5.0, elapsed
    if fault == "stall-body":
        # The wait for the next chunk is bounded by the idle timeout, not by the (far longer) read timeout.
        assert IDLE <= elapsed < STALL_READ, elapsed
    proxy.flush()
    attrs = root(telemetry).attributes or {}
    assert attrs[sc.ERROR_TYPE] == error_type
    assert attrs[sc.OUTCOME] == "error"
    assert attrs[sc.SLO_OUTCOME] == "missed"


def test_connection_refused(proxy_factory: Any, telemetry: Telemetry) -> None:
    running: Running = proxy_factory(build({"upstream": f"http://127.0.0.1:{free_port()}"}, env={}))
    status, received, _, _ = request(running.url)
    assert status == 502 and json.loads(received)["error"]["type"] == "upstream_unreachable"
    running.flush()
    assert root(telemetry).attributes[sc.ERROR_TYPE] == "upstream_unreachable"  # type: ignore[index]


def test_connect_timeout(proxy_factory: Any, telemetry: Telemetry) -> None:
    with unanswered_port() as port:
        running: Running = proxy_factory(
            build({"upstream": f"http://127.0.0.1:{port}", "connect_timeout": 0.3}, env={})
        )
        started = time.monotonic()
        status, received, _, _ = request(running.url)
        elapsed = time.monotonic() - started
    assert status == 504 and json.loads(received)["error"]["type"] == "upstream_timeout"
    assert 0.3 <= elapsed < 5.0, elapsed  # the connect timeout cut it: the client's own 10 s comes far later
    running.flush()
    assert root(telemetry).attributes[sc.ERROR_TYPE] == "connect_timeout"  # type: ignore[index]


def test_body_longer_than_content_length_never_answers_another_request(
    proxy: Running, upstream: FaultUpstream, telemetry: Telemetry
) -> None:
    """RFC 9112 section 6.3: bytes past a response's end must never be read as the next response."""
    telemetry.spans.clear()
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        first = client.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers={"x-fault": "cl-short"})
        assert first.status_code == 200
        assert first.content == b'{"id":"chatcmpl-fault","object":"chat.completion","choices":[]}'
        proxy.flush()
        assert root(telemetry).attributes[sc.ERROR_TYPE] == "upstream_protocol_error"  # type: ignore[index]
        # The next requests reuse the proxy's pool; the hidden response must not answer any of them.
        for _ in range(3):
            after = client.post("/v1/chat/completions", json={**CHAT, "stream": False})
            assert after.status_code == 200 and SMUGGLED not in after.content
            assert after.json()["object"] == "chat.completion"


# --- clients that leave -------------------------------------------------------------------------------


def _raw_request(port: int, body: dict[str, Any], headers: dict[str, str]) -> socket.socket:
    payload = json.dumps(body).encode()
    lines = ["POST /v1/chat/completions HTTP/1.1", "host: llmtap", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()] + [f"content-length: {len(payload)}", "", ""]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall("\r\n".join(lines).encode() + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes, count: int = 1) -> None:
    seen = b""
    sock.settimeout(10)
    while seen.count(marker) < count:
        part = sock.recv(65536)
        assert part, seen
        seen += part


@pytest.mark.parametrize("phase", ["before-headers", "before-first-token", "mid-decode"])
def test_client_disconnect_cancels_upstream_within_100ms(
    proxy: Running, upstream: FaultUpstream, telemetry: Telemetry, phase: str
) -> None:
    telemetry.spans.clear()
    rid = uuid.uuid4().hex
    headers = {"x-request-id": rid, "x-chunks": "500", "x-gap-ms": "20"}
    if phase == "before-headers":
        headers["x-fault"] = "stall-headers"
    elif phase == "before-first-token":
        headers["x-gap-ms"] = "3000"  # the first content chunk is 3 s away: the server is "prefilling"
    with contextlib.closing(_raw_request(proxy.server.port, CHAT, headers)) as sock:
        if phase == "before-headers":
            time.sleep(0.2)
        elif phase == "before-first-token":
            _read_until(sock, b'"role":"assistant"')
        else:
            _read_until(sock, b'"content":"', 6)
        left = time.monotonic()
    deadline = left + 2
    while (gone := upstream.sent(rid).get("gone_at")) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert gone is not None, "the upstream never saw the request end"
    print(f"\ndisconnect {phase}: upstream saw the request end {1000 * (gone - left):.1f} ms after the client left")
    assert gone - left < 0.100, f"upstream cancelled {1000 * (gone - left):.1f} ms after the client left"
    proxy.flush()
    attrs = root(telemetry).attributes or {}
    assert attrs[sc.OUTCOME] == "cancelled" and attrs[sc.ERROR_TYPE] == "cancelled"
    assert attrs[sc.SLO_OUTCOME] == "missed"
    cancelled = [
        p
        for p in telemetry.metrics()[sc.METRIC_REQUESTS]
        if p.attributes.get(sc.OUTCOME) == "cancelled" and p.attributes.get(sc.SLO_OUTCOME) == "missed"
    ]
    assert cancelled and sum(p.value for p in cancelled) >= 1


@pytest.fixture(scope="module")
def simulator() -> Iterator[Simulator]:
    sim = Simulator("support")
    yield sim
    sim.close()


@pytest.mark.parametrize("phase", ["before-headers", "during-prefill", "mid-decode"])
def test_client_disconnect_frees_the_simulators_slot(
    proxy_factory: Any, simulator: Simulator, telemetry: Telemetry, phase: str
) -> None:
    running: Running = proxy_factory(build({"upstream": simulator.url, "slo_ttft_ms": 5000}, env={}))
    # A prompt of its own (no prefix-cache hit) of about 6,000 tokens: 0.75 s of prefill.
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(1500))
    body = {
        "model": "llmtap-sim",
        "stream": phase != "before-headers",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": words}],
    }
    with contextlib.closing(_raw_request(running.server.port, body, {})) as sock:
        if phase == "before-headers":
            time.sleep(1.2)  # prefill done, decoding; a non-streamed answer has no headers yet
        elif phase == "during-prefill":
            _read_until(sock, b"HTTP/1.1 200")
            time.sleep(0.2)
        else:
            _read_until(sock, b'"content":"', 4)
        assert simulator.state()["running"] == 1
        left = time.monotonic()
    while simulator.state()["running"] and time.monotonic() < left + 2:
        time.sleep(0.002)
    freed = time.monotonic() - left
    assert simulator.state()["running"] == 0
    print(f"\nsimulator {phase}: slot freed within {1000 * freed:.1f} ms of the client leaving")
    assert freed < 0.100, f"the simulator's slot was freed {1000 * freed:.1f} ms after the client left"
    record = simulator.state()["requests"][-1]
    assert record["outcome"] == "cancelled"
    if phase == "during-prefill":
        assert record["first_token"] is None
    else:
        assert 0 < record["output_tokens"] < 200
    running.flush()
    attrs = root(telemetry).attributes or {}
    assert attrs[sc.OUTCOME] == "cancelled" and attrs[sc.SLO_OUTCOME] == "missed"


# --- a client that does not read: backpressure ----------------------------------------------------------


def test_slow_client_backpressure_bounds_the_proxys_buffer(upstream: FaultUpstream, tmp_path: Path) -> None:
    """A client that stops reading stops the proxy reading upstream; what the proxy holds is bounded."""
    size = 256 << 20
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--log-level", "warning")
    try:
        rid = uuid.uuid4().hex
        before = proxy.rss()
        sock = _raw_request(proxy.port, CHAT, {"x-request-id": rid, "x-fault": "flood", "x-fault-arg": str(size)})
        time.sleep(2.0)  # the client reads nothing: the upstream must be held back
        written = [upstream.sent(rid)["written"]]
        time.sleep(1.0)
        written.append(upstream.sent(rid)["written"])
        queued = tcp_queues({proxy.port, upstream.port})
        held = written[-1] - queued
        stalled_rss = proxy.rss()
        assert written[0] == written[1], "the upstream kept writing while the client read nothing"
        assert written[-1] < size // 16
        assert 0 <= held < 512 << 10, f"the proxy holds {held} bytes in user space"
        # Then the client reads it all: every byte arrives, unchanged.
        digest = hashlib.sha256()
        data = b""
        sock.settimeout(30)
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        digest.update(rest)
        got = len(rest)
        while got < size:
            part = sock.recv(1 << 20)
            assert part, got
            digest.update(part)
            got += len(part)
        sock.close()
        assert b"content-length: %d" % size in head_bytes.lower()
        assert digest.hexdigest() == upstream.sent(rid)["sha256"]
        after = proxy.rss()
        print(
            f"\nbackpressure: upstream stopped at {written[-1] / 1024:.0f} KiB written; {queued / 1024:.0f} KiB in"
            f" kernel queues; proxy user space {held / 1024:.0f} KiB; RSS {before >> 20} -> {stalled_rss >> 20}"
            f" -> {after >> 20} MiB after relaying {size >> 20} MiB"
        )
        assert stalled_rss - before < 16 << 20 and after - before < 32 << 20
    finally:
        proxy.close()


# --- collector faults --------------------------------------------------------------------------------


class _Failing(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that answers every export with 503."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class _Slow(_Failing):
    """An OTLP/HTTP collector that takes 3 s to answer each export (then times out the exporter)."""

    def do_POST(self) -> None:
        time.sleep(3)
        super().do_POST()


@contextlib.contextmanager
def _collector(kind: str) -> Iterator[str]:
    if kind == "unreachable":
        yield f"http://127.0.0.1:{free_port()}"
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Failing if kind == "errors" else _Slow)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("kind", ["unreachable", "errors", "slow"])
def test_collector_fault_drops_are_counted_and_memory_stays_flat(
    upstream: FaultUpstream, tmp_path: Path, kind: str
) -> None:
    with _collector(kind) as endpoint:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf" if kind != "unreachable" else "grpc",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
            "LLMTAP_TELEMETRY_QUEUE": "512",
            "OTEL_TRACES_EXPORTER": "otlp",
            # Every request keeps its chunk spans (34 a request), so 400 of them overflow the queue.
            "LLMTAP_CHUNK_DETAIL_SAMPLE": "1",
        }
        proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--log-level", "error", env=env)
        try:
            with httpx.Client(base_url=proxy.url, timeout=10) as client:

                def burst(n: int) -> None:
                    for _ in range(n):
                        rid = uuid.uuid4().hex
                        with client.stream(
                            "POST", "/v1/chat/completions", json=CHAT, headers={"x-request-id": rid, "x-chunks": "30"}
                        ) as r:
                            body = r.read()
                        # Streams are unaffected: every byte as the upstream wrote it.
                        assert hashlib.sha256(body).hexdigest() == upstream.sent(rid)["sha256"]

                burst(100)
                warm = proxy.rss()
                burst(300)
                hot = proxy.rss()
            # 400 requests of 34 spans each: far more than the queue holds, so most are dropped, and counted:
            # at export, or (a busy machine's telemetry process behind) with their whole tape, never made.
            wanted = 400 * 34 - 512 - 600
            deadline = time.monotonic() + 60
            while True:
                text = proxy.metrics()
                dropped = metric_value(text, "llmtap_telemetry_spans_dropped_total")
                lost = metric_value(text, "llmtap_telemetry_tapes_dropped_total")
                # An export fails after its timeout (1 s): on a quick machine the drops are all counted before that.
                failed_exports = metric_value(text, "llmtap_telemetry_exports_failed_total")
                if (dropped + 34 * lost >= wanted and failed_exports >= 1) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            rss = f"RSS {warm >> 20} -> {hot >> 20} MiB"
            print(f"\ncollector {kind}: {dropped:.0f} spans dropped, {lost:.0f} tapes dropped; {rss}")
            assert dropped + 34 * lost >= wanted, text
            assert failed_exports >= 1
            assert hot - warm < 8 << 20, (warm, hot)
            assert proxy.proc.poll() is None
        finally:
            proxy.close()


class _Stuck(SpanExporter):
    """A span exporter that blocks until released, then succeeds or fails: a collector that hangs."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.release = threading.Event()
        self.received = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(10)
        self.received += len(spans)
        return SpanExportResult.SUCCESS if self.ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


@pytest.mark.parametrize("ok", [True, False], ids=["collector-recovers", "collector-refuses"])
def test_export_gate_accounts_for_every_span(ok: bool) -> None:
    """Each ended span is exported, or dropped and counted once: queue_full, export_failed or shutdown."""
    exporter = _Stuck(ok)
    gate = ExportGate(exporter, capacity=100)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(gate)
    tracer = provider.get_tracer("test")
    for i in range(1000):
        tracer.start_span(f"s{i}").end()
    assert gate.dropped["queue_full"] == 900  # the exporter hangs: only the queue's worth waits
    exporter.release.set()
    provider.shutdown()
    assert gate.exported + gate.dropped["export_failed"] == 100 == exporter.received
    assert gate.exported == (100 if ok else 0)
    assert sum(gate.dropped.values()) + gate.exported == 1000
    observed = {o.attributes[sc.TELEMETRY_REASON]: o.value for o in gate.observe(None)}  # type: ignore[arg-type, index]
    assert observed == gate.dropped
