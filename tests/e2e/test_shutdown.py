"""SIGTERM: stop accepting, let streams in flight finish up to the drain deadline, then flush telemetry.

``llmtap serve`` runs as a child process, as an orchestrator runs it, with a real OTLP/HTTP receiver and
a request-record file: spans reach the receiver only through the exit flush (the batch delay is longer
than the test), so a span that arrives proves the flush ran after the stream ended.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.store.files import ReadStats, read_records
from tests.conftest import PATIENCE, free_port
from tests.e2e.test_otlp import HTTPReceiver, attributes, receiver as receiver  # the fixture
from tests.support.procs import FaultUpstream, Llmtap, upstream as upstream  # the fixture

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "fault",
    "stream": True,
    "messages": [{"role": "user", "content": "Say something."}],
    "stream_options": {"include_usage": True},
}


class Stream(threading.Thread):
    """A streamed request in a thread: what arrived, when it ended, and how."""

    def __init__(self, url: str, chunks: int, gap_ms: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.rid = uuid.uuid4().hex
        self.headers = {"x-request-id": self.rid, "x-chunks": str(chunks), "x-gap-ms": str(gap_ms)}
        self.received = b""
        self.error: Exception | None = None
        self.ended = 0.0
        self.first = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + "/v1/chat/completions", json=CHAT, headers=self.headers, timeout=30
            ) as r:
                for part in r.iter_raw():
                    self.received += part
                    self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.ended = time.monotonic()


def refused(port: int) -> bool:
    """True when nothing accepts connections on ``port`` any more."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


def exited(proxy: Llmtap, timeout: float) -> float:
    """Wait for the process to exit; return when it did (monotonic)."""
    proxy.proc.wait(timeout)
    return time.monotonic()


def span_of(receiver: HTTPReceiver, chunks: int) -> dict[str, Any]:
    roots = [attributes(s.attributes) for _, s in receiver.received.spans() if s.name == "chat fault"]
    assert len(roots) == 1, roots
    return roots[0]


#: The drain deadline of a stream that must finish: far past the stream's own length, so a proxy that waited for the
#: deadline rather than for its last stream is told from one that did not by a minute, whatever the machine's load.
DRAIN = 60.0
#: The stream's chunks, 50 ms apart: in flight for 5 s after its first.
CHUNKS = 100


def test_sigterm_lets_streams_finish_then_flushes(
    upstream: FaultUpstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    """SIGTERM with a stream in flight: new connections are refused while it goes on, it ends whole, the proxy exits
    after it, on its own (not at the drain deadline), and the exit flush sends its span and writes its record.

    Checked by order of events, not by how fast a busy machine runs them: the refusal is seen while the stream is
    still in flight (a stream of 5 s, from the upstream's own timer), the stream ends whole, and the exit comes before
    half the drain deadline (``DRAIN``), which a proxy that lingered would wait out whole."""
    records = tmp_path / "records"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    env |= {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_METRICS_EXPORTER": "none"}
    drain = ("--drain-timeout", str(DRAIN))
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", *drain, "--record", str(records), env=env)
    try:
        stream = Stream(proxy.url, chunks=CHUNKS, gap_ms=50)  # 5 s of stream, by the upstream's clock
        stream.start()
        assert stream.first.wait(PATIENCE)
        signalled = time.monotonic()
        proxy.terminate()
        # New connections are refused; the stream in flight goes on.
        while not refused(proxy.port):
            assert time.monotonic() - signalled < PATIENCE, "still accepting connections after SIGTERM"
            time.sleep(0.02)
        assert stream.is_alive(), "the stream ended before new connections were refused"
        stream.join(PATIENCE)
        end = exited(proxy, PATIENCE)
        assert stream.error is None, stream.error
        assert hashlib.sha256(stream.received).hexdigest() == upstream.sent(stream.rid)["sha256"]
        assert stream.received.endswith(b"data: [DONE]\n\n")
        assert stream.ended - signalled > 1.0  # it really was in flight for a while after SIGTERM
        assert end - signalled < DRAIN / 2, "the proxy lingered after its last stream"
        assert proxy.proc.returncode == 0, proxy.logs()
        # Telemetry went out after the stream ended, on the way out.
        attrs = span_of(receiver, CHUNKS)
        assert attrs["llmtap.outcome"] == "ok" and attrs["gen_ai.usage.output_tokens"] == CHUNKS
        lines = list(read_records(records, ReadStats()))
        assert [line["outcome"] for line in lines] == ["ok"]
    finally:
        proxy.close()


def test_sigterm_cuts_streams_at_the_drain_deadline(
    upstream: FaultUpstream, receiver: HTTPReceiver, tmp_path: Path
) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    env |= {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_METRICS_EXPORTER": "none"}
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--drain-timeout", "1", env=env)
    try:
        stream = Stream(proxy.url, chunks=100, gap_ms=100)  # 10 s of stream: longer than the deadline
        stream.start()
        assert stream.first.wait(PATIENCE)
        signalled = time.monotonic()
        proxy.terminate()
        stream.join(10)
        end = exited(proxy, 10)
        # Cut at the deadline (uvicorn checks every 0.1 s), never before it, and long before the stream's own end
        # (about 10 s after the signal): the upper bounds leave room for a busy machine, not for a missed cut.
        assert isinstance(stream.error, httpx.RemoteProtocolError), stream.error
        assert 1.0 <= stream.ended - signalled < 5.0, stream.ended - signalled
        assert end - signalled < 8.0, end - signalled
        assert proxy.proc.returncode == 0, proxy.logs()
        # What the client got is what the upstream wrote up to the cut (a prefix of it, unchanged).
        assert stream.received.startswith(b"data: ") and b"[DONE]" not in stream.received
        attrs = span_of(receiver, 100)
        assert attrs["error.type"] == "shutdown" and attrs["llmtap.outcome"] == "error"
    finally:
        proxy.close()


def _served_then_stopped(proxy: Llmtap) -> float:
    """Twenty requests through ``proxy``, then SIGTERM: seconds from the signal to its exit."""
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for _ in range(20):
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    time.sleep(0.3)  # an export is now under way (stuck retrying, with a dead collector)
    signalled = time.monotonic()
    proxy.terminate()
    return exited(proxy, 15) - signalled


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections and never answers (a hung server): the kernel completes the handshake into
    the listening socket's backlog, and nobody ever reads."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


@pytest.mark.parametrize("hung", ["collector", "collector and ClickHouse"])
def test_sigterm_with_a_dead_collector_exits_within_the_flush_bound(
    upstream: FaultUpstream, silent_port: int, tmp_path: Path, hung: str
) -> None:
    # gRPC to a port nobody listens on: each export retries with backoff for 10 s (the exporter's default). With a
    # ClickHouse that never answers too, the records' sink holds its part of the exit as long as it is let: the
    # bound is one for the whole flush, not one for each thing that flushes.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    env |= {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    args = ["--flush-timeout", "2"]
    if "ClickHouse" in hung:
        args += ["--record-clickhouse", f"http://127.0.0.1:{silent_port}"]
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", *args, env=env)
    try:
        took = _served_then_stopped(proxy)
        # The control: the same proxy with no collector and no ClickHouse, its exit timed the same way in the same
        # test. A wait past the flush bound (the exporter's 10 s of retries, or one bound for each part) shows
        # however slow the machine is.
        control = Llmtap(upstream.url, tmp_path / "control.log", "--flush-timeout", "2")
        try:
            plain = _served_then_stopped(control)
        finally:
            control.close()
        print(f"\nSIGTERM with a hung {hung}: exited in {took:.2f} s (flush bound 2 s; none: {plain:.2f} s)")
        assert took < 2.0 + plain + max(1.0, plain), (took, plain)
        assert proxy.proc.returncode == 0
        logs = proxy.logs()
        assert "spans dropped" in logs
        if "ClickHouse" in hung:
            # What ClickHouse never took is counted and said, not lost silently: the records its sink held (or, on a
            # machine too busy for the recorder to reach them within the bound, the requests still queued).
            assert re.search(r"[1-9]\d* (records lost \(clickhouse_unsent\)|tapes lost \(shutdown\))", logs), logs
    finally:
        proxy.close()
