"""The recorder: tapes in, one finished request at a time into spans, metrics, record lines and listeners.

The relay's tapes arrive here as messages (``submit``, from the relay's channel in this process or from
the telemetry process's socket reader); a worker thread plays each stream back into a timeline
(``replay``), summarizes it (tiktoken counting included) and records everything. The spans carry the
ids the relay made and sent upstream as ``traceparent``. A failure here never reaches a client's stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import (
    TracerProvider,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmtap.analysis.cachediag import CacheDiagnoser, Diagnosis
from llmtap.analysis.cost import PriceTable, request_cost
from llmtap.analysis.estimator import Estimator
from llmtap.analysis.summary import Summary, adopt_server_timing, reached_model, summarize
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings
from llmtap.providers.timing import PHASES
from llmtap.telemetry import forward, identity, peers, sched, semconv as sc
from llmtap.telemetry.access_log import AccessLog
from llmtap.telemetry.attributes import cache_attributes, cost_attributes
from llmtap.telemetry.forward import OUTCOMES as FORWARD_OUTCOMES
from llmtap.telemetry.metrics import MetricWriter
from llmtap.telemetry.records import record_line
from llmtap.telemetry.replay import Playback
from llmtap.telemetry.serverspans import OUTCOMES, REJECT_REASONS, Join, ServerSpan
from llmtap.telemetry.sinks import Sink, build_sinks, drop_reasons
from llmtap.telemetry.spans import SpanWriter
from llmtap.telemetry.upstreams import UpstreamWatch
from llmtap.wire.tape import CLIENT_TIMEOUT_KINDS, CONNECTION_REFUSAL_REASONS, END, RESPONSE_CUT_REASONS, SEGMENT, STATS

log = logging.getLogger("llmtap.telemetry")

_PROPAGATOR = TraceContextTextMapPropagator()
_STOP = object()
#: Why a tape did not become telemetry, in whole (``channel_full``: the relay's channel; ``queue_full``: this
#: queue; ``evicted``: too many streams open at once) or in part (``partial``: timing without some bytes;
#: ``inflate_limit``, ``body_limit``: the tap stopped reading a response past its bounds, ``llmtap.telemetry.tap``).
TAPE_DROP_REASONS = ("channel_full", "queue_full", "evicted", "partial", "inflate_limit", "body_limit")
#: Why a client's trace header was not read (``llmtap.trace_context.ignored``).
TRACE_CONTEXT_REASONS = ("traceparent_too_long", "tracestate_too_long")
#: Why the admin listener refused or cut something (``llmtap.admin.refused``; the instrument says each).
ADMIN_REASONS = ("connection_evicted", "connection_limit", "event_streams", "unauthorized", "forbidden")
#: How the admission queue refuses a request (``error.type``).
QUEUE_REFUSALS = ("queue_full", "queue_timeout")
#: Streams being played back at once (their segments came, their end not yet); past it the oldest goes.
MAX_OPEN_STREAMS = 4096
#: Seconds a request recorded before its upstream's ``/metrics`` was first read waits for that read (once per
#: upstream), on a route that declares a tracing model server (``provider``): whether the upstream traces
#: decides whether the request waits for the server's span, and a fresh proxy's first request can end before
#: two are ever in flight (which starts the reads otherwise). Other upstreams are not read on a first request.
FIRST_READ = 2.0
TRACING_PROVIDERS = frozenset({"vllm", "sglang"})
#: Response bytes waiting in the queue at most. Past it a message keeps its timing and loses its bytes (its
#: tape is ``partial``), as at the relay's channel: what waits here, and so how long any record waits behind
#: it, stays bounded however fast one upstream streams.
MAX_QUEUED_BYTES = 16 * 1024 * 1024


class Recorder:
    """Turns timelines into telemetry; one per app."""

    def __init__(
        self,
        settings: Settings,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        logger_provider: Any = None,
    ) -> None:
        self.settings = settings
        #: The request's spans, and its metrics.
        self.spans = SpanWriter(settings, tracer_provider)
        self.metrics = MetricWriter(settings, meter_provider)
        self.instruments = self.metrics.instruments
        self.spans.on_ignored = self._count_trace_context
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.telemetry.queue_size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.recorded = 0
        self.failed = 0
        # Tapes dropped on the worker thread, and ends the full queue turned away (the producer's count).
        self._dropped = 0
        self._dropped_ends = 0
        # Response bytes queued (by the producer) and taken (by the worker): each written by one thread only.
        self._queued_in = 0
        self._queued_out = 0
        #: Called on the worker thread with each finished request's timeline and summary (the demo's
        #: tables read them); a listener that raises is logged and skipped.
        self.listeners: list[Callable[[Timeline, Summary], None]] = []
        #: Splits upstream TTFT into queue and prefill; only the worker thread touches it.
        self.estimator = Estimator()
        #: Finished requests waiting for the upstream's own span of them; only the worker thread touches it.
        self.join: Join[tuple[Timeline, Summary]] = Join(settings.telemetry.server_spans_wait, self._count_join)
        #: The upstreams' ``/metrics``: whether each can trace, and its slot count (read on their own thread).
        self.upstreams = UpstreamWatch()
        self._routes = {r.name: r for r in settings.routes}
        #: Fingerprints prompts and classifies their cache use; only the worker thread touches it.
        self.cache = CacheDiagnoser(settings.routes)
        #: The shipped prices with the user's file over them (``--prices``), for each request's cost.
        self.prices = PriceTable(settings.attribution.prices)
        #: Who writes this process's records (``service.instance.id`` and the rest).
        self.identity = identity.current()
        #: Where records go (``--record DIR``, ``--record-logs``), written by the worker thread.
        self.sinks: list[Sink] = build_sinks(
            settings,
            self.identity,
            self._count_record_drop,
            logger_provider=logger_provider,
            on_insert=self._count_clickhouse_insert,
        )
        for reason in drop_reasons(settings):
            self._count_record_drop(reason, 0)
        #: ``--access-log PATH``: one line per request, written by the worker thread after the record.
        self.access_log: AccessLog | None = None
        if settings.access_log:
            self.access_log = AccessLog(settings.access_log)
            self.listeners.append(self.access_log.write)
        #: Passes the spans ``/v1/traces`` took on to the OTLP traces backend (None: traces do not go out over OTLP).
        self.forwarder = forward.from_settings(settings.telemetry, self._count_forward)
        if self.forwarder is not None:
            for outcome in FORWARD_OUTCOMES:
                self._count_forward(outcome, 0)
        #: The traces this process relayed: only their spans go to the backend; only the worker thread touches it.
        self.owned = peers.Ownership(settings.telemetry.server_spans_wait, self._count_unowned)
        #: Passes spans another replica owns to that replica's admin listener (None: no peers).
        self.peers = peers.peer_forwarder(settings.telemetry, self._count_routed)
        if self.peers is not None:
            for outcome in FORWARD_OUTCOMES[:3]:
                self._count_routed(outcome, 0)
        #: Streams whose segments came and whose end has not, by (source, key); only the worker touches it.
        self._open: OrderedDict[tuple[int, int], Playback] = OrderedDict()
        # Streams a message of which was dropped here: their end is counted as a dropped tape.
        self._lost: set[tuple[int, int]] = set()
        # The relays' gauges as each last reported them (by source), so changes become additions.
        self._gauges: dict[int, tuple[dict[str, int], dict[str, int], int]] = {}
        #: Whether each relay said it is ready (``/readyz`` of the telemetry process).
        self.relays_ready: dict[int, bool] = {}
        # Readiness is taken as each report arrives (``relay_ready``), not when the worker reaches it in the queue.
        self._ready_on_arrival = False
        # The relays' counts of client connections cut or refused, by source, as each last reported them.
        self._connections: dict[int, dict[tuple[str, str], int]] = {}
        # Every reason a tape can be lost reads 0 from the start: "none dropped" is a value, not an absence.
        for reason in TAPE_DROP_REASONS:
            self._count_drop(reason, 0)
        # So does every way a client connection can be cut or refused.
        for kind in CLIENT_TIMEOUT_KINDS:
            self.instruments.client_timeouts.add(0, {sc.TIMEOUT_KIND: kind})
        for reason in CONNECTION_REFUSAL_REASONS:
            self.instruments.connections_refused.add(0, {sc.REFUSAL_REASON: reason})
        for reason in RESPONSE_CUT_REASONS:
            self.instruments.responses_cut.add(0, {sc.CUT_REASON: reason})
        for outcome in OUTCOMES:
            self._count_join(outcome, 0)
        for reason in REJECT_REASONS:
            self.count_rejected(reason, 0)
        for reason in ADMIN_REASONS:
            self.count_admin(reason, 0)
        self.instruments.event_streams.add(0)
        self.instruments.live_samples_dropped.add(0)
        for reason in TRACE_CONTEXT_REASONS:
            self._count_trace_context(reason, 0)
        # And every route's admission refusals, ignored server timings (by phase) and unparsable events: their
        # panels show a line at 0, not "No data", until the first one.
        for route in settings.routes:
            self.instruments.malformed.add(0, {sc.ROUTE: route.name})
            for error in QUEUE_REFUSALS:
                self.instruments.queue_rejected.add(0, {sc.ROUTE: route.name, sc.ERROR_TYPE: error})
            for phase in PHASES:
                self.instruments.timing_rejected.add(0, {sc.ROUTE: route.name, sc.TIMING_FIELD: phase})

    # -- called by the relay's channel, or the telemetry process's reader ------------------------

    def model_label(self, model: str) -> str:
        """The label metrics give ``model``: itself, or ``_OTHER`` past the bound on distinct models."""
        return self.metrics.model_label(model)

    def version_label(self, version: str) -> str:
        """The label metrics give a prompt version: itself, or ``_OTHER`` past the bound on distinct versions."""
        return self.metrics.version_label(version)

    def submit(self, message: tuple[Any, ...], source: int = 0) -> bool:
        """Queue one tape message from relay ``source`` for the worker; False when the queue is full.

        Never blocks, never raises. A dropped segment or end makes its stream's record a dropped tape.
        """
        try:
            self._ensure_worker()
            size = len(message[3][3]) if message[0] in (SEGMENT, END) else 0
            if size and self._queued_in + size - self._queued_out > MAX_QUEUED_BYTES:
                times, delivered, sizes, _ = message[3]
                message = (*message[:3], (times, delivered, sizes, b""), *message[4:])
                size = 0
            self._queue.put_nowait((source, message, size))
            self._queued_in += size
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

    def submit_spans(
        self, spans: list[ServerSpan], export: ExportTraceServiceRequest | None = None, size: int = 0
    ) -> bool:
        """Queue the upstream's spans (the admin listener's receiver) for the join, and ``export`` (all the spans
        they came with, ``size`` bytes) for the traces backend; False when the queue is full."""
        try:
            self._ensure_worker()
            if size and self._queued_in + size - self._queued_out > MAX_QUEUED_BYTES:
                return False
            self._queue.put_nowait((-1, _Spans(spans, export), size))
            self._queued_in += size
            return True
        except queue.Full:
            return False

    def route(self, address: str, export: ExportTraceServiceRequest, spans: int) -> None:
        """Pass spans another replica owns to its admin listener; never waits (queued, or counted dropped)."""
        if self.peers is not None:
            self.peers.offer(export.SerializeToString(), spans, to=address)

    def count_rejected(self, reason: str, n: int = 1) -> None:
        """An OTLP body the span receiver refused."""
        try:
            self.instruments.otlp_rejected.add(n, {sc.OTLP_REJECT_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count a refused OTLP body", exc_info=True)

    def _count_unowned(self, n: int) -> None:
        self._count_forward("unowned", n)

    def _count_routed(self, outcome: str, n: int) -> None:
        try:
            self.instruments.otlp_routed.add(n, {sc.OTLP_FORWARD_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a span passed to another replica", exc_info=True)

    def count_admin(self, reason: str, n: int = 1) -> None:
        """Something the admin listener refused or cut (``ADMIN_REASONS``)."""
        try:
            self.instruments.admin_refused.add(n, {sc.ADMIN_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count an admin refusal", exc_info=True)

    def _count_trace_context(self, reason: str, n: int = 1) -> None:
        try:
            self.instruments.trace_context_ignored.add(n, {sc.TRACE_CONTEXT_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count an ignored trace header", exc_info=True)

    def live_samples_dropped(self, n: int) -> None:
        """The live view let ``n`` of its oldest latency values go, past its bound."""
        try:
            self.instruments.live_samples_dropped.add(n)
        except Exception:
            log.debug("telemetry: could not count dropped live view values", exc_info=True)

    def event_streams(self, change: int) -> None:
        """The live view's open ``/events`` streams went up or down by ``change``."""
        try:
            self.instruments.event_streams.add(change)
        except Exception:
            log.debug("telemetry: could not count an event stream", exc_info=True)

    def _count_forward(self, outcome: str, n: int) -> None:
        try:
            self.instruments.otlp_forwarded.add(n, {sc.OTLP_FORWARD_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a forwarded span", exc_info=True)

    def record_timeline(self, tl: Timeline) -> None:
        """Queue a finished timeline as it is (tests and tools that build timelines themselves)."""
        self._ensure_worker()
        self._queue.put((-1, tl, 0))

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

    def _next_deadline(self) -> float | None:
        deadlines = [d for d in (self.join.next_deadline(), self.owned.next_deadline()) if d is not None]
        return min(deadlines) if deadlines else None

    def _due(self) -> None:
        now = time.monotonic()
        self._emit_all(self.join.due(now))
        self.owned.due(now)

    def _run(self) -> None:
        sched.idle_here()
        while True:
            deadline = self._next_deadline()
            try:
                if deadline is None:
                    item = self._queue.get()
                else:
                    item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                # A wait ran out with nothing else to do: what it released is written now, not with the next
                # request (the record line included).
                self._due()
                self._flush_records()
                continue
            if item is _STOP:
                self._emit_all(self.join.release())
                return
            if isinstance(item, _Marker):
                # Flushed means written: what waits for its server span is written as it is.
                self._emit_all(self.join.release())
                self._flush_records()
                item.event.set()
                continue
            source, message, size = item
            self._queued_out += size
            try:
                if isinstance(message, Timeline):
                    self._record_counted(message)
                elif isinstance(message, _Spans):
                    self._join_spans(message)
                else:
                    self.take(source, message)
            except Exception:
                log.exception("telemetry: could not take a tape message")
            if deadline is not None and deadline <= time.monotonic():
                self._due()
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
            self._relayed(playback.tl.trace_id)
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
        tl = playback.finish(message[4])
        if tl.unread is not None:
            self._count_drop(tl.unread)
        self._record_counted(tl)

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

    def _count_record_drop(self, reason: str, n: int) -> None:
        try:
            self.instruments.records_dropped.add(n, {sc.TELEMETRY_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count a lost record", exc_info=True)

    def _count_clickhouse_insert(self, outcome: str, n: int) -> None:
        try:
            self.instruments.clickhouse_inserts.add(n, {sc.CLICKHOUSE_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a ClickHouse insert", exc_info=True)

    def _count_drop(self, reason: str, n: int = 1) -> None:
        try:
            self.instruments.telemetry_dropped.add(n, {sc.TELEMETRY_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count a drop", exc_info=True)

    def _stats(self, source: int, message: tuple[Any, ...]) -> None:
        """A relay's gauges and counts, as absolute values: added to the instruments as the change since its last
        report."""
        _, ready, dropped, active, waiting, timeouts, refused, *rest = message
        cuts = rest[0] if rest else ()  # responses the relay cut, by reason (absent from older relays)
        new_active, new_waiting = dict(active), dict(waiting)
        old_active, old_waiting, old_dropped = self._gauges.get(source, ({}, {}, 0))
        ins = self.instruments
        # A route reported for the first time gets its series even at 0: an idle gauge reads 0, not absent.
        for route, active in new_active.items():
            # Two requests in flight at once: the upstream's slot count matters; read its gauges.
            if active >= 2 and route in self._routes:
                self.upstreams.watch(self._routes[route].upstream)
        for route in new_active.keys() | old_active.keys():
            change = new_active.get(route, 0) - old_active.get(route, 0)
            if change or route not in old_active:
                ins.active_streams.add(change, {sc.ROUTE: route})
        for route in new_waiting.keys() | old_waiting.keys():
            change = new_waiting.get(route, 0) - old_waiting.get(route, 0)
            if change or route not in old_waiting:
                ins.queue_waiting.add(change, {sc.ROUTE: route})
        if dropped > old_dropped:
            self._count_drop("channel_full", dropped - old_dropped)
            self._dropped += dropped - old_dropped
        self._gauges[source] = (new_active, new_waiting, dropped)
        if not self._ready_on_arrival:
            self.relays_ready[source] = bool(ready)
        counted = self._connections.setdefault(source, {})
        for attribute, counter, counts in (
            (sc.TIMEOUT_KIND, ins.client_timeouts, timeouts),
            (sc.REFUSAL_REASON, ins.connections_refused, refused),
            (sc.CUT_REASON, ins.responses_cut, cuts),
        ):
            for label, count in counts:
                before = counted.get((attribute, label), 0)
                # Fewer than last time: a new relay process took this source's place and counts from 0.
                change = count - before if count >= before else count
                if change:
                    counter.add(change, {attribute: str(label)})
                counted[(attribute, label)] = count

    def relay_ready(self, source: int, ready: bool) -> None:
        """Relay ``source`` reported its readiness: taken now, so ``/readyz`` follows a drain's start at once (the
        worker, which may be behind, then leaves readiness alone)."""
        self._ready_on_arrival = True
        self.relays_ready[source] = ready

    def relay_gone(self, source: int) -> None:
        """Relay ``source`` disconnected: its gauges go back to zero and its open streams are dropped."""
        if self._ready_on_arrival:
            self.relays_ready[source] = False
        self._ensure_worker()
        self._queue.put((source, (STATS, False, self._gauges.get(source, ({}, {}, 0))[2], (), (), (), ()), 0))

    def _flush_records(self) -> None:
        for sink in self.sinks:
            try:
                sink.flush()  # a write that fails is counted and said there, once
            except Exception:
                log.exception("telemetry: a record sink could not flush")

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
            self.upstreams.close()
            if self.forwarder is not None:
                self.forwarder.close(timeout)
            if self.peers is not None:
                self.peers.close(timeout)
        finally:
            for sink in self.sinks:
                try:
                    sink.close(timeout)
                except Exception:
                    log.exception("telemetry: a record sink could not close")
            if self.access_log is not None:
                self.access_log.close()

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
        """Write spans and metrics for one finished request (runs on the worker thread).

        A request to an upstream that exports its own spans waits for its span first (``serverspans``),
        at most ``telemetry.server_spans_wait`` seconds; the summary returned is then the estimate.
        """
        self._relayed(tl.trace_id)
        slots = self.upstreams.slots(tl.upstream)
        s = summarize(
            tl,
            self.settings.slo,
            estimator=self.estimator,
            route=self._routes.get(tl.route),
            shapes=self.settings.shapes,
            slots=slots,
        )
        if tl.protocol is not None:
            s.cost = request_cost(self.prices, tl, s)
        if self._joinable(tl):
            assert tl.span_id is not None
            now = time.monotonic()
            span = self.join.early(tl.span_id, now)
            if span is not None:
                self._count_join("matched", 1)
                adopt_server_timing(tl, s, span.timing)
            elif self.join.wants(tl.upstream, compatible=self._compatible(tl)):
                self._emit_all(self.join.hold(tl.span_id, tl.upstream, (tl, s), now))
                return s
            else:
                self.join.recorded(tl.span_id, tl.upstream)
        self._emit(tl, s)
        return s

    def _compatible(self, tl: Timeline) -> bool:
        """Whether ``tl``'s upstream showed a tracing-capable server; on a route declared ``vllm`` or ``sglang``, an
        upstream never read is read now and the answer waited for (``FIRST_READ``)."""
        route = self._routes.get(tl.route)
        declared = route is not None and (route.provider or "").lower() in TRACING_PROVIDERS
        return self.upstreams.compatible(tl.upstream, wait=FIRST_READ if declared else 0.0)

    def _joinable(self, tl: Timeline) -> bool:
        """Whether a server span of ``tl`` can come: it reached the model, in a sampled trace, with no phase
        reported in the stream itself."""
        st = tl.server_timing
        return (
            tl.span_id is not None
            and tl.sampled
            and tl.protocol is not None
            and reached_model(tl)
            and (st is None or (st.queue is None and st.prefill is None))
        )

    def _join_spans(self, spans: _Spans) -> None:
        for (tl, s), span in self.join.spans(spans, time.monotonic()):
            adopt_server_timing(tl, s, span.timing)
            self._emit_counted(tl, s)
        if spans.export is not None and self.forwarder is not None:
            own = self.owned.take(spans.export, time.monotonic())
            if own is not None:
                self.forwarder.offer(own[0].SerializeToString(), own[1])

    def _relayed(self, trace_id: str | None) -> None:
        """This process relayed ``trace_id``: spans of it may go to the backend, and those that waited go now."""
        if trace_id is None or self.forwarder is None:
            return
        found = self.owned.relayed(trace_id)
        if found is not None:
            self.forwarder.offer(found[0].SerializeToString(), found[1])

    def _emit_all(self, items: list[tuple[Timeline, Summary]]) -> None:
        for tl, s in items:
            self._emit_counted(tl, s)

    def _emit_counted(self, tl: Timeline, s: Summary) -> None:
        try:
            self._emit(tl, s)
        except Exception:
            self.failed += 1
            log.exception("telemetry: could not record %s %s", tl.method, tl.path)

    def _count_join(self, outcome: str, n: int) -> None:
        try:
            self.instruments.server_spans.add(n, {sc.SERVER_SPAN_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a server span", exc_info=True)

    def _emit(self, tl: Timeline, s: Summary) -> None:
        """Spans, metrics, the record line and the listeners of one summarized request."""
        ins = self.instruments
        if tl.error_type in QUEUE_REFUSALS:
            ins.queue_rejected.add(1, {sc.ROUTE: tl.route, sc.ERROR_TYPE: tl.error_type})
        for name in s.rejected_timings:
            log.debug("ignored server timing %s of %s %s", name, tl.method, tl.path)
            ins.timing_rejected.add(1, {sc.ROUTE: tl.route, sc.TIMING_FIELD: name})
        diag = self._diagnose(tl, s)
        if diag is not None:
            s.cache_class = diag.cache_class
        try:
            root = self.spans.root(tl)
            if diag is not None:
                root.set_attributes(cache_attributes(diag))
            if s.cost is not None:
                root.set_attributes(cost_attributes(s.cost, hop=self.spans.is_hop(tl)))
            self.spans.write(tl, s, root)
        except Exception:
            log.exception("telemetry: could not write the spans of %s %s", tl.method, tl.path)
        if tl.protocol is not None:
            self.metrics.record(tl, s)
            if diag is not None:
                ins.cache_requests.add(1, self.metrics.cache_attributes(tl, diag))
        if self.sinks:
            line = record_line(tl, s, diag, self.identity)
            for sink in self.sinks:
                try:
                    sink.write(line)  # a lost record is counted there
                except Exception:
                    log.exception("telemetry: a record sink failed")
        for listener in self.listeners:
            try:
                listener(tl, s)
            except Exception:
                log.exception("telemetry: a record listener failed")

    def _diagnose(self, tl: Timeline, s: Summary) -> Diagnosis | None:
        try:
            return self.cache.diagnose(tl, s)
        except Exception:
            log.exception("telemetry: could not diagnose the cache use of %s %s", tl.method, tl.path)
            return None


class _Spans(list[ServerSpan]):
    """Spans the upstream exported, as the receiver read them: a queue item of their own kind, with every span
    of their export (for the backend)."""

    def __init__(self, spans: list[ServerSpan], export: ExportTraceServiceRequest | None) -> None:
        super().__init__(spans)
        self.export = export


class _Marker:
    """A flush marker: the worker sets the event when it reaches it."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
