"""The only code that turns a finished request into spans, metrics and record lines.

The relay's tapes arrive here as messages (``submit``, from the relay's channel in this process or from
the telemetry process's socket reader); a worker thread plays each stream back into a timeline
(``replay``), summarizes it (tiktoken counting included) and records everything. The spans carry the
ids the relay made and sent upstream as ``traceparent``. A failure here never reaches a client's stream.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context, trace
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
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

from proxy.analysis.cachediag import MISS_CHANGED, CacheDiagnoser, Diagnosis
from proxy.analysis.estimator import Estimator
from proxy.analysis.fingerprint import TopK
from proxy.analysis.summary import Summary, summarize
from proxy.analysis.timeline import CANCELLED, OK, Timeline
from proxy.providers.openai_common import collect_text
from proxy.settings import Settings
from proxy.tape import END, SEGMENT, STATS
from proxy.telemetry import semconv as sc
from proxy.telemetry.instruments import Instruments, create
from proxy.telemetry.records import RecordWriter, record_line
from proxy.telemetry.replay import Playback
from proxy.types import PromptRegion

log = logging.getLogger("llmtap.telemetry")

_PROPAGATOR = TraceContextTextMapPropagator()
_STOP = object()
_CONTENT_CAP = 16 * 1024
#: Streams being played back at once (their segments came, their end not yet); past it the oldest goes.
MAX_OPEN_STREAMS = 4096


class BoundedValues:
    """Keeps the first ``limit`` distinct values of a metric attribute; later ones become ``_OTHER``.

    Model names come from clients; without a bound, a client could create unbounded time series.
    """

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self._limit:
                self._seen.add(value)
                return value
        return "_OTHER"


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
    end) cost about 25 µs a span, the constructed span about 4 µs (bench/RESULTS.md), and a stream has a
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

    def write(self, parent: SpanContext, start: int, end: int, attributes: dict[str, Any]) -> None:
        """One finished chunk span, child of ``parent``, from ``start`` to ``end`` (epoch ns)."""
        context = SpanContext(parent.trace_id, self._span_id(), False, parent.trace_flags, parent.trace_state)
        span = ReadableSpan(
            sc.SPAN_CHUNK,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=SpanKind.INTERNAL,
            instrumentation_scope=self._scope,
            start_time=start,
            end_time=end,
        )
        self._processor.on_end(span)


class Recorder:
    """Turns timelines into telemetry; one per app."""

    def __init__(
        self,
        settings: Settings,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self.settings = settings
        self._ids = FixedIds.install(tracer_provider)
        self._tracer = (tracer_provider or NoOpTracerProvider()).get_tracer("llmtap")
        #: Chunk spans straight to the SDK's processors when the provider is the SDK's; None otherwise.
        self.chunk_writer = ChunkSpanWriter.of(tracer_provider, self._tracer)
        meter = (meter_provider or NoOpMeterProvider()).get_meter("llmtap")
        self.instruments: Instruments = create(meter, latest=settings.telemetry.semconv_latest)
        self._models = BoundedValues()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.telemetry.queue_size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.recorded = 0
        self.failed = 0
        # Tapes dropped on the worker thread, and ends the full queue turned away (the producer's count).
        self._dropped = 0
        self._dropped_ends = 0
        #: Called on the worker thread with each finished request's timeline and summary (the demo's
        #: tables read them); a listener that raises is logged and skipped.
        self.listeners: list[Callable[[Timeline, Summary], None]] = []
        #: Splits upstream TTFT into queue and prefill; only the worker thread touches it.
        self.estimator = Estimator()
        self._routes = {r.name: r for r in settings.routes}
        #: Fingerprints prompts and classifies their cache use; only the worker thread touches it.
        self.cache = CacheDiagnoser(settings.routes)
        self._versions = TopK()
        rec = settings.record
        #: ``--record PATH``: one JSON line per request, written by the worker thread.
        self.records = RecordWriter(rec.path, max_bytes=rec.max_bytes, files=rec.files) if rec.path else None
        #: Streams whose segments came and whose end has not, by (source, key); only the worker touches it.
        self._open: OrderedDict[tuple[int, int], Playback] = OrderedDict()
        # Streams a message of which was dropped here: their end is counted as a dropped tape.
        self._lost: set[tuple[int, int]] = set()
        # The relays' gauges as each last reported them (by source), so changes become additions.
        self._gauges: dict[int, tuple[dict[str, int], dict[str, int], int]] = {}
        #: Whether each relay said it is ready (``/readyz`` of the telemetry process).
        self.relays_ready: dict[int, bool] = {}

    # -- called by the relay's channel, or the telemetry process's reader ------------------------

    def model_label(self, model: str) -> str:
        """The label metrics give ``model``: itself, or ``_OTHER`` past the bound on distinct models."""
        return self._models(model)

    def submit(self, message: tuple[Any, ...], source: int = 0) -> bool:
        """Queue one tape message from relay ``source`` for the worker; False when the queue is full.

        Never blocks, never raises. A dropped segment or end makes its stream's record a dropped tape.
        """
        try:
            self._ensure_worker()
            self._queue.put_nowait((source, message))
            return True
        except queue.Full:
            if message[0] == END:
                self._dropped_ends += 1
                self._count_drop("queue_full")
            elif message[0] == SEGMENT:
                self._lost.add((source, message[1]))
            return False
        except Exception:
            log.exception("telemetry: could not queue a tape message")
            return False

    def record_timeline(self, tl: Timeline) -> None:
        """Queue a finished timeline as it is (tests and tools that build timelines themselves)."""
        self._ensure_worker()
        self._queue.put((-1, tl))

    # -- the worker --------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                # Published only once started: ``close`` on another thread may join it at any moment.
                thread = threading.Thread(target=self._run, name="llmtap-recorder", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _Marker):
                self._flush_records()
                item.event.set()
                continue
            source, message = item
            try:
                if isinstance(message, Timeline):
                    self._record_counted(message)
                else:
                    self.take(source, message)
            except Exception:
                log.exception("telemetry: could not take a tape message")
            if self._queue.empty():
                # Idle: push record lines out now, so ``llmtap compare`` can read a live file.
                self._flush_records()

    def take(self, source: int, message: tuple[Any, ...]) -> None:
        """One message of relay ``source``: a stream's segment or end, or the relay's gauges.

        Runs on the worker thread; call it directly only where no worker runs (tools, tests)."""
        kind = message[0]
        if kind == STATS:
            self._stats(source, message)
            return
        key = (source, message[1])
        playback = self._open.pop(key, None)
        head = message[2]
        if playback is None and head is not None and key not in self._lost:
            playback = Playback(head, self.settings, self._routes)
        if playback is not None:
            playback.feed(message[3])
        if kind == SEGMENT:
            if playback is not None:
                self._open[key] = playback
                if len(self._open) > MAX_OPEN_STREAMS:
                    _, oldest = self._open.popitem(last=False)
                    self._drop_tape("evicted", oldest.tl.route)
            return
        if playback is None or key in self._lost:
            self._lost.discard(key)
            self._drop_tape("queue_full", playback.tl.route if playback is not None else None)
            return
        if playback.partial:
            self._count_drop("partial")
        self._record_counted(playback.finish(message[4]))

    def _record_counted(self, tl: Timeline) -> None:
        try:
            self.record(tl)
            self.recorded += 1
        except Exception:
            self.failed += 1
            log.exception("telemetry: could not record %s %s", tl.method, tl.path)

    @property
    def dropped(self) -> int:
        """Tapes that never became telemetry: dropped here (queue full, evicted) or by the relays."""
        return self._dropped + self._dropped_ends

    def _drop_tape(self, reason: str, route: str | None) -> None:
        self._dropped += 1
        log.debug("telemetry: dropped a tape (%s) of route %s", reason, route)
        self._count_drop(reason)

    def _count_drop(self, reason: str, n: int = 1) -> None:
        try:
            self.instruments.telemetry_dropped.add(n, {sc.TELEMETRY_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count a drop", exc_info=True)

    def _stats(self, source: int, message: tuple[Any, ...]) -> None:
        """A relay's gauges, as absolute values: added to the instruments as the change since its last report."""
        _, ready, dropped, active, waiting = message
        new_active, new_waiting = dict(active), dict(waiting)
        old_active, old_waiting, old_dropped = self._gauges.get(source, ({}, {}, 0))
        ins = self.instruments
        for route in new_active.keys() | old_active.keys():
            change = new_active.get(route, 0) - old_active.get(route, 0)
            if change:
                ins.active_streams.add(change, {sc.ROUTE: route})
        for route in new_waiting.keys() | old_waiting.keys():
            change = new_waiting.get(route, 0) - old_waiting.get(route, 0)
            if change:
                ins.queue_waiting.add(change, {sc.ROUTE: route})
        if dropped > old_dropped:
            self._count_drop("channel_full", dropped - old_dropped)
            self._dropped += dropped - old_dropped
        self._gauges[source] = (new_active, new_waiting, dropped)
        self.relays_ready[source] = bool(ready)

    def relay_gone(self, source: int) -> None:
        """Relay ``source`` disconnected: its gauges go back to zero and its open streams are dropped."""
        self._ensure_worker()
        self._queue.put((source, (STATS, False, self._gauges.get(source, ({}, {}, 0))[2], (), ())))

    def _flush_records(self) -> None:
        if self.records is not None:
            try:
                self.records.flush()
            except OSError:
                log.exception("telemetry: could not flush the record file")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued record is written; True when the queue drained in time."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._queue.put(_Marker(done), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Drain the queue, stop the worker and close the record file."""
        try:
            self._stop_worker(timeout)
        finally:
            if self.records is not None:
                self.records.close()

    def _stop_worker(self, timeout: float) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("telemetry: queue still full at shutdown; some records are lost")
            return
        self._thread.join(timeout)

    # -- mapping a timeline to telemetry -------------------------------------------------------

    def record(self, tl: Timeline) -> Summary:
        """Write spans and metrics for one finished request (runs on the worker thread)."""
        s = summarize(tl, self.settings.slo, estimator=self.estimator, route=self._routes.get(tl.route))
        ins = self.instruments
        if tl.error_type in ("queue_full", "queue_timeout"):
            ins.queue_rejected.add(1, {sc.ROUTE: tl.route, sc.ERROR_TYPE: tl.error_type})
        for name in s.rejected_timings:
            log.debug("ignored server timing %s of %s %s", name, tl.method, tl.path)
            ins.timing_rejected.add(1, {sc.ROUTE: tl.route, sc.TIMING_FIELD: name})
        diag = self._diagnose(tl, s)
        if diag is not None:
            s.cache_class = diag.cache_class
        try:
            root = self._root(tl)
            if diag is not None:
                root.set_attributes(cache_attributes(diag))
            self._spans(tl, s, root)
        except Exception:
            log.exception("telemetry: could not write the spans of %s %s", tl.method, tl.path)
        if tl.protocol is not None:
            self._metrics(tl, s)
            if diag is not None:
                ins.cache_requests.add(1, self._cache_metric_attributes(tl, diag))
        if self.records is not None:
            try:
                self.records.write(record_line(tl, s, diag))
            except (OSError, ValueError):
                log.exception("telemetry: could not write the record of %s %s", tl.method, tl.path)
        for listener in self.listeners:
            try:
                listener(tl, s)
            except Exception:
                log.exception("telemetry: a record listener failed")
        return s

    def _diagnose(self, tl: Timeline, s: Summary) -> Diagnosis | None:
        try:
            return self.cache.diagnose(tl, s)
        except Exception:
            log.exception("telemetry: could not diagnose the cache use of %s %s", tl.method, tl.path)
            return None

    def _cache_metric_attributes(self, tl: Timeline, diag: Diagnosis) -> dict[str, Any]:
        # After ``metric_attributes`` counted this request's version: read its label, do not count again.
        req = tl.request
        attrs: dict[str, Any] = {sc.CACHE_CLASS: diag.cache_class, sc.ROUTE: tl.route}
        if req is not None and req.model:
            attrs[sc.REQUEST_MODEL] = self._models(req.model)
        if tl.prompt_version:
            attrs[sc.PROMPT_VERSION] = self._versions.label(tl.prompt_version)
        if diag.cache_class == MISS_CHANGED and diag.changed_region:
            attrs[sc.CACHE_CHANGED_REGION] = diag.changed_region
        return attrs

    def _root(self, tl: Timeline) -> Span:
        """The request's root span, with the ids the relay made (a child of the client's ``traceparent``)."""
        parent = otel_context.Context()
        if tl.parent is not None:
            traceparent, tracestate = tl.parent
            carrier = {"traceparent": traceparent}
            if tracestate:
                carrier["tracestate"] = tracestate
            parent = _PROPAGATOR.extract(carrier)
        if self._ids is not None and tl.span_id is not None and tl.trace_id is not None:
            self._ids.prime(int(tl.trace_id, 16), int(tl.span_id, 16))
        span = self._tracer.start_span(
            root_name(tl),
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=start_attributes(tl),
            start_time=tl.received_wall_ns,
        )
        if self._ids is not None:
            self._ids.prime(None, None)
        ctx = span.get_span_context()
        if ctx.is_valid and tl.span_id is None:
            tl.trace_id = format(ctx.trace_id, "032x")
            tl.span_id = format(ctx.span_id, "016x")
        return span

    def _spans(self, tl: Timeline, s: Summary, root: Span) -> None:
        end = tl.end if tl.end is not None else tl.received
        if tl.protocol is not None:
            t = self.settings.telemetry
            root.set_attributes(end_attributes(tl, s, capture=t.capture_content, latest=t.semconv_latest))
        if tl.status_code is not None:
            root.set_attribute(sc.HTTP_STATUS, tl.status_code)
        if tl.outcome != OK:
            root.set_attribute(sc.ERROR_TYPE, tl.error_type or "_OTHER")
            root.set_status(Status(StatusCode.ERROR, tl.error_message or tl.error_type))
        if tl.protocol is not None:
            ctx = trace.set_span_in_context(root, otel_context.Context())
            self._phase_spans(tl, s, ctx)
        root.end(end_time=tl.wall_ns(end))

    def _phase_spans(self, tl: Timeline, s: Summary, ctx: otel_context.Context) -> None:
        tracer = self._tracer
        queue_end = tl.admitted if tl.admitted is not None else tl.body_read
        start = tl.sent if tl.sent is not None else queue_end
        if start is not None and s.upstream_queue is not None:
            # The server's own line follows the proxy's: the queue span runs until the server took it up.
            queue_end = start + s.upstream_queue
            start = queue_end
        if queue_end is not None:
            span = tracer.start_span(sc.SPAN_QUEUE, context=ctx, start_time=tl.wall_ns(tl.received))
            span.set_attributes(queue_attributes(s))
            span.end(end_time=tl.wall_ns(queue_end))
        if start is not None and tl.first_content is not None:
            span = tracer.start_span(sc.SPAN_PREFILL, context=ctx, start_time=tl.wall_ns(start))
            attrs: dict[str, Any] = {sc.PREFILL_SOURCE: s.prefill_source}
            if s.prefill is not None:
                attrs[sc.PREFILL_DURATION] = s.prefill
            if s.input_tokens is not None:
                attrs[sc.USAGE_INPUT_TOKENS] = s.input_tokens
                attrs[sc.UNCACHED_INPUT_TOKENS] = s.input_tokens - (s.cache_read_tokens or 0)
            if s.cache_read_tokens is not None:
                attrs[sc.USAGE_CACHE_READ] = s.cache_read_tokens
            span.set_attributes(attrs)
            span.end(end_time=tl.wall_ns(tl.first_content))
        if tl.first_content is None or tl.last_content is None:
            return
        decode = tracer.start_span(sc.SPAN_DECODE, context=ctx, start_time=tl.wall_ns(tl.first_content))
        attrs = {sc.CHUNK_COUNT: len(tl.chunk_times), sc.DECODE_DURATION: s.decode or 0.0}
        if s.output_tokens is not None:
            attrs[sc.USAGE_OUTPUT_TOKENS] = s.output_tokens
        if s.tpot is not None:
            attrs[sc.TPOT] = s.tpot
        decode.set_attributes(attrs)
        mode = self.settings.telemetry.chunk_spans
        if mode != "off":
            self._chunks(tl, s, decode, mode)
        decode.end(end_time=tl.wall_ns(tl.last_content))

    def _chunks(self, tl: Timeline, s: Summary, decode: Span, mode: str) -> None:
        times, sizes = tl.chunk_times, tl.chunk_bytes
        n = len(times)
        cap = self.settings.telemetry.chunk_span_cap
        shown = n if n <= cap else cap - 1
        ctx = trace.set_span_in_context(decode, otel_context.Context())
        emit = self._chunk_emitter(decode, ctx)
        for i in range(shown):
            gap = times[i] - times[i - 1] if i else 0.0
            attrs: dict[str, Any] = {sc.CHUNK_INDEX: i, sc.CHUNK_BYTES: sizes[i], sc.CHUNK_GAP: gap}
            if i < len(s.chunk_tokens):
                attrs[sc.CHUNK_TOKENS] = s.chunk_tokens[i]
            if mode == "events":
                decode.add_event(sc.EVENT_CHUNK, attrs, timestamp=tl.wall_ns(times[i]))
            else:
                emit(tl.wall_ns(times[i - 1] if i else times[i]), tl.wall_ns(times[i]), attrs)
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
                decode.add_event(sc.EVENT_CHUNK, attrs, timestamp=tl.wall_ns(times[-1]))
            else:
                emit(tl.wall_ns(times[shown - 1] if shown else times[0]), tl.wall_ns(times[-1]), attrs)

    def _chunk_emitter(self, decode: Span, ctx: otel_context.Context) -> Callable[[int, int, dict[str, Any]], None]:
        """How this request's chunk spans are written: straight to the processors, or through the tracer."""
        writer = self.chunk_writer
        parent = decode.get_span_context()
        if writer is not None and decode.is_recording() and parent.trace_flags.sampled:
            return lambda start, end, attrs: writer.write(parent, start, end, attrs)

        def through_tracer(start: int, end: int, attrs: dict[str, Any]) -> None:
            self._tracer.start_span(sc.SPAN_CHUNK, context=ctx, start_time=start, attributes=attrs).end(end_time=end)

        return through_tracer

    def metric_attributes(self, tl: Timeline, s: Summary) -> dict[str, Any]:
        """The bounded subset of span attributes that metrics carry."""
        req = tl.request
        attrs: dict[str, Any] = {
            sc.OPERATION_NAME: req.operation if req else sc.OP_CHAT,
            sc.PROVIDER_NAME: tl.provider_name,
            sc.SERVER_ADDRESS: tl.server_address,
            sc.SERVER_PORT: tl.server_port,
            sc.ROUTE: tl.route,
            sc.INPUT_SIZE: s.input_size,
        }
        if req is not None and req.stream:
            # As on the span: set if and only if the request streams (gen-ai-spans.md).
            attrs[sc.REQUEST_STREAM] = True
        if req is not None and req.model:
            attrs[sc.REQUEST_MODEL] = self._models(req.model)
        if tl.response_model:
            attrs[sc.RESPONSE_MODEL] = self._models(tl.response_model)
        if tl.outcome != OK:
            attrs[sc.ERROR_TYPE] = tl.error_type or "_OTHER"
        if tl.prompt_version:
            # Versions come from clients: a bounded top-K keeps the number of series small.
            attrs[sc.PROMPT_VERSION] = self._versions(tl.prompt_version)
        return attrs

    def _metrics(self, tl: Timeline, s: Summary) -> None:
        ins = self.instruments
        attrs = self.metric_attributes(tl, s)
        ok = tl.outcome == OK
        stream = bool(tl.request and tl.request.stream)
        if s.e2e is not None:
            ins.operation_duration.record(s.e2e, attrs)
            ins.server_duration.record(s.e2e, attrs)
        ins.requests.add(1, {**attrs, sc.OUTCOME: tl.outcome, sc.SLO_OUTCOME: s.slo})
        if tl.malformed_events:
            ins.malformed.add(tl.malformed_events, {sc.ROUTE: tl.route})
        if s.ttfb is not None:
            ins.ttfb.record(s.ttfb, attrs)
        if stream and s.ttft is not None:
            ins.time_to_first_chunk.record(s.ttft, attrs)
            for gap in s.gaps:
                ins.time_per_output_chunk.record(gap, attrs)
            for itl in s.itl_per_token:
                ins.itl.record(itl, attrs)
        if s.upstream_ttft is not None and stream:
            ins.upstream_ttft.record(s.upstream_ttft, attrs)
        if ok and s.ttft is not None and stream:
            ins.server_ttft.record(s.ttft, attrs)
        if ok and s.tpot is not None:
            ins.server_tpot.record(s.tpot, attrs)
        if s.queue is not None:
            ins.queue.record(s.queue, {**attrs, sc.QUEUE_SOURCE: s.queue_source})
        if s.prefill is not None and stream:
            ins.prefill.record(s.prefill, {**attrs, sc.PREFILL_SOURCE: s.prefill_source})
        if s.decode is not None and stream:
            ins.decode.record(s.decode, attrs)
        self._token_metrics(s, attrs)
        if tl.sent is not None:
            ins.overhead.record(proxy_added(tl), {sc.ROUTE: tl.route})

    def _token_metrics(self, s: Summary, attrs: dict[str, Any]) -> None:
        ins = self.instruments
        for kind, value, source, drift in (
            ("input", s.input_tokens, s.input_source, s.input_drift),
            ("output", s.output_tokens, s.output_source, s.output_drift),
        ):
            if value is None:
                continue
            if ins.token_usage is not None:
                ins.token_usage.record(value, {**attrs, sc.TOKEN_TYPE: kind})
            hist = ins.input_tokens_histogram if kind == "input" else ins.output_tokens_histogram
            if hist is not None:
                hist.record(value, attrs)
            counter = ins.input_tokens_counter if kind == "input" else ins.output_tokens_counter
            if counter is not None:
                counter.add(value, {**attrs, sc.TOKEN_MODALITY: "text"})
            own = ins.input_tokens if kind == "input" else ins.output_tokens
            own.add(value, {**attrs, sc.INPUT_TOKENS_SOURCE if kind == "input" else sc.OUTPUT_TOKENS_SOURCE: source})
            if drift is not None:
                # OTel histograms take no negative values: the size goes in the value, the sign in an attribute.
                direction = "over" if drift > 0 else "under" if drift < 0 else "exact"
                ins.drift.record(
                    abs(drift), {sc.TOKEN_TYPE: kind, sc.ROUTE: attrs[sc.ROUTE], sc.DRIFT_DIRECTION: direction}
                )
        if s.cache_read_tokens is not None:
            ins.cache_read.add(s.cache_read_tokens, attrs)
            if ins.cache_read_counter is not None:
                ins.cache_read_counter.add(s.cache_read_tokens, {**attrs, sc.TOKEN_MODALITY: "text"})
        if s.cache_write_tokens is not None:
            ins.cache_write.add(s.cache_write_tokens, attrs)
            if ins.cache_write_counter is not None:
                ins.cache_write_counter.add(s.cache_write_tokens, {**attrs, sc.TOKEN_MODALITY: "text"})


class _Marker:
    """A flush marker: the worker sets the event when it reaches it."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event


def proxy_added(tl: Timeline) -> float:
    """The proxy's own time in the user's TTFT: from the request's first byte to its send upstream (less the
    admission line, a measured queue of its own), plus from the first content's arrival to its hand-over
    to the client. A saturated proxy shows here, in its own numbers."""
    start = tl.admitted if tl.admitted is not None else tl.received
    added = max((tl.sent or start) - start, 0.0)
    if tl.admitted is not None and tl.body_read is not None:
        added += max(tl.body_read - tl.received, 0.0)
    if tl.first_content is not None and tl.first_content_delivered is not None:
        added += max(tl.first_content_delivered - tl.first_content, 0.0)
    return added


def root_name(tl: Timeline) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` for LLM calls; ``{method}`` for plain relays."""
    req = tl.request
    if tl.protocol is None or req is None:
        return tl.method
    return f"{req.operation} {req.model}" if req.model else req.operation


def start_attributes(tl: Timeline) -> dict[str, Any]:
    """Attributes known when the request arrives; samplers see these (gen-ai-spans.md: set at creation)."""
    attrs: dict[str, Any] = {
        sc.SERVER_ADDRESS: tl.server_address,
        sc.SERVER_PORT: tl.server_port,
        sc.HTTP_METHOD: tl.method,
        sc.URL_PATH: tl.path,
        sc.ROUTE: tl.route,
    }
    req = tl.request
    if tl.protocol is None or req is None:
        return attrs
    attrs[sc.OPERATION_NAME] = req.operation
    attrs[sc.PROVIDER_NAME] = tl.provider_name
    attrs[sc.PROTOCOL] = tl.protocol
    if req.model:
        attrs[sc.REQUEST_MODEL] = req.model
    if req.stream:
        attrs[sc.REQUEST_STREAM] = True
    if req.parse_error:
        attrs[sc.REQUEST_PARSE_ERROR] = req.parse_error
    # Provider params are keyed by their gen_ai.request.* suffix (max_tokens, temperature, choice.count, ...).
    for key, value in req.params.items():
        if value is not None:
            attrs[f"gen_ai.request.{key}"] = value
    if tl.prompt_version:
        attrs[sc.PROMPT_VERSION] = tl.prompt_version
    return attrs


def _put(attrs: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        attrs[key] = value


def queue_attributes(s: Summary) -> dict[str, Any]:
    """The queue and its two parts: the proxy's own line (measured) and the server's (reported or estimated)."""
    attrs: dict[str, Any] = {}
    if s.queue is not None:
        attrs[sc.QUEUE_DURATION] = s.queue
        attrs[sc.QUEUE_SOURCE] = s.queue_source
    _put(attrs, sc.QUEUE_PROXY_DURATION, s.proxy_queue)
    if s.upstream_queue is not None:
        attrs[sc.QUEUE_UPSTREAM_DURATION] = s.upstream_queue
        attrs[sc.QUEUE_UPSTREAM_SOURCE] = s.upstream_queue_source
    return attrs


def cache_attributes(diag: Diagnosis) -> dict[str, Any]:
    """The prompt's fingerprint (hash and tokens per region) and its cache class, for the root span."""
    attrs: dict[str, Any] = {
        sc.CACHE_CLASS: diag.cache_class,
        sc.CACHE_EXPECTED_PREFIX: diag.expected_prefix_tokens,
        sc.PROMPT_SHARED_PREFIX: diag.shared_prefix_tokens,
    }
    _put(attrs, sc.CACHE_CHANGED_REGION, diag.changed_region)
    if diag.fingerprint is not None:
        for region in diag.fingerprint.regions:
            attrs[f"{sc.PROMPT_FINGERPRINT}.{region.name}"] = region.digest
            attrs[f"{sc.PROMPT_REGION_TOKENS}.{region.name}"] = region.tokens
    return attrs


def input_messages(regions: list[PromptRegion], cap: int) -> str:
    """``gen_ai.input.messages`` (content capture only): the system part and messages, ``cap`` characters of text."""
    messages: list[dict[str, Any]] = []
    room = cap
    for region in regions:
        if region.kind == "tools":
            continue
        value = region.value
        role = value.get("role") if isinstance(value, dict) else None
        parts: list[str] = []
        collect_text(value, parts)
        text = "\n".join(parts)[:room]
        room -= len(text)
        content = [{"type": "text", "content": text}]
        messages.append({"role": "system" if region.kind == "system" else role or "user", "parts": content})
        if room <= 0:
            break
    return json.dumps(messages, ensure_ascii=False)


def end_attributes(tl: Timeline, s: Summary, *, capture: bool, latest: bool = False) -> dict[str, Any]:
    """Attributes known when the stream ends."""
    attrs: dict[str, Any] = {}
    _put(attrs, sc.RESPONSE_ID, tl.response_id)
    _put(attrs, sc.RESPONSE_MODEL, tl.response_model)
    if tl.finish_reasons:
        attrs[sc.RESPONSE_FINISH_REASONS] = list(tl.finish_reasons)
    elif tl.outcome != OK and tl.request is not None:
        # semantic-conventions-genai: a missing or aborted finish is reported as "error".
        attrs[sc.RESPONSE_FINISH_REASONS] = ["error"]
    _put(attrs, sc.USAGE_INPUT_TOKENS, s.input_tokens)
    _put(attrs, sc.USAGE_OUTPUT_TOKENS, s.output_tokens)
    _put(attrs, sc.USAGE_CACHE_READ, s.cache_read_tokens)
    # semantic-conventions-genai migration.md: cache_creation.input_tokens -> cache_write.input_tokens.
    _put(attrs, sc.USAGE_CACHE_WRITE if latest else sc.USAGE_CACHE_CREATION, s.cache_write_tokens)
    _put(attrs, sc.USAGE_REASONING, s.reasoning_tokens)
    if s.input_tokens is not None:
        attrs[sc.INPUT_TOKENS_SOURCE] = s.input_source
    if s.output_tokens is not None:
        attrs[sc.OUTPUT_TOKENS_SOURCE] = s.output_source
    if tl.request is not None and tl.request.stream:
        _put(attrs, sc.RESPONSE_TIME_TO_FIRST_CHUNK, s.ttft)
    _put(attrs, sc.TTFB, s.ttfb)
    _put(attrs, sc.UPSTREAM_TTFT, s.upstream_ttft)
    _put(attrs, sc.TPOT, s.tpot)
    _put(attrs, sc.E2E, s.e2e)
    attrs.update(queue_attributes(s))
    _put(attrs, sc.PREFILL_DURATION, s.prefill)
    _put(attrs, sc.DECODE_DURATION, s.decode)
    if s.prefill is not None:
        attrs[sc.PREFILL_SOURCE] = s.prefill_source
    attrs[sc.OUTCOME] = tl.outcome
    attrs[sc.SLO_OUTCOME] = s.slo
    attrs[sc.INPUT_SIZE] = s.input_size
    attrs[sc.RESPONSE_BYTES] = tl.response_bytes
    if tl.malformed_events:
        attrs[sc.MALFORMED_EVENTS] = tl.malformed_events
    if tl.oversized_events:
        attrs[sc.OVERSIZED_EVENTS] = tl.oversized_events
    if capture and tl.request is not None and tl.request.regions:
        attrs[sc.INPUT_MESSAGES] = input_messages(tl.request.regions, _CONTENT_CAP)
    if capture and tl.chunk_texts:
        text = "".join(tl.chunk_texts)[:_CONTENT_CAP]
        attrs[sc.OUTPUT_MESSAGES] = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}]}])
    if tl.outcome == CANCELLED:
        attrs[sc.ERROR_TYPE] = "cancelled"
    return attrs
