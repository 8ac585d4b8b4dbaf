"""The per-request record: monotonic timestamps, content chunks and what the stream said.

Built on the telemetry side from the relay's tape (``llmtap.telemetry.intake.replay``) and read once, after the
stream ends, by the recorder. It holds no OpenTelemetry objects and does no I/O.

Its memory is bounded whatever the response's length: the generated text is counted as it arrives
(``Output``) and kept only up to ``KEEP_CHARS``; past ``MAX_CHUNKS`` content chunks, each further one
is folded into the last.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TypeVar

from llmtap.analysis import tokens
from llmtap.analysis.objectives import RequestObjective
from llmtap.types import Facts, RequestInfo, ServerTiming, Usage
from llmtap.wire.tape import now as tape_now

T = TypeVar("T")

__all__ = ["CANCELLED", "COUNT_CHARS", "ERROR", "KEEP_CHARS", "OK", "Output", "Timeline"]

#: Outcomes of a request, as ``llmtap.outcome``.
OK, ERROR, CANCELLED = "ok", "error", "cancelled"
#: Characters of a response's text given to tiktoken (a quarter of a million tokens or so, past the longest
#: outputs models stream); the count of the rest is estimated at the tokens per character counted.
COUNT_CHARS = 1 << 20
#: Characters of a response's text kept for its span when content capture is on (``attributes.CONTENT_CAP``).
KEEP_CHARS = 16 * 1024
#: Content chunks kept one by one (twice the longest outputs at a token per chunk); later ones join the last.
MAX_CHUNKS = 1 << 18


class Output:
    """A response's generated text as it arrives: counted in bounded pieces, kept up to ``keep`` characters."""

    __slots__ = ("_chunk", "_chunk_rest", "chars", "encoding", "keep", "kept", "whole")

    def __init__(self, encoding: str, *, keep: int = KEEP_CHARS) -> None:
        self.encoding = encoding
        self.keep = keep
        self.whole = tokens.Counter(encoding, limit=COUNT_CHARS)
        self.chars = 0
        self.kept: list[str] = []
        self._chunk: list[str] = []  # the open chunk's text, as far as the whole's limit took it
        self._chunk_rest = 0  # characters of the open chunk past the limit

    def add(self, text: str) -> None:
        """Part of the content chunk being read."""
        took = self.whole.feed(text)
        if took:
            self._chunk.append(text if took == len(text) else text[:took])
        self._chunk_rest += len(text) - took
        if self.chars < self.keep:
            self.kept.append(text[: self.keep - self.chars])
        self.chars += len(text)

    def end_chunk(self) -> int:
        """Close the chunk being read: its tokens, counted, and estimated for what was past the limit."""
        parts = self._chunk
        n = tokens.count(parts[0] if len(parts) == 1 else "".join(parts), self.encoding) if parts else 0
        if self._chunk_rest:
            n += round(self._chunk_rest * self._rate())
            self._chunk_rest = 0
        self._chunk = []
        return n

    @property
    def estimated(self) -> bool:
        """Whether part of the text was past the count limit, its tokens estimated rather than counted."""
        return self.chars > self.whole.counted

    def tokens(self) -> int:
        """Tokens of the whole text, as one string: counted, and estimated past the limit."""
        n = self.whole.count()
        return n + round((self.chars - self.whole.counted) * self._rate())

    @property
    def text(self) -> str:
        """The text kept: its first ``keep`` characters."""
        return "".join(self.kept)

    def _rate(self) -> float:
        # Only asked for past the limit, when the whole count has settled its tail.
        counter = self.whole
        return counter.tokens / counter.counted if counter.counted else 0.0


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
    #: Who sent it (``llmtap.analysis.attribution``): dimension name to value, bounded.
    attribution: dict[str, str] = field(default_factory=dict)
    #: Properties past the per-request bound, dropped.
    attribution_dropped: int = 0
    #: The latency the caller asked for this request (``x-slo-*`` headers; ``llmtap.analysis.objectives``).
    request_objective: RequestObjective | None = None
    body_read: float | None = None
    admitted: float | None = None
    sent: float | None = None
    #: When the request's head went onto the upstream connection: ``sent`` plus any connect and TLS handshake
    #: (None: not known, read as ``sent``). Requests reach the upstream in this order.
    written: float | None = None
    headers: float | None = None
    first_byte: float | None = None
    first_content: float | None = None
    #: The first chunk with answer content (not reasoning alone): the first output token's arrival.
    first_output: float | None = None
    last_content: float | None = None
    end: float | None = None
    status_code: int | None = None
    # One entry per content chunk: the time its bytes reached the proxy, their size, their tokens (tiktoken's,
    # or estimated past the count limit: ``output.estimated``).
    chunk_times: array[float] = field(default_factory=lambda: array("d"))
    chunk_bytes: array[int] = field(default_factory=lambda: array("l"))
    chunk_tokens: array[int] = field(default_factory=lambda: array("q"))
    #: Content chunks past ``MAX_CHUNKS``, folded into the last one kept.
    folded_chunks: int = 0
    #: The generated text, counted; None until the first content arrives.
    output: Output | None = None
    #: Characters of generated text to keep (``KEEP_CHARS``, or 0 when content capture is off).
    keep_chars: int = KEEP_CHARS
    #: Why the tap stopped reading the response before its end (``inflate_limit``, ``body_limit``), if it did.
    unread: str | None = None
    response_bytes: int = 0
    usage: Usage | None = None
    #: The cost a gateway before the upstream put in a response header (LiteLLM's ``x-litellm-response-cost``), USD.
    header_cost: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    response_id: str | None = None
    #: The protocol's last event (``[DONE]``, ``message_stop``, ``response.completed``, ``done: true``) or a
    #: whole body arrived; ``completed_delivered``: and the relay handed it to the client's socket.
    completed: bool = False
    completed_delivered: bool = False
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
    # in flight when it was written: what the estimator needs to replay a slot-limited server.
    upstream_seq: int | None = None
    upstream_ahead: int = 0
    # Names of timing headers the relay found malformed or inconsistent, and so ignored.
    rejected_timings: list[str] = field(default_factory=list)
    span_id: str | None = None
    # What identifies the request's record (32 hex), traced or not: the relay makes it with the tape.
    record_id: str | None = None
    # Whether the relay marked the trace sampled, and the client's traceparent and tracestate (or None).
    sampled: bool = True
    parent: tuple[str, str] | None = None
    # When the first content chunk was handed to the client's socket: the end of TTFT as the client sees it.
    first_content_delivered: float | None = None
    #: Per upstream read that reached the client: seconds from its arrival to its write to the client's socket
    #: (the relay's own delay of each chunk).
    relay_delays: array[float] = field(default_factory=lambda: array("d"))
    #: What the telemetry side keeps the request's tape under until every record sink has it (its record journal's
    #: reference; None: not kept). Opaque here.
    ref: int | None = None

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
        if facts.done:
            self.completed = True
        if facts.server_timing is not None:
            self.server_timing = facts.server_timing
        if facts.error_type and not self.error_type:
            self.error_type = facts.error_type
            self.error_message = facts.error_message
            self.outcome = ERROR

    def add_text(self, text: str) -> None:
        """Content of the chunk being read (one event's), counted now; ``add_chunk`` closes the chunk."""
        out = self.output
        if out is None:
            # The encoding is the response model's when the stream said it before its first content.
            model = self.response_model or (self.request.model if self.request is not None else None)
            out = self.output = Output(tokens.encoding_for_model(model), keep=self.keep_chars)
        out.add(text)

    def add_chunk(self, t: float, nbytes: int, text: str = "", *, output: bool = True) -> None:
        """Record one content chunk: all content that arrived in one upstream read (``text``, or given before
        through ``add_text``). ``output``: it carried answer content, not reasoning alone."""
        if text:
            self.add_text(text)
        n = self.output.end_chunk() if self.output is not None else 0
        if self.first_content is None:
            self.first_content = t
        if output and self.first_output is None:
            self.first_output = t
        self.last_content = t
        if len(self.chunk_times) >= MAX_CHUNKS:
            # One more gap would be one more entry for ever: the chunk joins the last, its gap and tokens too.
            self.chunk_times[-1] = t
            self.chunk_bytes[-1] += nbytes
            self.chunk_tokens[-1] += n
            self.folded_chunks += 1
            return
        self.chunk_times.append(t)
        self.chunk_bytes.append(nbytes)
        self.chunk_tokens.append(n)

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


#: A usage's fields in their order, read at once (``dataclasses.replace`` and ``fields`` cost a microsecond or two a
#: request; every request with usage merges it once at least).
_USAGE_FIELDS = attrgetter(*(f.name for f in fields(Usage)))


def merge_usage(old: Usage | None, new: Usage) -> Usage:
    """Later usage replaces earlier usage field by field: streams report cumulative counts, never deltas."""
    if old is None:
        return Usage(*_USAGE_FIELDS(new))
    return Usage(*map(_later, _USAGE_FIELDS(old), _USAGE_FIELDS(new)))


def _later(old: T, new: T) -> T:
    return new if new is not None else old


now = tape_now  # the relay's clock: one monotonic clock for both processes
