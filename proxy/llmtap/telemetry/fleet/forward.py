"""The upstream's own spans, passed on to the traces backend llmtap exports to, as they came.

A model server that sends its spans to the admin listener's ``/v1/traces`` sends them nowhere else, so
llmtap forwards each body it took to its own OTLP traces endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
and protocol, with the exporter's headers): the server's resource (``service.name=vllm``), scope, ids and
parent (llmtap's span) unchanged, so a trace backend shows the server's span under llmtap's.

Nothing waits for it: the receiver hands the body over (``offer``, which never blocks) and answers; one
daemon thread sends what waits, each export within the traces exporter's timeout (``traces_timeout``:
``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``, 10 s by default). What waits is bounded by count (``MAX_QUEUED``)
and bytes (``MAX_QUEUED_BYTES``); past either a body is dropped, and every span is
counted by outcome (``OUTCOMES``): ``sent`` (the backend took it), ``dropped`` (the queue was full, or
still waiting at shutdown), ``failed`` (the backend refused it, could not be reached, or took too long).
There are no retries: the backend sees the spans once or not at all, and a down backend costs one
timeout per body, with the queue bounding the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import httpx

from llmtap.config.types import TelemetrySettings
from llmtap.telemetry import sched
from llmtap.telemetry.emit.setup import http_endpoint
from llmtap.worker import QueueWorker

__all__ = ["MAX_QUEUED", "MAX_QUEUED_BYTES", "OUTCOMES", "Forwarder", "from_settings"]

log = logging.getLogger("llmtap.telemetry")

#: How a forwarded span ended up (``llmtap.otlp.outcome``); ``unowned``: not forwarded, since no request this
#: process relayed is in its trace (``llmtap.telemetry.fleet.peers.Ownership``). Spans passed to another replica end
#: up as one of the first three.
OUTCOMES = ("sent", "dropped", "failed", "unowned")
#: Bodies waiting to be sent at most, and their bytes at most.
MAX_QUEUED = 256
MAX_QUEUED_BYTES = 32 << 20

#: Sends one ``ExportTraceServiceRequest`` (its bytes); raises when the backend did not take it.
Send = Callable[[bytes], None]
#: Sends one to the named destination (another replica's admin listener, ``llmtap.telemetry.fleet.peers``).
SendTo = Callable[[bytes, str], None]


class Forwarder(QueueWorker[tuple[bytes, int, str | None]]):
    """A bounded queue of OTLP trace bodies and the thread that sends them; ``count(outcome, spans)``."""

    def __init__(
        self,
        send: Send | None,
        count: Callable[[str, int], None],
        *,
        max_queued: int | None = None,
        max_bytes: int | None = None,
        close: Callable[[], None] | None = None,
        send_to: SendTo | None = None,
    ) -> None:
        super().__init__(
            "llmtap-span-forward",
            max_items=MAX_QUEUED if max_queued is None else max_queued,
            max_bytes=MAX_QUEUED_BYTES if max_bytes is None else max_bytes,
            on_thread=sched.idle_here,
        )
        self._send = send
        self._send_to = send_to
        self._count = count
        self._close = close

    def offer(self, body: bytes, spans: int, to: str | None = None) -> bool:
        """Queue one body of ``spans`` spans for the backend (or destination ``to``); False (counted dropped)
        when it cannot wait."""
        return self._put((body, spans, to), len(body))

    def _serve(self) -> None:
        for body, spans, to in self._items():
            try:
                if to is None:
                    assert self._send is not None
                    self._send(body)
                else:
                    assert self._send_to is not None
                    self._send_to(body, to)
            except Exception as exc:
                log.debug("telemetry: forwarding %d server spans failed: %s", spans, exc)
                self._count("failed", spans)
            else:
                self._count("sent", spans)

    def _dropped(self, items: list[tuple[bytes, int, str | None]], why: str) -> None:
        self._count("dropped", sum(spans for _, spans, _ in items))

    def close(self, timeout: float = 5.0) -> None:
        """Send what waits within ``timeout`` seconds; what is still waiting then is counted dropped."""
        if self._stop(timeout) and self._close is not None:
            self._close()


def http_sender(endpoint: str, headers: Mapping[str, str], timeout: float) -> tuple[Send, Callable[[], None]]:
    """POST each body to an OTLP/HTTP traces ``endpoint`` (the full URL, ``.../v1/traces``); and its closer."""
    client = httpx.Client(timeout=timeout, headers={**headers, "content-type": "application/x-protobuf"})

    def send(body: bytes) -> None:
        answer = client.post(endpoint, content=body)
        if answer.status_code != 200:
            raise RuntimeError(f"{endpoint} answered {answer.status_code}")

    return send, client.close


def grpc_sender(endpoint: str, headers: Mapping[str, str], timeout: float) -> tuple[Send, Callable[[], None]]:
    """Export each body to an OTLP/gRPC ``endpoint`` over the trace service; and its closer.

    The channel is built as the SDK's exporter builds it: plaintext for ``http://``, TLS otherwise.
    """
    from urllib.parse import urlparse

    import grpc  # type: ignore[import-untyped]
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

    parsed = urlparse(endpoint)
    target = parsed.netloc or endpoint
    if parsed.scheme == "http":
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials())
    stub = TraceServiceStub(channel)  # type: ignore[no-untyped-call]
    metadata = tuple(headers.items())

    def send(body: bytes) -> None:
        stub.Export(ExportTraceServiceRequest.FromString(body), timeout=timeout, metadata=metadata)

    return send, channel.close


def from_settings(t: TelemetrySettings, count: Callable[[str, int], None]) -> Forwarder | None:
    """The forwarder to llmtap's OTLP traces endpoint, or None when it exports no traces over OTLP or is told not to."""
    if not t.forward_server_spans or t.sdk_disabled or t.traces_exporter != "otlp" or t.traces_endpoint is None:
        return None
    headers = dict(t.traces_headers)
    if t.traces_protocol == "http/protobuf":
        url = http_endpoint(t.traces_endpoint, "traces", specific=t.traces_endpoint_specific)
        send, close = http_sender(url, headers, t.traces_timeout)
    else:
        send, close = grpc_sender(t.traces_endpoint, headers, t.traces_timeout)
    return Forwarder(send, count, close=close)
