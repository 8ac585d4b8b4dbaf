"""The telemetry side's composition root: from the settings, every part the recorder dispatches to.

The recorder (``llmtap.telemetry.recorder``) only dispatches; what it dispatches to is made here, once per process,
wired to the counts each part keeps (``llmtap.telemetry.counts``) and to the few calls that come back to the
recorder (``Owner``): a stream's first message, a route gone busy, the other telemetry processes' lessons. Kept
apart so that what a process is made of reads in one place, and the recorder's walk reads without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from llmtap.analysis.finish import Analysis
from llmtap.config.types import Settings
from llmtap.telemetry import identity, semconv as sc
from llmtap.telemetry.counts import Counts
from llmtap.telemetry.emit.batch import Emission
from llmtap.telemetry.emit.finished import Emitter, Listeners
from llmtap.telemetry.emit.metrics import MetricWriter
from llmtap.telemetry.emit.spans import SpanWriter
from llmtap.telemetry.fleet import forward, peers
from llmtap.telemetry.fleet.serverspans import ServerSpanWait
from llmtap.telemetry.fleet.siblings import Lessons
from llmtap.telemetry.fleet.upstreams import UpstreamWatch
from llmtap.telemetry.intake.inbox import Inbox
from llmtap.telemetry.intake.relays import Drops, RelayGauges
from llmtap.telemetry.intake.replay import Playback
from llmtap.telemetry.intake.streams import MAX_OPEN_STREAMS, Streams
from llmtap.telemetry.journal.losses import STATE_FILE, Losses
from llmtap.telemetry.journal.spool import JOURNAL_DROP_REASONS, Spool
from llmtap.telemetry.journal.start import open_spool
from llmtap.telemetry.loop import Dispatch, Worker
from llmtap.telemetry.records.access_log import AccessLog
from llmtap.telemetry.records.content_drops import ContentUnavailable
from llmtap.telemetry.records.emitter import RecordEmitter
from llmtap.telemetry.records.sinks import build_sinks
from llmtap.telemetry.trim import Trimmer
from llmtap.wire.lessons import Decoding, Ended, Idle, LiveEntry, PassedSpans, Prefix, SlotCount
from llmtap.wire.messages import Head

if TYPE_CHECKING:
    from llmtap.telemetry.records.content import ContentEmitter

__all__ = ["Fleet", "Intake", "Outputs", "Owner", "Parts", "assemble"]

log = logging.getLogger("llmtap.telemetry")


class Owner(Dispatch, Protocol):
    """What the parts call back in the recorder, besides the worker's dispatch (``llmtap.telemetry.loop``)."""

    def wake(self) -> None:
        """The inbox took its first item: the worker starts."""

    def playback(self, head: Head) -> Playback:
        """A stream's playback, from its first message's head."""

    def busy(self, route: str) -> None:
        """Two requests of ``route`` in flight at once."""

    def learn_slots(self, lesson: SlotCount) -> None:
        """Another telemetry process read an upstream's slot count."""

    def learn_live(self, lesson: LiveEntry) -> None:
        """Another telemetry process finished a request (for the live view's window)."""

    def learn_spans(self, lesson: PassedSpans) -> None:
        """Another telemetry process passed spans of a request this one recorded."""

    def unreadable_lesson(self, exc: Exception) -> None:
        """A lesson could not be decoded."""


@dataclass
class Outputs:
    """Where a finished request goes: the emitters in their order, and what they write to."""

    spans: SpanWriter
    metrics: MetricWriter
    #: Who writes this process's records (``service.instance.id`` and the rest).
    identity: identity.Identity
    records: RecordEmitter
    #: Called on the worker thread with each finished request (the live view, the demo's tables).
    listeners: Listeners
    #: ``--access-log PATH``: one line per request, after the record (None: not asked).
    access_log: AccessLog | None
    #: The opt-in content event (``--content-event``), after the others (None: no field named).
    content: ContentEmitter | ContentUnavailable | None
    emission: Emission


@dataclass
class Fleet:
    """The upstreams' spans and gauges, the other replicas, the other telemetry processes."""

    #: Whether a finished request waits for its upstream's own span.
    wait: ServerSpanWait
    #: Passes the spans ``/v1/traces`` took on to the OTLP traces backend (None: traces do not go out over OTLP).
    forwarder: forward.Forwarder | None
    #: The traces this process relayed: only their spans go to the backend.
    owned: peers.Ownership
    #: Passes spans another replica owns to that replica's admin listener (None: no peers).
    peers: forward.Forwarder | None
    #: What the other telemetry processes tell, each kind to the one that learns it.
    lessons: Lessons


@dataclass
class Intake:
    """From the relays' messages to finished timelines."""

    #: Tapes lost.
    drops: Drops
    #: Streams being played back, and those a message of which the full queue turned away; bounded.
    streams: Streams
    inbox: Inbox
    #: The relays' gauges and readiness.
    relays: RelayGauges


@dataclass
class Parts:
    """Everything one recorder dispatches to."""

    losses: Losses
    counts: Counts
    #: The summary, cost and cache diagnosis of each request.
    analysis: Analysis
    outputs: Outputs
    fleet: Fleet
    intake: Intake
    worker: Worker
    #: Gives the C allocator's free memory back to the system while the worker is idle.
    trimmer: Trimmer
    #: The record journal: each tape kept until every sink has its record (None: not kept).
    spool: Spool | None


def assemble(
    settings: Settings,
    owner: Owner,
    *,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    logger_provider: Any = None,
    journal: int | None = None,
) -> Parts:
    """The parts of one recorder (``owner``), wired; ``journal``: this telemetry process's index, when it keeps a
    record journal (``--record-journal``)."""
    spans = SpanWriter(settings, tracer_provider)
    metrics = MetricWriter(settings, meter_provider)
    losses = _losses(metrics)
    counts = Counts(metrics.instruments, losses)
    spans.on_ignored = counts.trace_context
    analysis = Analysis(settings)
    keep_unsent = journal is not None and settings.record.journal is not None
    outputs = _outputs(settings, spans, metrics, counts, logger_provider, keep_unsent=keep_unsent)
    fleet = _fleet(settings, counts, analysis, owner)
    intake = _intake(settings, metrics, losses, counts, owner)
    worker = Worker(intake.inbox, owner, outputs.emission)
    spool = None if journal is None else _open_spool(settings, journal, outputs, losses, counts, intake.drops)
    intake.streams.spool = intake.inbox.spool = outputs.emission.spool = spool
    counts.start(settings, forwarding=fleet.forwarder is not None, routing=fleet.peers is not None)
    losses.start()
    return Parts(losses, counts, analysis, outputs, fleet, intake, worker, Trimmer(), spool)


def _losses(metrics: MetricWriter) -> Losses:
    """Every loss counted: its totals kept across restarts (with a journal), and said in the log with its count."""
    instruments = metrics.instruments
    return Losses(
        {
            "tapes": instruments.telemetry_dropped,
            "records": instruments.records_dropped,
            "recovered": instruments.records_recovered,
        },
        sc.TELEMETRY_REASON,
    )


def _outputs(
    settings: Settings,
    spans: SpanWriter,
    metrics: MetricWriter,
    counts: Counts,
    logger_provider: Any,
    *,
    keep_unsent: bool,
) -> Outputs:
    """The records, the listeners and the order of the emitters."""
    who = identity.current()
    # Where records go (``--record DIR``, ``--record-logs``), written by the worker thread.
    sinks = build_sinks(
        settings,
        who,
        counts.record_drop,
        logger_provider=logger_provider,
        on_insert=counts.clickhouse_insert,
        keep_unsent=keep_unsent,
    )
    records = RecordEmitter(sinks, who)
    # A listener that raises is logged and skipped.
    listeners = Listeners()
    access_log = None
    if settings.access_log:
        access_log = AccessLog(settings.access_log)
        listeners.callables.append(access_log.write)
    emitters: tuple[Emitter, ...] = (spans, metrics, records, listeners)
    content = _content(settings, counts)
    if content is not None:
        emitters += (content,)
    return Outputs(spans, metrics, who, records, listeners, access_log, content, Emission(emitters, records))


def _content(settings: Settings, counts: Counts) -> ContentEmitter | ContentUnavailable | None:
    """The content event's emitter when a field is named; its OpenTelemetry logs SDK is loaded only then (as the
    record logs' is)."""
    if not settings.content.on:
        return None
    try:
        from llmtap.telemetry.records.content import content_emitter
    except ImportError as exc:
        log.error("telemetry: --content-event needs a newer opentelemetry-sdk (%s); no content event", exc)
        return ContentUnavailable(f"the opentelemetry-sdk installed is too old ({exc})", counts.content_drop)
    return content_emitter(settings, counts.content_drop)


def _fleet(settings: Settings, counts: Counts, analysis: Analysis, owner: Owner) -> Fleet:
    """The upstreams' spans and gauges, the other replicas, the other telemetry processes."""
    estimator = analysis.estimator
    learners: dict[type[Any], Callable[[Any], None]] = {
        Decoding: estimator.learn,
        Ended: estimator.learn,
        Idle: estimator.learn,
        Prefix: analysis.cache.learn,
        SlotCount: owner.learn_slots,
        LiveEntry: owner.learn_live,
        PassedSpans: owner.learn_spans,
    }
    return Fleet(
        wait=ServerSpanWait(settings, UpstreamWatch(), counts.join),
        forwarder=forward.from_settings(settings.telemetry, counts.forward),
        owned=peers.Ownership(settings.telemetry.server_spans_wait, counts.unowned),
        peers=peers.peer_forwarder(settings.telemetry, counts.routed),
        lessons=Lessons(learners, owner.unreadable_lesson),
    )


def _intake(settings: Settings, metrics: MetricWriter, losses: Losses, counts: Counts, owner: Owner) -> Intake:
    """The inbox, the streams it plays back, the relays' gauges."""
    drops = Drops(metrics.instruments, losses)
    streams = Streams(drops, owner.playback, limit=MAX_OPEN_STREAMS)
    inbox = Inbox(settings.telemetry.queue_size, drops, streams, counts.facts_dropped, owner.wake)
    relays = RelayGauges(metrics.instruments, drops, owner.busy)
    return Intake(drops, streams, inbox, relays)


def _open_spool(
    settings: Settings, index: int, outputs: Outputs, losses: Losses, counts: Counts, drops: Drops
) -> Spool | None:
    """The record journal of telemetry process ``index``, its counts and gauges (None: not asked, or no sink)."""
    rec = settings.record
    records = outputs.records
    spool = open_spool(
        rec.journal,
        records.sinks,
        index=index,
        max_bytes=rec.journal_bytes,
        on_lost=counts.journal_drop,
        on_recovered=counts.recovered,
        on_tapes_lost=drops.journal,
    )
    records.spool = spool
    if spool is None:
        return None
    # Before the last run's replay counts anything: the counters go on from the last run's totals.
    losses.keep(spool.slot.path / STATE_FILE)
    # Ends the last run counted in sequences.json and was killed before the counters had them: counted now.
    for reason, n in sorted(spool.sequences.unmarked(losses.marks).items()):
        log.warning("record journal: %d tapes lost (%s) counted by the last run, added to the counters", n, reason)
        drops.journal(reason, n)
    for reason in JOURNAL_DROP_REASONS:
        counts.record_drop(reason, 0)
    counts.recovered(0)
    spool.observe(outputs.metrics.meter)
    return spool
