"""Spans of a finished request: the root with the relay's ids, the queue, prefill and decode phases, and one per
chunk for the requests that keep chunk detail (``llmtap.telemetry.emit.chunkdetail`` decides which).

Everything here runs on the recorder's worker thread, after the stream ended: spans are written with
their real start and end times (epoch nanoseconds from the timeline's monotonic stamps).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    ReadableSpan,
    SpanProcessor as SdkSpanProcessor,
    TracerProvider as SdkTracerProvider,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NoOpTracerProvider,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TracerProvider,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmtap import __version__
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import OK, Timeline
from llmtap.config.types import Settings
from llmtap.labels import OTHER, clean
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.attributes import (
    as_hop,
    cache_attributes,
    cost_attributes,
    end_attributes,
    hop_name,
    is_hop,
    queue_attributes,
    root_name,
    start_attributes,
)
from llmtap.telemetry.emit.chunkdetail import SUMMARY, ChunkDetail, chunk_stats, largest_gap
from llmtap.telemetry.sched import checkpoint

if TYPE_CHECKING:
    from llmtap.analysis.finish import Finished

__all__ = ["MAX_TRACE_CONTEXT", "SpanWriter", "wall_ns"]

_PROPAGATOR = TraceContextTextMapPropagator()
#: The longest ``traceparent`` and ``tracestate`` the SDK's propagator reads (W3C Trace Context, section 3.3.1.1:
#: 512 characters for tracestate); past it the SDK logs a warning per request, so llmtap ignores them first.
MAX_TRACE_CONTEXT = 512
#: Seconds between two log lines about ignored trace context; the counter has every one.
LOG_EVERY = 60.0
log = logging.getLogger("llmtap.telemetry")


class FixedIds(IdGenerator):
    """The SDK's id generator, told the next ids: so the spans carry the ids the relay already sent.

    The relay makes a request's trace and span ids and sends them upstream as ``traceparent`` before
    any span exists; the recorder, writing the root span later, primes this generator with them. Unprimed
    (every other span) it returns the wrapped generator's ids. Primed values are per thread.
    """

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self._next = threading.local()

    def prime(self, trace_id: int | None, span_id: int | None) -> None:
        """The next trace id and span id this thread asks for."""
        self._next.trace_id, self._next.span_id = trace_id, span_id

    def generate_span_id(self) -> int:
        """The primed span id, once; else a new one."""
        value: int | None = getattr(self._next, "span_id", None)
        if value is None:
            return self.inner.generate_span_id()
        self._next.span_id = None
        return value

    def generate_trace_id(self) -> int:
        """The primed trace id, once; else a new one."""
        value: int | None = getattr(self._next, "trace_id", None)
        if value is None:
            return self.inner.generate_trace_id()
        self._next.trace_id = None
        return value

    @classmethod
    def install(cls, provider: TracerProvider | None) -> FixedIds | None:
        """Wrap an SDK provider's generator (before its tracer is made); None for any other provider."""
        if not isinstance(provider, SdkTracerProvider):
            return None
        current = provider.id_generator
        if isinstance(current, FixedIds):
            return current
        fixed = cls(current)
        provider.id_generator = fixed  # type: ignore[assignment]
        return fixed


class ChunkSpanWriter:
    """Writes finished chunk spans straight to the SDK provider's span processors.

    A chunk span is born finished: its times, parent and attributes are known when the request is
    recorded. ``Tracer.start_span`` and ``end`` (context lookup, sampler, attribute validation, a lock per
    end) cost about 25 µs a span, the constructed span about 4 µs (bench/archive/RESULTS-2026-12.md), and a stream has a
    span per chunk. Sampling follows the parent (the decode span), as the SDK's default sampler decides;
    ``on_start`` is not called, as nothing can be added to a finished span. Reaching the processors takes
    two SDK attributes that are not public: without them (another SDK version, another provider) ``of``
    returns None and chunk spans go through the tracer as any other.
    """

    def __init__(self, processor: SdkSpanProcessor, resource: Resource, scope: InstrumentationScope, ids: Any) -> None:
        self._processor = processor
        self._resource = resource
        self._scope = scope
        self._span_id: Callable[[], int] = ids.generate_span_id

    @classmethod
    def of(cls, provider: TracerProvider | None, tracer: Any) -> ChunkSpanWriter | None:
        """A writer for an SDK provider and its tracer, or None."""
        if not isinstance(provider, SdkTracerProvider):
            return None
        processor = getattr(provider, "_active_span_processor", None)
        scope = getattr(tracer, "_instrumentation_scope", None)
        if not isinstance(processor, SdkSpanProcessor) or not isinstance(scope, InstrumentationScope):
            return None
        return cls(processor, provider.resource, scope, provider.id_generator)

    def child(self, parent: SpanContext) -> SpanContext:
        """A new span's context under ``parent`` (its trace, flags and state, as the default sampler keeps them)."""
        return SpanContext(parent.trace_id, self._span_id(), False, parent.trace_flags, parent.trace_state)

    def write(
        self,
        parent: SpanContext,
        start: int,
        end: int,
        attributes: dict[str, Any],
        *,
        name: str = sc.SPAN_CHUNK,
        context: SpanContext | None = None,
    ) -> None:
        """One finished span (a chunk's unless ``name`` says otherwise), child of ``parent``, from ``start`` to
        ``end`` (epoch ns); ``context``: its own, made beforehand with ``child`` (when children name it)."""
        span = ReadableSpan(
            name,
            context=context if context is not None else self.child(parent),
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=SpanKind.INTERNAL,
            instrumentation_scope=self._scope,
            start_time=start,
            end_time=end,
        )
        self._processor.on_end(span)


class SpanWriter:
    """Writes each finished request's spans through one tracer (the injected provider's)."""

    def __init__(self, settings: Settings, tracer_provider: TracerProvider | None) -> None:
        self.settings = settings
        self._ids = FixedIds.install(tracer_provider)
        latest = settings.telemetry.semconv_latest
        self._tracer = (tracer_provider or NoOpTracerProvider()).get_tracer(
            "llmtap", __version__, schema_url=sc.schema_url(latest)
        )
        #: Chunk spans straight to the SDK's processors when the provider is the SDK's; None otherwise.
        self.chunk_writer = ChunkSpanWriter.of(tracer_provider, self._tracer)
        # The SDK provider's span processors, read at each request (one may be added later); None: not the SDK's.
        self._processors = getattr(tracer_provider, "_active_span_processor", None)
        #: Which requests keep their chunk spans; the others get their chunk statistics only.
        self.chunk_detail = ChunkDetail(settings.telemetry)
        #: Called with ``traceparent_too_long`` or ``tracestate_too_long`` for each client header ignored.
        self.on_ignored: Callable[[str], None] | None = None
        self._ignored = 0
        self._logged_at = -LOG_EVERY

    def _ignore(self, reason: str, length: int) -> None:
        """Count a client trace header too long to read; log it at most once per ``LOG_EVERY`` seconds."""
        self._ignored += 1
        if self.on_ignored is not None:
            self.on_ignored(reason)
        clock = time.monotonic()
        if clock - self._logged_at >= LOG_EVERY:
            self._logged_at = clock
            log.warning(
                "telemetry: ignored a client's %s of %d characters (over %d; %d ignored so far, "
                "llmtap_trace_context_ignored_total counts each)",
                reason.removesuffix("_too_long"),
                length,
                MAX_TRACE_CONTEXT,
                self._ignored,
            )

    def emit(self, request: Finished) -> None:
        """The spans of a finished request: its root (with its cache diagnosis and cost), phases and chunks.

        A failure is logged, never raised: a broken trace pipeline costs the spans, nothing else."""
        tl, s, diag = request.tl, request.summary, request.diagnosis
        try:
            if self.unread(tl):
                self.unwritten(tl, s)
                return
            root = self.root(tl)
            if diag is not None:
                root.set_attributes(cache_attributes(diag))
            if s.cost is not None:
                root.set_attributes(cost_attributes(s.cost, hop=self.is_hop(tl)))
            self.write(tl, s, root)
        except Exception:
            log.exception("telemetry: could not write the spans of %s %s", tl.method, tl.path)

    def unread(self, tl: Timeline) -> bool:
        """Whether nothing would read ``tl``'s spans: the SDK's provider has no span processor (no traces endpoint,
        none added since) and the relay gave the request its ids (the root span gives none to ``tl``).

        Then the spans are not built: with no processor the SDK ends each span into nothing, and the live view,
        the records and the metrics' exemplars read the timeline, not the spans. What building them does beyond
        them is done by ``unwritten``."""
        processors = self._processors
        return tl.span_id is not None and processors is not None and not getattr(processors, "_span_processors", True)

    def unwritten(self, tl: Timeline, s: Summary) -> None:
        """What ``emit`` does beyond the spans themselves, for a request whose spans nothing reads (``unread``): a
        client's trace header too long to read is counted, and the chunk-detail tail sees the request, so a span
        processor added later finds both as it would have had every span been built."""
        if tl.parent is not None:
            traceparent, tracestate = tl.parent
            if len(traceparent) > MAX_TRACE_CONTEXT:
                self._ignore("traceparent_too_long", len(traceparent))
            elif len(tracestate) > MAX_TRACE_CONTEXT:
                self._ignore("tracestate_too_long", len(tracestate))
        if tl.protocol is not None and tl.first_content is not None and tl.last_content is not None:
            self.chunk_detail.decide(tl, s, largest_gap(s))

    def root(self, tl: Timeline) -> Span:
        """The request's root span, with the ids the relay made (a child of the client's ``traceparent``)."""
        parent = otel_context.Context()
        if tl.parent is not None:
            traceparent, tracestate = tl.parent
            if len(traceparent) > MAX_TRACE_CONTEXT:
                self._ignore("traceparent_too_long", len(traceparent))
            else:
                carrier = {"traceparent": traceparent}
                if len(tracestate) > MAX_TRACE_CONTEXT:
                    self._ignore("tracestate_too_long", len(tracestate))
                elif tracestate:
                    carrier["tracestate"] = tracestate
                parent = _PROPAGATOR.extract(carrier)
        if self._ids is not None and tl.span_id is not None and tl.trace_id is not None:
            self._ids.prime(int(tl.trace_id, 16), int(tl.span_id, 16))
        attrs = start_attributes(tl)
        if self.is_hop(tl):
            # The client's own span is the generation: this one is the HTTP hop through the proxy.
            name, kind, attrs = hop_name(tl), SpanKind.SERVER, {**as_hop(attrs), sc.SPAN_ROLE: "hop"}
        else:
            name, kind = root_name(tl), SpanKind.CLIENT
        start = tl.received_wall_ns
        span = self._tracer.start_span(name, context=parent, kind=kind, attributes=attrs, start_time=start)
        if self._ids is not None:
            self._ids.prime(None, None)
        ctx = span.get_span_context()
        if ctx.is_valid and tl.span_id is None:
            tl.trace_id = format(ctx.trace_id, "032x")
            tl.span_id = format(ctx.span_id, "016x")
        return span

    def is_hop(self, tl: Timeline) -> bool:
        """True when the root span is the hop, not the generation (``attributes.is_hop``)."""
        return is_hop(tl, self.settings.telemetry.span_role)

    def write(self, tl: Timeline, s: Summary, root: Span) -> None:
        """End the root span with what the stream said, and write its phase and chunk spans."""
        end = tl.end if tl.end is not None else tl.received
        if tl.protocol is not None:
            t = self.settings.telemetry
            attrs = end_attributes(
                tl, s, capture=t.capture_content, latest=t.semconv_latest, offline=t.offline_token_usage
            )
            root.set_attributes(as_hop(attrs) if self.is_hop(tl) else attrs)
        if tl.status_code is not None:
            root.set_attribute(sc.HTTP_STATUS, tl.status_code)
        root.set_attributes(relay_cost(tl, s))
        if tl.outcome != OK:
            # Both from the upstream as often as not (its error object): cleaned like every such string.
            root.set_attribute(sc.ERROR_TYPE, clean(tl.error_type) if tl.error_type else OTHER)
            message = tl.error_message or tl.error_type
            root.set_status(Status(StatusCode.ERROR, clean(message) if message else None))
        if tl.protocol is not None:
            self._phase_spans(tl, s, self._phases(root))
        root.end(end_time=wall_ns(tl, end))

    def _phases(self, root: Span) -> Callable[[str, int], Any]:
        """How the root's phase spans start: born finished and handed to the span processors when the provider
        is the SDK's and the root is sampled (as chunk spans are: a tenth of ``start_span``'s cost), else through
        the tracer. Span events (``chunk_spans: events``) need the SDK's span: the tracer then."""
        writer = self.chunk_writer
        parent = root.get_span_context()
        if (
            writer is not None
            and root.is_recording()
            and parent.trace_flags.sampled
            and self.settings.telemetry.chunk_spans != "events"
        ):
            return lambda name, start: _Born(writer, name, parent, start)
        ctx = trace.set_span_in_context(root, otel_context.Context())
        tracer = self._tracer
        return lambda name, start: tracer.start_span(name, context=ctx, start_time=start)

    def _phase_spans(self, tl: Timeline, s: Summary, start_span: Callable[[str, int], Any]) -> None:
        queue_end = tl.admitted if tl.admitted is not None else tl.body_read
        start = tl.sent if tl.sent is not None else queue_end
        if start is not None and s.upstream_queue is not None:
            # The server's own line follows the proxy's: the queue span runs until the server took it up.
            queue_end = start + s.upstream_queue
            start = queue_end
        if queue_end is not None:
            span = start_span(sc.SPAN_QUEUE, wall_ns(tl, tl.received))
            span.set_attributes(queue_attributes(s))
            span.end(end_time=wall_ns(tl, queue_end))
        if start is not None and tl.first_content is not None and s.upstream_unattributed is not None:
            start = self._unattributed_span(tl, s, start_span, start)
        if start is not None and tl.first_content is not None:
            span = start_span(sc.SPAN_PREFILL, wall_ns(tl, start))
            attrs: dict[str, Any] = {sc.PREFILL_SOURCE: s.prefill_source}
            if s.prefill is not None:
                attrs[sc.PREFILL_DURATION] = s.prefill
            # Children carry llmtap's names: a gen_ai.usage.* here would count the request's tokens again.
            if s.input_tokens is not None:
                attrs[sc.INPUT_TOKENS] = s.input_tokens
                attrs[sc.UNCACHED_INPUT_TOKENS] = s.input_tokens - (s.cache_read_tokens or 0)
            if s.cache_read_tokens is not None:
                attrs[sc.CACHE_READ_TOKENS] = s.cache_read_tokens
            span.set_attributes(attrs)
            span.end(end_time=wall_ns(tl, tl.first_content))
        if tl.first_content is None or tl.last_content is None:
            return
        decode = start_span(sc.SPAN_DECODE, wall_ns(tl, tl.first_content))
        attrs = {sc.CHUNK_COUNT: len(tl.chunk_times) + tl.folded_chunks, sc.DECODE_DURATION: s.decode or 0.0}
        if s.output_tokens is not None:
            attrs[sc.OUTPUT_TOKENS] = s.output_tokens
        if s.tpot is not None:
            attrs[sc.TPOT] = s.tpot
        # Every request: its chunk statistics; only the requests that matter: a span per chunk (``chunkdetail``).
        attrs.update(chunk_stats(s, tl.chunk_times))
        keep = self.chunk_detail.decide(tl, s, largest_gap(s))
        attrs[sc.CHUNK_DETAIL] = keep or SUMMARY
        decode.set_attributes(attrs)
        mode = self.settings.telemetry.chunk_spans
        if mode != "off" and keep is not None:
            self._chunks(tl, s, decode, mode)
        decode.end(end_time=wall_ns(tl, tl.last_content))

    def _unattributed_span(
        self, tl: Timeline, s: Summary, start_span: Callable[[str, int], Any], start: float
    ) -> float:
        """The upstream time the server's queue and prefill leave out, as its own span between the two (the
        server does not say where it went); returns where prefill starts: the server's prefill before the first
        content chunk, never stretched over this part."""
        assert tl.first_content is not None and s.upstream_unattributed is not None
        begin = max(tl.first_content - (s.prefill or 0.0), start)
        span = start_span(sc.SPAN_UNATTRIBUTED, wall_ns(tl, start))
        span.set_attribute(sc.UPSTREAM_UNATTRIBUTED_DURATION, s.upstream_unattributed)
        span.end(end_time=wall_ns(tl, begin))
        return begin

    def _chunks(self, tl: Timeline, s: Summary, decode: Any, mode: str) -> None:
        times, sizes = tl.chunk_times, tl.chunk_bytes
        n = len(times)
        cap = self.settings.telemetry.chunk_span_cap
        shown = n if n <= cap else cap - 1
        ctx = trace.set_span_in_context(decode, otel_context.Context())
        emit = self._chunk_emitter(decode, ctx)
        for i in range(shown):
            checkpoint()
            gap = times[i] - times[i - 1] if i else 0.0
            attrs: dict[str, Any] = {sc.CHUNK_INDEX: i, sc.CHUNK_BYTES: sizes[i], sc.CHUNK_GAP: gap}
            if i < len(s.chunk_tokens):
                attrs[sc.CHUNK_TOKENS] = s.chunk_tokens[i]
            if mode == "events":
                decode.add_event(sc.EVENT_CHUNK, attrs, timestamp=wall_ns(tl, times[i]))
            else:
                emit(wall_ns(tl, times[i - 1] if i else times[i]), wall_ns(tl, times[i]), attrs)
        if shown < n:
            # Past the cap, the tail folds into one span so a 10,000-chunk stream stays cheap.
            attrs = {
                sc.CHUNK_INDEX: shown,
                sc.CHUNK_FOLDED: n - shown,
                sc.CHUNK_BYTES: sum(sizes[shown:]),
                sc.CHUNK_GAP: times[-1] - times[shown - 1] if shown else 0.0,
            }
            if len(s.chunk_tokens) == n:
                attrs[sc.CHUNK_TOKENS] = sum(s.chunk_tokens[shown:])
            if mode == "events":
                decode.add_event(sc.EVENT_CHUNK, attrs, timestamp=wall_ns(tl, times[-1]))
            else:
                emit(wall_ns(tl, times[shown - 1] if shown else times[0]), wall_ns(tl, times[-1]), attrs)

    def _chunk_emitter(self, decode: Any, ctx: otel_context.Context) -> Callable[[int, int, dict[str, Any]], None]:
        """How this request's chunk spans are written: straight to the processors, or through the tracer."""
        writer = self.chunk_writer
        parent = decode.get_span_context()
        if writer is not None and decode.is_recording() and parent.trace_flags.sampled:
            return lambda start, end, attrs: writer.write(parent, start, end, attrs)

        def through_tracer(start: int, end: int, attrs: dict[str, Any]) -> None:
            self._tracer.start_span(sc.SPAN_CHUNK, context=ctx, start_time=start, attributes=attrs).end(end_time=end)

        return through_tracer


def wall_ns(tl: Timeline, t: float) -> int:
    """Epoch nanoseconds of the request's monotonic time ``t``: span timestamps need wall-clock time, and the
    timeline carries the wall clock of its arrival alone."""
    return tl.received_wall_ns + round((t - tl.received) * 1e9)


class _Born:
    """A phase span written when it ends, born finished (``ChunkSpanWriter``): what ``_phase_spans`` uses of a span."""

    __slots__ = ("_attributes", "_context", "_name", "_parent", "_start", "_writer")

    def __init__(self, writer: ChunkSpanWriter, name: str, parent: SpanContext, start: int) -> None:
        self._writer, self._name, self._parent, self._start = writer, name, parent, start
        self._context = writer.child(parent)
        self._attributes: dict[str, Any] = {}

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self._attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes[key] = value

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return True

    def end(self, end_time: int) -> None:
        self._writer.write(
            self._parent, self._start, end_time, self._attributes, name=self._name, context=self._context
        )


def relay_cost(tl: Timeline, s: Summary) -> dict[str, float]:
    """The proxy's own cost of a request, for its span: its overhead, and the p99 and largest delay it added
    to a chunk (seconds)."""
    out: dict[str, float] = {}
    if s.proxy_added is not None:
        out[sc.PROXY_OVERHEAD] = s.proxy_added
    delays = tl.relay_delays
    if delays:
        # The p99 of the samples the histogram got (all, or an even spread of a very long stream's); the max of all.
        out[sc.RELAY_CHUNK_DELAY_P99] = s.relay_delay_p99 or 0.0
        out[sc.RELAY_CHUNK_DELAY_MAX] = max(delays)
    return out
