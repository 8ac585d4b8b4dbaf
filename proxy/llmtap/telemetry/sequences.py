"""What never reached the record journal: the relays' stream ends, counted by their sequence numbers.

Issue 44. Each relay numbers the stream ends it hands to each telemetry process, 1, 2, 3, ... (``End.seq``, only
once the channel took the end: one it refused is counted dropped by the relay itself). The journal
(``llmtap.telemetry.spool``) notes the last number it saw of each relay; so a gap is an end that the relay handed
over and the journal never got: in the socket, or in the relay's gather, when the telemetry process was killed
(or its connection lost). Counted as tapes dropped, ``in_transit``.

Across a restart of the telemetry process: the last run's numbers are in its segments (read by the replay) and,
for those already deleted, in the slot's ``relays`` file (``save``, before any segment is deleted); a relay's first
end in this run is compared with them once they are known (``resolve``). Across a kill of the whole tree: the
dead relays' ledgers (``llmtap.wire.ledger``) say what each handed over last and how many requests it was still
relaying (``in_flight``: their tapes never left it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from llmtap.wire.ledger import LedgerState, dead, mark_read

__all__ = ["Sequences"]

log = logging.getLogger("llmtap.telemetry")

#: Relays whose last number is remembered at most (the oldest forgotten first).
MAX_RELAYS = 4096
#: Seconds after which a dead relay's ledger that no journal here knew is removed.
STALE = 3600.0


def _load(path: Path) -> dict[int, int]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {int(k): int(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


class Sequences:
    """Per relay, the last stream end the journal saw, of the last run and of this one; the gaps, counted.

    ``seen`` runs under the journal's lock (the event loop's thread); the rest on the recorder's worker."""

    def __init__(self, path: Path, index: int, on_lost: Callable[[str, int], None] | None = None) -> None:
        self.path = path
        self.index = index
        self._on_lost = on_lost
        #: The last run's (complete once ``resolve`` ran), and this run's, last number per relay.
        self.old = _load(path)
        self.last: dict[int, int] = {}
        self._first: dict[int, int] = {}
        self._resolved = False
        #: Ends the journal never got, and requests dead relays were relaying, counted so far.
        self.in_transit = 0
        self.in_flight = 0
        self._said = False

    def seen(self, relay: int, seq: int) -> None:
        """Relay ``relay``'s ``seq``-th end reached the journal."""
        last = self.last.get(relay)
        if last is None:
            self._first[relay] = seq
            if self._resolved:
                self._gap(seq - self.old.get(relay, seq - 1) - 1)
        elif seq > last + 1:
            self._gap(seq - last - 1)  # a connection lost and made again: what was on its way went with it
        if last is None or seq > last:
            self.last[relay] = seq

    def seen_old(self, relay: int, seq: int) -> None:
        """The replay read relay ``relay``'s ``seq``-th end in the last run's segments."""
        if seq > self.old.get(relay, 0):
            self.old[relay] = seq

    def resolve(self) -> tuple[int, int]:
        """The last run's numbers are all known: the gaps to this run's first ends, and what the dead relays'
        ledgers say never reached the journal. Returns (``in_transit``, ``in_flight``) found now."""
        before = self.in_transit
        self._resolved = True
        for relay, first in self._first.items():
            if relay in self.old:
                self._gap(first - self.old[relay] - 1)
        for state, fd in dead(self.path.parent.parent):
            try:
                self._dead(state, fd)
            finally:
                os.close(fd)
        return self.in_transit - before, self.in_flight

    def _dead(self, state: LedgerState, fd: int) -> None:
        """A dead relay's ledger: counted by the telemetry process whose journal knew the relay (on a folder several
        replicas share, another replica's relay is not this journal's to count); one nobody knew is let go after
        ``STALE`` seconds."""
        relay = state.relay_id
        if relay not in self.old and relay not in self.last:
            with contextlib.suppress(OSError):
                if time.time() - state.path.stat().st_mtime > STALE:
                    state.path.unlink()
            return
        if self.index < len(state.handed) and not state.read[self.index]:
            journaled = max(self.old.pop(relay, 0), self.last.get(relay, 0))
            self._gap(state.handed[self.index] - journaled)
            if self.index == 0 and state.in_flight:
                self.in_flight += state.in_flight
                self._lost("in_flight", state.in_flight)
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
        if self._on_lost is not None:
            self._on_lost(reason, n)

    def save(self) -> None:
        """The last numbers, this run's over the last run's, kept for the next start (before segments go)."""
        merged = {**self.old, **self.last}
        if len(merged) > MAX_RELAYS:
            merged = dict(list(merged.items())[-MAX_RELAYS:])
        aside = self.path.with_name(self.path.name + ".new")
        with contextlib.suppress(OSError):
            aside.write_text(json.dumps({str(k): v for k, v in merged.items()}), encoding="utf-8")
            os.replace(aside, self.path)
