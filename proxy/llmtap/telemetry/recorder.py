"""The recorder: the relays' messages in, finished requests out to the emitters, a batch at a time.

The relay's messages (``llmtap.wire.messages``) arrive encoded (``submit``) and wait in the inbox
(``llmtap.telemetry.intake.inbox``); the worker thread (``llmtap.telemetry.loop``) hands each to ``dispatch``: a
stream's segments and end are played back into a timeline (``intake.streams``, ``intake.replay``), a relay's report
goes to its gauges (``intake.relays``), another telemetry process's lessons to their learners
(``fleet.siblings.Lessons``), the upstream's spans to the server-span wait (``fleet.serverspans``). A finished
timeline goes down into the analysis once and comes back whole (``llmtap.analysis.finish``: summary, cost, cache
class), may wait for its server span, and goes as that one ``Finished`` request to each emitter once
(``emit.batch``): spans, metrics, the record line and the listeners. The spans carry the ids the relay made and
sent upstream as ``traceparent``. A failure here never reaches a client's stream.

The recorder builds its parts (one per process) and dispatches; each part keeps its own state, its counts go
through ``llmtap.telemetry.counts``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import TracerProvider

from llmtap.analysis.estimator import Estimator
from llmtap.analysis.finish import Analysis
from llmtap.analysis.slots import Slots
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings
from llmtap.telemetry import identity, sched, semconv as sc
from llmtap.telemetry.counts import Counts
from llmtap.telemetry.emit.batch import Emission
from llmtap.telemetry.emit.finished import Emitter, Listener, Listeners
from llmtap.telemetry.emit.metrics import MetricWriter
from llmtap.telemetry.emit.spans import SpanWriter
from llmtap.telemetry.fleet import forward, peers
from llmtap.telemetry.fleet.serverspans import Finishing, Join, ServerSpan, ServerSpanWait, server_spans
from llmtap.telemetry.fleet.siblings import Lessons, Siblings
from llmtap.telemetry.fleet.upstreams import UpstreamWatch
from llmtap.telemetry.intake.holes import Hole, Holed, Holes
from llmtap.telemetry.intake.inbox import MAX_QUEUED_BYTES, Gone, Inbox, Spans
from llmtap.telemetry.intake.relays import Drops, RelayGauges
from llmtap.telemetry.intake.replay import Playback
from llmtap.telemetry.intake.streams import MAX_OPEN_STREAMS, Streams
from llmtap.telemetry.journal.losses import STATE_FILE, Losses
from llmtap.telemetry.journal.spool import JOURNAL_DROP_REASONS, Spool
from llmtap.telemetry.journal.start import open_spool
from llmtap.telemetry.loop import Worker
from llmtap.telemetry.records.access_log import AccessLog
from llmtap.telemetry.records.content_drops import ContentUnavailable
from llmtap.telemetry.records.emitter import RecordEmitter
from llmtap.telemetry.records.sinks import Sink, build_sinks
from llmtap.telemetry.trim import Trimmer
from llmtap.wire.lessons import Decoding, Ended, Idle, Lesson, LiveEntry, PassedSpans, Prefix, SlotCount
from llmtap.wire.messages import END, End, Facts, Head, Raw, Stats, WireError, decode

if TYPE_CHECKING:
    from llmtap.telemetry.records.content import ContentEmitter

__all__ = ["MAX_QUEUED_BYTES", "Recorder"]

log = logging.getLogger("llmtap.telemetry")


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
        self._routes = {r.name: r for r in settings.routes}
        #: Requests whose timeline could not be made telemetry (logged where it failed).
        self._failed = 0
        self.recorded = 0
        #: Messages and lessons dropped because they could not be decoded (``llmtap.wire.messages.WireError``).
        self.unreadable = 0
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
        self.counts = Counts(self.instruments, self.losses)
        self.spans.on_ignored = self.counts.trace_context
        # The admin listener's and the live view's counters, under the names they call.
        self.count_rejected = self.counts.rejected
        self.count_admin = self.counts.admin
        self.live_samples_dropped = self.counts.live_samples_dropped
        self.event_streams = self.counts.event_streams
        self.count_facts_dropped = self.counts.facts_dropped
        #: The summary, cost and cache diagnosis of each request; only the worker thread touches it.
        self.analysis = Analysis(settings)
        self._build_outputs(
            settings, logger_provider, keep_unsent=journal is not None and settings.record.journal is not None
        )
        self._build_fleet(settings)
        self._build_intake(settings)
        #: The record journal: each tape kept until every sink has its record (None: not kept).
        self.spool = None if journal is None else self._open_spool(journal)
        self.streams.spool = self.inbox.spool = self.emission.spool = self.spool
        self.counts.start(settings, forwarding=self.forwarder is not None, routing=self.peers is not None)
        self.losses.start()
        if self.spool is not None and self.spool.replay is not None:
            self.worker.start()  # the last run's records are made again now, whether tapes come or not

    def _build_outputs(self, settings: Settings, logger_provider: Any, *, keep_unsent: bool) -> None:
        """The records, the listeners and the order of the emitters."""
        #: Who writes this process's records (``service.instance.id`` and the rest).
        self.identity = identity.current()
        #: Where records go (``--record DIR``, ``--record-logs``), written by the worker thread.
        sinks = build_sinks(
            settings,
            self.identity,
            self.counts.record_drop,
            logger_provider=logger_provider,
            on_insert=self.counts.clickhouse_insert,
            keep_unsent=keep_unsent,
        )
        self.records = RecordEmitter(sinks, self.identity)
        #: The listeners emitter: each is called on the worker thread with each finished request's timeline and
        #: summary (the live view, the demo's tables); a listener that raises is logged and skipped.
        self._listeners = Listeners()
        self.listeners: list[Listener] = self._listeners.callables
        #: ``--access-log PATH``: one line per request, written by the worker thread after the record.
        self.access_log: AccessLog | None = None
        if settings.access_log:
            self.access_log = AccessLog(settings.access_log)
            self.listeners.append(self.access_log.write)
        emitters: tuple[Emitter, ...] = (self.spans, self.metrics, self.records, self._listeners)
        #: The opt-in content event (``--content-event``), after the others: None unless a field is named.
        self.content: ContentEmitter | ContentUnavailable | None = None
        if settings.content.on:
            # The OpenTelemetry logs SDK it needs is loaded only when asked for (as the record logs' is).
            try:
                from llmtap.telemetry.records.content import content_emitter
            except ImportError as exc:
                log.error("telemetry: --content-event needs a newer opentelemetry-sdk (%s); no content event", exc)
                cause = f"the opentelemetry-sdk installed is too old ({exc})"
                self.content = ContentUnavailable(cause, self.counts.content_drop)
            else:
                self.content = content_emitter(settings, self.counts.content_drop)
        if self.content is not None:
            emitters += (self.content,)
        self.emission = Emission(emitters, self.records)

    def _build_fleet(self, settings: Settings) -> None:
        """The upstreams' spans and gauges, the other replicas, the other telemetry processes."""
        #: Whether a finished request waits for its upstream's own span; only the worker thread touches it.
        self.wait = ServerSpanWait(settings, UpstreamWatch(), self.counts.join)
        #: Passes the spans ``/v1/traces`` took on to the OTLP traces backend (None: traces do not go out over OTLP).
        self.forwarder = forward.from_settings(settings.telemetry, self.counts.forward)
        #: The traces this process relayed: only their spans go to the backend; only the worker thread touches it.
        self.owned = peers.Ownership(settings.telemetry.server_spans_wait, self.counts.unowned)
        #: Passes spans another replica owns to that replica's admin listener (None: no peers).
        self.peers = peers.peer_forwarder(settings.telemetry, self.counts.routed)
        #: The other telemetry processes, told what must stay whole per upstream (None: this is the only one).
        self.siblings: Siblings | None = None
        #: Where the other processes' finished requests go in process 0 (its live view's window), if anywhere.
        self.live_entries: Callable[[Any], None] | None = None
        # Slot counts the siblings learned from upstreams' gauges this process does not read (only the worker).
        self._sibling_slots: dict[str, Slots] = {}
        #: What the siblings tell, each kind to the one that learns it.
        self.lessons = Lessons(
            {
                Decoding: self.estimator.learn,
                Ended: self.estimator.learn,
                Idle: self.estimator.learn,
                Prefix: self.analysis.cache.learn,
                SlotCount: self._learn_slots,
                LiveEntry: self._learn_live,
                PassedSpans: self._learn_spans,
            },
            self._unreadable_lesson,
        )

    def _build_intake(self, settings: Settings) -> None:
        """From the relays' messages to finished timelines: the inbox, its worker, the streams, the relays."""
        #: Tapes lost, and the relays' gauges and readiness.
        self.drops = Drops(self.instruments, self.losses)
        #: Streams being played back, and those a message of which the full queue turned away; bounded.
        self.streams = Streams(self.drops, self._playback, limit=MAX_OPEN_STREAMS)
        self.inbox = Inbox(
            settings.telemetry.queue_size, self.drops, self.streams, self.counts.facts_dropped, self._start
        )
        self._queue = self.inbox.queue
        self.worker = Worker(self.inbox, self, self.emission)
        #: Gives the C allocator's free memory back to the system while the worker is idle (only the worker).
        self.trimmer = Trimmer()
        self.relays = RelayGauges(self.instruments, self.drops, self._busy)

    def _open_spool(self, index: int) -> Spool | None:
        """The record journal of telemetry process ``index``, its counts and gauges (None: not asked, or no sink)."""
        rec = self.settings.record
        spool = open_spool(
            rec.journal,
            self.records.sinks,
            index=index,
            max_bytes=rec.journal_bytes,
            on_lost=self.counts.journal_drop,
            on_recovered=self.counts.recovered,
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
            self.counts.record_drop(reason, 0)
        self.counts.recovered(0)
        spool.observe(self.metrics.meter)
        return spool

    # -- what the recorder's parts are, as its callers and the tests know them --------------------------------

    @property
    def estimator(self) -> Estimator:
        """Splits upstream TTFT into queue and prefill (the analysis's); only the worker thread touches it."""
        return self.analysis.estimator

    @property
    def emitters(self) -> tuple[Emitter, ...]:
        """Each finished request goes to these, in this order."""
        return self.emission.emitters

    @emitters.setter
    def emitters(self, emitters: tuple[Emitter, ...]) -> None:
        self.emission.emitters = emitters

    @property
    def failed(self) -> int:
        """Requests some of whose telemetry could not be made (logged where it failed)."""
        return self._failed + self.emission.failed

    @property
    def holes(self) -> Holes:
        """Streams with segments the full queue turned away, played as a gap."""
        return self.inbox.holes

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
        return self.inbox.submit(message, source)

    def submit_spans(
        self, spans: list[ServerSpan], export: ExportTraceServiceRequest | None = None, size: int = 0
    ) -> bool:
        """Queue the upstream's spans (the admin listener's receiver) for the join, and ``export`` (all the spans
        they came with, ``size`` bytes) for the traces backend; False when the queue is full."""
        return self.inbox.submit_spans(spans, export, size)

    def route(self, address: str, export: ExportTraceServiceRequest, spans: int) -> None:
        """Pass spans another replica owns to its admin listener; never waits (queued, or counted dropped)."""
        if self.peers is not None:
            self.peers.offer(export.SerializeToString(), spans, to=address)

    def pass_spans(self, index: int, export: bytes, spans: int) -> None:
        """Pass spans whose requests telemetry process ``index`` recorded to it (the event loop's thread; never
        waits: sent, or counted dropped)."""
        sent = self.siblings is not None and self.siblings.pass_spans(index, export)
        self.counts.routed("sent" if sent else "dropped", spans)

    def relay_ready(self, source: int, ready: bool) -> None:
        """Relay ``source`` reported its readiness: taken now, so ``/readyz`` follows a drain's start at once."""
        self.relays.arrived(source, ready)

    def relay_gone(self, source: int) -> None:
        """Relay ``source`` disconnected: its gauges go back to zero and its open streams are dropped (the worker does
        both once it reaches this in the queue, after every message the relay sent)."""
        self.inbox.gone(source, self.relays.gone(source))

    def share_with(self, siblings: Siblings) -> None:
        """Tell ``siblings`` what each request teaches the state kept whole per upstream, and learn what they tell
        (``llmtap.telemetry.fleet.siblings``); before the first message."""
        self.siblings = siblings
        self.analysis.share()
        self.counts.start_routing(True)

    def record_timeline(self, tl: Timeline) -> None:
        """Queue a finished timeline as it is (tests and tools that build timelines themselves)."""
        self.inbox.timeline(tl)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued record is written; True when the queue drained in time."""
        return self.worker.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Drain the queue, stop the worker and close the record file."""
        try:
            self.worker.stop(timeout)
            self.upstreams.close()
            if self.forwarder is not None:
                self.forwarder.close(timeout)
            if self.peers is not None:
                self.peers.close(timeout)
        finally:
            self.records.close(timeout)
            if self.spool is not None:
                self.spool.close()  # after the sinks: what they did not take stays for the next start
            self.losses.close()
            if self.access_log is not None:
                self.access_log.close()
            if self.content is not None:
                self.content.close()

    # -- the worker's side (``llmtap.telemetry.loop``) ---------------------------------------------------------

    def _start(self) -> None:
        self.worker.start()

    def dispatch(self, source: int, item: Any) -> None:
        """One queued item, by its kind: a timeline, the upstream's spans, a relay's message (after a hole), or a
        relay gone."""
        if isinstance(item, Timeline):
            self._record_counted(item)
        elif isinstance(item, Spans):
            self._join_spans(item)
        elif isinstance(item, Holed):
            self.take(source, item.message, item.hole)
        elif isinstance(item, Gone):
            self.take(source, item.report)
            self.relays.forget(source)
            self.streams.forget(source)
        else:
            self.take(source, item)

    def next_deadline(self) -> float | None:
        """When the worker must wake next: a server-span wait, an unowned span, the siblings' batch, the journal."""
        lessons = self.siblings.deadline() if self.siblings is not None else None
        journal = self.spool.due() if self.spool is not None else None
        deadlines = [
            d for d in (self.wait.next_deadline(), self.owned.next_deadline(), lessons, journal) if d is not None
        ]
        return min(deadlines) if deadlines else None

    def due(self) -> None:
        """Do what is due now."""
        now = time.monotonic()
        if self.spool is not None:
            due = self.spool.due()
            if due is not None and due <= now:
                self.spool.poll()
        self.emission.add(self.wait.due(now))
        self.owned.due(now)
        if self.siblings is not None:
            lessons = self.siblings.deadline()
            if lessons is not None and lessons <= now:
                self.siblings.flush()

    def settle(self, *, write: bool) -> None:
        """Everything waiting for its server span goes out as it is (a flush, ``write``: and is written now)."""
        self.emission.add(self.wait.release())
        if write:
            self.emission.release()
            self.records.flush()

    def idle(self, *, trim: bool) -> None:
        """Nothing waits: what is held goes out, record lines are pushed out (``trim``: memory given back)."""
        self.emission.release()
        self.records.flush()
        if trim:
            self.trimmer.idle()

    def replay(self) -> Any:
        """The last run's journal replay, while it is under way."""
        replay = self.spool.replay if self.spool is not None else None
        return replay if replay is not None and not replay.done else None

    def take_replayed(self, replay: Any) -> None:
        """One slice of the last run's tapes, taken as the relays' are."""
        for source, message in replay.next_slice():
            try:
                self.take(source, message)
            except Exception:
                log.exception("telemetry: could not take a tape message of the last run")
            if message[0] == END:
                replay.taken_end(source, message[1])
            sched.checkpoint()
        self.emission.release()
        # What is due goes on during a long replay: the journal's acknowledgements above all (a kill before the
        # replay ends must not find this run's records unacknowledged and make them all again).
        deadline = self.next_deadline()
        if deadline is not None and deadline <= time.monotonic():
            self.due()
            self.records.flush()

    def take(self, source: int, message: Raw, hole: Hole | None = None) -> None:
        """One encoded message of relay ``source``: a stream's segment or end (after ``hole``, reads of its stream
        that were turned away before it), the relay's report, or another telemetry process's lessons.

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
            self.lessons.take(m)
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
            self._failed += 1
            log.exception("telemetry: could not record %s %s", tl.method, tl.path)
            if self.spool is not None:
                self.spool.settle(tl.ref)

    def _join_spans(self, spans: Spans) -> None:
        self.emission.add(self.wait.spans(spans, time.monotonic()))
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

    # -- from a timeline to the emitters -------------------------------------------------------

    def record(self, tl: Timeline) -> Summary:
        """Analyse one finished request whole and emit it (runs on the worker thread).

        A request to an upstream that exports its own spans waits for its span first (``serverspans``),
        at most ``telemetry.server_spans_wait`` seconds; the summary returned is then the estimate.
        """
        self._relayed(tl.trace_id)
        slots = self.upstreams.slots(tl.upstream)
        request = self.analysis.finish(tl, slots or self._sibling_slots.get(tl.upstream))
        if self.siblings is not None:
            self._share(tl.upstream, slots)
        if self.spool is not None and self.spool.replayed(tl.ref):
            self.emission.add([request])  # of the last run: its upstream's span is long gone
        else:
            self.emission.add(self.wait.offer(request, time.monotonic()))
        return request.summary

    def _share(self, upstream: str, slots: Slots | None) -> None:
        """Pass what the last request taught (and the upstream's slot count, now and then) to the siblings."""
        assert self.siblings is not None
        lessons: list[Lesson] = self.analysis.lessons()
        if slots is not None and self.siblings.slots_due(upstream, time.monotonic()):
            lessons.append(SlotCount(upstream, slots.slots, slots.source, slots.confidence))
        self.siblings.offer(lessons)

    def _learn_slots(self, lesson: SlotCount) -> None:
        if len(self._sibling_slots) >= 4096:
            self._sibling_slots.clear()
        self._sibling_slots[lesson.upstream] = Slots(lesson.slots, lesson.source, float(lesson.confidence))

    def _learn_live(self, lesson: LiveEntry) -> None:
        if self.live_entries is not None:
            self.live_entries(lesson.entry)

    def _learn_spans(self, lesson: PassedSpans) -> None:
        export = ExportTraceServiceRequest.FromString(lesson.export)
        self._join_spans(Spans(server_spans(export), export))

    def _unreadable_lesson(self, exc: Exception) -> None:
        self.unreadable += 1
        if self.unreadable & (self.unreadable - 1) == 0:
            log.error("telemetry: dropped a lesson of another telemetry process that cannot be read: %s", exc)

    def _busy(self, route: str) -> None:
        """Two requests of ``route`` in flight at once: its upstream's slot count matters; read its gauges."""
        if route in self._routes:
            self.upstreams.watch(self._routes[route].upstream)
