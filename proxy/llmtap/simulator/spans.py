"""The simulator's own request spans, exported over OTLP/HTTP as vLLM exports them (``--otlp-traces-endpoint``).

vLLM, given ``--otlp-traces-endpoint``, ends one ``llm_request`` span (kind SERVER) per finished request, back-dated
to the request's arrival and parented on the ``traceparent`` it received, with its phases as
``gen_ai.latency.*`` attributes in seconds (standards B.2: ``vllm/tracing`` ``SpanAttributes``). The simulator does
the same from its own truth (``RequestRecord``): queue is arrival to admission, prefill admission to the first
token, decode the first token to the last, so a proxy that joins server spans (llmtap's ``/v1/traces``) reads the
phases the server itself measured, offline.

Spans are batched, as vLLM's ``BatchSpanProcessor`` does, and posted from a thread of their own, so no request
waits for an export: at most ``MAX_PENDING`` wait (the oldest are dropped past it, and counted), every
``interval`` seconds. A failed post is logged once and its batch dropped: the simulator never retries, as a
server's exporter gives up after its timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from llmtap.simulator.truth import RequestRecord

__all__ = ["MAX_PENDING", "SpanExporter", "parse_traceparent", "request_span", "traces_url"]

log = logging.getLogger(__name__)

#: Finished requests waiting for the next export, at most; past it the oldest go.
MAX_PENDING = 4096
_POST_TIMEOUT_S = 5.0


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: ``endpoint`` as given, with ``/v1/traces`` added when it names no path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: an http:// or https:// URL (OTLP/HTTP protobuf)")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def parse_traceparent(value: bytes | None) -> tuple[bytes, bytes] | None:
    """The trace id and parent span id of a W3C ``traceparent`` (version 00), or None when absent or malformed."""
    if value is None:
        return None
    parts = value.decode("latin-1").strip().split("-")
    if len(parts) < 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, parent = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        return None
    return (trace_id, parent) if any(trace_id) and any(parent) else None


def _seconds(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def _attribute(key: str, value: float | int | str) -> KeyValue:
    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(double_value=value))


def _attributes(record: RequestRecord, ended: float) -> list[KeyValue]:
    """vLLM's ``SpanAttributes`` for one finished request (seconds; token counts; the request's own facts)."""
    prefill, decode = _seconds(record.admitted, record.first_token), _seconds(record.first_token, record.last_token)
    values: dict[str, float | int | str | None] = {
        "gen_ai.response.model": record.model,
        "gen_ai.request.id": record.id,
        "gen_ai.request.max_tokens": record.max_tokens,
        "gen_ai.request.n": 1,
        "gen_ai.usage.prompt_tokens": record.prompt_tokens,
        "gen_ai.usage.completion_tokens": record.output_tokens,
        "gen_ai.usage.cached_tokens": record.cached_tokens,
        "gen_ai.latency.time_in_queue": _seconds(record.arrival, record.admitted),
        "gen_ai.latency.time_to_first_token": _seconds(record.arrival, record.first_token),
        "gen_ai.latency.e2e": _seconds(record.arrival, ended),
        "gen_ai.latency.time_in_model_prefill": prefill,
        "gen_ai.latency.time_in_model_decode": decode,
        "gen_ai.latency.time_in_model_inference": None if prefill is None or decode is None else prefill + decode,
        "gen_ai.response.finish_reasons": '["length"]',
    }
    return [_attribute(key, value) for key, value in values.items() if value is not None]


def request_span(record: RequestRecord, parent: tuple[bytes, bytes] | None, ended: float, span_id: bytes) -> Span:
    """The ``llm_request`` span of one finished request; times from the monotonic record, moved to the wall clock."""
    to_wall_ns = time.time_ns() - int(time.monotonic() * 1e9)
    trace_id, parent_id = parent if parent is not None else (os.urandom(16), b"")
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_id,
        name="llm_request",
        kind=Span.SpanKind.SPAN_KIND_SERVER,
        start_time_unix_nano=to_wall_ns + int(record.arrival * 1e9),
        end_time_unix_nano=to_wall_ns + int(ended * 1e9),
        attributes=_attributes(record, ended),
    )


@dataclass(slots=True)
class _Pending:
    record: RequestRecord
    parent: tuple[bytes, bytes] | None
    ended: float


class SpanExporter:
    """Batches finished requests' spans and posts them to an OTLP/HTTP endpoint from its own thread."""

    def __init__(self, endpoint: str, *, service: str = "llmtap-sim", interval: float = 0.5) -> None:
        self.url, self.interval = traces_url(endpoint), interval
        self._resource = [_attribute("service.name", service)]
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._sent_all = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._unsent = 0
        #: Spans posted, and spans dropped (a full queue or a failed post).
        self.sent = 0
        self.dropped = 0

    def finished(self, record: RequestRecord, traceparent: bytes | None) -> None:
        """Queue the span of a request that reached the model; others (refused, cancelled in line) have none."""
        if record.admitted is None or record.outcome != "ok":
            return
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
                self.dropped += 1
                self._unsent -= 1
            self._pending.append(_Pending(record, parse_traceparent(traceparent), time.monotonic()))
            self._unsent += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmtap-sim-spans", daemon=True)
                self._thread.start()

    @property
    def pending(self) -> int:
        """Spans queued or being posted: 0 once every finished request's span was sent (or dropped)."""
        with self._lock:
            return self._unsent

    def drain(self, timeout: float) -> bool:
        """Wait until every queued span was posted (or dropped), at most ``timeout`` seconds; True when none is left."""
        with self._lock:
            return self._sent_all.wait_for(lambda: self._unsent == 0, timeout)

    def close(self) -> None:
        """Post what is pending and stop the thread."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(_POST_TIMEOUT_S + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._export()
        self._export()

    def _export(self) -> None:
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
        if not batch:
            return
        try:
            self._send(batch)
        finally:
            with self._lock:
                self._unsent -= len(batch)
                self._sent_all.notify_all()

    def _send(self, batch: list[_Pending]) -> None:
        spans = [request_span(p.record, p.parent, p.ended, os.urandom(8)) for p in batch]
        scope = ScopeSpans(spans=spans)
        scope.scope.name = "llmtap.simulator"
        body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[scope])])
        body.resource_spans[0].resource.attributes.extend(self._resource)
        self._post(body.SerializeToString(), len(spans))

    def _post(self, body: bytes, count: int) -> None:
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/x-protobuf"}
        )
        try:
            with urllib.request.urlopen(request, timeout=_POST_TIMEOUT_S) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            self.dropped += count
            if not self._failing:
                log.warning(
                    "exporting %d server spans to %s failed (%s); spans are dropped until it works",
                    count,
                    self.url,
                    exc,
                )
            self._failing = True
            return
        if self._failing:
            log.warning("exporting server spans to %s works again", self.url)
        self._failing = False
        self.sent += count
