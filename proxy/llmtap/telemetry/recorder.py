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

The recorder only dispatches: its parts (one per process) are made and wired by ``llmtap.telemetry.assemble``; each
keeps its own state, its counts go through ``llmtap.telemetry.counts``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import TracerProvider

from llmtap.analysis.estimator import Estimator
from llmtap.analysis.slots import Slots
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings
from llmtap.deadline import Deadline
from llmtap.telemetry import sched
from llmtap.telemetry.assemble import assemble
from llmtap.telemetry.emit.finished import Emitter, Listener
from llmtap.telemetry.fleet.serverspans import Finishing, Join, ServerSpan, server_spans
from llmtap.telemetry.fleet.siblings import Siblings
from llmtap.telemetry.fleet.upstreams import UpstreamWatch
from llmtap.telemetry.intake.holes import Hole, Holed, Holes
from llmtap.telemetry.intake.inbox import MAX_QUEUED_BYTES, Gone, Spans
from llmtap.telemetry.intake.replay import Playback
from llmtap.telemetry.records.sinks import Sink
from llmtap.wire.lessons import Lesson, LiveEntry, PassedSpans, SlotCount
from llmtap.wire.messages import END, End, Facts, Head, Raw, Stats, WireError, decode

if TYPE_CHECKING:
    from llmtap.telemetry.assemble import Parts

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
        """``journal``: this telemetry process's index, when it keeps a record journal (``--record-journal``).

        Its parts are made by ``llmtap.telemetry.assemble``; the recorder holds them under the names its callers
        know."""
        self.settings = settings
        self._routes = {r.name: r for r in settings.routes}
        #: Requests whose timeline could not be made telemetry (logged where it failed).
        self._failed = 0
        self.recorded = 0
        #: Messages and lessons dropped because they could not be decoded (``llmtap.wire.messages.WireError``).
        self.unreadable = 0
        #: The other telemetry processes, told what must stay whole per upstream (None: this is the only one).
        self.siblings: Siblings | None = None
        #: Where the other processes' finished requests go in process 0 (its live view's window), if anywhere.
        self.live_entries: Callable[[Any], None] | None = None
        # Slot counts the siblings learned from upstreams' gauges this process does not read (only the worker).
        self._sibling_slots: dict[str, Slots] = {}
        self._hold(
            assemble(
                settings,
                self,
                tracer_provider=tracer_provider,
                meter_provider=meter_provider,
                logger_provider=logger_provider,
                journal=journal,
            )
        )
        if self.spool is not None and self.spool.replay is not None:
            self.worker.start()  # the last run's records are made again now, whether tapes come or not

    def _hold(self, parts: Parts) -> None:
        """Hold ``parts`` under the names the dispatch, its callers and the tests use (one attribute read each)."""
        self.parts = parts
        out, fleet, intake = parts.outputs, parts.fleet, parts.intake
        #: The emitters and what they write to (``assemble.Outputs``).
        self.spans, self.metrics, self.records, self.emission = out.spans, out.metrics, out.records, out.emission
        self.instruments = out.metrics.instruments
        self.identity, self.access_log, self.content = out.identity, out.access_log, out.content
        #: Each is called on the worker thread with each finished request's timeline and summary.
        self.listeners: list[Listener] = out.listeners.callables
        self.losses, self.counts, self.analysis = parts.losses, parts.counts, parts.analysis
        # The admin listener's and the live view's counters, under the names they call.
        self.count_rejected = self.counts.rejected
        self.count_admin = self.counts.admin
        self.live_samples_dropped = self.counts.live_samples_dropped
        self.event_streams = self.counts.event_streams
        self.count_facts_dropped = self.counts.facts_dropped
        #: The upstreams' spans and gauges, the other replicas, the other processes (``assemble.Fleet``).
        self.wait, self.forwarder, self.owned, self.peers = fleet.wait, fleet.forwarder, fleet.owned, fleet.peers
        self.lessons = fleet.lessons
        #: From the relays' messages to finished timelines (``assemble.Intake``).
        self.drops, self.streams, self.inbox, self.relays = intake.drops, intake.streams, intake.inbox, intake.relays
        self._queue = self.inbox.queue
        self.worker, self.trimmer, self.spool = parts.worker, parts.trimmer, parts.spool

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

    def submit_all(self, messages: Sequence[Raw], source: int = 0) -> None:
        """``submit`` each of one read's ``messages`` from relay ``source``, in order, waking the worker once."""
        self.inbox.submit_all(messages, source)

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
        """Drain the queue, stop the worker and close the record file, all within ``timeout`` seconds: one bound
        for every step together, not one each (what a sink has not taken by then is counted lost by the sink, or
        stays in the record journal when there is one)."""
        left = Deadline(timeout).left
        try:
            if not self.worker.stop(left()):
                self._unfinished(self.inbox.abandon())
            self.upstreams.close()
            if self.forwarder is not None:
                self.forwarder.close(left())
            if self.peers is not None:
                self.peers.close(left())
        finally:
            self.records.close(left())
            if self.spool is not None:
                self.spool.close()  # after the sinks: what they did not take stays for the next start
            self.losses.close()
            if self.access_log is not None:
                self.access_log.close()
            if self.content is not None:
                self.content.close()

    def _unfinished(self, requests: int) -> None:
        """``requests`` still queued when the exit's bound ran out: kept by the journal for the next start, or lost
        and counted (``shutdown``), said either way."""
        if not requests:
            return
        if self.spool is not None:
            log.warning("telemetry: %d requests not recorded within the flush bound: the journal keeps them", requests)
            return
        self.drops.unfinished(requests)
        log.warning(
            "telemetry: %d requests not recorded within the flush bound (--flush-timeout): lost, counted as shutdown",
            requests,
        )

    # -- the worker's side (``llmtap.telemetry.loop``) ---------------------------------------------------------

    def wake(self) -> None:
        """The inbox took its first item: the worker starts."""
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

    def playback(self, head: Head) -> Playback:
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

    def learn_slots(self, lesson: SlotCount) -> None:
        """Another process read an upstream's slot count: kept for requests to it (bounded)."""
        if len(self._sibling_slots) >= 4096:
            self._sibling_slots.clear()
        self._sibling_slots[lesson.upstream] = Slots(lesson.slots, lesson.source, float(lesson.confidence))

    def learn_live(self, lesson: LiveEntry) -> None:
        """Another process finished a request: to the live view's window, where it has one."""
        if self.live_entries is not None:
            self.live_entries(lesson.entry)

    def learn_spans(self, lesson: PassedSpans) -> None:
        """Another process passed spans of requests this one recorded: joined as this one's own."""
        export = ExportTraceServiceRequest.FromString(lesson.export)
        self._join_spans(Spans(server_spans(export), export))

    def unreadable_lesson(self, exc: Exception) -> None:
        """A lesson that cannot be decoded: counted, and said at the 1st, 2nd, 4th, ..."""
        self.unreadable += 1
        if self.unreadable & (self.unreadable - 1) == 0:
            log.error("telemetry: dropped a lesson of another telemetry process that cannot be read: %s", exc)

    def busy(self, route: str) -> None:
        """Two requests of ``route`` in flight at once: its upstream's slot count matters; read its gauges."""
        if route in self._routes:
            self.upstreams.watch(self._routes[route].upstream)
