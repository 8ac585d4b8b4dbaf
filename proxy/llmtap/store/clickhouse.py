"""Request records in ClickHouse: the table (``clickhouse.sql``), a record sink, and the flat columns analysis reads.

The sink (``ClickHouseSink``, ``--record-clickhouse URL``) takes the same records as the record file and sends
them in batches over ClickHouse's HTTP interface (``INSERT ... FORMAT JSONEachRow``) from a thread of its own:
``write`` only queues a line, so the recorder's worker never waits on the network. The queue is bounded in
records and bytes; past either bound a record is dropped and counted. While ClickHouse cannot be reached the
batch in hand is retried with a growing pause (0.5 s doubling to 30 s) and the queue fills, then drops; a batch
ClickHouse answers with an error is tried ``REJECT_ATTEMPTS`` times, then dropped and counted. Every drop is
counted by reason through ``on_drop`` (``llmtap_telemetry_records_dropped_total``), every insert by outcome
through ``on_insert`` (``llmtap_telemetry_clickhouse_inserts_total``).

``query`` reads the flat columns (``COLUMNS``) of the records in a time range, filtered and sorted in SQL.
Only the standard library is used: ClickHouse's HTTP interface is plain HTTP.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmtap.config.types import ClickHouseRecords, ConfigError
from llmtap.worker import Progress, QueueWorker

__all__ = [
    "DDL_FILE",
    "DROP_REASONS",
    "TTL_SINCE",
    "ClickHouseError",
    "ClickHouseSink",
    "ClickHouseSource",
    "Server",
    "add_missing_columns",
    "clickhouse_sink",
    "create_table",
    "ddl",
    "flat_row",
    "parse_rows",
    "query",
    "select",
    "server_from_env",
    "table_name",
]

log = logging.getLogger("llmtap.telemetry")

DDL_FILE = Path(__file__).with_name("clickhouse.sql")
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

#: The flat columns analysis reads (the shared contract), and the SQL that makes each from the table.
COLUMNS: dict[str, str] = {
    "time_s": "time_s",
    "route": "nullIf(route, '')",
    "model": "model",
    "shape": "shape",
    "prompt_version": "nullIf(prompt_version, '')",
    "outcome": "outcome",
    "stream": "stream",
    "slo": "slo",
    "ttft": "ttft",
    "tpot": "tpot",
    "e2e": "e2e",
    "prefill": "prefill",
    "prefill_source": "prefill_source",
    "input_tokens": "tokens_input",
    "cache_read_tokens": "tokens_cache_read",
    "cache_class": "cache_class",
    "obj_shape": "objective_shape",
    "obj_percentile": "objective_percentile",
    "obj_ttft": "objective_ttft",
    "obj_tpot": "objective_tpot",
    "obj_e2e": "objective_e2e",
    "trace_id": "trace_id",
    "instance_id": "instance_id",
    "cost": "cost_amount",
}
_FLOATS = {"time_s", "ttft", "tpot", "e2e", "prefill", "obj_percentile", "obj_ttft", "obj_tpot", "obj_e2e", "cost"}
_INTS = {"input_tokens", "cache_read_tokens"}


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
    missing = [(name, kind) for name, kind in _column_kinds().items() if name not in have]
    for name, kind in missing:
        server.query(f"ALTER TABLE {table_name(table)} ADD COLUMN {name} {kind}")
    if missing:
        log.info("ClickHouse table %s: added the columns %s", table, ", ".join(name for name, _ in missing))
    return [name for name, _ in missing]


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


# -- records to rows -------------------------------------------------------------------------------


def _epoch(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _part(record: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = record.get(key)
    return value if isinstance(value, dict) else {}


def flat_row(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """A record as a row of the table; None for one without a readable time."""
    t = _epoch(record.get("time"))
    if t is None:
        return None
    objective, slots, gaps = _part(record, "objective"), _part(record, "slots"), _part(record, "gaps")
    tokens, cache = _part(record, "tokens"), _part(record, "cache")
    prompt = record.get("prompt")
    row = {
        "schema": record.get("llmtap_record"),
        "time": int(t),
        "time_s": t,
        "trace_id": record.get("trace_id") or "",
        "span_id": record.get("span_id"),
        "instance_id": record.get("instance_id"),
        "host": record.get("host"),
        "pid": record.get("pid"),
        "llmtap_version": record.get("llmtap_version"),
        "response_id": record.get("response_id"),
        "route": record.get("route") or "",
        "upstream": record.get("upstream"),
        "protocol": record.get("protocol"),
        "operation": record.get("operation"),
        "model": record.get("model"),
        "response_model": record.get("response_model"),
        "stream": 1 if record.get("stream") is True else 0,
        "status": record.get("status"),
        "outcome": record.get("outcome"),
        "error_type": record.get("error_type"),
        "slo": record.get("slo"),
        "shape": record.get("shape"),
        "objective_shape": objective.get("shape"),
        "objective_percentile": objective.get("percentile"),
        "objective_ttft": objective.get("ttft"),
        "objective_tpot": objective.get("tpot"),
        "objective_e2e": objective.get("e2e"),
        "prompt_version": record.get("prompt_version") or "",
        "slots_value": slots.get("value"),
        "slots_source": slots.get("source"),
        "slots_confidence": slots.get("confidence"),
        "gaps_n": gaps.get("n") or 0,
        "gaps_p50": gaps.get("p50"),
        "gaps_p95": gaps.get("p95"),
        "gaps_max": gaps.get("max"),
        "tokens_input": tokens.get("input"),
        "tokens_input_source": tokens.get("input_source"),
        "tokens_output": tokens.get("output"),
        "tokens_output_source": tokens.get("output_source"),
        "tokens_cache_read": tokens.get("cache_read"),
        "tokens_cache_write": tokens.get("cache_write"),
        "tokens_reasoning": tokens.get("reasoning"),
        "prompt_json": None if prompt is None else json.dumps(prompt, separators=(",", ":")),
        "cache_class": cache.get("class"),
        "cache_changed_region": cache.get("changed_region"),
        "cache_expected_prefix_tokens": cache.get("expected_prefix_tokens"),
        "cache_cached_tokens": cache.get("cached_tokens"),
        "cache_min_tokens": cache.get("min_tokens"),
        "cost_amount": _part(record, "cost").get("amount"),
        "cost_status": _part(record, "cost").get("status"),
    }
    for name in ("ttft", "ttfb", "upstream_ttft", "tpot", "e2e", "queue", "queue_source", "prefill"):
        row[name] = record.get(name)
    for name in ("prefill_source", "decode", "server_decode"):
        row[name] = record.get(name)
    # A value of the wrong type reads as null (as every source reads it), so one odd record cannot make
    # ClickHouse refuse its whole batch. Plain type checks, no call per column: this runs for every record.
    for name, code, nullable, low, high in _specs():
        value: Any = row.get(name)
        kind = type(value)
        if code == _FLOAT:
            if kind is float:
                if not math.isfinite(value):
                    value = None
            elif kind is int:
                value = float(value)
            else:
                value = None
        elif code == _INT:
            if kind is not int or not low <= value < high:
                value = None
        elif code == _STR:
            if kind is not str:
                value = None
        if value is None and not nullable:
            value = "" if code == _STR else 0
        row[name] = value
    return row


_FLOAT, _INT, _STR, _OTHER = range(4)
_INT_RANGES = {"UInt8": (0, 2**8), "UInt16": (0, 2**16), "UInt32": (0, 2**32), "Int64": (-(2**63), 2**63)}
_SPECS: list[tuple[str, int, bool, int, int]] = []


def _specs() -> list[tuple[str, int, bool, int, int]]:
    """Each column: its name, what it holds (``_FLOAT`` ..), whether it takes null, and an integer's range."""
    if not _SPECS:
        for name, kind in _column_kinds().items():
            nullable = kind.startswith("Nullable(")
            base = kind[9:-1] if nullable else kind
            if base.startswith("LowCardinality("):
                base = base[15:-1]
            low, high = _INT_RANGES.get(base, (0, 0))
            code = (
                _FLOAT if base == "Float64" else _INT if base in _INT_RANGES else _STR if base == "String" else _OTHER
            )
            _SPECS.append((name, code, nullable, low, high))
    return _SPECS


_KINDS: dict[str, str] = {}


def _column_kinds() -> dict[str, str]:
    """Each column of ``clickhouse.sql`` and its type."""
    if not _KINDS:
        for match in re.finditer(r"^\s{4}(\w+) ([\w()']+),?$", DDL_FILE.read_text(encoding="utf-8"), re.M):
            _KINDS[match.group(1)] = match.group(2)
    return _KINDS


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


# -- reading ---------------------------------------------------------------------------------------

_ESCAPES = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r", "0": "\0", "b": "\b", "f": "\f", "'": "'", "a": "\a"}
_ESCAPED = re.compile(r"\\(.)", re.S)


def _unescape(field: str) -> str:
    return _ESCAPED.sub(lambda m: _ESCAPES.get(m.group(1), m.group(1)), field) if "\\" in field else field


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def select(
    table: str,
    *,
    start: float | None = None,
    end: float | None = None,
    route: str | None = None,
    model: str | None = None,
    shape: str | None = None,
    versions: tuple[str, ...] | None = None,
) -> str:
    """The SELECT of the flat columns of the records wanted, oldest first (TabSeparated)."""
    where: list[str] = []
    if start is not None:
        # The day partitions and the sorting key's time prune by the whole second; time_s keeps the exact bound.
        where += [f"time >= toDateTime({int(start)}, 'UTC')", f"time_s >= {float(start)!r}"]
    if end is not None:
        where += [f"time <= toDateTime({int(end) + 1}, 'UTC')", f"time_s <= {float(end)!r}"]
    if route is not None:
        where.append(f"route = {_quote(route)}")
    if model is not None:
        where.append(f"model = {_quote(model)}")
    if shape is not None:
        where.append(f"shape = {_quote(shape)}")
    if versions is not None:
        where.append(f"prompt_version IN ({', '.join(_quote(v) for v in versions)})")
    columns = ", ".join(f"{sql} AS {name}" if sql != name else name for name, sql in COLUMNS.items())
    condition = f" WHERE {' AND '.join(where)}" if where else ""
    return f"SELECT {columns} FROM {table_name(table)}{condition} ORDER BY time_s FORMAT TabSeparated"


def _value(name: str, field: str) -> Any:
    if field == "\\N":
        return None
    if name in _FLOATS:
        # Records keep 6 decimals; ClickHouse before 20 parses some of them a step off (1.146505 as
        # 1.1465049999999999): rounding gives back the value written, so every engine reads the same.
        return round(float(field), 6)
    if name in _INTS:
        return int(field)
    if name == "stream":
        return field == "1"
    return _unescape(field)


def parse_rows(data: bytes) -> Iterator[dict[str, Any]]:
    """The rows of a TabSeparated answer to ``select``, as dicts of the flat columns."""
    names = tuple(COLUMNS)
    for line in data.decode("utf-8", "replace").split("\n"):
        if not line:
            continue
        fields = line.split("\t")
        if len(fields) != len(names):
            raise ClickHouseError(f"unexpected row of {len(fields)} columns", reachable=True)
        yield {name: _value(name, field) for name, field in zip(names, fields, strict=True)}


def query(server: Server, table: str, **where: Any) -> list[dict[str, Any]]:
    """The flat columns of the records wanted (``select``'s filters), oldest first; ``ConfigError`` when
    ClickHouse cannot answer."""
    try:
        return list(parse_rows(server.query(select(table, **where))))
    except ClickHouseError as exc:
        raise ConfigError(f"ClickHouse {server.url} table {table}: {exc}") from None


# -- the source (llmtap.store.Source) ---------------------------------------------------------------

_OK = "outcome = 'ok'"
_STREAM_TTFT = "stream = 1 AND ttft IS NOT NULL"
_VALID_OBJECTIVE = (
    "objective_percentile > 0 AND objective_percentile < 1 AND "
    "(objective_ttft IS NOT NULL OR objective_tpot IS NOT NULL OR objective_e2e IS NOT NULL)"
)
#: How count_met reads a figure: no TPOT (one chunk) or no TTFT (not streamed) is within any limit.
_LIMITED = {"tpot": "ifNull(tpot, 0)", "ttft": "if(stream = 1, ttft, ifNull(ttft, 0))"}
#: A group's key with its nulls as a value, so IN matches them (NULL equals nothing in SQL).
_NOT_NULL = "ifNull(k, '\\0'), ifNull(r, '\\0'), ifNull(s, '\\0')"
#: The sorted values of a group: each figure's name in ``Group``, its column and the records it takes.
_FIGURE_QUERIES = (
    ("ttft_ok", "ttft", f"{_STREAM_TTFT} AND {_OK}"),
    ("ttft_failed", "ttft", f"{_STREAM_TTFT} AND NOT ({_OK})"),
    ("prefill", "prefill", f"{_STREAM_TTFT} AND {_OK} AND prefill IS NOT NULL"),
    ("tpot", "tpot", f"{_OK} AND tpot IS NOT NULL"),
    ("e2e", "e2e", "e2e IS NOT NULL"),
)


def _literal(value: float) -> str:
    return repr(float(value))


def _tsv(data: bytes) -> Iterator[list[str | None]]:
    for line in data.decode("utf-8", "replace").split("\n"):
        if line:
            yield [None if f == "\\N" else _unescape(f) for f in line.split("\t")]


class ClickHouseSource:
    """Records in a ClickHouse table, read as ``llmtap.store.Source``: ClickHouse filters, groups and sorts.

    One query gives each group's counts, sums, time range and prefill sources; one more its cache classes,
    one its newest objective, and one per figure its values, sorted (``ORDER BY``): llmtap's statistics then
    draw the same bootstrap from them as from any other source.
    """

    def __init__(self, server: Server, table: str) -> None:
        self.server = server
        self.table = table_name(table)

    def describe(self) -> str:
        """How a report names the source."""
        return f"ClickHouse {self.server.url} table {self.table}"

    def close(self) -> None:
        """Nothing to release: each query is one HTTP request."""

    def _query(self, sql: str) -> bytes:
        try:
            return self.server.query(sql + " FORMAT TabSeparated")
        except ClickHouseError as exc:
            raise ConfigError(f"{self.describe()}: {exc}") from None

    @staticmethod
    def _key(by: Any) -> str:
        if by == "version":
            return "nullIf(prompt_version, '')"
        if isinstance(by, float):
            return f"if(time_s < {_literal(by)}, 'before', 'after')"
        return "CAST(NULL AS Nullable(String))"

    @staticmethod
    def _where(where: Any) -> str:
        parts: list[str] = ["1"]
        if where.start is not None:
            parts += [f"time >= toDateTime({int(where.start)}, 'UTC')", f"time_s >= {_literal(where.start)}"]
        if where.end is not None:
            parts += [
                f"time <= toDateTime({int(where.end) + 1}, 'UTC')",
                f"time_s {'<' if where.open_end else '<='} {_literal(where.end)}",
            ]
        for name in ("route", "model", "shape"):
            value = getattr(where, name)
            if value is not None:
                parts.append(f"{name} = {_quote(value)}")
        return " AND ".join(parts)

    def scan(self, where: Any, by: Any) -> Any:
        """The records that pass ``where``, grouped by side key, route and shape (``llmtap.store.Source``)."""
        from llmtap.store import Group, Objective, Scan

        key, cond = self._key(by), self._where(where)
        group_by = f"{key} AS k, nullIf(route, '') AS r, shape AS s"
        base = f"FROM {self.table} WHERE {cond} GROUP BY k, r, s"
        groups: dict[tuple[str | None, str | None, str | None], Group] = {}
        facts = self._query(
            f"SELECT {group_by}, count(), countIf(NOT ({_OK})), countIf(slo = 'met'), min(time_s), max(time_s), "
            f"sumIf(tokens_input, {_OK} AND tokens_input IS NOT NULL), "
            f"sumIf(ifNull(tokens_cache_read, 0), {_OK} AND tokens_input IS NOT NULL), "
            f"groupUniqArrayIf(ifNull(prefill_source, 'unknown'), {_STREAM_TTFT} AND {_OK} AND prefill IS NOT NULL), "
            f"countIf(cost_amount IS NOT NULL), sumIf(assumeNotNull(cost_amount), cost_amount IS NOT NULL) "
            f"{base}"
        )
        for k, r, s, n, errors, met, first, last, inp, cached, sources, priced, cost in _tsv(facts):
            g = Group(k, r, s, int(n or 0), int(errors or 0), int(met or 0), float(first or 0), float(last or 0))
            g.input_tokens, g.cached_tokens = int(inp or 0), int(cached or 0)
            g.priced, g.cost = int(priced or 0), float(cost or 0)
            g.prefill_sources = set(_array(sources or "[]"))
            groups[(k, r, s)] = g
        classes = self._query(
            f"SELECT {group_by}, cache_class, count() FROM {self.table} WHERE {cond} AND cache_class IS NOT NULL "
            "GROUP BY k, r, s, cache_class"
        )
        for k, r, s, cls, n in _tsv(classes):
            if (k, r, s) in groups and cls is not None:
                groups[(k, r, s)].classes[cls] = int(n or 0)
        # The newest valid objective: the records at each group's latest such moment, ranked here as the
        # reference ranks them (ties are rare, and only they come back more than once).
        newest = self._query(
            f"SELECT {group_by}, time_s, objective_shape, objective_percentile, objective_ttft, objective_tpot, "
            f"objective_e2e FROM {self.table} WHERE {cond} AND {_VALID_OBJECTIVE} AND ({_NOT_NULL}, time_s) IN "
            f"(SELECT {_NOT_NULL}, max(time_s) FROM (SELECT {group_by}, time_s FROM {self.table} "
            f"WHERE {cond} AND {_VALID_OBJECTIVE}) GROUP BY k, r, s)"
        )
        for k, r, s, t, shape, pct, ttft, tpot, e2e in _tsv(newest):
            held = groups.get((k, r, s))
            if held is None or t is None or pct is None:
                continue
            obj = Objective(shape, _round(pct), *(None if v is None else _round(v) for v in (ttft, tpot, e2e)))
            if held.objective is None or obj.order() > held.objective.order():
                held.objective, held.objective_time = obj, _round(t)
        for name, column, only in _FIGURE_QUERIES:
            # One row per group, its values sorted there as one array: a tenth of the bytes of a row per value,
            # and parsed by numpy, not line by line.
            data = self._query(
                f"SELECT {group_by}, arraySort(groupArray(assumeNotNull({column}))) FROM {self.table} "
                f"WHERE {cond} AND {only} GROUP BY k, r, s"
            )
            for line in data.split(b"\n"):
                if not line:
                    continue
                *names, values = line.split(b"\t")
                k, r, s = (None if f == b"\\N" else _unescape(f.decode()) for f in names)
                if (k, r, s) in groups:
                    setattr(groups[(k, r, s)], name, _sorted_values(values))
        # The slowest ok streams of each group with their trace ids, in the reference's order.
        from llmtap.store import SLOWEST

        slow = self._query(
            f"SELECT k, r, s, v, trace_id FROM (SELECT {group_by}, assumeNotNull(ttft) AS v, trace_id "
            f"FROM {self.table} WHERE {cond} AND {_STREAM_TTFT} AND {_OK} ORDER BY k, r, s, v DESC, trace_id) "
            f"LIMIT {SLOWEST} BY k, r, s"
        )
        for k, r, s, v, trace in _tsv(slow):
            if (k, r, s) in groups and v is not None:
                groups[(k, r, s)].slowest.append((_round(v), trace or ""))
        total = int(self._query(f"SELECT count() FROM {self.table}").strip() or 0)
        return Scan(list(groups.values()), self.describe(), total, 0, {})

    def count_met(
        self, where: Any, by: Any, limits: dict[tuple[str, str], dict[str, float]]
    ) -> dict[tuple[str | None, str, str], int]:
        """Ok records within every limit of their route and shape (a null tpot as 0, another null as missed)."""
        if not limits:
            return {}
        cases: list[str] = []
        for (route, shape), figures in limits.items():
            checks = [f"route = {_quote(route)}", f"shape = {_quote(shape)}"]
            for figure, limit in figures.items():
                column = _LIMITED.get(figure, figure)
                checks.append(f"{column} <= {_literal(limit)}")
            cases.append("(" + " AND ".join(checks) + ")")
        data = self._query(
            f"SELECT {self._key(by)} AS k, route, shape, count() FROM {self.table} "
            f"WHERE {self._where(where)} AND {_OK} AND ({' OR '.join(cases)}) GROUP BY k, route, shape"
        )
        return {(k, r or "", s or ""): int(n or 0) for k, r, s, n in _tsv(data)}


def _sorted_values(text: bytes) -> array[float]:
    """A ClickHouse array of numbers as TabSeparated prints it (``[0.1,0.25]``), each rounded as ``_round``."""
    import numpy as np

    values = np.fromstring(text.strip()[1:-1], sep=",")
    # rint(x * 1e6) / 1e6 is Python's round(x, 6) for every value a record holds (six decimals, below 2**53/1e6).
    return array("d", (np.rint(values * 1e6) / 1e6).tobytes())


def _round(field: str) -> float:
    return round(float(field), 6)  # as ``_value``: the value written, whatever the server's float parsing


def _array(text: str) -> list[str]:
    """A ClickHouse array of strings as TabSeparated prints it: ['a','b']."""
    inner = text.strip()[1:-1]
    return [_unescape(m) for m in re.findall(r"'((?:[^'\\]|\\.)*)'", inner)]
