"""The upstream's own spans: read from OTLP, joined to llmtap's requests, their phases taken as the truth.

A tracing model server (vLLM with ``--otlp-traces-endpoint``) exports one span per request, parented on
the ``traceparent`` llmtap sent upstream, with the server's own queue, prefill and decode times
(``gen_ai.latency.time_in_queue``, ``time_in_model_prefill``, ``time_in_model_decode``, seconds). The
admin listener receives them (``POST /v1/traces``, OTLP/HTTP protobuf) and the recorder's worker joins
each to the request whose root span is its parent: an exact join, since llmtap made that span id.

The server exports a request's span after the request ends, in batches (vLLM's SDK: every 5 s by
default), so a finished request may wait for it in the ``Join``, at most ``wait`` seconds. Waiting,
rather than recording at once and correcting later, keeps every output right: a histogram sample or an
ended span cannot be taken back, so a late correction would count the request twice or leave the first,
estimated, figure standing. The wait is on the telemetry side only; no relayed byte waits for it.

What waits is bounded (``MAX_HELD`` requests, ``MAX_EARLY`` spans that came before their request), and
an upstream is waited for only while waiting pays: once one of its spans came (``traced``), or, before
any came, for its first ``PROBE`` requests when its ``/metrics`` shows a server that can trace
(``compatible``). ``PROBE`` requests in a row without a span stop the waiting until a span comes again.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from llmtap.analysis.finish import Finished
from llmtap.analysis.summary import Summary, adopt_server_timing
from llmtap.analysis.timeline import Timeline
from llmtap.compression import InflateLimit, Inflater, decodable
from llmtap.config.types import Settings
from llmtap.providers.timing import seconds
from llmtap.telemetry.fleet.upstreams import UpstreamWatch
from llmtap.types import ServerTiming

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_EARLY",
    "MAX_HELD",
    "MAX_HELD_CHARS",
    "MAX_RECENT",
    "OUTCOMES",
    "PROBE",
    "RATIO_FLOOR",
    "REJECT_REASONS",
    "BadBody",
    "Finishing",
    "Join",
    "ServerSpan",
    "ServerSpanWait",
    "decode",
    "inflate",
    "parse",
    "server_spans",
    "span_count",
]

#: The latency attributes of a server's request span (vLLM's ``SpanAttributes``), in seconds, by phase.
LATENCY_ATTRIBUTES = {
    "queue": "gen_ai.latency.time_in_queue",
    "prefill": "gen_ai.latency.time_in_model_prefill",
    "decode": "gen_ai.latency.time_in_model_decode",
}
#: Largest OTLP body taken, as sent and once inflated (vLLM sends at most 512 spans of ~1 KB per batch).
MAX_BODY_BYTES = 4 << 20
MAX_INFLATED_BYTES = 16 << 20
#: A gzip body may always inflate to this many bytes, whatever its ratio (a small batch compresses well).
RATIO_FLOOR = 1 << 20
#: Finished requests waiting for their server span at most, and the characters of their prompts (a held request
#: keeps its prompt for the cache diagnosis, in a few copies: about 4 bytes a character); past either the oldest is
#: recorded without.
MAX_HELD = 4096
MAX_HELD_CHARS = 8 << 20
#: Spans kept that came before their request finished (the telemetry queue was behind); the oldest go.
MAX_EARLY = 8192
#: Requests recorded recently, remembered so that a span coming after its request counts as late.
MAX_RECENT = 8192
#: Requests in a row without a span after which an upstream is no longer waited for.
PROBE = 4
#: How each span (or each request, for ``missing``) ended up: joined in time; came after its request
#: was recorded; joined nothing llmtap sent; a request whose span never came within the wait; a further span
#: for a request that already has one (a retry of the server's export, or a forgery), which is never joined.
OUTCOMES = ("matched", "late", "unmatched", "missing", "duplicate")
#: Why the receiver refused a body: unreadable (400), too large as sent or once inflated (413), not
#: protobuf or gzip (415), no or a wrong token, or marked as
#: passed on by another replica without the replicas' token (401), from beyond loopback with no token configured (403).
REJECT_REASONS = ("bad_body", "too_large", "inflated_too_large", "unsupported_type", "unauthorized", "forbidden")
#: Seconds a request recorded before its upstream's ``/metrics`` was first read waits for that read (once per
#: upstream), on a route that declares a tracing model server (``provider``): whether the upstream traces
#: decides whether the request waits for the server's span, and a fresh proxy's first request can end before
#: two are ever in flight (which starts the reads otherwise). Other upstreams are not read on a first request.
FIRST_READ = 2.0
TRACING_PROVIDERS = frozenset({"vllm", "sglang"})


class BadBody(ValueError):
    """An OTLP body that cannot be read; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ServerSpan:
    """One server span with latency attributes: its ids (lowercase hex) and the phases it reports."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    timing: ServerTiming


def inflate(
    body: bytes,
    encoding: str | None,
    *,
    max_body: int = MAX_BODY_BYTES,
    max_inflated: int = MAX_INFLATED_BYTES,
    max_ratio: int | None = None,
) -> bytes:
    """The body as sent (gzip or deflate as ``llmtap.compression`` reads them, or as is), inflated within
    ``max_inflated`` bytes and, with ``max_ratio``, within ``max_ratio`` times its size as sent (or
    ``RATIO_FLOOR`` bytes, whichever is more).

    The inflater stops one byte past the bound, so a gzip bomb costs at most the bound in memory.
    """
    if len(body) > max_body:
        raise BadBody("too_large", f"body of {len(body)} bytes is over {max_body}")
    coding = (encoding or "identity").strip().lower()
    if coding == "identity":
        return body
    if not decodable(coding):
        raise BadBody("unsupported_type", f"content-encoding {coding!r} is not gzip or deflate")
    limit = max_inflated if max_ratio is None else min(max_inflated, max(RATIO_FLOOR, max_ratio * len(body)))
    # One piece of at most the bound plus a byte: a gzip bomb costs at most the bound in memory.
    inflater = Inflater(coding, limit, piece=limit + 1)
    try:
        out = b"".join(inflater.feed(body)) + inflater.flush()
    except zlib.error as exc:
        raise BadBody("bad_body", f"{coding}: {exc}") from None
    except InflateLimit:
        why = f"{max_ratio} times its {len(body)} bytes" if limit < max_inflated else f"{max_inflated} bytes"
        raise BadBody("inflated_too_large", f"inflated body over {why}") from None
    if not inflater.complete:
        raise BadBody("bad_body", f"{coding}: truncated")
    return out


def _number(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "double_value":
        return value.double_value
    if kind == "int_value":
        return value.int_value
    return None


def parse(body: bytes) -> list[ServerSpan]:
    """Every span of an OTLP ``ExportTraceServiceRequest`` that reports a server phase (``server_spans``).

    Raises ``BadBody`` when the bytes are no such message.
    """
    return server_spans(decode(body))


def decode(body: bytes) -> ExportTraceServiceRequest:
    """The OTLP ``ExportTraceServiceRequest`` of ``body``; ``BadBody`` when the bytes are no such message."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise BadBody("bad_body", f"not an OTLP trace export: {exc}") from None
    return request


def span_count(request: ExportTraceServiceRequest) -> int:
    """How many spans ``request`` holds, of any kind."""
    return sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)


def server_spans(request: ExportTraceServiceRequest) -> list[ServerSpan]:
    """Every span of ``request`` that reports a server phase.

    A phase that is not a finite non-negative number of seconds is named in the timing's ``rejected`` and
    left out.
    """
    spans: list[ServerSpan] = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                timing = _timing(span.attributes)
                if timing is None or len(span.trace_id) != 16 or len(span.parent_span_id) != 8:
                    continue
                spans.append(
                    ServerSpan(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name, timing)
                )
    return spans


def _timing(attributes: object) -> ServerTiming | None:
    found: dict[str, float] = {}
    rejected: list[str] = []
    names = {name: phase for phase, name in LATENCY_ATTRIBUTES.items()}
    for attribute in attributes:  # type: ignore[attr-defined]
        phase = names.get(attribute.key)
        if phase is None:
            continue
        value = seconds(_number(attribute.value), 1.0)
        if value is None:
            rejected.append(phase)
        else:
            found[phase] = value
    if not found and not rejected:
        return None
    return ServerTiming(found.get("queue"), found.get("prefill"), found.get("decode"), rejected)


T = TypeVar("T")


@dataclass(slots=True)
class _Tracing:
    traced: bool = False
    misses: int = 0


@dataclass(slots=True)
class _Held(Generic[T]):
    item: T
    upstream: str
    deadline: float
    size: int = 0


@dataclass(slots=True)
class Join(Generic[T]):
    """Finished requests waiting for their server span, keyed by llmtap's root span id; bounded.

    Used by one thread (the recorder's worker); time is passed in. ``count(outcome, n)`` counts spans and
    requests by ``OUTCOMES``. The items are the recorder's (a timeline and its summary).
    """

    wait: float
    count: Callable[[str, int], None]
    _held: OrderedDict[str, _Held[T]] = field(default_factory=OrderedDict)
    _early: OrderedDict[str, tuple[ServerSpan, float]] = field(default_factory=OrderedDict)
    _recent: OrderedDict[str, str] = field(default_factory=OrderedDict)
    #: Requests a span already joined (matched, or late): a further span of one is a duplicate.
    _joined: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _upstreams: dict[str, _Tracing] = field(default_factory=dict)
    _held_size: int = 0

    def traced(self, upstream: str) -> bool:
        """Whether a span of ``upstream`` came and none of its last ``PROBE`` requests went without one."""
        state = self._upstreams.get(upstream)
        return state is not None and state.traced

    def wants(self, upstream: str, *, compatible: bool) -> bool:
        """Whether a finished request to ``upstream`` should wait for its span."""
        if self.wait <= 0:
            return False
        state = self._upstreams.get(upstream)
        if state is not None and state.traced:
            return True
        return compatible and (state is None or state.misses < PROBE)

    def early(self, span_id: str, now: float) -> ServerSpan | None:
        """The span of request ``span_id`` when it came before the request finished (taken out, and the request
        counted as joined); one kept past the wait joined nothing (``unmatched``)."""
        found = self._early.pop(span_id, None)
        if found is None:
            return None
        if now - found[1] > self.wait:
            self.count("unmatched", 1)
            return None
        self._join(span_id)
        return found[0]

    def _join(self, span_id: str) -> None:
        self._joined[span_id] = None
        while len(self._joined) > MAX_RECENT:
            self._joined.popitem(last=False)

    def hold(self, span_id: str, upstream: str, item: T, now: float, size: int = 0) -> list[T]:
        """Let a finished request wait (``size``: its prompt's characters); returns the requests pushed out past
        ``MAX_HELD`` or ``MAX_HELD_CHARS`` (record them now)."""
        self._take(span_id)
        self._held[span_id] = _Held(item, upstream, now + self.wait, size)
        self._held_size += size
        out: list[T] = []
        while len(self._held) > MAX_HELD or (self._held_size > MAX_HELD_CHARS and len(self._held) > 1):
            key, held = self._held.popitem(last=False)
            self._held_size -= held.size
            out.append(self._missed(key, held))
        return out

    def _take(self, span_id: str) -> _Held[T] | None:
        held = self._held.pop(span_id, None)
        if held is not None:
            self._held_size -= held.size
        return held

    def recorded(self, span_id: str | None, upstream: str) -> None:
        """A request was recorded without waiting: a span of it that comes later is late."""
        if span_id is not None:
            self._remember(span_id, upstream)

    def _remember(self, span_id: str, upstream: str) -> None:
        """Remember a recorded request, so that its span counts as late; the oldest go past ``MAX_RECENT``."""
        self._recent[span_id] = upstream
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)

    def spans(self, spans: list[ServerSpan], now: float) -> list[tuple[T, ServerSpan]]:
        """Join spans that came: the waiting requests they complete, with their span, to record now."""
        matched: list[tuple[T, ServerSpan]] = []
        unmatched = late = duplicate = 0
        for span in spans:
            parent = span.parent_span_id
            held = self._take(parent)
            if held is not None:
                self._hit(held.upstream)
                self._join(parent)
                matched.append((held.item, span))
                continue
            upstream = self._recent.pop(parent, None)
            if upstream is not None:
                late += 1
                self._hit(upstream)  # it traces: wait for its next requests
                self._join(parent)
                continue
            if parent in self._joined or parent in self._early:
                # A request has one server span: the first one stands, and this one is counted, never joined.
                duplicate += 1
                continue
            # Its request may not have finished yet (the telemetry queue is behind): kept for a while.
            self._early[parent] = (span, now)
            while len(self._early) > MAX_EARLY:
                self._early.popitem(last=False)
                unmatched += 1
        if matched:
            self.count("matched", len(matched))
        if late:
            self.count("late", late)
        if unmatched:
            self.count("unmatched", unmatched)
        if duplicate:
            self.count("duplicate", duplicate)
        return matched

    def _hit(self, upstream: str) -> None:
        state = self._upstreams.setdefault(upstream, _Tracing())
        state.traced, state.misses = True, 0

    def _missed(self, key: str, held: _Held[T]) -> T:
        state = self._upstreams.setdefault(held.upstream, _Tracing())
        state.misses += 1
        if state.misses >= PROBE:
            state.traced = False
        self._remember(key, held.upstream)
        self.count("missing", 1)
        return held.item

    def due(self, now: float) -> list[T]:
        """Requests whose wait is over, recorded without a span; early spans past the wait are dropped."""
        out: list[T] = []
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.deadline > now:
                break
            self._take(key)
            out.append(self._missed(key, held))
        stale = 0
        while self._early:
            key, (_, at) = next(iter(self._early.items()))
            if now - at <= self.wait:
                break
            del self._early[key]
            stale += 1
        if stale:
            self.count("unmatched", stale)
        return out

    def release(self) -> list[T]:
        """Every waiting request, now (flush, shutdown); none of them counts against its upstream."""
        out = [held.item for held in self._held.values()]
        for key, held in self._held.items():
            self._remember(key, held.upstream)
        self._held.clear()
        self._held_size = 0
        return out

    def next_deadline(self) -> float | None:
        """When the first waiting request's wait ends (they wait in the order they came), or None."""
        if self._held:
            return next(iter(self._held.values())).deadline
        if self._early:
            return next(iter(self._early.values()))[1] + self.wait
        return None

    @property
    def held(self) -> int:
        """Requests waiting now."""
        return len(self._held)

    @property
    def held_size(self) -> int:
        """The characters of the prompts of the requests waiting now."""
        return self._held_size


#: What waits for its server span: a finished request, analysed whole (``llmtap.analysis.finish``).
Finishing = Finished


class ServerSpanWait:
    """Whether a finished request waits for its upstream's own span, and the requests the wait lets go.

    Used by the recorder's worker thread only; time is passed in. What it returns is final (the server's
    timing adopted where its span came): the caller emits it as it is.
    """

    def __init__(self, settings: Settings, upstreams: UpstreamWatch, count: Callable[[str, int], None]) -> None:
        self.join: Join[Finishing] = Join(settings.telemetry.server_spans_wait, count)
        #: The upstreams' ``/metrics``: whether each can trace (read on their own thread).
        self.upstreams = upstreams
        self._count = count
        self._routes = {r.name: r for r in settings.routes}

    def offer(self, request: Finishing, now: float) -> list[Finishing]:
        """``request`` finished: what to emit now (itself, unless it waits, and any request its wait pushed out)."""
        tl, s = request.tl, request.summary
        if not self._joinable(tl, s):
            return [request]
        assert tl.span_id is not None
        span = self.join.early(tl.span_id, now)
        if span is not None:
            self._count("matched", 1)
            adopt_server_timing(tl, s, span.timing)
        elif self.join.wants(tl.upstream, compatible=self._compatible(tl)):
            size = len(tl.request.prompt_text) if tl.request is not None else 0
            return self.join.hold(tl.span_id, tl.upstream, request, now, size)
        else:
            self.join.recorded(tl.span_id, tl.upstream)
        return [request]

    def spans(self, spans: list[ServerSpan], now: float) -> list[Finishing]:
        """Spans came: the waiting requests they complete, with the server's timing adopted."""
        out: list[Finishing] = []
        for request, span in self.join.spans(spans, now):
            adopt_server_timing(request.tl, request.summary, span.timing)
            out.append(request)
        return out

    def due(self, now: float) -> list[Finishing]:
        """Requests whose wait is over, without a span."""
        return self.join.due(now)

    def release(self) -> list[Finishing]:
        """Every waiting request, now (flush, shutdown)."""
        return self.join.release()

    def next_deadline(self) -> float | None:
        """When the first wait ends, or None."""
        return self.join.next_deadline()

    def _compatible(self, tl: Timeline) -> bool:
        """Whether ``tl``'s upstream showed a tracing-capable server; on a route declared ``vllm`` or ``sglang``, an
        upstream never read is read now and the answer waited for (``FIRST_READ``)."""
        route = self._routes.get(tl.route)
        declared = route is not None and (route.provider or "").lower() in TRACING_PROVIDERS
        return self.upstreams.compatible(tl.upstream, wait=FIRST_READ if declared else 0.0)

    def _joinable(self, tl: Timeline, s: Summary) -> bool:
        """Whether a server span of ``tl`` can come: it reached the model, in a sampled trace, with no phase
        reported in the stream itself."""
        st = tl.server_timing
        return (
            tl.span_id is not None
            and tl.sampled
            and tl.protocol is not None
            and s.reached_model
            and (st is None or (st.queue is None and st.prefill is None))
        )
