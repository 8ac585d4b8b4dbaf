"""Hostile clients of the admin listener, through a real ``llmtap serve`` on real sockets: forged spans, a gzip
bomb, thousands of idle connections, hundreds of live-view subscribers, over-long trace headers.

Telling loopback from the network needs a second address, and these tests listen on 127.0.0.1 only. So where a
test needs a sender that counts as an outsider it runs the proxy with ``--admin-loopback-token``, which asks the
token of loopback peers too: the gate then takes the same decision it takes for a peer beyond loopback
(``llmtap.telemetry.admin.access.Gate``), and the peer-address rule itself is checked on its own below.
"""

from __future__ import annotations

import gzip
import resource
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from starlette.requests import Request

from llmtap.config.load import build
from llmtap.config.types import Admin, ConfigError
from llmtap.telemetry.admin.access import Gate, is_loopback
from llmtap.wire.tracecontext import MAX_TRACEPARENT, parse_traceparent
from tests.conftest import PATIENCE
from tests.e2e.test_otlp import HTTPReceiver
from tests.support.procs import (
    FaultUpstream,
    Llmtap,
    Serve,
    metric_value,
    serving,
    upstream as upstream,  # the fixture
)

TOKEN = "admin-token-0123456789abcdef"
OPERATOR = "operator-secret-0123456789"
PROTOBUF = {"content-type": "application/x-protobuf"}
REJECTED = "llmtap_otlp_rejected_total"
ADMIN_REFUSED = "llmtap_admin_refused_total"


@pytest.fixture
def backend() -> Iterator[HTTPReceiver]:
    """The OTLP/HTTP traces backend llmtap exports to, with the operator's token in its headers."""
    receiver = HTTPReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def serve(upstream: FaultUpstream, backend: HTTPReceiver, tmp_path: Path) -> Iterator[Serve]:
    """``serve(*flags)``: an ``llmtap serve`` exporting traces to ``backend`` with the operator's bearer token."""
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": backend.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{OPERATOR}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with serving(upstream.url, tmp_path, env) as start:

        def with_env(*flags: str, extra_env: dict[str, str] | None = None) -> Llmtap:
            return start(*flags, env=extra_env)

        yield with_env


def export(name: str, attribute_bytes: int = 8) -> bytes:
    """An OTLP export of one span named ``name`` with one string attribute of ``attribute_bytes`` letters."""
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = TRACE_ID, bytes(range(1, 9)), name
    span.attributes.append(KeyValue(key="x", value=AnyValue(string_value="a" * attribute_bytes)))
    return bytes(request.SerializeToString())


#: The trace of every span ``export`` makes; ``relay_trace`` relays a request in it, so that the receiver, which
#: forwards only spans of traces its proxy relayed, forwards an accepted span.
TRACE_ID = bytes(range(1, 17))


def relay_trace(proxy: Llmtap) -> None:
    """One request through the proxy as part of ``TRACE_ID``'s trace (the client's traceparent)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    traceparent = f"00-{TRACE_ID.hex()}-{'ab' * 8}-01"
    with httpx.Client(timeout=PATIENCE) as client:
        answer = client.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"traceparent": traceparent, "x-chunks": "2"}
        )
    assert answer.status_code == 200, answer.text


def forwarded(backend: HTTPReceiver, prefix: str) -> list[str]:
    """Names of the spans starting with ``prefix`` that reached the backend."""
    return [span.name for _, span in backend.received.spans() if span.name.startswith(prefix)]


def wait_forwarded(backend: HTTPReceiver, name: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while name not in forwarded(backend, name):
        assert time.monotonic() < deadline, f"{name} never reached the backend"
        time.sleep(0.05)


def token_file(tmp_path: Path) -> str:
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_forged_spans_without_the_token_are_refused_and_never_forwarded(
    serve: Serve, backend: HTTPReceiver, tmp_path: Path
) -> None:
    proxy = serve("--admin-token-file", token_file(tmp_path), "--admin-loopback-token")
    relay_trace(proxy)
    url = proxy.admin_url + "/v1/traces"
    with httpx.Client(timeout=10) as client:

        def post(name: str, authorization: str | None) -> httpx.Response:
            auth = {"authorization": authorization} if authorization else {}
            return client.post(url, content=export(name), headers={**PROTOBUF, **auth})

        none = post("forged-none", None)
        wrong = post("forged-wrong", f"Bearer {TOKEN[:-1]}x")  # all but the last character right
        basic = post("forged-basic", f"Basic {TOKEN}")
        good = post("forged-authorized", f"Bearer {TOKEN}")
        events = client.get(proxy.admin_url + "/events")
    assert [none.status_code, wrong.status_code, basic.status_code] == [401, 401, 401]
    assert none.headers["www-authenticate"] == "Bearer"
    assert good.status_code == 200
    assert events.status_code == 401 and "Bearer" in events.text
    # The forwarder sends in order: once the authorized span arrived, a forwarded refused one would be there too.
    wait_forwarded(backend, "forged-authorized")
    time.sleep(1.0)
    assert forwarded(backend, "forged-") == ["forged-authorized"]
    metrics = proxy.metrics()
    assert metric_value(metrics, REJECTED, llmtap_otlp_reason="unauthorized") == 3
    assert metric_value(metrics, ADMIN_REFUSED, llmtap_admin_reason="unauthorized") == 1
    # What the scrapers and probes read stays open without a token.
    assert httpx.get(proxy.admin_url + "/healthz").status_code == 200
    assert "llmtap_otlp_rejected_total" in metrics


def test_with_no_token_configured_an_outsider_is_refused_outright(serve: Serve, backend: HTTPReceiver) -> None:
    proxy = serve("--admin-loopback-token")
    with httpx.Client(timeout=10) as client:
        answer = client.post(
            proxy.admin_url + "/v1/traces", content=export("forged-open"), headers={**PROTOBUF, "authorization": "x"}
        )
        events = client.get(proxy.admin_url + "/events")
    assert answer.status_code == 403 and b"admin_token_file" in answer.content
    assert events.status_code == 403 and "loopback only" in events.text
    assert metric_value(proxy.metrics(), REJECTED, llmtap_otlp_reason="forbidden") == 1
    time.sleep(1.0)
    assert forwarded(backend, "forged-") == []


def test_the_gate_tells_loopback_from_the_network() -> None:
    """The peer-address rule on its own: loopback in any spelling is trusted; any other address needs the token."""
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback(h) for h in ("192.0.2.7", "10.0.0.1", "::ffff:10.0.0.1", "fd00::2", "", None, "x"))

    def request(host: str, authorization: str | None = None) -> Request:
        headers = [(b"authorization", authorization.encode())] if authorization else []
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "client": (host, 4000)})

    open_gate, locked = Gate(Admin()), Gate(Admin(token=TOKEN))
    assert open_gate.refusal(request("127.0.0.1"), "x") is None
    refusal = open_gate.refusal(request("192.0.2.7", f"Bearer {TOKEN}"), "x")
    assert refusal is not None and refusal.status == 403
    assert locked.refusal(request("192.0.2.7", f"Bearer {TOKEN}"), "x") is None
    wrong = locked.refusal(request("192.0.2.7", f"Bearer {TOKEN[:-1]}"), "x")
    assert wrong is not None and wrong.status == 401


def test_the_admin_token_comes_from_a_file_or_the_environment_and_must_be_sound(tmp_path: Path) -> None:
    path = token_file(tmp_path)
    assert build({"upstream": "http://u", "admin_token_file": path}, env={}).admin.token == TOKEN
    assert build({"upstream": "http://u"}, env={"LLMTAP_ADMIN_TOKEN": TOKEN}).admin.token == TOKEN
    # The file wins over the variable; neither: no token.
    env = {"LLMTAP_ADMIN_TOKEN": "another-token-0123456789"}
    assert build({"upstream": "http://u", "admin_token_file": path}, env=env).admin.token == TOKEN
    assert build({"upstream": "http://u"}, env={}).admin.token is None
    empty, short = tmp_path / "empty", tmp_path / "short"
    empty.write_text("\n")
    short.write_text("short\n")
    for flags, message in (
        ({"admin_token_file": str(tmp_path / "missing")}, "cannot read it"),
        ({"admin_token_file": str(empty)}, "the file is empty"),
        ({"admin_token_file": str(short)}, "at least 16 printable characters"),
    ):
        with pytest.raises(ConfigError, match=message):
            build({"upstream": "http://u", **flags}, env={})


def test_a_gzip_bomb_is_refused_with_413_and_memory_stays_flat(serve: Serve, backend: HTTPReceiver) -> None:
    proxy = serve()  # a loopback sender, as a vLLM beside llmtap: allowed, and still bounded
    relay_trace(proxy)
    url = proxy.admin_url + "/v1/traces"
    bomb = gzip.compress(export("bomb", 16_000_000), 9)
    assert len(bomb) < 20_000
    gz = {**PROTOBUF, "content-encoding": "gzip"}
    with httpx.Client(timeout=60) as client:
        # A control first: a small gzip'd export is taken and forwarded.
        assert client.post(url, content=gzip.compress(export("bomb-control")), headers=gz).status_code == 200
        wait_forwarded(backend, "bomb-control")
        before = proxy.telemetry_rss()
        codes = [client.post(url, content=bomb, headers=gz).status_code for _ in range(20)]
    after = proxy.telemetry_rss()
    assert codes == [413] * 20
    assert metric_value(proxy.metrics(), REJECTED, llmtap_otlp_reason="inflated_too_large") == 20
    # Each body is inflated at most 1 MiB (64 times 16 KB) before it is refused; before the ratio bound each
    # was inflated to 16 MB and forwarded, and the process grew by 200 MiB.
    assert after - before < 16 << 20, (before, after)
    time.sleep(1.0)
    assert forwarded(backend, "bomb") == ["bomb-control"]


def test_thousands_of_idle_admin_connections_leave_the_health_checks_answering(serve: Serve) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 20_000)
    if want < 12_000:
        pytest.fail(f"the descriptor limit ({hard}) is too low for 5,000 connections on both sides")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the proxy, started after, inherits it
    idle: list[socket.socket] = []
    try:
        proxy = serve()
        for _ in range(5000):
            idle.append(socket.create_connection(("127.0.0.1", proxy.admin_port), timeout=PATIENCE))
        answers = []
        for path in ("/healthz", "/readyz") * 3:
            answers.append(httpx.get(proxy.admin_url + path, timeout=PATIENCE).status_code)
        assert answers == [200] * 6
        # The connections that made room were closed by the proxy: the oldest idle ones.
        closed = 0
        for sock in idle[:1000]:
            sock.settimeout(PATIENCE)
            closed += sock.recv(1) == b""
        assert closed == 1000
        evicted = metric_value(proxy.metrics(), ADMIN_REFUSED, llmtap_admin_reason="connection_evicted")
        assert evicted >= 5000 - 256
    finally:
        for sock in idle:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Subscribers:
    """``count`` live-view event streams, read (and dropped) by one thread so that the proxy never waits on them."""

    def __init__(self, port: int, count: int) -> None:
        self.selector = selectors.DefaultSelector()
        self.socks = []
        self.heads: dict[int, bytes] = {}
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
            sock.sendall(b"GET /events HTTP/1.1\r\nhost: llmtap\r\n\r\n")
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, i)
            self.socks.append(sock)
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.halt.is_set():
            for key, _ in self.selector.select(0.2):
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                head = self.heads.get(key.data, b"")
                if len(head) < 12:
                    self.heads[key.data] = head + data[: 12 - len(head)]
                if not data:
                    self.selector.unregister(key.fileobj)

    def statuses(self) -> list[bytes]:
        return [self.heads.get(i, b"")[9:12] for i in range(len(self.socks))]

    def close(self) -> None:
        self.halt.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


def traffic(proxy: Llmtap, halt: threading.Event) -> None:
    """Short streams one after another, so the live view has requests to send to every subscriber."""
    with httpx.Client(timeout=PATIENCE) as client:
        i = 0
        while not halt.is_set():
            body = {"model": f"m{i % 8}", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
            client.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-chunks": "5"})
            i += 1
            time.sleep(0.02)


def metrics_times(proxy: Llmtap, count: int) -> list[float]:
    times = []
    with httpx.Client(timeout=PATIENCE) as client:
        for _ in range(count):
            start = time.perf_counter()
            assert client.get(proxy.admin_url + "/metrics").status_code == 200
            times.append(time.perf_counter() - start)
            time.sleep(0.2)
    return times


def test_three_hundred_live_view_subscribers_leave_metrics_quick(serve: Serve) -> None:
    proxy = serve("--admin-max-event-streams", "300", "--admin-max-connections", "400")  # every one served
    halt = threading.Event()
    load = threading.Thread(target=traffic, args=(proxy, halt), daemon=True)
    load.start()
    subscribers = None
    try:
        time.sleep(2.0)
        subscribers = Subscribers(proxy.admin_port, 300)
        time.sleep(3.0)  # every stream has had its first snapshots
        times = metrics_times(proxy, 10)
        statuses = subscribers.statuses()
    finally:
        halt.set()
        load.join(PATIENCE)
        if subscribers is not None:
            subscribers.close()
    assert statuses.count(b"200") == 300, statuses
    # Before the snapshot was shared, 300 streams made /metrics take 6.1 s (median) on this machine.
    assert statistics.median(times) < 1.0, times


def test_event_streams_past_the_bound_get_503_and_are_counted(serve: Serve) -> None:
    proxy = serve("--admin-max-event-streams", "2")
    subscribers = Subscribers(proxy.admin_port, 4)
    try:
        deadline = time.monotonic() + PATIENCE
        while b"" in subscribers.statuses() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(subscribers.statuses()) == [b"200", b"200", b"503", b"503"]
        metrics = proxy.metrics()
        assert metric_value(metrics, ADMIN_REFUSED, llmtap_admin_reason="event_streams") == 2
        assert metric_value(metrics, "llmtap_admin_event_streams") == 2
    finally:
        subscribers.close()


def test_an_over_long_traceparent_is_ignored_counted_and_logged_once(serve: Serve) -> None:
    proxy = serve()
    traceparent = "01-" + "ab" * 16 + "-" + "cd" * 8 + "-01-" + "e" * 600
    body = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(timeout=PATIENCE) as client:
        for _ in range(20):
            answer = client.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"traceparent": traceparent, "x-chunks": "3"}
            )
            assert answer.status_code == 200
    deadline = time.monotonic() + PATIENCE
    name = "llmtap_trace_context_ignored_total"
    while metric_value(proxy.metrics(), name, llmtap_trace_context_reason="traceparent_too_long") < 20:
        assert time.monotonic() < deadline, proxy.metrics()
        time.sleep(0.1)
    logs = proxy.logs()
    assert logs.count("ignored a client's traceparent") == 1, logs[-3000:]
    assert "exceeded the maximum length" not in logs


def test_the_relay_starts_a_new_trace_for_a_traceparent_the_sdk_would_not_read() -> None:
    valid = "01-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert parse_traceparent(valid + "-" + "e" * (MAX_TRACEPARENT - len(valid) - 1)) is not None
    assert parse_traceparent(valid + "-" + "e" * (MAX_TRACEPARENT - len(valid))) is None  # 513 characters
