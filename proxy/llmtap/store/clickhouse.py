"""Request records in ClickHouse: the table (``clickhouse.sql``), its HTTP client, and the flat columns analysis reads.

Both sides use this: the sink the telemetry process sends records through (``ClickHouseSink``,
``llmtap.telemetry.records.clickhouse``) and the source ``compare`` and ``slo`` read them back from
(``llmtap.store.clickhouse_read``).

The table keeps one row per record in the end (a journal replays records at least once): it is a
``ReplacingMergeTree`` whose sorting key ends with ``record_id``, the record's trace and span ids (a record
without both gets a random one, so it is never taken for another). Reading the table back, each record once, is
``llmtap.store.clickhouse_read``. Only the standard library is used: ClickHouse's HTTP interface is plain HTTP.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtap.config.types import ConfigError
from llmtap.store.clickhouse_rows import DDL_FILE, column_kinds, flat_row, record_id

__all__ = [
    "DDL_FILE",
    "TTL_SINCE",
    "ClickHouseError",
    "Server",
    "add_missing_columns",
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
