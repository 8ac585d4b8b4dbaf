"""The fault suite's ledger: requests sent, records read back, and every loss llmtap counted.

DESIGN.md, "Records are never lost silently": each fault must end with a record for every request sent, or the
difference counted on a ``/metrics`` counter and said in the log with its cause. The ledger holds the three
sides of that sum:

- requests sent, counted by the client (``tests.support.fault_load``: answered or cut, never a refused one);
- records, read with llmtap's own reader (``llmtap.store.files``) and counted once per (trace id, span id):
  an at-least-once replay may write a record twice;
- losses, read from ``/metrics`` as Prometheus' ``increase()`` reads a counter: scraped every fraction of a
  second, each series' rises summed, a fall taken as a reset from zero (llmtap's loss counters go on across a
  telemetry restart, so a restart alone is no reset).

``python -m tests.support.fault_ledger FILE`` prints the table of the ledgers a run wrote to FILE
(``LLMTAP_FAULT_TABLE``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from llmtap.store.files import ReadStats, read_records
from tests.support.fault_load import Outcome

#: Tapes that never became a request, so no sink has its record (``llmtap.telemetry.intake.relays``): every reason of
#: this counter but those of a tape that lost a part and still made its record (so a reason llmtap adds, such as a
#: journal's ``in_transit``, counts as a whole tape lost).
TAPES = "llmtap_telemetry_tapes_dropped_total"
PARTIAL_TAPE_REASONS = ("partial", "inflate_limit", "body_limit")
#: Records a sink could not keep, by reason.
RECORDS = "llmtap_telemetry_records_dropped_total"
#: Each sink's own reasons: a record one sink lost another may hold.
SINK_REASONS = {
    "files": ("no_space", "io_error", "invalid"),
    "logs": ("otlp_queue_full", "otlp_export_failed"),
    "clickhouse": ("clickhouse_queue_full", "clickhouse_rejected", "clickhouse_unsent"),
}
REASON = "llmtap_telemetry_reason"
#: When the telemetry process serving ``/metrics`` started (Unix seconds), where llmtap says it.
START_TIME = "llmtap_telemetry_start_time"
#: Where a run appends its ledgers (JSON lines), for the table.
TABLE_ENV = "LLMTAP_FAULT_TABLE"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page by (name, labels); exemplars and comments left out."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            out[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = float(value)
        except ValueError:
            continue
    return out


class Counters:
    """``/metrics`` scraped every ``every`` seconds in a thread; each counter's increase summed across resets.

    ``urls`` is called at each scrape: an llmtap started again answers on its new admin port. Scrapes that fail
    (llmtap down, or starting) are passed over, as Prometheus passes over a target that is down."""

    def __init__(self, urls: Callable[[], Iterable[str]], every: float = 0.25) -> None:
        self._urls = urls
        self.every = every
        self.resets = 0
        self.restarts = 0
        self.scrapes = 0
        #: Each scrape's loss counters as read (seconds since the first, then the nonzero samples): how a sum came.
        self.history: list[tuple[float, dict[str, float]]] = []
        self._last: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        self._started: dict[str, float | None] = {}
        self._total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Counters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.scrape()

    def scrape(self) -> None:
        """Read each target's page once now and add what rose since its last page."""
        for url in list(self._urls()):
            try:
                text = httpx.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            self._add(url, samples(text))

    def _add(self, url: str, page: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
        now = time.monotonic()
        losses = {
            f"{n.removeprefix('llmtap_telemetry_')}:{dict(ls).get(REASON, '')}": v
            for (n, ls), v in page.items()
            if n in (TAPES, RECORDS) and v
        }
        started = next((v for (n, _), v in page.items() if n.startswith(START_TIME)), None)
        with self._lock:
            self._t0 = self._t0 or now
            self.history.append((round(now - self._t0, 2), losses))
            self.scrapes += 1
            last = self._last.setdefault(url, {})
            # A telemetry process that says when it started: a new start, noted. Its loss counters go on from the last
            # run's totals (``llmtap.telemetry.journal.losses``), so, as for Prometheus' ``increase()``, only a fall is
            # a reset.
            if started is not None and self._started.get(url, started) != started:
                self.restarts += 1
            self._started[url] = started
            for key, value in page.items():
                if not key[0].endswith("_total"):
                    continue
                before = last.get(key)
                if before is None or value < before:  # new, or its process started again: from zero
                    self.resets += before is not None
                    rise = value
                else:
                    rise = value - before
                self._total[key] = self._total.get(key, 0.0) + rise
                last[key] = value

    def value(self, name: str, **labels: str) -> float:
        """The summed increase of ``name``'s series whose labels include ``labels``."""
        with self._lock:
            return sum(v for (n, ls), v in self._total.items() if n == name and set(labels.items()) <= set(ls))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The summed increase of ``name`` by the value of ``label``."""
        out: dict[str, float] = {}
        with self._lock:
            for (n, ls), v in self._total.items():
                if n == name:
                    key = dict(ls).get(label, "")
                    out[key] = out.get(key, 0.0) + v
        return out

    def losses(self, sink: str) -> dict[str, int]:
        """Records of ``sink`` counted as lost, by counter and reason: whole tapes, and the records-dropped reasons
        that are not another sink's own (so a reason llmtap adds, such as a journal's, counts for every sink)."""
        others = {r for s, rs in SINK_REASONS.items() if s != sink for r in rs}
        out = {f"tape:{r}": int(v) for r, v in self.by_label(TAPES, REASON).items() if r not in PARTIAL_TAPE_REASONS}
        out |= {f"record:{r}": int(v) for r, v in self.by_label(RECORDS, REASON).items() if r not in others}
        return {k: v for k, v in out.items() if v}


@dataclass(slots=True)
class Records:
    """Records read back: distinct (trace id, span id) by trace id, and the extra copies."""

    traces: dict[str, set[str]] = field(default_factory=dict)
    copies: int = 0
    stats: ReadStats = field(default_factory=ReadStats)

    def add(self, trace_id: Any, span_id: Any) -> None:
        spans = self.traces.setdefault(str(trace_id), set())
        if span_id in spans:
            self.copies += 1
        spans.add(str(span_id))


def read_folder(folder: Path) -> Records:
    """The records in a record folder, through llmtap's reader (which counts a record read twice once, as a skipped
    ``duplicate``: a copy all the same)."""
    out = Records()
    for record in read_records(folder, out.stats):
        out.add(record.get("trace_id"), record.get("span_id"))
    skips = getattr(out.stats, "skips", None)  # a reader of an earlier version counted nothing it skipped
    out.copies += skips.counts.get("duplicate", 0) if skips is not None else 0
    return out


@dataclass
class Ledger:
    """One fault's account: requests sent, records kept, losses counted, and what is left over."""

    fault: str
    sink: str
    answered: int
    cut: int
    refused: int
    recorded: int
    copies: int
    foreign: int
    counted: dict[str, int]
    said: list[str]
    notes: dict[str, Any] = field(default_factory=dict)
    #: Requests cut before any answer with no record: whether they reached llmtap at all the client cannot tell (a
    #: kill takes the bytes of a request not yet read with it), so llmtap may count them or not.
    unsure: int = 0
    published: bool = field(default=False, repr=False, compare=False)

    @property
    def sent(self) -> int:
        return self.answered + self.cut

    @property
    def lost(self) -> int:
        return self.sent - self.recorded

    @property
    def counted_lost(self) -> int:
        return sum(self.counted.values())

    @property
    def uncounted(self) -> int:
        """Requests sent with no record and no count (negative: more counted lost than were missing)."""
        return self.lost - self.counted_lost

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        del out["published"]
        out |= {"sent": self.sent, "lost": self.lost, "counted_lost": self.counted_lost, "uncounted": self.uncounted}
        return out

    def publish(self) -> None:
        """Print the ledger, and append it to the table file when the run names one (once)."""
        if self.published:
            return
        self.published = True
        line = json.dumps(self.row(), sort_keys=True)
        print(f"\nLEDGER {line}")
        path = os.environ.get(TABLE_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")


def ledger(
    fault: str,
    sink: str,
    outcomes: list[Outcome],
    kept: dict[str, set[str]],
    counters: Counters,
    log: str,
    copies: int = 0,
) -> Ledger:
    """The ledger of ``outcomes`` (every request the client began) against the records ``kept`` (span ids by trace
    id) and the losses ``counters`` summed for ``sink``; ``log``: llmtap's log, for the lines that say a loss;
    ``copies``: records the sink holds twice (an at-least-once replay), each counted once.

    A refused request that has a record did reach llmtap after all: it counts as sent (cut)."""
    by_trace = {o.trace_id: o for o in outcomes}
    kinds = {"answered": 0, "cut": 0, "refused": 0}
    for o in outcomes:
        kind = "cut" if o.kind == "refused" and o.trace_id in kept else o.kind
        kinds[kind] += 1
    recorded = sum(1 for t in by_trace if kept.get(t))
    foreign = sum(1 for t in kept if t not in by_trace)
    book = Ledger(
        fault, sink, kinds["answered"], kinds["cut"], kinds["refused"], recorded, copies, foreign,
        counters.losses(sink), loss_lines(log),
    )  # fmt: skip
    # How the requests without a record ended, for whoever reads a failed verdict: "answered 200" or the error.
    missing = collections.Counter(
        f"{o.kind} {o.status or ''} {(o.error or '').split('(')[0]}".strip()
        for o in outcomes
        if o.kind != "refused" and not kept.get(o.trace_id)
    )
    book.notes = {"without_record": dict(missing)} if missing else {}
    book.unsure = sum(1 for o in outcomes if o.kind == "cut" and o.status is None and not kept.get(o.trace_id))
    return book


#: A log line that says how many records (spans, tapes, rows) were lost: a count next to what was counted, and a
#: word of loss.
_COUNT = re.compile(r"\b\d+\s+(?:\w+\s+){0,3}?(?:records?|spans?|tapes?|rows?|requests?)\b", re.IGNORECASE)
_LOSS = re.compile(r"\b(?:lost|dropped|not recovered|could not|unsent|never|missing)\b", re.IGNORECASE)


def loss_lines(log: str) -> list[str]:
    """The lines of ``log`` that say a count of records (spans, tapes, rows) lost."""
    return [line.strip() for line in log.splitlines() if _COUNT.search(line) and _LOSS.search(line)]


def changes(history: list[tuple[float, dict[str, float]]]) -> list[tuple[float, dict[str, float]]]:
    """The scrapes whose loss counters differ from the scrape before (for a ledger's notes)."""
    out: list[tuple[float, dict[str, float]]] = []
    last: dict[str, float] | None = None
    for at, losses in history:
        if losses != last:
            out.append((at, losses))
            last = losses
    return out


def check(book: Ledger) -> None:
    """The fault's verdict: every request sent has its record, or its loss is counted (neither fewer nor more than are
    missing, but for ``unsure`` ones) and said in the log; and no record of a request that was never sent."""
    book.publish()
    assert book.foreign == 0, f"{book.foreign} records of requests never sent"
    assert 0 <= book.uncounted <= book.unsure, f"{book.fault}: {book.uncounted} lost without a count; {book.row()}"
    if book.counted_lost:
        assert book.said, f"{book.fault}: {book.counted_lost} counted lost, and no log line says so; {book.row()}"


COLUMNS = ("fault", "sink", "sent", "recorded", "counted_lost", "uncounted", "unsure", "cut", "copies")


def table(rows: Iterable[dict[str, Any]]) -> str:
    """A Markdown table of ledgers."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    rows = [json.loads(line) for path in argv for line in Path(path).read_text().splitlines() if line.strip()]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
