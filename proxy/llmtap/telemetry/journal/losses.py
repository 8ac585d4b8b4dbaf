"""Every loss a telemetry process counts: kept across its restarts, and said in the log with its count.

Counters that survive a restart. The loss counters (``llmtap_telemetry_tapes_dropped_total`` and
``llmtap_telemetry_records_dropped_total`` by reason, ``llmtap_telemetry_records_recovered_total``) and, per relay
(its random id, ``llmtap.wire.ledger.new_relay_id``), the last cumulative ``channel_full`` total it reported are kept
in ``counters.json`` in the process's journal slot (``llmtap.telemetry.journal.files.Slot``). It is written aside and
renamed in place (a kill leaves the old file or the new one, never half of one), at most every ``SAVE_EVERY``
seconds while counts change, at once after a count the journal is about to acknowledge (a gap of stream ends, the
last run's records recovered or lost: the next start must not count them again or forget them), and at shutdown.
A process started on the same slot adds those totals to its counters before it counts anything, so the counters
only grow across telemetry restarts, and a relay that sends its totals again adds only what rose since the total
kept (a relay started again has a new id, and counts from 0). What a kill takes is at most the counts of the last
``SAVE_EVERY`` seconds of losses the process made itself; a relay's are sent again. Without a journal folder
(``--record-journal`` off) nothing is kept: the counters start from 0 and ``llmtap_telemetry_start_time_seconds``
says so.

Said with its count. Each cause of loss gets a line when it first loses something and at most one every
``SAY_EVERY`` seconds after that ("12 records lost (no_space) in the last 10.0 s; 130 since start"), and a last one at
shutdown for every cause that lost anything since start.
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

from opentelemetry.metrics import Counter

__all__ = [
    "SAVE_EVERY",
    "SAY_EVERY",
    "STATE_FILE",
    "Losses",
]

log = logging.getLogger("llmtap.telemetry")

#: The state file's name in the journal slot.
STATE_FILE = "counters.json"
#: Seconds between two writes of the state file while counts change.
SAVE_EVERY = 0.5
#: Seconds between two log lines of one cause.
SAY_EVERY = 10.0
#: Relays whose last total is kept at most (the one heard from longest ago forgotten first).
MAX_RELAYS = 4096
#: Reasons of the tapes counter that lose no record (timing made without some bytes): said as kept in part.
PARTIAL = frozenset({"partial", "inflate_limit", "body_limit"})

#: A counter's kind as the state file and the log lines name it: what it counts, in the plural.
NOUNS = {"tapes": "tapes", "records": "records", "recovered": "records", "spans": "spans"}

Key = tuple[str, str]


class Losses:
    """The loss counters' totals (kept across restarts when ``keep`` names a file), and the log lines that say them.

    ``add`` and ``relay`` may run on any thread; a thread of its own writes the file and says the lines."""

    def __init__(self, counters: dict[str, Counter], reason: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._counters = counters
        self._reason = reason
        self._clock = clock
        self._lock = threading.Lock()
        #: Totals since the first start (the seed kept, and what this process counted).
        self.totals: dict[Key, int] = {}
        #: What this process counted since it started, and since each cause was last said.
        self.since_start: dict[Key, int] = {}
        self._unsaid: dict[Key, int] = {}
        self._said_at: dict[Key, float] = {}
        self._relays: dict[int, int] = {}
        #: Per mark, how much of the totals came through ``add`` with that mark, since the first start: what another
        #: file's own count of the same losses is compared with at start (``llmtap.telemetry.journal.sequences``).
        self.marks: dict[str, int] = {}
        #: Counts read from elsewhere (the span exporter's gate): by kind, a function giving totals by reason.
        self._watched: dict[str, Callable[[], dict[str, int]]] = {}
        self._seen: dict[Key, int] = {}
        self._path: Path | None = None
        self._dirty = False
        self._saved_at = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = clock()

    # -- counting ---------------------------------------------------------------------------------------------------

    def add(self, kind: str, reason: str, n: int, *, sync: bool = False, mark: str | None = None) -> None:
        """Count ``n`` of ``kind`` lost (or recovered) for ``reason``; ``sync``: the file is written before this
        returns (what the caller acknowledges next must not be counted again, or forgotten, after a kill); ``mark``:
        ``n`` is added to that mark too, in the same write of the file."""
        with self._lock:
            self._count(kind, reason, n)
            if mark is not None and n:
                self.marks[mark] = self.marks.get(mark, 0) + n
            if sync and n:
                self._save_locked()

    def relay(self, relay: int, total: int) -> int:
        """Relay ``relay`` says it dropped ``total`` tapes since it started (its channel full): the rise since the total
        last kept for it is counted (all of it when it is lower: the relay started again); returns the rise."""
        with self._lock:
            before = self._relays.pop(relay, 0)
            rise = total - before if total >= before else total
            self._relays[relay] = total
            while len(self._relays) > MAX_RELAYS:
                del self._relays[next(iter(self._relays))]
            self._count("tapes", "channel_full", max(rise, 0))
            return max(rise, 0)

    def _count(self, kind: str, reason: str, n: int) -> None:
        key = (kind, reason)
        counter = self._counters.get(kind)
        if counter is not None:
            attrs = {self._reason: reason} if kind != "recovered" else None
            try:
                counter.add(n, attrs)
            except Exception:
                log.debug("telemetry: could not count %s %s", kind, reason, exc_info=True)
        self.totals[key] = self.totals.get(key, 0) + n
        if n:
            self.since_start[key] = self.since_start.get(key, 0) + n
            self._unsaid[key] = self._unsaid.get(key, 0) + n
            self._dirty = True

    def watch(self, kind: str, totals: Callable[[], dict[str, int]]) -> None:
        """Say the losses ``totals`` gives (by reason, counted elsewhere since this process started) too."""
        self._watched[kind] = totals

    # -- the state file ---------------------------------------------------------------------------------------------

    def keep(self, path: Path) -> None:
        """Keep the totals in ``path`` from now on, and start from the totals a last run left there."""
        data = _load(path)
        with self._lock:
            self._path = path
            try:
                for kind, reasons in data.get("counts", {}).items():
                    for reason, n in reasons.items():
                        self._seed(str(kind), str(reason), int(n))
                for relay, total in data.get("relays", {}).items():
                    self._relays[int(relay)] = int(total)
                for mark, n in data.get("marks", {}).items():
                    self.marks[str(mark)] = int(n)
                unsaid = [
                    f"{int(n)} {NOUNS.get(str(kind), str(kind))} lost ({reason})"
                    for kind, reasons in data.get("unsaid", {}).items()
                    for reason, n in reasons.items()
                    if int(n) > 0 and kind != "recovered"
                ]
            except (AttributeError, TypeError, ValueError) as exc:
                log.warning("telemetry: loss counters of the last run partly unreadable (%s)", exc)
                unsaid = []
            self._save_locked()
        if data:
            log.info("telemetry: loss counters go on from the last run's (%s)", path)
        if unsaid:
            # Counted by a run killed before its next line: said now, so that no counted loss goes unsaid.
            log.warning("telemetry: the last run counted and was stopped before it said: %s", "; ".join(unsaid))

    def _seed(self, kind: str, reason: str, n: int) -> None:
        counter = self._counters.get(kind)
        if n <= 0 or counter is None:
            return
        with contextlib.suppress(Exception):
            counter.add(n, {self._reason: reason} if kind != "recovered" else None)
        self.totals[(kind, reason)] = self.totals.get((kind, reason), 0) + n

    def save(self) -> None:
        """Write the file now (when there is one)."""
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        self._dirty = False
        self._saved_at = self._clock()
        if self._path is None:
            return
        counts: dict[str, dict[str, int]] = {}
        for (kind, reason), n in self.totals.items():
            if n:
                counts.setdefault(kind, {})[reason] = n
        unsaid: dict[str, dict[str, int]] = {}
        for (kind, reason), n in self._unsaid.items():
            if n and kind in self._counters:
                unsaid.setdefault(kind, {})[reason] = n
        data = {
            "counts": counts,
            "relays": {str(k): v for k, v in self._relays.items()},
            "unsaid": unsaid,
            "marks": dict(self.marks),
        }
        aside = self._path.with_name(self._path.name + ".new")
        try:
            aside.write_text(json.dumps(data), encoding="utf-8")
            os.replace(aside, self._path)
        except OSError as exc:
            # A full disk: the counts are on /metrics still; the file catches up when it can.
            self._dirty = True
            log.debug("telemetry: loss counters not written to %s (%s)", self._path, exc)

    # -- the thread: the file, and the lines ------------------------------------------------------------------------

    def start(self) -> None:
        """Write the file and say the lines on a thread of its own from now on."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmtap-losses", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAVE_EVERY):
            try:
                self.tick()
            except Exception:
                log.debug("telemetry: loss bookkeeping failed", exc_info=True)

    def tick(self, *, final: bool = False) -> None:
        """Write the file if counts changed, and say each cause that is due (``final``: every one with a loss)."""
        self._read_watched()
        with self._lock:
            if self._dirty:
                self._save_locked()
            lines = self._due(final)
        for line in lines:
            log.warning("%s", line)

    def _read_watched(self) -> None:
        for kind, totals in list(self._watched.items()):
            try:
                now = totals()
            except Exception:
                continue
            with self._lock:
                for reason, n in now.items():
                    key = (kind, reason)
                    rise = n - self._seen.get(key, 0)
                    if rise > 0:
                        self._seen[key] = n
                        self.since_start[key] = self.since_start.get(key, 0) + rise
                        self._unsaid[key] = self._unsaid.get(key, 0) + rise

    def _due(self, final: bool) -> list[str]:
        now = self._clock()
        lines = []
        for key, n in sorted(self._unsaid.items()):
            since = self._said_at.get(key)
            if not n or (not final and since is not None and now - since < SAY_EVERY):
                continue
            kind, reason = key
            window = now - (since if since is not None else self._start)
            lines.append(_line(kind, reason, n, window, self.since_start.get(key, n), final))
            self._unsaid[key] = 0
            self._said_at[key] = now
            self._dirty = True  # said: the next start need not say it again
        return lines

    def close(self) -> None:
        """Stop the thread, write the file and say what was not said yet (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.tick(final=True)


def _line(kind: str, reason: str, n: int, window: float, total: int, final: bool) -> str:
    noun = NOUNS.get(kind, kind)
    if kind == "recovered":
        what = f"{n} {noun} of the last run recovered"
    elif kind == "tapes" and reason in PARTIAL:
        what = f"{n} {noun} made telemetry in part only ({reason})"
    else:
        what = f"{n} {noun} lost ({reason})"
    when = "at shutdown, since the last line" if final else f"in the last {window:.1f} s"
    return f"telemetry: {what} {when}; {total} since start"


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("telemetry: loss counters of the last run unreadable (%s): counting from 0", exc)
        return {}
    return data if isinstance(data, dict) else {}
