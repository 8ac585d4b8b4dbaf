"""What the relays report beside their tapes, and what becomes of tapes that never make telemetry.

``RelayGauges`` takes each relay's ``Stats`` (``llmtap.wire.messages``): absolute gauges and counts, turned into
additions to the instruments as the change since that relay's last report, and its readiness for ``/readyz``.
``Drops`` counts tapes lost in whole or in part, by reason, on ``llmtap.telemetry.tapes.dropped``. Both run on the
recorder's worker thread, except where a method says otherwise.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import Instruments
from llmtap.telemetry.journal.losses import Losses
from llmtap.wire.messages import (
    CLIENT_TIMEOUT_KINDS,
    CONNECTION_REFUSAL_REASONS,
    RESPONSE_CUT_REASONS,
    Raw,
    Stats,
    encode_stats,
)

__all__ = ["GONE_KEPT", "TAPE_DROP_REASONS", "Drops", "RelayGauges"]

log = logging.getLogger("llmtap.telemetry")

#: Why a tape did not become telemetry, in whole (``channel_full``: the relay's channel; ``queue_full``: the
#: recorder's queue; ``evicted``: too many streams open at once, or their relay went away mid-stream) or in part
#: (``partial``: timing without some bytes; ``inflate_limit``, ``body_limit``: the tap stopped reading a response
#: past its bounds, ``llmtap.telemetry.intake.tap``); ``split``: a stream whose start went to a telemetry process that
#: was killed, and whose end came to the one started in its place. With a record journal
#: (``llmtap.telemetry.journal.sequences``): ``in_transit``, a stream's end a relay handed over that never reached the
#: telemetry process (in the socket when it was killed); ``in_flight``, a request a relay was relaying when it was
#: killed with the whole tree (its tape never left it). ``shutdown``: a request still queued when the exit's flush
#: bound (``--flush-timeout``) ran out, with no record journal to keep it for the next start.
TAPE_DROP_REASONS = (
    "channel_full", "queue_full", "evicted", "partial", "inflate_limit", "body_limit", "split", "in_transit",
    "in_flight", "shutdown",
)  # fmt: skip
#: Relays gone whose readiness (``False``) is still told; each relay connection is a source of its own, so a relay
#: that restarts again and again must not add one each time for as long as the process runs.
GONE_KEPT = 64


class Drops:
    """Tapes lost, by reason; every reason reads 0 from the start ("none dropped" is a value, not an absence)."""

    def __init__(self, instruments: Instruments, losses: Losses) -> None:
        self._losses = losses
        #: Whole tapes lost on the worker thread (and reported by the relays), and ends the full queue turned away
        #: (the producer's count): each written by one thread only.
        self.whole = 0
        self.ends = 0
        for reason in TAPE_DROP_REASONS:
            self.count(reason, 0)

    @property
    def total(self) -> int:
        """Tapes that never became telemetry."""
        return self.whole + self.ends

    def count(self, reason: str, n: int = 1) -> None:
        """Count ``n`` tapes lost (in whole or in part) for ``reason``; never raises."""
        self._losses.add("tapes", reason, n)

    def journal(self, reason: str, n: int) -> None:
        """Count ``n`` tapes the record journal found lost (it acknowledges them next: kept on disk first), marked by
        ``reason``: the journal's ``sequences.json`` counted them first, and the next start adds what a kill between
        the two writes left out of the counters (``llmtap.telemetry.journal.sequences.Sequences.unmarked``)."""
        self._losses.add("tapes", reason, n, sync=True, mark=reason)

    def relay(self, relay: int, total: int) -> None:
        """Relay ``relay`` dropped ``total`` tapes since it started (its channel full): count the rise."""
        self.whole += self._losses.relay(relay, total)

    def tape(self, reason: str, route: str | None) -> None:
        """A whole tape lost on the worker thread."""
        self.whole += 1
        log.debug("telemetry: dropped a tape (%s) of route %s", reason, route)
        self.count(reason)

    def unfinished(self, n: int) -> None:
        """``n`` requests still queued when the exit's flush bound ran out (no journal keeps them)."""
        self.whole += n
        self.count("shutdown", n)

    def end(self) -> None:
        """A stream's end the full queue turned away (the producer's thread)."""
        self.ends += 1
        self.count("queue_full")


class RelayGauges:
    """The relays' gauges and counts as each last reported them (by source), so that changes become additions.

    ``busy(route)`` is called when two or more streams of ``route`` are in flight at once (its upstream's slot
    count starts to matter).
    """

    def __init__(self, instruments: Instruments, drops: Drops, busy: Callable[[str], None]) -> None:
        self._ins = instruments
        self._drops = drops
        self._busy = busy
        self._gauges: dict[int, tuple[dict[str, int], dict[str, int], int]] = {}
        # Client connections cut or refused, and responses cut, by source, as each last reported them.
        self._counts: dict[int, dict[tuple[str, str], int]] = {}
        # Each source's relay id, as its reports say it (the loss counters keep its totals by id).
        self._relay_ids: dict[int, int] = {}
        #: Whether each relay said it is ready (``/readyz`` of the telemetry process).
        self.ready: dict[int, bool] = {}
        # Readiness is taken as each report arrives (``arrived``), not when the worker reaches it in the queue.
        self._ready_on_arrival = False
        self._gone: deque[int] = deque()
        # Every way a client connection can be cut or refused, and a response cut, reads 0 from the start.
        for kind in CLIENT_TIMEOUT_KINDS:
            instruments.client_timeouts.add(0, {sc.TIMEOUT_KIND: kind})
        for reason in CONNECTION_REFUSAL_REASONS:
            instruments.connections_refused.add(0, {sc.REFUSAL_REASON: reason})
        for reason in RESPONSE_CUT_REASONS:
            instruments.responses_cut.add(0, {sc.CUT_REASON: reason})

    def report(self, source: int, stats: Stats) -> None:
        """Relay ``source``'s report: added to the instruments as the change since its last one."""
        new_active, new_waiting = dict(stats.active), dict(stats.waiting)
        old_active, old_waiting, old_dropped = self._gauges.get(source, ({}, {}, 0))
        ins = self._ins
        for route, active in new_active.items():
            if active >= 2:
                self._busy(route)
        # A route reported for the first time gets its series even at 0: an idle gauge reads 0, not absent.
        for route in new_active.keys() | old_active.keys():
            change = new_active.get(route, 0) - old_active.get(route, 0)
            if change or route not in old_active:
                ins.active_streams.add(change, {sc.ROUTE: route})
        for route in new_waiting.keys() | old_waiting.keys():
            change = new_waiting.get(route, 0) - old_waiting.get(route, 0)
            if change or route not in old_waiting:
                ins.queue_waiting.add(change, {sc.ROUTE: route})
        dropped = stats.dropped
        if stats.relay:
            self._relay_ids[source] = stats.relay
            self._drops.relay(stats.relay, dropped)
        elif dropped > old_dropped:  # a relay that sends no id: its totals since this process heard it first
            self._drops.count("channel_full", dropped - old_dropped)
            self._drops.whole += dropped - old_dropped
        self._gauges[source] = (new_active, new_waiting, dropped)
        if not self._ready_on_arrival:
            self.ready[source] = bool(stats.ready)
        counted = self._counts.setdefault(source, {})
        for attribute, counter, counts in (
            (sc.TIMEOUT_KIND, ins.client_timeouts, stats.timeouts),
            (sc.REFUSAL_REASON, ins.connections_refused, stats.refused),
            (sc.CUT_REASON, ins.responses_cut, stats.cuts),
        ):
            for label, count in counts:
                before = counted.get((attribute, label), 0)
                # Fewer than last time: a new relay process took this source's place and counts from 0.
                change = count - before if count >= before else count
                if change:
                    counter.add(change, {attribute: str(label)})
                counted[(attribute, label)] = count

    def arrived(self, source: int, ready: bool) -> None:
        """Relay ``source``'s readiness as its report arrived (the reader's thread): ``/readyz`` follows a drain's
        start at once, and the worker, which may be behind, leaves readiness alone from then on."""
        self._ready_on_arrival = True
        self.ready[source] = ready

    def gone(self, source: int) -> Raw:
        """Relay ``source`` disconnected (the reader's thread): not ready; the report to queue for the worker, which
        takes its gauges back to zero."""
        if self._ready_on_arrival:
            self.ready[source] = False
        dropped = self._gauges.get(source, ({}, {}, 0))[2]
        return encode_stats(Stats(False, dropped, (), (), (), (), (), self._relay_ids.get(source, 0)))

    def forget(self, source: int) -> None:
        """Relay ``source`` is gone and its last report taken (the worker): its gauges, counts and relay id are let go,
        and its readiness once ``GONE_KEPT`` relays went after it."""
        self._gauges.pop(source, None)
        self._counts.pop(source, None)
        self._relay_ids.pop(source, None)
        self._gone.append(source)
        while len(self._gone) > GONE_KEPT:
            self.ready.pop(self._gone.popleft(), None)
