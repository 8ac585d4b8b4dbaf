"""The fault suite's client side: a bounded load whose every request is accounted for, and an OTLP backend that
can be down for a while.

Each request carries a ``traceparent`` of its own, so its record (which keeps the client's trace id) is found by
trace id alone, and each ends in exactly one of three ways: ``answered`` (the whole stream, to ``[DONE]``), ``cut``
(it reached llmtap, then the connection failed: a kill) or ``refused`` (no connection at all: llmtap was down, so
nothing was sent). Requests sent are the answered and the cut ones.
"""

from __future__ import annotations

import dataclasses
import gzip
import http.server
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.support.net import answer, free_port

#: The simulator's model, short answers: a request takes tens of milliseconds (profile ``fast``).
CHAT: dict[str, Any] = {
    "model": "llmtap-sim",
    "stream": True,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Say something short."}],
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended, from the client's side."""

    trace_id: str
    kind: str  # answered, cut or refused
    status: int | None
    error: str | None
    began: float = 0.0  # monotonic


def begun_after(outcomes: list[Outcome], instant: float) -> list[Outcome]:
    """``outcomes`` with every request begun after ``instant`` (a kill of the whole tree) that got no answer taken as
    refused: it reached no llmtap. On a kept-alive connection such a request fails as cut (the kernel takes its
    bytes for a socket whose process is gone), not refused."""
    return [dataclasses.replace(o, kind="refused") if o.kind == "cut" and o.began > instant else o for o in outcomes]


def _one(client: httpx.Client, url: str, body: dict[str, Any], extra: dict[str, str], tag: str | None) -> Outcome:
    trace_id = secrets.token_hex(16)
    began = time.monotonic()
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01", **extra}
    if tag is not None:
        headers[tag] = trace_id
    status: int | None = None
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            status = r.status_code
            data = r.read()
    except httpx.ConnectError as exc:  # no connection: nothing reached llmtap
        return Outcome(trace_id, "refused", None, repr(exc), began)
    except httpx.HTTPError as exc:  # it reached llmtap; the answer did not come whole
        return Outcome(trace_id, "cut", status, repr(exc), began)
    whole = status != 200 or not body.get("stream") or data.rstrip().endswith(b"data: [DONE]")
    return Outcome(trace_id, "answered" if whole else "cut", status, None if whole else "no [DONE]", began)


class Load:
    """``total`` chat requests, ``concurrency`` at a time, at most ``rate`` a second, in daemon threads; each with
    ``headers`` besides its own ``traceparent``; with ``tag``, its trace id in that header too (a record keeps no trace
    id when tracing is off: ``x-llmtap-prompt-version`` finds it by its prompt version instead).

    ``url`` is called for each request, so a load can follow an llmtap started again on other ports."""

    def __init__(
        self,
        url: str | Callable[[], str],
        total: int,
        *,
        concurrency: int = 8,
        rate: float | None = None,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        tag: str | None = None,
    ) -> None:
        self._url = url if callable(url) else (lambda: url)
        self.headers = headers or {}
        self.tag = tag
        self.total = total
        self.rate = rate
        self.body = body or CHAT
        self.outcomes: list[Outcome] = []
        self._issued = 0
        self._started = 0.0
        self._stopped = threading.Event()
        self._going = threading.Event()
        self._going.set()
        self._paused_at: float | None = None
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(concurrency)]

    def start(self) -> Load:
        self._started = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def _take(self) -> bool:
        """Whether another request may go now (waits while paused, and for its turn under ``rate``)."""
        while not self._going.wait(0.05):
            if self._stopped.is_set():
                return False
        with self._lock:
            if self._stopped.is_set() or self._issued >= self.total:
                return False
            turn = self._issued
            self._issued += 1
        if self.rate:
            delay = self._started + turn / self.rate - time.monotonic()
            if delay > 0 and self._stopped.wait(delay):
                with self._lock:
                    self._issued -= 1  # stopped before it went
                return False
        return True

    def _work(self) -> None:
        with httpx.Client(timeout=30) as client:
            while self._take():
                outcome = _one(client, self._url(), self.body, self.headers, self.tag)
                with self._lock:
                    self.outcomes.append(outcome)

    @property
    def issued(self) -> int:
        """Requests begun so far."""
        with self._lock:
            return self._issued

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def pause(self) -> None:
        """Begin no more requests until ``resume`` (those in flight end as they end)."""
        with self._lock:
            self._paused_at = time.monotonic()
            self._going.clear()

    def resume(self) -> None:
        """Go on where ``pause`` stopped; a ``rate`` counts from now, as if the pause had not been."""
        with self._lock:
            if self._paused_at is not None:
                self._started += time.monotonic() - self._paused_at
                self._paused_at = None
            self._going.set()

    def stop(self) -> None:
        """Begin no more requests (those in flight end as they end)."""
        self._stopped.set()
        self._going.set()

    def join(self, timeout: float) -> list[Outcome]:
        """Wait (up to ``timeout`` s) until every thread ended; every outcome."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not self.running, f"the load did not end within {timeout:.0f} s"
        with self._lock:
            return list(self.outcomes)


def wait_for(what: str, check: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    """Poll ``check`` until it is truthy (its value) or fail after ``timeout`` s, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(step)


# --- an OTLP/HTTP backend that can be down for a while -------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            self.server.backend.take_spans(ExportTraceServiceRequest.FromString(body))
            reply = ExportTraceServiceResponse().SerializeToString()
        elif self.path == "/v1/logs":
            self.server.backend.take_logs(ExportLogsServiceRequest.FromString(body))
            reply = ExportLogsServiceResponse().SerializeToString()
        else:  # metrics and the rest: taken, not kept
            reply = b""
        answer(self, reply, "application/x-protobuf")

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, backend: OTLPBackend) -> None:
        self.backend = backend
        super().__init__(("127.0.0.1", port), _Handler)


class OTLPBackend:
    """OTLP/HTTP traces and logs on one port of 127.0.0.1 that ``down`` closes (connections refused) and ``up``
    opens again; it keeps the span ids of each trace and the (trace id, span id) of each log record."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: dict[str, set[str]] = {}
        self.logs: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def take_spans(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.setdefault(span.trace_id.hex(), set()).add(span.span_id.hex())

    def take_logs(self, request: ExportLogsServiceRequest) -> None:
        with self._lock:
            for rl in request.resource_logs:
                for sl in rl.scope_logs:
                    for record in sl.log_records:
                        self.logs.add((record.trace_id.hex(), record.span_id.hex()))

    def span_count(self, traces: set[str]) -> int:
        """Distinct spans received of the given traces."""
        with self._lock:
            return sum(len(self.spans.get(t, ())) for t in traces)

    def log_traces(self, traces: set[str]) -> int:
        """Distinct log records received (by trace and span id) of the given traces."""
        with self._lock:
            return sum(1 for trace, _ in self.logs if trace in traces)

    def log_records(self) -> dict[str, set[str]]:
        """The log records received: distinct span ids by trace id."""
        out: dict[str, set[str]] = {}
        with self._lock:
            for trace, span in self.logs:
                out.setdefault(trace, set()).add(span)
        return out

    def up(self) -> None:
        """Listen (again) on the same port."""
        self._server = _Server(self.port, self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()

    def down(self) -> None:
        """Stop listening: every connection is refused until ``up``."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)

    def close(self) -> None:
        self.down()


def otlp_backend() -> Iterator[OTLPBackend]:
    """One backend for a test (a fixture body)."""
    backend = OTLPBackend()
    yield backend
    backend.close()
