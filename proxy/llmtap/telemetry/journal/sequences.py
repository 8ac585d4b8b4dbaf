"""What never reached the record journal: the relays' stream ends, counted by their sequence numbers.

Issue 44. Each relay numbers the stream ends it hands to each telemetry process, 1, 2, 3, ... (``End.seq``, only
once the channel took the end: one it refused is counted dropped by the relay itself). The journal
(``llmtap.telemetry.journal.spool``) notes, per run of the telemetry process, the first and the last number it saw of
each relay; a gap is an end the relay handed over that the journal never got: in the socket, or in the relay's gather,
when the telemetry process was killed (or its connection lost). Counted as tapes dropped, ``in_transit``.

Across restarts: the runs the replay reads (their segments) and those the slot's ``sequences.json`` remembers
(``save``, before any segment is deleted) are put in order with what was already reconciled, once all of them are
known (``resolve``): a gap between one run's last number and the next run's first is counted then, once, however
many runs were killed before they could count it (a crash loop). A count and the state that says it was made are
kept together: ``sequences.json`` also holds, by cause, every end this slot's runs ever counted (``counted``),
written before the loss counters' ``counters.json`` (``llmtap.telemetry.journal.losses``) is told, which keeps beside
its totals how much of them came from here (its marks); a kill between the two writes leaves ``counted`` ahead, and the
next start adds the difference to the counters (``unmarked``) instead of counting the gap again.

Across a kill of the whole tree: the dead relays' ledgers (``llmtap.wire.ledger``) say what each handed over last
and how many requests it was still relaying (``in_flight``: their tapes never left it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtap.wire.ledger import LedgerState, dead, mark_read

__all__ = ["SEQUENCES_FILE", "Sequences", "last_run"]

#: The file in a journal slot that keeps the relays' numbers for the next start.
SEQUENCES_FILE = "sequences.json"

log = logging.getLogger("llmtap.telemetry")

#: Relays whose numbers are remembered at most (the oldest forgotten first).
MAX_RELAYS = 4096
#: Seconds after which a dead relay's ledger that no journal here knew is removed.
STALE = 3600.0

#: A relay's numbers in one run: the first and the last end the journal saw.
Span = list[int]


def _load(path: Path) -> tuple[dict[int, tuple[int, int]], dict[int, dict[int, Span]], dict[str, int]]:
    """What an earlier run left: per relay the (run, number) reconciled up to, the runs not reconciled yet, and by
    cause the ends counted since the first start."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        reconciled = {int(k): (int(v[0]), int(v[1])) for k, v in data.get("reconciled", {}).items()}
        runs = {
            int(run): {int(k): [int(v[0]), int(v[1])] for k, v in spans.items()}
            for run, spans in data.get("runs", {}).items()
        }
        counted = {str(k): int(v) for k, v in data.get("counted", {}).items()}
        return reconciled, runs, counted
    except (OSError, ValueError, AttributeError, TypeError, IndexError, KeyError):
        return {}, {}, {}


def last_run(path: Path) -> int:
    """The latest run the file at ``path`` knows of (0: none)."""
    reconciled, runs, _ = _load(path)
    try:
        saved = int(json.loads(path.read_text(encoding="utf-8")).get("run", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        saved = 0
    return max([saved] + [run for run, _ in reconciled.values()] + list(runs))


class Sequences:
    """Per relay, the stream ends the journal saw, run by run; the gaps, counted once.

    ``seen`` runs under the journal's lock (the event loop's thread); the rest on the recorder's worker: each takes
    the lock of its own, so that ``resolve`` and ``seen`` never interleave. A count is kept in ``sequences.json`` with
    the state that says it was made, in one write, before ``on_lost`` hears of it."""

    def __init__(self, path: Path, index: int, run: int, on_lost: Callable[[str, int], None] | None = None) -> None:
        self.path = path
        self.index = index
        self.run = run
        self._on_lost = on_lost
        #: Per relay, the run and number every gap up to which is counted; the earlier runs not yet reconciled.
        self.reconciled, self.runs, self.counted = _load(path)
        self._lock = threading.RLock()
        #: Counts made and not yet kept in ``sequences.json``: told to ``on_lost`` once it is written.
        self._pending: list[tuple[str, int]] = []
        #: This run's first and last number per relay.
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self._resolved = False
        #: Ends the journal never got, and requests dead relays were relaying, counted so far.
        self.in_transit = 0
        self.in_flight = 0
        self._said = False

    def unmarked(self, marks: dict[str, int]) -> dict[str, int]:
        """By cause, what ``counted`` holds beyond ``marks`` (what the loss counters say they got from here): counts
        a run was killed before it could tell them. Where the counters hold more (``sequences.json`` not written),
        ``counted`` takes their number."""
        with self._lock:
            missing = {}
            for reason in set(self.counted) | set(marks):
                n = self.counted.get(reason, 0) - marks.get(reason, 0)
                if n > 0:
                    missing[reason] = n
                elif n < 0:
                    self.counted[reason] = marks[reason]
            return missing

    def seen(self, relay: int, seq: int) -> None:
        """Relay ``relay``'s ``seq``-th end reached the journal."""
        with self._lock:
            self._seen(relay, seq)
            self._flush()

    def _seen(self, relay: int, seq: int) -> None:
        last = self.last.get(relay)
        if last is None:
            self.first[relay] = seq
            if self._resolved:
                self.last[relay] = seq
                if self._reconcile(relay):
                    self.save()
        elif seq > last + 1:
            self._gap(seq - last - 1)  # a connection lost and made again: what was on its way went with it
            self.save()
        if last is None or seq > last:
            self.last[relay] = seq

    def seen_old(self, run: int, relay: int, seq: int) -> None:
        """The replay read relay ``relay``'s ``seq``-th end in a segment of run ``run``."""
        with self._lock:
            span = self.runs.setdefault(run, {}).get(relay)
            if span is None:
                self.runs[run][relay] = [seq, seq]
            else:
                span[0], span[1] = min(span[0], seq), max(span[1], seq)

    def resolve(self) -> tuple[int, int]:
        """Every earlier run's numbers are known (the replay is done): the gaps between runs, and to this run's
        first ends, counted; then what the dead relays' ledgers say never reached the journal. Returns
        (``in_transit``, ``in_flight``) found now."""
        with self._lock:
            before = self.in_transit
            self._resolved = True
            for relay in {r for spans in self.runs.values() for r in spans} | set(self.first):
                self._reconcile(relay)
            self.runs = {}
            # What was counted is kept at once, with the state that says so, before the counters hear of it: a kill
            # before this save has the next run count it again (and the counters never had it), one after it has the
            # next start add to the counters what they missed (``unmarked``).
            self.save()
            self._flush()
            for state, fd in dead(self.path.parent.parent):
                try:
                    self._dead(state, fd)
                finally:
                    os.close(fd)
            return self.in_transit - before, self.in_flight

    def _reconcile(self, relay: int) -> int:
        """The gaps of ``relay`` from what was reconciled through the earlier runs, in order, to this run's first;
        returns how many ends they count.

        The run reconciled last may have gone on journaling ends after it saved its numbers (a save comes only when a
        segment goes): those its segments still hold extend it, and are no gap."""
        at_run, prev = self.reconciled.get(relay, (0, 0))
        known = relay in self.reconciled
        before = self.in_transit
        for run in sorted(self.runs):
            span = self.runs[run].get(relay)
            if run < at_run or span is None:
                continue
            if known and run > at_run:
                self._gap(span[0] - prev - 1)
            at_run, prev, known = run, max(prev, span[1]), True
        first = self.first.get(relay)
        if first is not None and known:
            self._gap(first - prev - 1)
        if known:
            self.reconciled[relay] = (at_run, prev)
        return self.in_transit - before

    def _dead(self, state: LedgerState, fd: int) -> None:
        """A dead relay's ledger: counted by the telemetry process whose journal knew the relay (on a folder several
        replicas share, another replica's relay is not this journal's to count); one nobody knew is let go after
        ``STALE`` seconds."""
        relay = state.relay_id
        if relay not in self.reconciled and relay not in self.last:
            with contextlib.suppress(OSError):
                if time.time() - state.path.stat().st_mtime > STALE:
                    state.path.unlink()
            return
        if self.index < len(state.handed) and not state.read[self.index]:
            journaled = max(self.reconciled.pop(relay, (0, 0))[1], self.last.get(relay, 0))
            self._gap(state.handed[self.index] - journaled)
            if self.index == 0 and state.in_flight:
                self.in_flight += state.in_flight
                self._lost("in_flight", state.in_flight)
            # Kept (the relay no longer reconciled, the count made) before the ledger says it was read.
            self.save()
            self._flush()
            mark_read(state, fd, self.index)

    def _gap(self, n: int) -> None:
        if n <= 0:
            return
        self.in_transit += n
        self._lost("in_transit", n)
        if self._resolved and not self._said:
            self._said = True
            log.warning(
                "record journal: %d stream ends the relays handed over never reached it (in the socket or the "
                "relay's buffer when the telemetry process stopped); counted as in_transit",
                n,
            )

    def _lost(self, reason: str, n: int) -> None:
        self.counted[reason] = self.counted.get(reason, 0) + n
        self._pending.append((reason, n))

    def _flush(self) -> None:
        """Tell ``on_lost`` the counts ``sequences.json`` keeps now."""
        pending, self._pending = self._pending, []
        if self._on_lost is not None:
            for reason, n in pending:
                self._on_lost(reason, n)

    def save(self) -> None:
        """What the next start needs, kept (before segments go): once resolved, this run's last numbers as the
        reconciled ones; before, this run beside the earlier runs still to reconcile; and the counts made."""
        with self._lock:
            self._save()

    def _save(self) -> None:
        reconciled = dict(self.reconciled)
        runs = {run: dict(spans) for run, spans in self.runs.items()}
        mine = {relay: [first, self.last[relay]] for relay, first in self.first.items()}
        if self._resolved:
            reconciled.update({relay: (self.run, span[1]) for relay, span in mine.items()})
        elif mine:
            runs[self.run] = mine
        if len(reconciled) > MAX_RELAYS:
            reconciled = dict(list(reconciled.items())[-MAX_RELAYS:])
        data = {
            "run": self.run,
            "reconciled": {str(k): list(v) for k, v in reconciled.items()},
            "runs": {str(run): {str(k): v for k, v in spans.items()} for run, spans in runs.items()},
            "counted": dict(self.counted),
        }
        # One aside file per thread: the event loop's (a gap seen) and the worker's may save at once.
        aside = self.path.with_name(f"{self.path.name}.new-{threading.get_ident()}")
        with contextlib.suppress(OSError):
            aside.write_text(json.dumps(data), encoding="utf-8")
            os.replace(aside, self.path)
