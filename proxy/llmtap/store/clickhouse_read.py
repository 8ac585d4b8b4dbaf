"""Records read back from ClickHouse: the flat columns of a time range (``select``), and a table as a
``llmtap.store.Source`` (``ClickHouseSource``), where ClickHouse filters, groups and sorts.

Each record counts once: a journal replays records at least once, so one can reach the table twice.
What identifies it is its ``record_id`` column (the record's own id, made with the request whether or not it is
traced; ``llmtap.store.clickhouse_rows.record_id``), and in a row without one (a table of an earlier version) its
``trace_id`` and ``span_id`` (neither empty nor all zeros). A table made by this version keeps one row per record in
the end (``ReplacingMergeTree`` on ``record_id``, ``clickhouse.sql``), but rows merge in the background, whenever
ClickHouse gets to it; so the source first counts the copies in the table (``uniqExact`` of the identities, one
pass), and when there are some, every query reads the table through ``LIMIT 1 BY`` the identity (rows without one
as they are), which any ClickHouse from 18.16 runs, and on a table of an earlier version (a ``MergeTree``) as
well. A column such a table lacks
reads as null, and a row of a schema version this llmtap does not know is counted and left out, as the file
readers do.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from llmtap.config.types import ConfigError
from llmtap.store import (
    REQUEST_OBJECTIVES,
    REQUEST_OUTCOMES,
    SLOWEST,
    VERSION,
    By,
    Filter,
    Group,
    Objective,
    Scan,
    Skips,
    count_request_objective,
)
from llmtap.store.clickhouse import ClickHouseError, Server, column_kinds, table_name

__all__ = ["COLUMNS", "ClickHouseSource", "parse_rows", "query", "select"]

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
    "ttfot": "ttfot",
    "ttst": "ttst",
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
    "obj_ttfot": "objective_ttfot",
    "obj_ttst": "objective_ttst",
    "trace_id": "trace_id",
    "instance_id": "instance_id",
    "cost": "cost_amount",
    "ro_ttft": "request_ttft_outcome",
    "ro_tpot": "request_tpot_outcome",
}
_FLOATS = {
    *("time_s", "ttft", "tpot", "e2e", "ttfot", "ttst", "prefill", "cost"),
    *("obj_percentile", "obj_ttft", "obj_tpot", "obj_e2e", "obj_ttfot", "obj_ttst"),
}
_INTS = {"input_tokens", "cache_read_tokens"}
#: The table's columns the source reads.
_READ = (
    "time_s route prompt_version shape model outcome slo stream ttft tpot e2e prefill prefill_source tokens_input "
    "tokens_cache_read cache_class objective_shape objective_percentile objective_ttft objective_tpot objective_e2e "
    "cost_amount trace_id span_id record_id instance_id request_ttft_outcome request_tpot_outcome "
    "ttfot ttst objective_ttfot objective_ttst"
).split()
#: Each group's records judged by their own objectives, by figure and outcome (``Group.request_objectives``).
_REQUEST_KEYS = [(figure, outcome) for figure in REQUEST_OBJECTIVES for outcome in REQUEST_OUTCOMES]
_REQUEST_COUNTS = ", ".join(f"countIf(request_{figure}_outcome = '{outcome}')" for figure, outcome in _REQUEST_KEYS)
#: Seconds one query of the source may take.
READ_TIMEOUT = 600.0
#: A row of a record schema version this llmtap reads.
_KNOWN = "schema IN (1, 2)"
#: A row with both trace and span ids, neither empty nor all zeros (W3C's invalid id): what is counted once in a table
#: without ``record_id``, and in a row without one.
_TRACE_IDS = (
    "trace_id != '' AND NOT match(trace_id, '^0+$') "
    "AND isNotNull(span_id) AND NOT match(assumeNotNull(span_id), '^0*$')"
)
#: A row with an identity: a ``record_id`` that is not a random stand-in (a leading ``-``), or, where it is empty
#: (a row written before the column was), both trace and span ids.
_IDS = f"(record_id != '' AND substring(record_id, 1, 1) != '-') OR (record_id = '' AND {_TRACE_IDS})"
#: A row's identity (``_IDS`` says whether it has one): its ``record_id``, else its trace and span ids as the
#: table's earlier versions made ``record_id`` of them.
_IDENTITY = "if(record_id != '', record_id, concat(trace_id, '-', ifNull(span_id, '')))"

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
    """The SELECT of the flat columns of the records wanted, each once, oldest first (TabSeparated)."""
    where: list[str] = [_KNOWN]
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
    table, cond, read = table_name(table), " AND ".join(where), ", ".join(_READ)
    rows = (
        f"(SELECT {read} FROM {table} WHERE {cond} AND ({_IDS}) LIMIT 1 BY {_IDENTITY} "
        f"UNION ALL SELECT {read} FROM {table} WHERE {cond} AND NOT ({_IDS}))"
    )
    return f"SELECT {columns} FROM {rows} ORDER BY time_s, trace_id FORMAT TabSeparated"


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
    "(objective_ttft IS NOT NULL OR objective_tpot IS NOT NULL OR objective_e2e IS NOT NULL "
    "OR objective_ttfot IS NOT NULL OR objective_ttst IS NOT NULL)"
)
#: How count_met reads a figure: no TPOT or TTST (one chunk) or no TTFT or TTFOT (not streamed) is within any limit.
_LIMITED = {
    "tpot": "ifNull(tpot, 0)",
    "ttst": "ifNull(ttst, 0)",
    "ttft": "if(stream = 1, ttft, ifNull(ttft, 0))",
    "ttfot": "if(stream = 1, ttfot, ifNull(ttfot, 0))",
}
#: A group's key with its nulls as a value, so IN matches them (NULL equals nothing in SQL).
_NOT_NULL = "ifNull(k, '\\0'), ifNull(r, '\\0'), ifNull(s, '\\0')"
#: The sorted values of a group: each figure's name in ``Group``, its column and the records it takes.
_FIGURE_QUERIES = (
    ("ttft_ok", "ttft", f"{_STREAM_TTFT} AND {_OK}"),
    ("ttft_failed", "ttft", f"{_STREAM_TTFT} AND NOT ({_OK})"),
    ("prefill", "prefill", f"{_STREAM_TTFT} AND {_OK} AND prefill IS NOT NULL"),
    ("tpot", "tpot", f"{_OK} AND tpot IS NOT NULL"),
    ("e2e", "e2e", "e2e IS NOT NULL"),
    ("ttfot", "ttfot", f"{_OK} AND stream = 1 AND ttfot IS NOT NULL"),
    ("ttst", "ttst", f"{_OK} AND stream = 1 AND ttst IS NOT NULL"),
)
_GroupKey = tuple[str | None, str | None, str | None]


def _literal(value: float) -> str:
    return repr(float(value))


def _tsv(data: bytes) -> Iterator[list[str | None]]:
    for line in data.decode("utf-8", "replace").split("\n"):
        if line:
            yield [None if f == "\\N" else _unescape(f) for f in line.split("\t")]


def _null(kind: str) -> str:
    """A value of a column a table lacks: null, or for a column that takes none, its type's zero."""
    if kind.startswith("Nullable("):
        return f"CAST(NULL AS {kind})"
    return "''" if "String" in kind else f"CAST(0 AS {kind})"


class ClickHouseSource:
    """Records in a ClickHouse table, read as ``llmtap.store.Source``: ClickHouse filters, groups and sorts.

    One query counts the table's records (each once) and what it holds that is not read; one gives each group's
    counts, sums, time range and prefill sources; one more its cache classes, one its newest objective, and one
    per figure its values, sorted (``ORDER BY``): llmtap's statistics then draw the same bootstrap from them as
    from any other source.
    """

    def __init__(self, server: Server, table: str) -> None:
        # An answer over a week of a fleet's records takes longer than an insert may (the sink's timeout).
        self.server = (
            replace(server, timeout=max(server.timeout, READ_TIMEOUT)) if isinstance(server, Server) else server
        )
        self.table = table_name(table)
        #: The table's census, taken once: its records, copies and rows of other schema versions.
        self._census: tuple[int, int, int] | None = None
        self._columns: str | None = None
        self._ids, self._known, self._identity = _IDS, _KNOWN, _IDENTITY

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

    def _look(self) -> str:
        """The select list the queries read the table through: a column the table lacks (made by an earlier
        version) as null; without its ids no record is told from another, without its schema every row is read."""
        if self._columns is None:
            have = {
                line.split("\t", 1)[0] for line in self._query(f"DESCRIBE TABLE {self.table}").decode().splitlines()
            }
            kinds = column_kinds()
            self._columns = ", ".join(name if name in have else f"{_null(kinds[name])} AS {name}" for name in _READ)
            if "record_id" not in have:
                self._ids, self._identity = _TRACE_IDS, "trace_id, assumeNotNull(span_id)"
                if not {"trace_id", "span_id"} <= have:
                    self._ids = "0"
            if "schema" not in have:
                self._known = "1"
        return self._columns

    def _count(self) -> tuple[int, int, int]:
        """The records in the table (each once), the copies counted once, and the rows of other schema versions."""
        if self._census is None:
            self._look()
            unique = "0" if self._ids == "0" else f"uniqExactIf({self._identity}, {self._known} AND ({self._ids}))"
            data = self._query(
                f"SELECT count(), countIf(NOT ({self._known})), countIf({self._known} AND ({self._ids})), {unique} "
                f"FROM {self.table}"
            )
            total, other, with_ids, once = (int(v or 0) for v in next(_tsv(data), [0, 0, 0, 0]))
            copies = with_ids - once
            self._census = (total - other - copies, copies, other)
        return self._census

    def _rows(self, cond: str) -> str:
        """The rows that pass ``cond``, as a subquery of the columns read, each record once."""
        columns, (_, copies, _) = self._look(), self._count()
        cond = f"{cond} AND {self._known}"
        if not copies:
            return f"(SELECT {columns} FROM {self.table} WHERE {cond})"
        return (
            f"(SELECT {columns} FROM {self.table} WHERE {cond} AND ({self._ids}) LIMIT 1 BY {self._identity} "
            f"UNION ALL SELECT {columns} FROM {self.table} WHERE {cond} AND NOT ({self._ids}))"
        )

    @staticmethod
    def _key(by: By) -> str:
        if by == VERSION:
            return "nullIf(prompt_version, '')"
        if isinstance(by, float):
            return f"if(time_s < {_literal(by)}, 'before', 'after')"
        return "CAST(NULL AS Nullable(String))"

    @staticmethod
    def _where(where: Filter) -> str:
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

    def scan(self, where: Filter, by: By) -> Scan:
        """The records that pass ``where``, grouped by side key, route and shape (``llmtap.store.Source``)."""
        records, copies, other = self._count()
        rows = self._rows(self._where(where))
        group_by = f"{self._key(by)} AS k, nullIf(route, '') AS r, shape AS s"
        groups = self._facts(rows, group_by)
        self._classes(groups, rows, group_by)
        self._newest(groups, rows, group_by)
        self._figures(groups, rows, group_by)
        self._slowest(groups, rows, group_by)
        skips = Skips()
        skips.add("duplicate", None, copies)
        skips.add("other_schema", None, other)
        return Scan(list(groups.values()), self.describe(), records, 0, skips)

    def _facts(self, rows: str, group_by: str) -> dict[_GroupKey, Group]:
        """Each group's counts, sums, time range, prefill sources and costs."""
        groups: dict[_GroupKey, Group] = {}
        facts = self._query(
            f"SELECT {group_by}, count(), countIf(NOT ({_OK})), countIf(slo = 'met'), min(time_s), max(time_s), "
            f"sumIf(tokens_input, {_OK} AND tokens_input IS NOT NULL), "
            f"sumIf(ifNull(tokens_cache_read, 0), {_OK} AND tokens_input IS NOT NULL), "
            f"groupUniqArrayIf(ifNull(prefill_source, 'unknown'), {_STREAM_TTFT} AND {_OK} AND prefill IS NOT NULL), "
            f"countIf(cost_amount IS NOT NULL), sumIf(assumeNotNull(cost_amount), cost_amount IS NOT NULL), "
            f"{_REQUEST_COUNTS} FROM {rows} GROUP BY k, r, s"
        )
        for k, r, s, n, errors, met, first, last, inp, cached, sources, priced, cost, *asked in _tsv(facts):
            g = Group(k, r, s, int(n or 0), int(errors or 0), int(met or 0), float(first or 0), float(last or 0))
            g.input_tokens, g.cached_tokens = int(inp or 0), int(cached or 0)
            g.priced, g.cost = int(priced or 0), float(cost or 0)
            g.prefill_sources = set(_array(sources or "[]"))
            for (figure, outcome), count in zip(_REQUEST_KEYS, asked, strict=True):
                count_request_objective(g, figure, outcome, int(count or 0))
            groups[(k, r, s)] = g
        return groups

    def _classes(self, groups: dict[_GroupKey, Group], rows: str, group_by: str) -> None:
        classes = self._query(
            f"SELECT {group_by}, cache_class, count() FROM {rows} WHERE cache_class IS NOT NULL "
            "GROUP BY k, r, s, cache_class"
        )
        for k, r, s, cls, n in _tsv(classes):
            if (k, r, s) in groups and cls is not None:
                groups[(k, r, s)].classes[cls] = int(n or 0)

    def _newest(self, groups: dict[_GroupKey, Group], rows: str, group_by: str) -> None:
        """The newest valid objective: the records at each group's latest such moment, ranked here as the
        reference ranks them (ties are rare, and only they come back more than once)."""
        newest = self._query(
            f"SELECT {group_by}, time_s, objective_shape, objective_percentile, objective_ttft, objective_tpot, "
            f"objective_e2e, objective_ttfot, objective_ttst FROM {rows} "
            f"WHERE {_VALID_OBJECTIVE} AND ({_NOT_NULL}, time_s) IN "
            f"(SELECT {_NOT_NULL}, max(time_s) FROM (SELECT {group_by}, time_s FROM {rows} "
            f"WHERE {_VALID_OBJECTIVE}) GROUP BY k, r, s)"
        )
        for k, r, s, t, shape, pct, *limits in _tsv(newest):
            held = groups.get((k, r, s))
            if held is None or t is None or pct is None:
                continue
            obj = Objective(shape, _round(pct), *(None if v is None else _round(v) for v in limits))
            if held.objective is None or obj.order() > held.objective.order():
                held.objective, held.objective_time = obj, _round(t)

    def _figures(self, groups: dict[_GroupKey, Group], rows: str, group_by: str) -> None:
        for name, column, only in _FIGURE_QUERIES:
            # One row per group, its values sorted there as one array: a tenth of the bytes of a row per value,
            # and parsed by numpy, not line by line.
            data = self._query(
                f"SELECT {group_by}, arraySort(groupArray(assumeNotNull({column}))) FROM {rows} "
                f"WHERE {only} GROUP BY k, r, s"
            )
            for line in data.split(b"\n"):
                if not line:
                    continue
                *names, values = line.split(b"\t")
                k, r, s = (None if f == b"\\N" else _unescape(f.decode()) for f in names)
                if (k, r, s) in groups:
                    setattr(groups[(k, r, s)], name, _sorted_values(values))

    def _slowest(self, groups: dict[_GroupKey, Group], rows: str, group_by: str) -> None:
        """The slowest ok streams of each group with their trace ids, in the reference's order."""
        slow = self._query(
            f"SELECT k, r, s, v, trace_id FROM (SELECT {group_by}, assumeNotNull(ttft) AS v, trace_id "
            f"FROM {rows} WHERE {_STREAM_TTFT} AND {_OK} ORDER BY k, r, s, v DESC, trace_id) "
            f"LIMIT {SLOWEST} BY k, r, s"
        )
        for k, r, s, v, trace in _tsv(slow):
            if (k, r, s) in groups and v is not None:
                groups[(k, r, s)].slowest.append((_round(v), trace or ""))

    def count_met(
        self, where: Filter, by: By, limits: dict[tuple[str, str], dict[str, float]]
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
            f"SELECT {self._key(by)} AS k, route, shape, count() FROM {self._rows(self._where(where))} "
            f"WHERE {_OK} AND ({' OR '.join(cases)}) GROUP BY k, route, shape"
        )
        return {(k, r or "", s or ""): int(n or 0) for k, r, s, n in _tsv(data)}


def _sorted_values(text: bytes) -> array[float]:
    """A ClickHouse array of numbers as TabSeparated prints it (``[0.1,0.25]``), each rounded as ``_round``.

    numpy parses a long array far faster, when it is installed (the analysis extra); without it, Python does the
    same arithmetic: round(x * 1e6) rounds half to even as rint does, so the two give the same floats."""
    inner = text.strip()[1:-1]
    try:
        import numpy as np
    except ImportError:
        return array("d", (round(float(v) * 1e6) / 1e6 for v in inner.split(b",")) if inner else ())
    values = np.fromstring(inner, sep=",")
    # rint(x * 1e6) / 1e6 is Python's round(x, 6) for every value a record holds (six decimals, below 2**53/1e6).
    return array("d", (np.rint(values * 1e6) / 1e6).tobytes())


def _round(field: str) -> float:
    return round(float(field), 6)  # as ``_value``: the value written, whatever the server's float parsing


def _array(text: str) -> list[str]:
    """A ClickHouse array of strings as TabSeparated prints it: ['a','b']."""
    inner = text.strip()[1:-1]
    return [_unescape(m) for m in re.findall(r"'((?:[^'\\]|\\.)*)'", inner)]
