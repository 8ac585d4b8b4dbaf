"""The per-request record: monotonic timestamps, content chunks and what the stream said.

Built on the telemetry side from the relay's tape (``proxy.telemetry.replay``) and read once, after the
stream ends, by the recorder. It holds no OpenTelemetry objects and does no I/O.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from proxy.tape import now as tape_now
from proxy.types import Facts, RequestInfo, ServerTiming, Usage

#: Outcomes of a request, as ``llmtap.outcome``.
OK, ERROR, CANCELLED = "ok", "error", "cancelled"


@dataclass(slots=True)
class Timeline:
    """Everything measured about one proxied request; times are ``time.perf_counter()`` seconds."""

    method: str
    path: str
    route: str
    upstream: str
    server_address: str
    server_port: int
    protocol: str | None
    provider_name: str
    received: float
    received_wall_ns: int
    request: RequestInfo | None = None
    prompt_version: str | None = None
    body_read: float | None = None
    admitted: float | None = None
    sent: float | None = None
    headers: float | None = None
    first_byte: float | None = None
    first_content: float | None = None
    last_content: float | None = None
    end: float | None = None
    status_code: int | None = None
    # One entry per content chunk: the time its bytes reached the proxy, their size, their text.
    chunk_times: array[float] = field(default_factory=lambda: array("d"))
    chunk_bytes: array[int] = field(default_factory=lambda: array("l"))
    chunk_texts: list[str] = field(default_factory=list)
    response_bytes: int = 0
    usage: Usage | None = None
    finish_reasons: list[str] = field(default_factory=list)
    response_id: str | None = None
    response_model: str | None = None
    system_fingerprint: str | None = None
    server_timing: ServerTiming | None = None
    outcome: str = OK
    error_type: str | None = None
    error_message: str | None = None
    malformed_events: int = 0
    oversized_events: int = 0
    trace_id: str | None = None
    # The upstream's sequence number of this request and how many requests to the same upstream were
    # in flight when it was sent: what the estimator needs to replay a slot-limited server.
    upstream_seq: int | None = None
    upstream_ahead: int = 0
    # Names of timing headers the relay found malformed or inconsistent, and so ignored.
    rejected_timings: list[str] = field(default_factory=list)
    span_id: str | None = None
    # Whether the relay marked the trace sampled, and the client's traceparent and tracestate (or None).
    sampled: bool = True
    parent: tuple[str, str] | None = None
    # When the first content chunk was handed to the client's socket: the end of TTFT as the client sees it.
    first_content_delivered: float | None = None

    def wall_ns(self, t: float) -> int:
        """Epoch nanoseconds of monotonic time ``t`` (span timestamps need wall-clock time)."""
        return self.received_wall_ns + round((t - self.received) * 1e9)

    def apply(self, facts: Facts) -> None:
        """Fold one event's facts (not its content: see ``add_chunk``) into the record."""
        if facts.usage is not None:
            self.usage = merge_usage(self.usage, facts.usage)
        if facts.finish_reasons:
            # With n > 1 each choice finishes in its own event.
            self.finish_reasons.extend(facts.finish_reasons)
        if facts.response_id and not self.response_id:
            self.response_id = facts.response_id
        if facts.response_model and not self.response_model:
            self.response_model = facts.response_model
        if facts.system_fingerprint and not self.system_fingerprint:
            self.system_fingerprint = facts.system_fingerprint
        if facts.server_timing is not None:
            self.server_timing = facts.server_timing
        if facts.error_type and not self.error_type:
            self.error_type = facts.error_type
            self.error_message = facts.error_message
            self.outcome = ERROR

    def add_chunk(self, t: float, nbytes: int, text: str) -> None:
        """Record one content chunk: all content that arrived in one upstream read."""
        if self.first_content is None:
            self.first_content = t
        self.last_content = t
        self.chunk_times.append(t)
        self.chunk_bytes.append(nbytes)
        self.chunk_texts.append(text)

    def fail(self, error_type: str, message: str | None = None, *, cancelled: bool = False) -> None:
        """Mark the request failed (first failure wins) or cancelled by the client."""
        if cancelled:
            self.outcome = CANCELLED
            self.error_type = self.error_type or "cancelled"
            return
        if self.outcome == OK:
            self.outcome = ERROR
            self.error_type = error_type
            self.error_message = message


def merge_usage(old: Usage | None, new: Usage) -> Usage:
    """Later usage replaces earlier usage field by field: streams report cumulative counts, never deltas."""
    if old is None:
        return Usage(
            new.input_tokens, new.output_tokens, new.cache_read_tokens, new.cache_write_tokens, new.reasoning_tokens
        )
    return Usage(
        new.input_tokens if new.input_tokens is not None else old.input_tokens,
        new.output_tokens if new.output_tokens is not None else old.output_tokens,
        new.cache_read_tokens if new.cache_read_tokens is not None else old.cache_read_tokens,
        new.cache_write_tokens if new.cache_write_tokens is not None else old.cache_write_tokens,
        new.reasoning_tokens if new.reasoning_tokens is not None else old.reasoning_tokens,
    )


now = tape_now  # the relay's clock: one monotonic clock for both processes
