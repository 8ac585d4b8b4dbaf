"""The ClickHouse record sink (``--record-clickhouse URL``), run by the telemetry process.

It takes the same records as the record file and sends them in batches over ClickHouse's HTTP interface
(``INSERT ... FORMAT JSONEachRow``, through ``llmtap.store.clickhouse.Server``) from a thread of its own: ``write``
only queues a line, so the recorder's worker never waits on the network. The queue is bounded in records and
bytes; past either bound a record is dropped and counted. While ClickHouse cannot be reached the batch in hand is
retried with a growing pause (0.5 s doubling to 30 s) and the queue fills, then drops; a batch ClickHouse answers
with an error is tried ``REJECT_ATTEMPTS`` times, then dropped and counted. Every drop is counted by reason through
``on_drop`` (``llmtap_telemetry_records_dropped_total``), every insert by outcome through ``on_insert``
(``llmtap_telemetry_clickhouse_inserts_total``). The table it writes to and its schema: ``llmtap.store.clickhouse``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from llmtap.config.types import ClickHouseRecords
from llmtap.deadline import Deadline
from llmtap.store.clickhouse import ClickHouseError, Server, create_table, table_name
from llmtap.store.clickhouse_rows import flat_row
from llmtap.worker import Progress, QueueWorker

__all__ = ["BACKOFF", "DROP_REASONS", "INSERT_OUTCOMES", "REJECT_ATTEMPTS", "ClickHouseSink", "clickhouse_sink"]

log = logging.getLogger("llmtap.telemetry")

#: Why the ClickHouse sink lost a record (reasons of ``llmtap_telemetry_records_dropped_total``):
#: ``clickhouse_queue_full`` (its queue was at its bound: ClickHouse slow or down), ``clickhouse_rejected``
#: (ClickHouse refused the batch ``REJECT_ATTEMPTS`` times), ``clickhouse_unsent`` (still queued at shutdown).
DROP_REASONS = ("clickhouse_queue_full", "clickhouse_rejected", "clickhouse_unsent")
#: Outcomes of an insert (``llmtap_telemetry_clickhouse_inserts_total``): ``ok`` or ``failed``.
INSERT_OUTCOMES = ("ok", "failed")
#: Records sent in one INSERT at most, and bytes.
BATCH_RECORDS = 10_000
BATCH_BYTES = 4 << 20
#: Seconds a record waits at most before its batch leaves while traffic flows.
FLUSH_INTERVAL = 1.0
#: The pause after a failed insert: doubles from the first to the last.
BACKOFF = (0.5, 30.0)
#: Tries of a batch ClickHouse answered with an error before it is dropped.
REJECT_ATTEMPTS = 3


class ClickHouseSink(QueueWorker[bytes]):
    """Sends records to a ClickHouse table in batches, from its own thread; ``write`` never blocks or raises.

    The queue holds ``max_records`` records and ``max_bytes`` bytes of JSON at most. ``flush`` waits (up to
    ``timeout``) until what was queued before it has been sent or dropped; ``close`` does the same, then stops
    the thread: what could not be sent in time is dropped and counted (``clickhouse_unsent``), or, with
    ``keep_unsent`` (the record journal holds every record, ``llmtap.telemetry.journal.spool``), left to the journal for
    the next start. A record is settled (``progress``) once ClickHouse took it, or it was dropped and counted.
    """

    #: Which sink this is, to the record journal.
    kind = "clickhouse"

    def __init__(
        self,
        server: Server,
        table: str,
        *,
        ttl_days: int = 30,
        max_records: int = 100_000,
        max_bytes: int = 64 << 20,
        on_drop: Callable[[str, int], None] | None = None,
        on_insert: Callable[[str, int], None] | None = None,
        backoff: tuple[float, float] = BACKOFF,
        flush_interval: float = FLUSH_INTERVAL,
        on_thread: Callable[[], None] | None = None,
        keep_unsent: bool = False,
    ) -> None:
        self.server = server
        self.keep_unsent = keep_unsent
        #: The records given and not yet sent or dropped (``llmtap.worker.Progress``).
        self.progress = Progress()
        self.table = table_name(table)
        self.ttl_days = ttl_days
        self.max_records = max_records
        self.backoff = backoff
        self.flush_interval = flush_interval
        self._on_drop = on_drop
        self._on_insert = on_insert
        self._taken = 0  # records the thread took off the queue (sent or dropped), for flush
        self._flush_wanted = False
        self._last_sent = time.monotonic()
        self._ready = False
        self._said_down = False
        self._said_invalid = False
        #: Records sent, and records lost by reason (``DROP_REASONS`` and ``invalid``).
        self.written = 0
        self.dropped: dict[str, int] = dict.fromkeys((*DROP_REASONS, "invalid"), 0)
        self.inserts: dict[str, int] = dict.fromkeys(INSERT_OUTCOMES, 0)
        self._insert_sql = f"INSERT INTO {self.table} FORMAT JSONEachRow"
        super().__init__(
            "llmtap-clickhouse", max_items=max_records, max_bytes=max_bytes, start=True, on_thread=on_thread
        )

    # -- the recorder's side (any thread) --

    def write(self, record: Mapping[str, Any]) -> None:
        """Queue one record; dropped and counted when the queue is at its bound."""
        try:
            row = flat_row(record)
            line = (json.dumps(row, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode()
        except (ValueError, TypeError) as exc:
            row, line = None, b""
            if not self._said_invalid:
                self._said_invalid = True
                log.warning("ClickHouse records: a record could not be written as JSON (%s); such are counted", exc)
        if row is None:
            self.progress.settle_now()
            self._drop("invalid", 1)
            return
        self.progress.hold()
        if not self._put(line, len(line)):
            self.progress.withdraw()

    def _wake_now(self) -> bool:
        return len(self._queue) == 1 or self._bytes >= BATCH_BYTES or len(self._queue) >= BATCH_RECORDS

    def _dropped(self, items: list[bytes], why: str) -> None:
        if why == "unsent":
            with self._cond:
                self._taken += len(items)
            if self.keep_unsent:
                return  # still held: the journal keeps them for the next start
            self.progress.release(len(items))
        self._drop("clickhouse_queue_full" if why == "full" else "clickhouse_unsent", len(items))

    def flush(self) -> None:
        """Ask the thread to send what is queued now; returns at once (the recorder calls it when idle)."""
        with self._cond:
            if self._queue:
                self._flush_wanted = True
                self._cond.notify()

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every record queued so far was sent or dropped; True when that happened in time."""
        deadline = Deadline(timeout)
        with self._cond:
            target = self._put_count
            self._flush_wanted = True
            self._cond.notify()
            while self._taken < target:
                left = deadline.left()
                if left <= 0 or not self._alive():
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (within ``timeout``; not at all while ClickHouse is away, so a shutdown does not
        wait on it), then stop, both within the one ``timeout``; the rest is dropped and counted."""
        deadline = Deadline(timeout)
        if not self._said_down:
            self.drain(timeout)
        self._stop(deadline.left())

    # -- the sink's thread --

    def _serve(self) -> None:
        pause = self.backoff[0]
        attempts = 0
        while True:
            with self._cond:
                while not self._closed and not self._due():
                    idle = time.monotonic() - self._last_sent
                    self._cond.wait(max(self.flush_interval - idle, 0.01) if self._queue else None)
                if self._closed:
                    return
                self._flush_wanted = False
                batch = self._batch()
            try:
                if not self._ready:
                    said = create_table(self.server, self.table, self.ttl_days)
                    log.info("ClickHouse records: %s", said)
                    self._ready = True
                self.server.query(self._insert_sql, b"".join(batch), settings={"input_format_skip_unknown_fields": 1})
            except ClickHouseError as exc:
                self._count_insert("failed")
                attempts += 1
                if exc.reachable and attempts >= REJECT_ATTEMPTS and self._ready:
                    log.warning(
                        "ClickHouse records: %d records refused %d times (%s); dropped and counted",
                        len(batch),
                        attempts,
                        exc,
                    )
                    self._done(batch)
                    self._drop("clickhouse_rejected", len(batch))
                    attempts, pause = 0, self.backoff[0]
                    continue
                if not self._said_down:
                    self._said_down = True
                    log.warning(
                        "ClickHouse records: cannot write to %s (%s); retrying, records queue up to %d "
                        "and past that are dropped and counted (llmtap_telemetry_records_dropped_total)",
                        self.server.url,
                        exc,
                        self.max_records,
                    )
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, pause)
                pause = min(pause * 2, self.backoff[1])
                continue
            except Exception:  # never let the thread die: a bug here must not stop the records
                log.exception("ClickHouse records: an insert failed")
                self._count_insert("failed")
                self._done(batch)
                self._drop("clickhouse_rejected", len(batch))
                continue
            self._count_insert("ok")
            if self._said_down:
                self._said_down = False
                log.warning("ClickHouse records: %s takes records again", self.server.url)
            attempts, pause = 0, self.backoff[0]
            self.written += len(batch)
            self._done(batch)

    def _due(self) -> bool:
        """A batch should leave: records wait, and a flush was asked, a batch is full or the interval passed."""
        return bool(self._queue) and (
            self._flush_wanted
            or self._bytes >= BATCH_BYTES
            or len(self._queue) >= BATCH_RECORDS
            or time.monotonic() - self._last_sent >= self.flush_interval
        )

    def _batch(self) -> list[bytes]:
        """The oldest records, up to a batch; they stay queued (counted) until ``_done``."""
        out: list[bytes] = []
        size = 0
        for line, _ in self._queue:
            if out and (len(out) >= BATCH_RECORDS or size + len(line) > BATCH_BYTES):
                break
            out.append(line)
            size += len(line)
        return out

    def _done(self, batch: list[bytes]) -> None:
        self.progress.release(len(batch))
        with self._cond:
            self._pop(len(batch))
            self._taken += len(batch)
            self._last_sent = time.monotonic()
            self._cond.notify_all()

    def _drop(self, reason: str, n: int) -> None:
        if not n:
            return
        self.dropped[reason] += n
        if self._on_drop is not None:
            self._on_drop(reason, n)

    def _count_insert(self, outcome: str) -> None:
        self.inserts[outcome] += 1
        if self._on_insert is not None:
            self._on_insert(outcome, 1)


def clickhouse_sink(
    settings: ClickHouseRecords,
    on_drop: Callable[[str, int], None] | None = None,
    on_insert: Callable[[str, int], None] | None = None,
    on_thread: Callable[[], None] | None = None,
    keep_unsent: bool = False,
) -> ClickHouseSink:
    """The sink ``--record-clickhouse`` asks for; every drop reason and insert outcome counted 0 from the start.

    ``on_thread`` runs first on the sink's thread (``llmtap.telemetry.sched.idle_here`` in the telemetry process).
    """
    server = Server.parse(settings.url, user=settings.user, password=settings.password)
    for reason in DROP_REASONS:
        if on_drop is not None:
            on_drop(reason, 0)
    for outcome in INSERT_OUTCOMES:
        if on_insert is not None:
            on_insert(outcome, 0)
    return ClickHouseSink(
        server,
        settings.table,
        ttl_days=settings.ttl_days,
        max_records=settings.max_records,
        max_bytes=settings.max_bytes,
        on_drop=on_drop,
        on_insert=on_insert,
        on_thread=on_thread,
        keep_unsent=keep_unsent,
    )
