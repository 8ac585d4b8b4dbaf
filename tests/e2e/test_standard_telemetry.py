"""What llmtap reports, as the GenAI conventions define it, through ``llmtap serve`` and a real OTLP receiver.

Usage is what the model reported: a request that never reached it (refused by llmtap, or by the upstream)
reports none, and tiktoken's counts stay llmtap's own. Time per output token needs a timed decode. A stream
the client received to its last event is ``ok``, however soon after the client hangs up. Under a client that
traces, llmtap's span is the hop, not a second generation.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE
from tests.e2e.test_otlp import HTTPReceiver, attributes, receiver as receiver  # the fixture
from tests.support.procs import Llmtap

pytestmark = pytest.mark.e2e

ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    "OTEL_METRIC_EXPORT_INTERVAL": "200",
}


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-std",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "std",
        "system_fingerprint": "fp_llmtap_test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta or finish else [],
    }
    if usage is not None:
        body["usage"] = usage
    return _event(body)


USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


class Upstream:
    """Chat streams that linger after ``[DONE]`` (the body's end comes ``linger`` s later), whole answers,
    and a 404 for model ``missing``; over chunked HTTP/1.1, one request per connection."""

    def __init__(self, linger: float = 1.0) -> None:
        self.linger = linger
        #: Released as each stream's headers go out: the stream holds its slot in llmtap from then on.
        self.streaming = threading.Semaphore(0)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            while len(body) < length:
                body += conn.recv(65536)
            request = json.loads(body)
            if request.get("model") == "missing":
                error = b'{"error":{"message":"The model `missing` does not exist.","type":"NotFoundError","code":404}}'
                _whole(conn, b"404 Not Found", error)
                return
            if not request.get("stream"):
                answer = json.dumps(
                    {
                        "id": "chatcmpl-std",
                        "object": "chat.completion",
                        "created": 1700000000,
                        "model": "std",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "alpha beta gamma"}}],
                        "usage": USAGE,
                    }
                ).encode()
                _whole(conn, b"200 OK", answer)
                return
            self.streaming.release()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\n"
                + CLOSE
                + b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            events = [_chunk({"role": "assistant", "content": ""})]
            events += [_chunk({"content": w}) for w in (" alpha", " beta")]
            events.append(_chunk({"content": " gamma"}, "stop"))
            if (request.get("stream_options") or {}).get("include_usage"):
                events.append(_chunk({}, usage=USAGE))
            events.append(b"data: [DONE]\n\n")
            try:
                for event in events:
                    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                    time.sleep(0.02)
                time.sleep(self.linger)  # the stream is over for the client; the body's end comes later
                conn.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the proxy closed the request: its client left

    def close(self) -> None:
        self.sock.close()


#: Every answer closes its connection, so no request finds a pooled connection the upstream has closed.
CLOSE = b"connection: close\r\n"


def _whole(conn: socket.socket, status: bytes, body: bytes) -> None:
    head = b"HTTP/1.1 " + status + b"\r\n" + CLOSE + b"content-type: application/json\r\n"
    conn.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


def start(upstream: Upstream, receiver: HTTPReceiver, log: Path, *args: str) -> Llmtap:
    return Llmtap(upstream.url, log, *args, env={**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})


def post(port: int, body: dict[str, Any], *, headers: bytes = b"", until: bytes | None = None) -> bytes:
    """A raw request; with ``until``, the connection is closed the moment those bytes have arrived."""
    payload = json.dumps(body).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: llmtap.test\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n%s" % (len(payload), headers, payload)
        )
        while True:
            part = sock.recv(65536)
            if not part:
                break
            got += part
            if until is not None and until in got:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                break  # a reset, at once: as a client that stops reading at [DONE]
            if until is None and got.count(b"\r\n\r\n") and _complete(got):
                break
    return got


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length"):
            return len(body) >= int(line.split(b":")[1])
    return body.endswith(b"0\r\n\r\n")


def root_spans(receiver: HTTPReceiver, count: int, timeout: float = PATIENCE) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [attributes(s.attributes) | {"_name": s.name, "_kind": s.kind} for _, s in receiver.received.spans()]
        roots = [a for a in found if sc.ROUTE in a]
        if len(roots) >= count or time.monotonic() > deadline:
            assert len(roots) >= count, f"{len(roots)} root spans arrived, wanted {count}"
            return roots
        time.sleep(0.05)


CHAT = {"model": "std", "stream": True, "messages": [{"role": "user", "content": "Say three words."}]}


def test_a_client_that_leaves_at_done_got_the_whole_stream(
    upstream: Upstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    proxy = start(upstream, receiver, tmp_path / "llmtap.log")
    try:
        got = post(proxy.port, CHAT, until=b"data: [DONE]")
        assert b" gamma" in got and b"[DONE]" in got
        # A client that leaves before the end is still cancelled.
        early = post(proxy.port, CHAT, until=b" alpha")
        assert b"[DONE]" not in early
        first, second = root_spans(receiver, 2)
    finally:
        proxy.close()
    assert first[sc.OUTCOME] == "ok" and sc.ERROR_TYPE not in first, first
    assert first[sc.USAGE_OUTPUT_TOKENS] == 3 and first[sc.RESPONSE_FINISH_REASONS] == ["stop"]
    assert first[sc.OPENAI_SYSTEM_FINGERPRINT] == "fp_llmtap_test"
    assert second[sc.OUTCOME] == "cancelled" and second[sc.ERROR_TYPE] == "cancelled", second


def test_requests_that_never_reached_the_model_report_no_usage(
    upstream: Upstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    proxy = start(upstream, receiver, tmp_path / "llmtap.log", "--max-concurrency", "1", "--queue-limit", "0")
    try:
        missing = post(proxy.port, {**CHAT, "model": "missing", "stream": False})
        assert missing.startswith(b"HTTP/1.1 404"), missing[:200]
        # One stream holds the only slot (it lingers after [DONE]); the next is refused by llmtap itself.
        while upstream.streaming.acquire(blocking=False):
            pass  # the module's earlier streams
        holder = threading.Thread(target=post, args=(proxy.port, CHAT))
        holder.start()
        assert upstream.streaming.acquire(timeout=PATIENCE), "the first stream never reached the upstream"
        refused = post(proxy.port, CHAT)
        holder.join()
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        roots = root_spans(receiver, 3)
        metrics = _metric_points(receiver, "gen_ai.client.token.usage")
    finally:
        proxy.close()
    by_status = {a.get(sc.HTTP_STATUS): a for a in roots}
    for status in (404, 503):
        a = by_status[status]
        assert not {sc.USAGE_INPUT_TOKENS, sc.USAGE_OUTPUT_TOKENS, sc.INPUT_TOKENS} & set(a), (status, a)
    ok = by_status[200]
    assert (ok[sc.USAGE_INPUT_TOKENS], ok[sc.USAGE_OUTPUT_TOKENS]) == (11, 3)
    # Only the stream that reached the model is in the token histogram: 11 in, 3 out, nothing invented.
    sums = {p["gen_ai.token.type"]: (count, total) for p, count, total in metrics}
    assert sums == {"input": (1, 11.0), "output": (1, 3.0)}, sums


def test_time_per_output_token_only_where_a_decode_was_timed(
    upstream: Upstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    proxy = start(upstream, receiver, tmp_path / "llmtap.log")
    try:
        whole = post(proxy.port, {**CHAT, "stream": False})
        assert whole.startswith(b"HTTP/1.1 200"), whole[:200]
        (root,) = root_spans(receiver, 1)
        assert root[sc.OUTCOME] == "ok" and root[sc.USAGE_OUTPUT_TOKENS] == 3
        assert sc.TPOT not in root, root
        post(proxy.port, CHAT)
        streamed = [a for a in root_spans(receiver, 2) if a.get(sc.REQUEST_STREAM)]
        assert streamed and streamed[0][sc.TPOT] > 0
    finally:
        proxy.close()


def test_under_a_traced_client_llmtaps_span_is_the_hop(
    upstream: Upstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    proxy = start(upstream, receiver, tmp_path / "llmtap.log")
    try:
        traceparent = b"traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n"
        post(proxy.port, CHAT, headers=traceparent)
        (root,) = root_spans(receiver, 1)
    finally:
        proxy.close()
    assert root["_name"] == "POST /v1/chat/completions" and root[sc.SPAN_ROLE] == "hop"
    assert not [k for k in root if k.startswith("gen_ai.")], root
    assert (root[sc.INPUT_TOKENS], root[sc.OUTPUT_TOKENS], root[sc.HOP_REQUEST_MODEL]) == (11, 3, "std")


def _metric_points(
    receiver: HTTPReceiver, name: str, timeout: float = PATIENCE
) -> list[tuple[dict[str, Any], int, float]]:
    """(attributes, count, sum) of each point of histogram ``name`` in the newest export that has it."""
    deadline = time.monotonic() + timeout
    while True:
        found = receiver.received.latest_metrics().get(name)
        if found is not None:
            points = [(attributes(p.attributes), p.count, p.sum) for p in found[1].histogram.data_points]
            if sum(count for _, count, _ in points) >= 2 or time.monotonic() > deadline:
                return points
        elif time.monotonic() > deadline:
            return []
        time.sleep(0.1)
