"""Request records in ClickHouse: the table (``clickhouse.sql``), a record sink, and the flat columns analysis reads.

The sink (``ClickHouseSink``, ``--record-clickhouse URL``) takes the same records as the record file and sends
them in batches over ClickHouse's HTTP interface (``INSERT ... FORMAT JSONEachRow``) from a thread of its own:
``write`` only queues a line, so the recorder's worker never waits on the network. The queue is bounded in
records and bytes; past either bound a record is dropped and counted. While ClickHouse cannot be reached the
batch in hand is retried with a growing pause (0.5 s doubling to 30 s) and the queue fills, then drops; a batch
ClickHouse answers with an error is tried ``REJECT_ATTEMPTS`` times, then dropped and counted. Every drop is
counted by reason through ``on_drop`` (``llmtap_telemetry_records_dropped_total``), every insert by outcome
through ``on_insert`` (``llmtap_telemetry_clickhouse_inserts_total``).

The table keeps one row per record in the end (issue 44: a journal replays records at least once): it is a
``ReplacingMergeTree`` whose sorting key ends with ``record_id``, the record's trace and span ids (a record
without both gets a random one, so it is never taken for another). Reading the table back, each record once, is
``llmtap.store.clickhouse_read``. Only the standard library is used: ClickHouse's HTTP interface is plain HTTP.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtap.config.types import ClickHouseRecords, ConfigError
from llmtap.store.clickhouse_rows import DDL_FILE, column_kinds, flat_row, record_id
from llmtap.worker import Progress, QueueWorker

__all__ = [
    "DDL_FILE",
    "DROP_REASONS",
    "TTL_SINCE",
    "ClickHouseError",
    "ClickHouseSink",
    "Server",
    "add_missing_columns",
    "clickhouse_sink",
    "column_kinds",
    "create_table",
    "ddl",
    "flat_row",
    "record_id",
    "server_from_env",
    "table_engine",
    "table_name",
]

log = logging.getLogger("llmtap.telemetry")

#: The ClickHouse release that first took ``TTL`` (older ones keep rows until they are deleted by hand).
TTL_SINCE = (19, 6)
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
#: Seconds an HTTP request to ClickHouse may take.
TIMEOUT = 10.0
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


class ClickHouseError(Exception):
    """ClickHouse could not be reached (``reachable`` False) or answered with an error."""

    def __init__(self, message: str, *, reachable: bool) -> None:
        super().__init__(message)
        self.reachable = reachable


def table_name(name: str) -> str:
    """A table name as the DDL takes it (``table`` or ``database.table``); ``ConfigError`` otherwise."""
    if not _NAME.fullmatch(name):
        raise ConfigError(f"ClickHouse table {name!r}: expected a name like llmtap_records or db.llmtap_records")
    return name


def ddl(table: str) -> str:
    """The CREATE TABLE statement of ``clickhouse.sql`` for ``table`` (its comments left out)."""
    text = DDL_FILE.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(lines).replace("{table}", table_name(table)).strip() + "\n"


def ttl_statement(table: str, days: int) -> str:
    """The ALTER that keeps rows ``days`` days (ClickHouse 19.6 and later)."""
    return f"ALTER TABLE {table_name(table)} MODIFY TTL time + INTERVAL {int(days)} DAY"


@dataclass(frozen=True, slots=True)
class Server:
    """A ClickHouse HTTP endpoint and who to be there."""

    url: str
    user: str | None = None
    password: str | None = None
    timeout: float = TIMEOUT

    @classmethod
    def parse(cls, url: str, *, user: str | None = None, password: str | None = None) -> Server:
        """From ``http(s)://[user[:password]@]host:port[/]``; ``user``/``password`` given here win over the URL's."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"ClickHouse URL {url!r}: expected http://host:8123 (its HTTP interface)")
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if parts.port is not None:
            netloc += f":{parts.port}"
        base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", "", ""))
        url_user = urllib.parse.unquote(parts.username) if parts.username else None
        url_password = urllib.parse.unquote(parts.password) if parts.password else None
        return cls(base, user or url_user, password if password is not None else url_password)

    def query(self, sql: str, body: bytes = b"", settings: Mapping[str, Any] | None = None) -> bytes:
        """Run ``sql`` (with ``body`` after it, as INSERT data); the answer's bytes."""
        params = {"query": sql, **{k: str(v) for k, v in (settings or {}).items()}}
        request = urllib.request.Request(self.url + "?" + urllib.parse.urlencode(params), data=body, method="POST")
        if self.user is not None:
            token = base64.b64encode(f"{self.user}:{self.password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read(2048).decode("utf-8", "replace").strip()
            # A proxy or load balancer in front says 502-504 when ClickHouse behind it is away.
            raise ClickHouseError(f"HTTP {exc.code}: {detail}", reachable=exc.code not in (502, 503, 504)) from None
        except (OSError, urllib.error.URLError) as exc:
            raise ClickHouseError(f"{self.url}: {getattr(exc, 'reason', exc)}", reachable=False) from None

    def version(self) -> tuple[int, int]:
        """The server's release, as (major, minor)."""
        text = self.query("SELECT version()").decode().strip()
        match = re.match(r"(\d+)\.(\d+)", text)
        if not match:
            raise ClickHouseError(f"unexpected version {text!r}", reachable=True)
        return int(match.group(1)), int(match.group(2))


def server_from_env(url: str, env: Mapping[str, str] | None = None) -> Server:
    """The server at ``url``, its user and password from ``LLMTAP_RECORD_CLICKHOUSE_USER`` and
    ``LLMTAP_RECORD_CLICKHOUSE_PASSWORD`` (or ``..._PASSWORD_FILE``) when set, else the URL's."""
    env = os.environ if env is None else env
    password = env.get("LLMTAP_RECORD_CLICKHOUSE_PASSWORD")
    password_file = env.get("LLMTAP_RECORD_CLICKHOUSE_PASSWORD_FILE")
    if password is None and password_file:
        try:
            password = Path(password_file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            what = f"LLMTAP_RECORD_CLICKHOUSE_PASSWORD_FILE {password_file!r}"
            raise ConfigError(f"{what}: {exc.strerror or exc}") from None
    return Server.parse(url, user=env.get("LLMTAP_RECORD_CLICKHOUSE_USER"), password=password)


def add_missing_columns(server: Server, table: str) -> list[str]:
    """Add the columns of ``clickhouse.sql`` a table made by an earlier version lacks; their names."""
    have = {
        line.split("\t", 1)[0] for line in server.query(f"DESCRIBE TABLE {table_name(table)}").decode().splitlines()
    }
    missing = [(name, kind) for name, kind in column_kinds().items() if name not in have]
    for name, kind in missing:
        server.query(f"ALTER TABLE {table_name(table)} ADD COLUMN {name} {kind}")
    if missing:
        log.info("ClickHouse table %s: added the columns %s", table, ", ".join(name for name, _ in missing))
    return [name for name, _ in missing]


def table_engine(server: Server, table: str) -> str:
    """The table engine of ``table`` (``ReplacingMergeTree`` as this version makes it), or '' when not found."""
    database, _, name = table_name(table).rpartition(".")
    where = f"database = {repr(database) if database else 'currentDatabase()'} AND name = {name!r}"
    return server.query(f"SELECT engine FROM system.tables WHERE {where} FORMAT TabSeparated").decode().strip()


def create_table(server: Server, table: str, ttl_days: int) -> str:
    """Create ``table`` if it is not there and apply the TTL where the server can; what was done, in words."""
    try:
        server.query(ddl(table))
    except ClickHouseError as exc:
        # ClickHouse before 19 wants LowCardinality asked for; later ones no longer know the setting.
        if "allow_experimental_low_cardinality_type" not in str(exc):
            raise
        server.query(ddl(table), settings={"allow_experimental_low_cardinality_type": 1})
    add_missing_columns(server, table)
    engine = table_engine(server, table)
    if engine and not engine.startswith("Replacing"):
        log.info(
            "ClickHouse table %s was made by an earlier llmtap (%s): a record sent twice (a replay) stays twice in "
            "it, and is counted once when read; a table made now keeps one row per record",
            table,
            engine,
        )
    if ttl_days <= 0:
        return f"table {table} ready; rows are kept until deleted (no TTL asked)"
    release = server.version()
    if release < TTL_SINCE:
        log.warning(
            "ClickHouse %d.%d has no TTL (since 19.6): rows in %s are kept until deleted "
            "(ALTER TABLE %s DROP PARTITION 'YYYY-MM-DD' removes a day); the %d-day TTL is not applied",
            *release,
            table,
            table,
            ttl_days,
        )
        return f"table {table} ready; no TTL on ClickHouse {release[0]}.{release[1]}"
    server.query(ttl_statement(table, ttl_days))
    return f"table {table} ready; rows kept {ttl_days} days"


# -- the sink --------------------------------------------------------------------------------------


class ClickHouseSink(QueueWorker[bytes]):
    """Sends records to a ClickHouse table in batches, from its own thread; ``write`` never blocks or raises.

    The queue holds ``max_records`` records and ``max_bytes`` bytes of JSON at most. ``flush`` waits (up to
    ``timeout``) until what was queued before it has been sent or dropped; ``close`` does the same, then stops
    the thread: what could not be sent in time is dropped and counted (``clickhouse_unsent``), or, with
    ``keep_unsent`` (the record journal holds every record, ``llmtap.telemetry.spool``), left to the journal for the
    next start. A record is settled (``progress``) once ClickHouse took it, or it was dropped and counted.
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
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._put_count
            self._flush_wanted = True
            self._cond.notify()
            while self._taken < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._alive():
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (within ``timeout``; not at all while ClickHouse is away, so a shutdown does not
        wait on it), then stop; the rest is dropped and counted."""
        if not self._said_down:
            self.drain(timeout)
        self._stop(timeout)

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
