"""The admin listener under hostile clients, through ``llmtap serve``: forged spans, a gzip bomb, idle connections
and many live-view subscribers.

``python -m bench.probes.admin`` starts ``llmtap serve`` (whatever ``proxy`` package ``PYTHONPATH`` names, so an
older checkout runs the same phases) exporting traces over OTLP/HTTP, with a bearer token in
``OTEL_EXPORTER_OTLP_HEADERS``, to a backend here that counts what it receives. Then, one after the other:

* forged: one OTLP export posted to ``/v1/traces`` with no credential (``--token``: the bomb's posts and the
  streams carry the token, the forged post never does); its status, and whether it reached the
  backend carrying the operator's token;
* bomb: ``--bombs`` posts of a gzip'd export inflating to 16,000,000 bytes (about 16 KB sent); their statuses,
  the bytes the backend received, and the telemetry process's resident memory before and at its peak;
* idle: ``--idle`` connections opened to the admin port and left silent, then ``/healthz`` asked five times on
  fresh connections; the statuses;
* drain (only with ``--only drain``): SIGTERM with a stream in flight; how long ``/readyz`` still said 200;
* events: with short streams relayed one after another (``tests/support/fault_upstream.py``), ``/metrics`` fetched ten
  times (the control), then ``--subscribers`` live-view ``/events`` streams held open (and read) and ``/metrics``
  fetched ten times again; its time (median, max) and the telemetry process's CPU over each, and the streams
  refused.

``--serve-arg`` passes a flag to ``llmtap serve`` (repeat it), e.g. the settings that make a loopback sender
count as an outsider: the forged post is sent from loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import resource
import selectors
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.support.net import LoopbackHTTPServer, free_port, wait_http
from tests.support.proctree import Service, cpu_seconds, rss_bytes

OPERATOR_TOKEN = "operator-secret-token"
UPSTREAM = [sys.executable, "-m", "tests.support.fault_upstream"]


class Backend:
    """An OTLP/HTTP traces backend on loopback: counts bodies and bytes, and how many carried the operator's token."""

    def __init__(self) -> None:
        self.bodies = 0
        self.bytes = 0
        self.with_token = 0
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                backend.bodies += 1
                backend.bytes += len(body)
                if OPERATOR_TOKEN in (self.headers.get("authorization") or ""):
                    backend.with_token += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = LoopbackHTTPServer(Handler)


def export(attribute_bytes: int = 16) -> bytes:
    """An OTLP export of one span, with one string attribute of ``attribute_bytes`` letters."""
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes(range(1, 17)), bytes(range(1, 9)), "forged"
    span.attributes.append(KeyValue(key="x", value=AnyValue(string_value="a" * attribute_bytes)))
    return bytes(request.SerializeToString())


def telemetry_pids(service: Service) -> list[int]:
    return service.roles().get("telemetry", [])


def forged(admin: str, backend: Backend) -> dict[str, Any]:
    before = backend.bodies
    answer = httpx.post(admin + "/v1/traces", content=export(), headers={"content-type": "application/x-protobuf"})
    time.sleep(3.0)  # the forwarder sends within its batch delay
    return {"forged_status": answer.status_code, "forged_forwarded": backend.bodies - before}


def bomb(admin: str, backend: Backend, service: Service, count: int, auth: dict[str, str]) -> dict[str, Any]:
    body = gzip.compress(export(16_000_000), 9)
    pids = telemetry_pids(service)
    rss0 = rss_bytes(pids)
    peak = rss0
    sent0 = backend.bytes
    statuses: dict[int, int] = {}
    headers = {"content-type": "application/x-protobuf", "content-encoding": "gzip", **auth}
    with httpx.Client(timeout=60) as client:
        for _ in range(count):
            code = client.post(admin + "/v1/traces", content=body, headers=headers).status_code
            statuses[code] = statuses.get(code, 0) + 1
            peak = max(peak, rss_bytes(pids))
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        peak = max(peak, rss_bytes(pids))
        time.sleep(0.1)
    return {
        "bomb_sent_bytes": len(body),
        "bomb_statuses": statuses,
        "bomb_backend_mb": round((backend.bytes - sent0) / 1e6, 1),
        "bomb_telemetry_rss_mib": [round(rss0 / 2**20, 1), round(peak / 2**20, 1)],
    }


def idle(host: str, port: int, count: int, admin: str) -> dict[str, Any]:
    socks: list[socket.socket] = []
    opened_fail = 0
    for _ in range(count):
        try:
            socks.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            opened_fail += 1
    time.sleep(1.0)
    statuses: list[int | str] = []
    for _ in range(5):
        try:
            statuses.append(httpx.get(admin + "/healthz", timeout=5).status_code)
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)
        time.sleep(0.5)
    for s in socks:
        s.close()
    return {"idle_opened": len(socks), "idle_failed": opened_fail, "idle_healthz": statuses}


class Traffic(threading.Thread):
    """Short streams through the proxy, one after another (a pause between), so the live view has requests to show."""

    def __init__(self, url: str, pause: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.url, self.pause, self.done = url, pause, 0
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.halt.is_set():
                body = {"model": f"m{self.done % 8}", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
                with contextlib.suppress(httpx.HTTPError):
                    client.post(self.url + "/v1/chat/completions", json=body, headers={"x-chunks": "5"})
                    self.done += 1
                time.sleep(self.pause)


def scrape(admin: str, service: Service, count: int) -> tuple[list[float], float]:
    """``/metrics`` fetched ``count`` times, 0.2 s apart: each one's time, and the telemetry process's CPU meanwhile."""
    pids = telemetry_pids(service)
    cpu0, t0 = cpu_seconds(pids), time.monotonic()
    times = []
    for _ in range(count):
        start = time.monotonic()
        with contextlib.suppress(httpx.TimeoutException):  # counted as the 60 s it was given
            httpx.get(admin + "/metrics", timeout=60)
        times.append(time.monotonic() - start)
        time.sleep(0.2)
    return times, (cpu_seconds(pids) - cpu0) / (time.monotonic() - t0)


def events(host: str, port: int, count: int, admin: str, service: Service, auth: dict[str, str]) -> dict[str, Any]:
    control, control_cpu = scrape(admin, service, 10)  # the same traffic, no subscriber
    selector = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    refused = 0
    heads: dict[int, bytes] = {}
    for _ in range(count):
        s = socket.create_connection((host, port), timeout=5)
        extra = "".join(f"{k}: {v}\r\n" for k, v in auth.items()).encode()
        s.sendall(b"GET /events HTTP/1.1\r\nhost: llmtap\r\n" + extra + b"\r\n")
        s.setblocking(False)
        selector.register(s, selectors.EVENT_READ)
        socks.append(s)
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            for key, _ in selector.select(0.2):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if sock.fileno() not in heads or len(heads[sock.fileno()]) < 12:
                    heads[sock.fileno()] = heads.get(sock.fileno(), b"") + data[:12]
                if not data:
                    selector.unregister(sock)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    time.sleep(3.0)
    times, cpu = scrape(admin, service, 10)
    stop.set()
    reader.join(5)
    refused = sum(1 for head in heads.values() if not head.startswith(b"HTTP/1.1 200"))
    for s in socks:
        s.close()
    return {
        "control_metrics_s_median": round(statistics.median(control), 3),
        "control_metrics_s_max": round(max(control), 3),
        "control_telemetry_cpu_percent": round(control_cpu * 100, 1),
        "events_streams": count,
        "events_refused": refused,
        "metrics_s_median": round(statistics.median(times), 3),
        "metrics_s_max": round(max(times), 3),
        "metrics_s_each": [round(t, 2) for t in times],
        "telemetry_cpu_percent": round(cpu * 100, 1),
    }


def drain(admin: str, url: str, service: Service) -> dict[str, Any]:
    """SIGTERM with a stream in flight: seconds until ``/readyz`` first says 503, asked every 2 ms."""
    body = {"model": "drain", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    started = threading.Event()

    def stream() -> None:
        headers = {"x-chunks": "100", "x-gap-ms": "50"}
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
                for _ in r.iter_raw():
                    started.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    started.wait(30)
    with httpx.Client(timeout=5) as client:
        assert client.get(admin + "/readyz").status_code == 200
        os.kill(service.proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        while client.get(admin + "/readyz").status_code == 200 and time.monotonic() - sent < 10:
            time.sleep(0.002)
        took = time.monotonic() - sent
    thread.join(30)
    return {"drain_readyz_503_after_s": round(took, 3)}


def main(argv: list[str] | None = None) -> None:
    """Run the four phases once and print what each measured."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.admin", description=__doc__)
    p.add_argument("--bombs", type=int, default=20, help="gzip bomb posts (20)")
    p.add_argument("--idle", type=int, default=5000, help="idle admin connections (5000)")
    p.add_argument("--subscribers", type=int, default=300, help="live-view event streams (300)")
    p.add_argument("--serve-arg", action="append", default=[], help="a flag for llmtap serve (repeatable)")
    p.add_argument("--token", help="the admin token: given to llmtap serve, sent with the bomb and the streams")
    p.add_argument("--only", choices=("forged", "bomb", "idle", "events", "drain"), help="run this phase alone")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20000), hard))  # the proxy inherits it too
    backend = Backend()
    port, admin_port = free_port(), free_port()
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": backend.server.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{OPERATOR_TOKEN}",
    }
    auth = {"authorization": f"Bearer {args.token}"} if args.token else {}
    if args.token:
        env["LLMTAP_ADMIN_TOKEN"] = args.token
    argv_serve = [sys.executable, "-m", "llmtap", "serve", "--upstream", "(the fault upstream)"]
    argv_serve += ["--port", str(port), "--admin-port", str(admin_port), *args.serve_arg]
    admin = f"http://127.0.0.1:{admin_port}"
    with tempfile.TemporaryDirectory() as folder:
        upstream = Service("upstream", UPSTREAM, log=Path(folder) / "upstream.log", cpu=None)
        argv_serve[argv_serve.index("--upstream") + 1] = f"http://127.0.0.1:{upstream.read_line()}"
        service = Service("llmtap", argv_serve, log=Path(folder) / "llmtap.log", env=env, cpu=None)
        traffic = Traffic(f"http://127.0.0.1:{port}")
        try:
            service.ready(lambda: wait_http(admin + "/healthz", 60, alive=lambda: service.proc.poll() is None))
            time.sleep(1.0)
            result: dict[str, Any] = {}
            if args.only in (None, "forged"):
                result.update(forged(admin, backend))
            if args.only in (None, "bomb"):
                result.update(bomb(admin, backend, service, args.bombs, auth))
            if args.only in (None, "idle"):
                result.update(idle("127.0.0.1", admin_port, args.idle, admin))
            if args.only in (None, "events"):
                traffic.start()
                time.sleep(5.0)
                result.update(events("127.0.0.1", admin_port, args.subscribers, admin, service, auth))
                result["events_requests_during"] = traffic.done
            if args.only == "drain":
                result.update(drain(admin, f"http://127.0.0.1:{port}", service))
        finally:
            traffic.halt.set()
            service.stop()
            upstream.stop()
            backend.server.close()
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
