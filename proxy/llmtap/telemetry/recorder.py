"""The recorder: the relays' messages in, finished requests out to the emitters, a batch at a time.

The relay's messages (``llmtap.wire.messages``) arrive here encoded (``submit``, from the relay's channel in this
process or from the telemetry process's socket reader) and wait in a bounded queue; a worker thread decodes each
and dispatches it: a stream's segments and end are played back into a timeline (``replay``), a relay's report
goes to its gauges (``relays``), the upstream's spans to the server-span wait (``serverspans``). A finished
timeline is summarized (tiktoken counting included), may wait for its server span, has its cache use diagnosed,
and goes as one ``Finished`` request to each emitter once (``finished``): spans, metrics, the record line and
the listeners. The spans carry the ids the relay made and sent upstream as ``traceparent``. A failure here never
reaches a client's stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError
from opentelemetry.metrics import MeterProvider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import TracerProvider

from llmtap.analysis.cachediag import PREFIX, CacheDiagnoser, Diagnosis
from llmtap.analysis.cost import PriceTable, request_cost
from llmtap.analysis.estimator import Estimator
from llmtap.analysis.slots import Slots
from llmtap.analysis.summary import Summary, drift_possible, summarize
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings
from llmtap.telemetry import forward, identity, peers, sched, semconv as sc
from llmtap.telemetry.access_log import AccessLog
from llmtap.telemetry.content import content_emitter
from llmtap.telemetry.finished import Emitter, Finished, Listener, Listeners, RecordEmitter
from llmtap.telemetry.forward import OUTCOMES as FORWARD_OUTCOMES
from llmtap.telemetry.holes import Hole, Holed, Holes
from llmtap.telemetry.losses import STATE_FILE, Losses
from llmtap.telemetry.metrics import MetricWriter
from llmtap.telemetry.relays import Drops, RelayGauges
from llmtap.telemetry.replay import Playback
from llmtap.telemetry.serverspans import (
    OUTCOMES,
    REJECT_REASONS,
    Finishing,
    Join,
    ServerSpan,
    ServerSpanWait,
    server_spans,
)
from llmtap.telemetry.siblings import FACT_DROP_REASONS, LIVE, SLOTS, SPANS, Siblings
from llmtap.telemetry.sinks import Sink, build_sinks, drop_reasons
from llmtap.telemetry.spans import SpanWriter
from llmtap.telemetry.spool import EMITTED, JOURNAL_DROP_REASONS, Spool, open_spool
from llmtap.telemetry.streams import MAX_OPEN_STREAMS, Streams
from llmtap.telemetry.trim import Trimmer
from llmtap.telemetry.upstreams import UpstreamWatch
from llmtap.wire.messages import (
    END,
    FACTS,
    SEGMENT,
    End,
    Facts,
    Head,
    Raw,
    Stats,
    WireError,
    data_size,
    decode,
    without_bytes,
)

__all__ = ["DRIFT_EVERY", "MAX_QUEUED_BYTES", "Recorder"]

log = logging.getLogger("llmtap.telemetry")

_STOP = object()
#: Why a client's trace header was not read (``llmtap.trace_context.ignored``).
TRACE_CONTEXT_REASONS = ("traceparent_too_long", "tracestate_too_long")
#: Why the admin listener refused or cut something (``llmtap.admin.refused``; the instrument says each).
ADMIN_REASONS = ("connection_evicted", "connection_limit", "event_streams", "unauthorized", "forbidden")
#: Messages of the relays the worker takes between two slices of the last run's replay, when both wait.
REPLAY_EVERY = 64
#: Finished requests the worker holds at most before it emits them (``_emit_staged``): tens of milliseconds of work.
STAGED = 64
#: Response bytes waiting in the queue at most. Past it a message keeps its timing and loses its bytes (its
#: tape is ``partial``), as at the relay's channel: what waits here, and so how long any record waits behind
#: it, stays bounded however fast one upstream streams.
MAX_QUEUED_BYTES = 16 * 1024 * 1024
#: Where usage reports the input or the output, tiktoken's drift from it is measured on at most one request per route
#: in this many seconds (the requests' own clock): it takes a whole prompt's count (about 1 ms for 6,000 tokens) and
#: the whole output's (about 0.1 ms for 100 tokens, a tenth of a 50-chunk request's telemetry), costs per request the
#: token figures themselves do not need, and one sample a second per route describes the drift.
DRIFT_EVERY = 1.0


class Recorder:
    """Turns the relays' messages into telemetry; one per app (or per telemetry process)."""

    def __init__(
        self,
        settings: Settings,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        logger_provider: Any = None,
        journal: int | None = None,
    ) -> None:
        """``journal``: this telemetry process's index, when it keeps a record journal (``--record-journal``)."""
        self.settings = settings
        #: The request's spans, and its metrics: two of the emitters.
        self.spans = SpanWriter(settings, tracer_provider)
        self.metrics = MetricWriter(settings, meter_provider)
        self.instruments = self.metrics.instruments
        #: Every loss counted: its totals kept across restarts (with a journal), and said in the log with its count.
        self.losses = Losses(
            {
                "tapes": self.instruments.telemetry_dropped,
                "records": self.instruments.records_dropped,
                "recovered": self.instruments.records_recovered,
            },
            sc.TELEMETRY_REASON,
        )
        self.spans.on_ignored = self._count_trace_context
        # Tapes fill it up to ``queue_size``; the other telemetry processes' lessons and the upstream's spans may use
        # a quarter more, so a backlog of tapes delays them but does not lose them (the state kept whole, the join).
        self._tape_room = settings.telemetry.queue_size
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self._tape_room + max(self._tape_room // 4, 64))
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.recorded = 0
        #: Requests some of whose telemetry could not be made (logged where it failed).
        self.failed = 0
        #: Messages dropped because they could not be decoded (``llmtap.wire.messages.WireError``).
        self.unreadable = 0
        # Response bytes queued (by the producer) and taken (by the worker): each written by one thread only.
        self._queued_in = 0
        self._queued_out = 0
        #: The listeners emitter: each is called on the worker thread with each finished request's timeline and
        #: summary (the live view, the demo's tables); a listener that raises is logged and skipped.
        self._listeners = Listeners()
        self.listeners: list[Listener] = self._listeners.callables
        #: Splits upstream TTFT into queue and prefill; only the worker thread touches it.
        self.estimator = Estimator()
        #: Whether a finished request waits for its upstream's own span; only the worker thread touches it.
        self.wait = ServerSpanWait(settings, UpstreamWatch(), self._count_join)
        self._routes = {r.name: r for r in settings.routes}
        self._drift_at: dict[str, float] = {}  # route: when its last drift was measured
        #: Fingerprints prompts and classifies their cache use; only the worker thread touches it.
        self.cache = CacheDiagnoser(settings.routes)
        #: The shipped prices with the user's file over them (``--prices``), for each request's cost.
        self.prices = PriceTable(settings.attribution.prices)
        #: Who writes this process's records (``service.instance.id`` and the rest).
        self.identity = identity.current()
        #: Where records go (``--record DIR``, ``--record-logs``), written by the worker thread.
        self.records = RecordEmitter(
            build_sinks(
                settings,
                self.identity,
                self._count_record_drop,
                logger_provider=logger_provider,
                on_insert=self._count_clickhouse_insert,
                keep_unsent=journal is not None and settings.record.journal is not None,
            ),
            self.identity,
        )
        for reason in drop_reasons(settings):
            self._count_record_drop(reason, 0)
        #: ``--access-log PATH``: one line per request, written by the worker thread after the record.
        self.access_log: AccessLog | None = None
        if settings.access_log:
            self.access_log = AccessLog(settings.access_log)
            self.listeners.append(self.access_log.write)
        #: Each finished request goes to these, in this order (the metrics' exemplars read the ids the root span
        #: may have given a timeline without any).
        self.emitters: tuple[Emitter, ...] = (self.spans, self.metrics, self.records, self._listeners)
        #: The opt-in content event (``--content-event``), after the others: None unless a field is named.
        self.content = content_emitter(settings)
        if self.content is not None:
            self.emitters += (self.content,)
        #: On the worker: requests made final while more messages wait in the queue, emitted together once it is
        #: empty or ``STAGED`` are held (``_emit_staged``); a call on another thread (a direct ``record``) emits
        #: at once.
        self._held: list[Finishing] | None = None
        self._worker_id = 0
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
        #: Streams with segments the full queue turned away, played as a gap (the submitting thread's).
        self.holes = Holes()
        #: Tapes lost, and the relays' gauges and readiness.
        self.drops = Drops(self.instruments, self.losses)
        #: Streams being played back, and those a message of which the full queue turned away; bounded.
        self.streams = Streams(self.drops, self._playback, limit=MAX_OPEN_STREAMS)
        #: Gives the C allocator's free memory back to the system while the worker is idle (only the worker).
        self.trimmer = Trimmer()
        self.relays = RelayGauges(self.instruments, self.drops, self._busy)
        #: The record journal: each tape kept until every sink has its record (None: not kept).
        self.spool = None if journal is None else self._open_spool(journal)
        self.streams.spool = self.spool
        for outcome in OUTCOMES:
            self._count_join(outcome, 0)
        for reason in REJECT_REASONS:
            self.count_rejected(reason, 0)
        for reason in ADMIN_REASONS:
            self.count_admin(reason, 0)
        self.instruments.event_streams.add(0)
        self.instruments.live_samples_dropped.add(0)
        #: The other telemetry processes, told what must stay whole per upstream (None: this is the only one).
        self.siblings: Siblings | None = None
        #: Where the other processes' finished requests go in process 0 (its live view's window), if anywhere.
        self.live_entries: Callable[[Any], None] | None = None
        # Slot counts the siblings learned from upstreams' gauges this process does not read (only the worker).
        self._sibling_slots: dict[str, Slots] = {}
        for reason in FACT_DROP_REASONS:
            self.count_facts_dropped(reason, 0)
        for reason in TRACE_CONTEXT_REASONS:
            self._count_trace_context(reason, 0)
        self.losses.start()
        if self.spool is not None and self.spool.replay is not None:
            self._ensure_worker()  # the last run's records are made again now, whether tapes come or not

    def _open_spool(self, index: int) -> Spool | None:
        """The record journal of telemetry process ``index``, its counts and gauges (None: not asked, or no sink)."""
        rec = self.settings.record
        spool = open_spool(
            rec.journal,
            self.records.sinks,
            index=index,
            max_bytes=rec.journal_bytes,
            on_lost=self._count_journal_drop,
            on_recovered=self._count_recovered,
            on_tapes_lost=self.drops.journal,
        )
        self.records.spool = spool
        if spool is None:
            return None
        # Before the last run's replay counts anything: the counters go on from the last run's totals.
        self.losses.keep(spool.slot.path / STATE_FILE)
        # Ends the last run counted in sequences.json and was killed before the counters had them: counted now.
        for reason, n in sorted(spool.sequences.unmarked(self.losses.marks).items()):
            log.warning("record journal: %d tapes lost (%s) counted by the last run, added to the counters", n, reason)
            self.drops.journal(reason, n)
        for reason in JOURNAL_DROP_REASONS:
            self._count_record_drop(reason, 0)
        self._count_recovered(0)
        spool.observe(self.metrics.meter)
        return spool

    def _count_recovered(self, n: int) -> None:
        self.losses.add("recovered", "", n, sync=True)

    def _count_journal_drop(self, reason: str, n: int) -> None:
        self.losses.add("records", reason, n, sync=True)

    @property
    def upstreams(self) -> UpstreamWatch:
        """The upstreams' ``/metrics``: whether each can trace, and its slot count (read on their own thread)."""
        return self.wait.upstreams

    @upstreams.setter
    def upstreams(self, watch: UpstreamWatch) -> None:
        self.wait.upstreams = watch

    @property
    def join(self) -> Join[Finishing]:
        """Finished requests waiting for the upstream's own span of them."""
        return self.wait.join

    @property
    def sinks(self) -> list[Sink]:
        """Where record lines go."""
        return self.records.sinks

    @property
    def relays_ready(self) -> dict[int, bool]:
        """Whether each relay said it is ready (``/readyz`` of the telemetry process)."""
        return self.relays.ready

    @property
    def dropped(self) -> int:
        """Tapes that never became telemetry: dropped here (queue full, evicted) or by the relays."""
        return self.drops.total

    # -- called by the relay's channel, the telemetry process's reader and the admin listener ---------------

    def model_label(self, model: str) -> str:
        """The label metrics give ``model``: itself, or ``_OTHER`` past the bound on distinct models."""
        return self.metrics.model_label(model)

    def version_label(self, version: str) -> str:
        """The label metrics give a prompt version: itself, or ``_OTHER`` past the bound on distinct versions."""
        return self.metrics.version_label(version)

    def submit(self, message: Raw, source: int = 0) -> bool:
        """Queue one encoded message from relay ``source`` for the worker; False when the queue is full.

        Never blocks, never raises. A dropped segment or end makes its stream's record a dropped tape.
        """
        try:
            self._ensure_worker()
            size = data_size(message)
            if size and self._queued_in + size - self._queued_out > MAX_QUEUED_BYTES:
                message = without_bytes(message) or message
                size = 0
            kind = message[0]
            item: Raw | Holed = message
            if kind == SEGMENT or kind == END:
                key = (source, message[1])
                if self._queue.qsize() >= self._tape_room and not (kind == END and self.holes.holed(key)):
                    # The end of a stream with a hole may use the reserve; a later segment becomes a hole.
                    if kind == SEGMENT and self.holes.punch(key, message):
                        return True
                    raise queue.Full
                item = self.holes.carry(key, message)
                if kind == END:
                    self.holes.ended(key)
            elif kind != FACTS and self._queue.qsize() >= self._tape_room:
                raise queue.Full
            self._queue.put_nowait((source, item, size))
            self._queued_in += size
            return True
        except queue.Full:
            if message[0] == END:
                self.holes.ended((source, message[1]))
                self.drops.end()
                if self.spool is not None:
                    self.spool.dropped(source, message)
                if message[2] is None:  # a segment carried its head: some of it may wait in the queue
                    self.streams.dropped((source, message[1]), end=True)
            elif message[0] == SEGMENT:
                self.streams.dropped((source, message[1]), end=False)
            elif message[0] == FACTS:
                self.count_facts_dropped("queue_full", len(message[1]))
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

    def pass_spans(self, index: int, export: bytes, spans: int) -> None:
        """Pass spans whose requests telemetry process ``index`` recorded to it (the event loop's thread; never
        waits: sent, or counted dropped)."""
        sent = self.siblings is not None and self.siblings.pass_spans(index, export)
        self._count_routed("sent" if sent else "dropped", spans)

    def relay_ready(self, source: int, ready: bool) -> None:
        """Relay ``source`` reported its readiness: taken now, so ``/readyz`` follows a drain's start at once."""
        self.relays.arrived(source, ready)

    def relay_gone(self, source: int) -> None:
        """Relay ``source`` disconnected: its gauges go back to zero and its open streams are dropped (the worker does
        both once it reaches this in the queue, after every message the relay sent)."""
        self._ensure_worker()
        self.holes.forget(source)
        self._queue.put((source, _Gone(self.relays.gone(source)), 0))

    def share_with(self, siblings: Siblings) -> None:
        """Tell ``siblings`` what each request teaches the state kept whole per upstream, and learn what they tell
        (``llmtap.telemetry.siblings``); before the first message."""
        self.siblings = siblings
        self.estimator.learned = []
        self.cache.learned = []
        for outcome in FORWARD_OUTCOMES[:3]:
            self._count_routed(outcome, 0)

    def record_timeline(self, tl: Timeline) -> None:
        """Queue a finished timeline as it is (tests and tools that build timelines themselves)."""
        self._ensure_worker()
        self._queue.put((-1, tl, 0))

    # -- counters of the admin listener and the live view ----------------------------------------------------

    def count_rejected(self, reason: str, n: int = 1) -> None:
        """An OTLP body the span receiver refused."""
        try:
            self.instruments.otlp_rejected.add(n, {sc.OTLP_REJECT_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count a refused OTLP body", exc_info=True)

    def count_admin(self, reason: str, n: int = 1) -> None:
        """Something the admin listener refused or cut (``ADMIN_REASONS``)."""
        try:
            self.instruments.admin_refused.add(n, {sc.ADMIN_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count an admin refusal", exc_info=True)

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

    def count_facts_dropped(self, reason: str, n: int = 1) -> None:
        """Lessons for or from the other telemetry processes that were lost (``FACT_DROP_REASONS``)."""
        try:
            self.instruments.facts_dropped.add(n, {sc.TELEMETRY_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count a lost lesson", exc_info=True)

    def _count_unowned(self, n: int) -> None:
        self._count_forward("unowned", n)

    def _count_routed(self, outcome: str, n: int) -> None:
        try:
            self.instruments.otlp_routed.add(n, {sc.OTLP_FORWARD_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a span passed to another replica", exc_info=True)

    def _count_trace_context(self, reason: str, n: int = 1) -> None:
        try:
            self.instruments.trace_context_ignored.add(n, {sc.TRACE_CONTEXT_REASON: reason})
        except Exception:
            log.debug("telemetry: could not count an ignored trace header", exc_info=True)

    def _count_forward(self, outcome: str, n: int) -> None:
        try:
            self.instruments.otlp_forwarded.add(n, {sc.OTLP_FORWARD_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a forwarded span", exc_info=True)

    def _count_record_drop(self, reason: str, n: int) -> None:
        self.losses.add("records", reason, n)

    def _count_clickhouse_insert(self, outcome: str, n: int) -> None:
        try:
            self.instruments.clickhouse_inserts.add(n, {sc.CLICKHOUSE_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a ClickHouse insert", exc_info=True)

    def _count_join(self, outcome: str, n: int) -> None:
        try:
            self.instruments.server_spans.add(n, {sc.SERVER_SPAN_OUTCOME: outcome})
        except Exception:
            log.debug("telemetry: could not count a server span", exc_info=True)

    def _busy(self, route: str) -> None:
        """Two requests of ``route`` in flight at once: its upstream's slot count matters; read its gauges."""
        if route in self._routes:
            self.upstreams.watch(self._routes[route].upstream)

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
        lessons = self.siblings.deadline() if self.siblings is not None else None
        journal = self.spool.due() if self.spool is not None else None
        deadlines = [
            d for d in (self.wait.next_deadline(), self.owned.next_deadline(), lessons, journal) if d is not None
        ]
        return min(deadlines) if deadlines else None

    def _due(self) -> None:
        now = time.monotonic()
        if self.spool is not None:
            due = self.spool.due()
            if due is not None and due <= now:
                self.spool.poll()
        self._emit_all(self.wait.due(now))
        self.owned.due(now)
        if self.siblings is not None:
            lessons = self.siblings.deadline()
            if lessons is not None and lessons <= now:
                self.siblings.flush()

    def _run(self) -> None:
        sched.idle_here()
        self._worker_id = threading.get_ident()
        self._held = []
        try:
            self._work()
        finally:
            self._emit_held()
            self._held = None

    def _work(self) -> None:
        taken = 0
        while True:
            held = self._held
            if held and (len(held) >= STAGED or self._queue.empty()):
                self._emit_held()
            replay = self.spool.replay if self.spool is not None else None
            if replay is not None and not replay.done and (self._queue.empty() or taken >= REPLAY_EVERY):
                # The last run's tapes, a slice at a time: between the relays' messages, never before them all.
                taken = 0
                self._replay_slice(replay)
                continue
            taken += 1
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
                self._emit_held()
                self.records.flush()
                continue
            if item is _STOP:
                self._emit_all(self.wait.release())
                return
            if isinstance(item, _Marker):
                # Flushed means written: what waits for its server span is written as it is.
                self._emit_all(self.wait.release())
                self._emit_held()
                self.records.flush()
                item.event.set()
                continue
            source, message, size = item
            self._queued_out += size
            try:
                if isinstance(message, Timeline):
                    self._record_counted(message)
                elif isinstance(message, _Spans):
                    self._join_spans(message)
                elif isinstance(message, Holed):
                    self.take(source, message.message, message.hole)
                elif isinstance(message, _Gone):
                    self.take(source, message.report)
                    self.relays.forget(source)
                    self.streams.forget(source)
                else:
                    self.take(source, message)
            except Exception:
                log.exception("telemetry: could not take a tape message")
            if deadline is not None and deadline <= time.monotonic():
                self._due()
            sched.checkpoint()
            if self._queue.empty():
                # Idle: push record lines out now, so ``llmtap compare`` can read a live file; and now and then
                # give what a backlog left free back to the system.
                self._emit_held()
                self.records.flush()
                self.trimmer.idle()

    def _replay_slice(self, replay: Any) -> None:
        for source, message in replay.next_slice():
            try:
                self.take(source, message)
            except Exception:
                log.exception("telemetry: could not take a tape message of the last run")
            if message[0] == END:
                replay.taken_end(source, message[1])
            sched.checkpoint()
        self._emit_held()
        # What is due goes on during a long replay: the journal's acknowledgements above all (a kill before the
        # replay ends must not find this run's records unacknowledged and make them all again).
        deadline = self._next_deadline()
        if deadline is not None and deadline <= time.monotonic():
            self._due()
            self.records.flush()

    def take(self, source: int, message: Raw, hole: Hole | None = None) -> None:
        """One encoded message of relay ``source``: a stream's segment or end (after ``hole``, reads of its stream
        that were turned away before it), or the relay's report.

        Runs on the worker thread; call it directly only where no worker runs (tools, tests). A message that
        cannot be decoded (garbled, or from another build) is logged and dropped, never raised."""
        try:
            m = decode(message)
        except WireError as exc:
            self.unreadable += 1
            if self.unreadable & (self.unreadable - 1) == 0:  # the 1st, 2nd, 4th, ...: said, never a flood
                log.error(
                    "telemetry: dropped a message of relay %d that cannot be read (%d so far): %s",
                    source,
                    self.unreadable,
                    exc,
                )
            return
        if isinstance(m, Stats):
            self.relays.report(source, m)
            return
        if isinstance(m, Facts):
            self._learn(m)
            return
        playback = self.streams.take((source, m.key), m, hole)
        if playback is None or not isinstance(m, End):  # a segment, or a stream that cannot be recorded
            return
        if playback.partial:
            self.drops.count("partial")
        tl = playback.finish(m.tail)  # its ref, the journal's, set by ``streams``
        if tl.unread is not None:
            self.drops.count(tl.unread)
        self._record_counted(tl)

    def _playback(self, head: Head) -> Playback:
        """A stream's playback, from its first message's head."""
        playback = Playback(head, self.settings, self._routes)
        self._relayed(playback.tl.trace_id)
        return playback

    def _record_counted(self, tl: Timeline) -> None:
        try:
            self.record(tl)
            self.recorded += 1
        except Exception:
            self.failed += 1
            log.exception("telemetry: could not record %s %s", tl.method, tl.path)
            if self.spool is not None:
                self.spool.settle(tl.ref)

    def _join_spans(self, spans: _Spans) -> None:
        self._emit_all(self.wait.spans(spans, time.monotonic()))
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
            self.records.close(timeout)
            if self.content is not None:
                self.content.close()
            if self.spool is not None:
                self.spool.close()  # after the sinks: what they did not take stays for the next start
            self.losses.close()
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

    # -- from a timeline to the emitters -------------------------------------------------------

    def record(self, tl: Timeline) -> Summary:
        """Summarize one finished request and emit it (runs on the worker thread).

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
            slots=slots or self._sibling_slots.get(tl.upstream),
            drift=self._drift_due(tl),
        )
        if self.siblings is not None:
            self._share(self.estimator.learned, tl.upstream, slots)
        if tl.protocol is not None:
            s.cost = request_cost(self.prices, tl, s)
        if self.spool is not None and self.spool.replayed(tl.ref):
            self._emit_all([(tl, s)])  # of the last run: its upstream's span is long gone
        else:
            self._emit_all(self.wait.offer(tl, s, time.monotonic()))
        return s

    def _share(self, learned: list[Any] | None, upstream: str | None = None, slots: Slots | None = None) -> None:
        """Pass what the last request taught (and the upstream's slot count, now and then) to the siblings."""
        assert self.siblings is not None
        lessons = list(learned) if learned else []
        if learned:
            learned.clear()
        if upstream is not None and slots is not None and self.siblings.slots_due(upstream, time.monotonic()):
            lessons.append((SLOTS, upstream, slots.slots, slots.source, slots.confidence))
        self.siblings.offer(lessons)

    def _learn(self, facts: Facts) -> None:
        """What another telemetry process's requests taught it, into this one's estimator, cache index, slots."""
        for lesson in facts.lessons:
            try:
                kind = lesson[0]
                if kind == PREFIX:
                    self.cache.learn(lesson)
                elif kind == LIVE:
                    if self.live_entries is not None:
                        self.live_entries(lesson[1])
                elif kind == SPANS:
                    export = ExportTraceServiceRequest.FromString(lesson[1])
                    self._join_spans(_Spans(server_spans(export), export))
                elif kind == SLOTS:
                    _, upstream, count, source, confidence = lesson
                    if len(self._sibling_slots) >= 4096:
                        self._sibling_slots.clear()
                    self._sibling_slots[str(upstream)] = Slots(int(count), str(source), float(confidence))
                else:
                    self.estimator.learn(lesson)
            except (ValueError, TypeError, KeyError, IndexError, DecodeError) as exc:
                self.unreadable += 1
                if self.unreadable & (self.unreadable - 1) == 0:
                    log.error("telemetry: dropped a lesson of another telemetry process that cannot be read: %s", exc)

    def _drift_due(self, tl: Timeline) -> bool:
        if not drift_possible(tl):
            return False
        last = self._drift_at.get(tl.route)
        if last is not None and 0.0 <= tl.received - last < DRIFT_EVERY:
            return False
        if len(self._drift_at) >= len(self._routes) + 64:  # routes are configured; bounded all the same
            self._drift_at.clear()
        self._drift_at[tl.route] = tl.received
        return True

    def _emit_all(self, items: list[Finishing]) -> None:
        """Requests whose summaries are final: held on the worker while more messages wait, else emitted now."""
        if not items:
            return
        if self._held is not None and threading.get_ident() == self._worker_id:
            self._held.extend(items)
        else:
            self._emit_staged(items)

    def _emit_held(self) -> None:
        held = self._held
        if held:
            self._held = []
            self._emit_staged(held)

    def _emit_staged(self, items: list[Finishing]) -> None:
        """Each request's summary made final (its cache use diagnosed), then every emitter in turn over all of them.

        Emitter by emitter rather than request by request: one emitter's code and data stay in the CPU's caches
        for the whole batch. Tapes captured in place and played again (``bench.telemetry --tapes --before``) cost
        21.6 against 19.5 µs a chunk back to back, and 22.8 against 21.3 and 25.1 against 21.0 handed over 32
        messages at a time, 0.32 s apart. Each emitter still sees the requests in order, the spans first (they
        give ids to a timeline that came without any)."""
        requests = []
        for tl, s in items:
            requests.append(Finished.of(tl, s, self._diagnose(tl, s)))
            if self.siblings is not None:
                self._share(self.cache.learned)
        failed: set[int] = set()
        spool = self.spool
        # Requests of the last run whose spans, metrics and listeners it made already: their records only.
        made = set() if spool is None else {i for i, r in enumerate(requests) if spool.mask_of(r.tl.ref) & EMITTED}
        for emitter in self.emitters:
            for i, request in enumerate(requests):
                sched.checkpoint()
                if made and i in made and emitter is not self.records:
                    continue
                try:
                    emitter.emit(request)
                except Exception:
                    failed.add(i)
                    tl = request.tl
                    log.exception("telemetry: %s failed on %s %s", type(emitter).__name__, tl.method, tl.path)
        self.failed += len(failed)
        if spool is not None:
            for request in requests:
                spool.emitted(request.tl.ref)

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


class _Gone(NamedTuple):
    """A relay disconnected: its last report (its gauges at zero), then what is kept of it goes."""

    report: Raw


class _Marker:
    """A flush marker: the worker sets the event when it reaches it."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
