"""Security: secrets never exported, content capture off by default, no open proxy, header injection and
size limits refused, and the admin listener on an address of its own.

``llmtap serve`` runs as users run it (uvicorn, httptools, its own protocol limits), at log level debug,
with a real OTLP/HTTP receiver, a request-record file and the live view, so every place telemetry can go
is scanned for what the client sent.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import PATIENCE
from tests.e2e.test_otlp import HTTPReceiver, attributes, receiver as receiver  # the fixture
from tests.support.procs import FaultUpstream, Llmtap, upstream as upstream  # the fixture
from tests.support.records import plain

pytestmark = pytest.mark.e2e

CHAT = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
TELEMETRY_ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    "OTEL_METRIC_EXPORT_INTERVAL": "200",
}


def everything_exported(proxy: Llmtap, receiver: HTTPReceiver, records: Path) -> dict[str, bytes]:
    """Every place telemetry went, as bytes: OTLP exports, /metrics, the live view, the log, the records."""
    with receiver.received.lock:
        otlp = b"".join(r.SerializeToString() for r in receiver.received.traces)
        otlp += b"".join(r.SerializeToString() for r in receiver.received.metrics)
    live = b""
    with httpx.stream("GET", proxy.admin_url + "/events?after=0", timeout=5) as r:
        started = time.monotonic()
        for part in r.iter_raw():
            live += part
            if b"event: requests" in live or time.monotonic() - started > 3:
                break
    return {
        "otlp": otlp,
        "metrics": proxy.metrics().encode(),
        "live": live + httpx.get(proxy.admin_url + "/", timeout=5).content,
        "log": proxy.log_path.read_bytes(),
        "records": plain(records),
    }


def wait_exported(receiver: HTTPReceiver, count: int) -> None:
    deadline = time.monotonic() + PATIENCE
    while len([s for _, s in receiver.received.spans() if "llmtap.route" in attributes(s.attributes)]) < count:
        assert time.monotonic() < deadline, "spans did not arrive"
        time.sleep(0.05)


# --- secrets -------------------------------------------------------------------------------------------


def test_secrets_never_leave_in_any_exported_item(
    upstream: FaultUpstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    secrets = {name: f"sk-llmtap-{name}-{uuid.uuid4().hex}" for name in ("bearer", "xkey", "apikey", "cookie")}
    secrets |= {name: f"sk-llmtap-{name}-{uuid.uuid4().hex}" for name in ("query", "proxyauth", "goog", "querytoo")}
    headers = {
        "authorization": f"Bearer {secrets['bearer']}",
        "x-api-key": secrets["xkey"],
        "api-key": secrets["apikey"],
        "cookie": f"session={secrets['cookie']}; theme=dark",
        "proxy-authorization": f"Basic {secrets['proxyauth']}",
        "x-goog-api-key": secrets["goog"],
    }
    query = f"key={secrets['query']}&api_key={secrets['querytoo']}"
    records = tmp_path / "records"
    env = {**TELEMETRY_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--log-level", "debug", "--record", str(records), env=env)
    try:
        with httpx.Client(base_url=proxy.url, headers=headers, timeout=10) as client:
            paths = [
                "/v1/chat/completions",
                "/v1/messages",
                "/v1/completions",
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent",
            ]
            for path in paths:
                with client.stream("POST", f"{path}?{query}", json=CHAT) as r:
                    assert r.status_code == 200
                    r.read()
            unary = client.post(f"/v1/chat/completions?{query}", json={**CHAT, "stream": False})
            assert unary.status_code == 200
            failing = client.post(f"/v1/chat/completions?{query}", json=CHAT, headers={"x-fault": "status-500"})
            assert failing.status_code == 500
            with pytest.raises(httpx.RemoteProtocolError):
                client.post(f"/v1/chat/completions?{query}", json=CHAT, headers={"x-fault": "reset-mid-stream"})
            assert client.get(f"/v1/%2e%2e/chat?{query}").status_code == 400
            # The credentials themselves do go upstream, untouched: llmtap only never records them.
            seen = client.get(f"/echo?{query}").json()
            assert seen["headers"]["authorization"] == headers["authorization"]
            assert seen["headers"]["x-api-key"] == secrets["xkey"]
            assert seen["target"] == f"/echo?{query}"
        wait_exported(receiver, 8)
        # The scan reads real telemetry: the requests' spans and a metrics export after them (every 200 ms; on a
        # busy machine later) are in it before it runs.
        deadline = time.monotonic() + PATIENCE
        while True:
            exported = everything_exported(proxy, receiver, records)
            missing = [m for m in (b"chat fault", b"gen_ai.client.operation.duration") if m not in exported["otlp"]]
            if not missing:
                break
            assert time.monotonic() < deadline, f"never exported: {missing}"
            time.sleep(0.1)
        for where, data in exported.items():
            assert data, f"nothing in {where}: the scan would prove nothing"
            for name, secret in secrets.items():
                assert secret.encode() not in data, f"the {name} secret leaked into {where}"
        assert b'"route": "default"' in exported["records"] or b'"route":"default"' in exported["records"]
    finally:
        proxy.close()


# --- content capture ----------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", [False, True], ids=["off", "on"])
def test_content_capture_is_off_unless_asked_and_capped(
    upstream: FaultUpstream, receiver: HTTPReceiver, tmp_path: Path, capture: bool
) -> None:
    prompt_mark = f"PROMPT-{uuid.uuid4().hex}"
    answer = f"ANSWER-{uuid.uuid4().hex}-" + "z" * 30_000
    env = {**TELEMETRY_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
    if capture:
        env["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "true"
    records = tmp_path / "records"
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--log-level", "debug", "--record", str(records), env=env)
    try:
        body = {
            **CHAT,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": prompt_mark + " " + "q" * 40_000},
            ],
        }
        with httpx.stream(
            "POST", proxy.url + "/v1/chat/completions", json=body, headers={"x-say": answer}, timeout=30
        ) as r:
            assert r.status_code == 200
            r.read()
        wait_exported(receiver, 1)
        exported = everything_exported(proxy, receiver, records)
        roots = [attributes(s.attributes) for _, s in receiver.received.spans() if s.name == "chat fault"]
        assert len(roots) == 1
        leaked = [where for where, data in exported.items() if prompt_mark.encode() in data or b"ANSWER-" in data]
        if not capture:
            assert leaked == []
            assert "gen_ai.input.messages" not in roots[0] and "gen_ai.output.messages" not in roots[0]
            return
        # On: only on the span (never in metrics, the live view, logs or records), and capped.
        assert leaked == ["otlp"]
        inputs = json.loads(roots[0]["gen_ai.input.messages"])
        outputs = json.loads(roots[0]["gen_ai.output.messages"])
        assert [m["role"] for m in inputs] == ["system", "user"]
        assert inputs[1]["parts"][0]["content"].startswith(prompt_mark)
        assert sum(len(p["content"]) for m in inputs for p in m["parts"]) <= 16 * 1024
        text = outputs[0]["parts"][0]["content"]
        assert text.startswith("ANSWER-") and len(text) == 16 * 1024
    finally:
        proxy.close()


# --- no open proxy -------------------------------------------------------------------------------------


class Canary:
    """A listener that must never be contacted: it counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes as they are; return the status code and the whole answer (0 when none came)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + body)
        data = b""
        while True:
            try:
                part = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not part:
                break
            data += part
            if _complete(data):
                break
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return body.endswith(b"0\r\n\r\n")


@pytest.fixture
def guarded(upstream: FaultUpstream, tmp_path: Path) -> Iterator[Llmtap]:
    config = tmp_path / "llmtap.yaml"
    config.write_text(f"routes:\n  - {{prefix: /api, upstream: '{upstream.url}', strip_prefix: true}}\n")
    proxy = Llmtap(
        upstream.url,
        tmp_path / "llmtap.log",
        "--config",
        str(config),
        "--max-header-bytes",
        "8192",
        "--max-request-bytes",
        str(1 << 20),
    )
    yield proxy
    proxy.close()


def test_no_request_reaches_anything_but_the_configured_upstream(guarded: Llmtap, upstream: FaultUpstream) -> None:
    canary = Canary()
    try:
        other = f"127.0.0.1:{canary.port}"
        relayed = [
            # absolute-form target naming another host: relayed to the configured upstream, as a path
            f"GET http://{other}/echo HTTP/1.1\r\nhost: {other}\r\n\r\n",
            # Host-header tricks
            f"GET /echo HTTP/1.1\r\nhost: {other}\r\n\r\n",
            f"GET /echo HTTP/1.1\r\nhost: llmtap\r\nx-forwarded-host: {other}\r\nforwarded: host={other}\r\n\r\n",
            "GET /echo HTTP/1.1\r\nhost: 169.254.169.254\r\nx-forwarded-for: 127.0.0.1\r\n\r\n",
        ]
        for head in relayed:
            status, data = raw(guarded.port, head.encode())
            assert status == 200, (head, data[:200])
            seen = json.loads(data.partition(b"\r\n\r\n")[2])
            assert seen["target"] == "/echo" and seen["headers"]["host"] == f"127.0.0.1:{upstream.port}", seen
        # Paths that look like authorities stay paths on the configured upstream.
        for path in (f"//{other}/echo", f"/@{other}/echo", f"/%2F%2F{other}/echo", "/\\\\evil/echo"):
            status, data = raw(guarded.port, f"GET {path} HTTP/1.1\r\nhost: llmtap\r\n\r\n".encode())
            assert status in (200, 400), (path, data[:200])
        refused = {
            f"CONNECT {other} HTTP/1.1\r\nhost: {other}\r\n\r\n": (400, 405),
            "TRACE /echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (405,),
            "GET /v1/../echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "GET /v1/%2e%2e/echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "GET /v1/..%2Fecho HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "GET /v1/./echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "GET /v1\\..\\echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "GET /api/../echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            # the route prefix percent-encoded, or ending in an encoded slash: routed and sent would disagree
            "GET /%61pi/echo HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "GET /api%2Fecho HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
            "OPTIONS * HTTP/1.1\r\nhost: llmtap\r\n\r\n": (400,),
        }
        for head, statuses in refused.items():
            status, data = raw(guarded.port, head.encode())
            assert status in statuses, (head, data[:200])
        # The route strips its prefix and stays on its upstream.
        status, data = raw(guarded.port, b"GET /api/echo?x=1 HTTP/1.1\r\nhost: llmtap\r\n\r\n")
        assert status == 200 and json.loads(data.partition(b"\r\n\r\n")[2])["target"] == "/echo?x=1"
        time.sleep(0.2)
        assert canary.accepted == 0
    finally:
        canary.close()


@pytest.mark.parametrize(
    "field",
    [
        b"x-a: one\rx-b: two",
        b"x-a: one\nx-b: two",
        b"x-a: one\x00two",
        b"x-a: one\r\n folded",
        b"x-a : spaced",
        b"x\x01a: control",
    ],
    ids=["cr", "lf", "nul", "obs-fold", "space-before-colon", "control-in-name"],
)
def test_header_injection_is_refused(guarded: Llmtap, upstream: FaultUpstream, field: bytes) -> None:
    rid = uuid.uuid4().hex
    head = b"GET /echo HTTP/1.1\r\nhost: llmtap\r\nx-request-id: " + rid.encode() + b"\r\n" + field + b"\r\n\r\n"
    status, _ = raw(guarded.port, head)
    assert status == 400
    assert upstream.sent(rid) == {}, "the request reached the upstream"


def test_size_limits(guarded: Llmtap, upstream: FaultUpstream) -> None:
    ok = uuid.uuid4().hex
    # Within the limits: relayed.
    body = json.dumps({**CHAT, "stream": False, "pad": "p" * 900_000}).encode()
    r = httpx.post(guarded.url + "/v1/chat/completions", content=body, headers={"x-request-id": ok}, timeout=10)
    assert r.status_code == 200 and upstream.sent(ok)["done"]
    # A header block past --max-header-bytes: 431, from the server protocol or the app.
    rid = uuid.uuid4().hex
    head = f"GET /echo HTTP/1.1\r\nhost: llmtap\r\nx-request-id: {rid}\r\nx-pad: {'p' * 9000}\r\n\r\n"
    status, _ = raw(guarded.port, head.encode())
    assert status == 431 and upstream.sent(rid) == {}
    # An endless header: refused once past the limit, memory untouched.
    before = guarded.rss()
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nhost: llmtap\r\nx-pad: ")
        sent = 0
        with pytest.raises(OSError):
            for _ in range(1000):  # up to 64 MiB
                sock.sendall(b"p" * 65536)
                sent += 65536
        assert sent < 16 << 20, sent
    assert guarded.rss() - before < 8 << 20
    # A body past --max-request-bytes: 413 whether its length is declared or not; nothing complete goes up.
    big = json.dumps({**CHAT, "stream": False, "pad": "p" * (2 << 20)}).encode()
    for declared in (True, False):
        rid = uuid.uuid4().hex
        headers = {"x-request-id": rid}
        pieces = [big[i : i + 65536] for i in range(0, len(big), 65536)]
        content: bytes | Iterator[bytes] = big if declared else iter(pieces)
        try:
            r = httpx.post(guarded.url + "/v1/chat/completions", content=content, headers=headers, timeout=10)
            assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        except httpx.TransportError:
            # The proxy answered 413 and closed while the client was still sending: the client may only
            # see the reset. Either way the request did not go through.
            pass
        assert upstream.sent(rid).get("done") is not True


def test_admin_listener_binds_its_own_address(upstream: FaultUpstream, tmp_path: Path) -> None:
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", admin_host="127.0.0.2")
    try:
        assert httpx.get(f"http://127.0.0.2:{proxy.admin_port}/metrics", timeout=5).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{proxy.admin_port}/metrics", timeout=5)
        # The proxy port relays /metrics to the upstream like any path; it never serves the proxy's own.
        relayed = httpx.get(proxy.url + "/metrics", timeout=5)
        assert b"llmtap_" not in relayed.content
    finally:
        proxy.close()
