"""The embedded engine: record files read, filtered, grouped and sorted by DuckDB.

DuckDB reads the files once: JSON lines (``.jsonl``, ``.jsonl.gz``, rotated ``PATH.N``) as raw lines,
each validated and its fields extracted by path with an explicit type check (a wrong-typed value reads
as null, as in ``proxy.store.python``; a line that is not a record is counted as ``truncated``,
``foreign`` or ``other_schema``, never fatal), Parquet files by their columns (the record's nested
structure, or the flat columns themselves; only the columns analysis reads). One read of the files
does it all: they are read in parts of ``PART_FILES`` files, each part's flat rows held in a temporary
table (in memory, spilled past ``MEMORY_LIMIT``) while one query aggregates its groups (merged into
the groups of the parts before) and its figures' values come back as numpy buffers, kept per group;
at the end each figure is sorted by numpy and handed over as ``array('d')``. ``count_met`` reads the
ok records' values the scan kept, not the files again. (A table of all the flat rows, written once
and queried after, cost more to write than the files cost to read: measured at 10M records from
Parquet, 52 s to write it against 17 s to read the same columns.)

Why DuckDB rather than chDB (ClickHouse embedded): measured on the same 300,000 generated records
(grouped counts and sorted TTFTs by version and route), the two took about the same time on gzip JSON
lines (15-25 s against 16-18 s on two busy shared cores) and on Parquet (1.4-2.0 s against 1.5-2.1 s),
so speed did not decide it; size and fit did: DuckDB is one wheel of a few tens of MB with no
dependencies, chDB 4.4 installs 887 MB (its engine, and numpy and more of its own); DuckDB's Python API
hands results over as numpy buffers, and its SQL has the typed JSON access and ``arg_max`` over a
tuple that the facts need. ClickHouse itself, for the fleet, is a ``Source`` of its own.
"""

from __future__ import annotations

import shutil
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from proxy.store import SLOWEST, VERSION, By, Filter, Group, Objective, Scan, slowest
from proxy.store.files import record_files

#: What the engine may hold in memory before it spills to its temporary directory.
MEMORY_LIMIT = "512MB"
#: Files read by one statement at most (a part: its rows are held at once, in memory or spilled).
PART_FILES = 256
#: Lines longer than this are not records (the longest llmtap writes is a few KB).
MAX_LINE = 1024 * 1024

_SCHEMA_PREFIX = '{"llmtap_record":'
#: The JSON paths extracted from a line, in order; their index in SQL is one more.
_PATHS = (
    "$.llmtap_record",
    "$.time",
    "$.route",
    "$.model",
    "$.shape",
    "$.prompt_version",
    "$.outcome",
    "$.stream",
    "$.slo",
    "$.ttft",
    "$.tpot",
    "$.e2e",
    "$.prefill",
    "$.prefill_source",
    "$.tokens.input",
    "$.tokens.cache_read",
    "$.cache.class",
    "$.objective.shape",
    "$.objective.percentile",
    "$.objective.ttft",
    "$.objective.tpot",
    "$.objective.e2e",
    "$.trace_id",  # the slowest requests' names (Group.slowest)
    "$.cost.amount",
)
#: A value's JSON type read from its first character (the extracted text is minimal JSON): cheaper than
#: parsing it again, and exactly Python's view (a string is never a number, a boolean never a number).
_MACROS = """
CREATE OR REPLACE TEMP MACRO j_num(x) AS
  CASE WHEN regexp_full_match(x::VARCHAR, '-?[0-9][0-9.eE+-]*') AND isfinite(TRY_CAST(x::VARCHAR AS DOUBLE))
       THEN TRY_CAST(x::VARCHAR AS DOUBLE) END;
CREATE OR REPLACE TEMP MACRO j_int(x) AS
  CASE WHEN regexp_full_match(x::VARCHAR, '-?[0-9]+') THEN TRY_CAST(x::VARCHAR AS BIGINT) END;
CREATE OR REPLACE TEMP MACRO j_str(x) AS CASE WHEN starts_with(x::VARCHAR, '"') THEN x ->> '$' END;
CREATE OR REPLACE TEMP MACRO j_true(x) AS coalesce(x::VARCHAR = 'true', false);
CREATE OR REPLACE TEMP MACRO t_epoch(s) AS
  epoch_us(TRY_CAST(replace(trim(s, ' \t\n\r'), 'Z', '+00:00') AS TIMESTAMPTZ)) / 1e6;
"""
#: The flat columns analysis reads, with a line's extracted values ``j`` (1-based, as ``_PATHS``).
_JSON_COLUMNS = {
    "time_s": "t_epoch(j_str(j[2]))",
    "route": "j_str(j[3])",
    "model": "j_str(j[4])",
    "shape": "j_str(j[5])",
    "prompt_version": "j_str(j[6])",
    "outcome": "j_str(j[7])",
    "stream": "j_true(j[8])",
    "slo": "j_str(j[9])",
    "ttft": "j_num(j[10])",
    "tpot": "j_num(j[11])",
    "e2e": "j_num(j[12])",
    "prefill": "j_num(j[13])",
    "prefill_source": "j_str(j[14])",
    "input_tokens": "j_int(j[15])",
    "cache_read_tokens": "j_int(j[16])",
    "cache_class": "j_str(j[17])",
    "obj_shape": "j_str(j[18])",
    "obj_percentile": "j_num(j[19])",
    "obj_ttft": "j_num(j[20])",
    "obj_tpot": "j_num(j[21])",
    "obj_e2e": "j_num(j[22])",
    "trace_id": "j_str(j[23])",
    "cost": "j_num(j[24])",
}
_KINDS = {"float": "DOUBLE", "str": "VARCHAR", "int": "BIGINT", "bool": "BOOLEAN"}
#: Where each flat column sits in a Parquet file of nested records (a flat one names them as COLUMNS).
_NESTED = {
    "time_s": ("time",),
    "input_tokens": ("tokens", "input"),
    "cache_read_tokens": ("tokens", "cache_read"),
    "cache_class": ("cache", "class"),
    "obj_shape": ("objective", "shape"),
    "obj_percentile": ("objective", "percentile"),
    "obj_ttft": ("objective", "ttft"),
    "obj_tpot": ("objective", "tpot"),
    "obj_e2e": ("objective", "e2e"),
    "cost": ("cost", "amount"),
}
_NUMERIC = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT")
_FLOATS = ("FLOAT", "DOUBLE", "DECIMAL")
_OBJ_VALID = "obj_percentile > 0 AND obj_percentile < 1 AND coalesce(obj_ttft, obj_tpot, obj_e2e) IS NOT NULL"


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _struct_fields(type_text: str) -> dict[str, str]:
    """The fields of a ``STRUCT(a BIGINT, b VARCHAR)`` type as DuckDB prints it (one level)."""
    inner = type_text[len("STRUCT(") : -1]
    out: dict[str, str] = {}
    depth, start = 0, 0
    for i, ch in enumerate(inner + ","):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            part = inner[start:i].strip()
            start = i + 1
            if not part:
                continue
            if part.startswith('"'):
                end = part.index('"', 1)
                name, kind = part[1:end], part[end + 1 :].strip()
            else:
                name, _, kind = part.partition(" ")
            out[name] = kind.strip()
    return out


class EngineSource:
    """Record files through DuckDB."""

    def __init__(self, paths: Iterable[str | Path], *, threads: int | None = None) -> None:
        import duckdb

        self.paths = [str(p) for p in paths]
        self.files = record_files(self.paths)
        self._dir = tempfile.mkdtemp(prefix="llmtap-engine-")
        self._con = duckdb.connect()
        settings = [
            f"SET memory_limit = {_q(MEMORY_LIMIT)}",
            f"SET temp_directory = {_q(str(Path(self._dir) / 'spill'))}",
            "SET TimeZone = 'UTC'",
            "SET enable_progress_bar = false",
            "SET preserve_insertion_order = false",
        ]
        if threads is not None:
            settings.append(f"SET threads = {int(threads)}")
        for statement in settings:
            self._con.execute(statement)
        self._con.execute(_MACROS)
        self._ok: dict[tuple[int, str], Any] = {}
        self._ok_of: tuple[Filter, By, dict[int, tuple[str | None, str | None, str | None]]] | None = None
        self._counts: dict[str, int] = {}

    def close(self) -> None:
        """Close the engine and remove its temporary database."""
        self._con.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        """The paths as a report names them."""
        return ", ".join(self.paths)

    # -- reading ---------------------------------------------------------------------------------------

    def _json_sql(self, files: list[Path]) -> str:
        listed = "[" + ", ".join(_q(str(f)) for f in files) + "]"
        paths = "[" + ", ".join(_q(p) for p in _PATHS) + "]"
        columns = ",\n  ".join(f"{expr} AS {name}" for name, expr in _JSON_COLUMNS.items())
        return f"""
SELECT kind,
  {columns}
FROM (
  SELECT j, CASE
      WHEN j IS NULL THEN CASE WHEN starts_with(line, {_q(_SCHEMA_PREFIX)}) THEN 'truncated' ELSE 'foreign' END
      WHEN j[1] IS NULL THEN 'foreign'
      WHEN j[1]::VARCHAR IN ('1', '2') THEN 'record'
      ELSE 'other_schema' END AS kind
  FROM (
    -- try(): a line that is not JSON reads as NULL (cheaper than validating every line first)
    SELECT line, try(json_extract(line, {paths})) AS j
    FROM read_csv({listed}, columns = {{'line': 'VARCHAR'}}, delim = '\x01', quote = '', escape = '',
                  header = false, auto_detect = false, ignore_errors = true, max_line_size = {MAX_LINE},
                  filename = false)
    -- a blank line is no line (a long one is never blank: trim only the short)
    WHERE line IS NOT NULL AND CASE WHEN length(line) < 64 THEN trim(line, ' \t\r') <> '' ELSE true END
  )
)"""

    def _parquet_sql(self, files: list[Path], *, union: bool) -> str:
        listed = "[" + ", ".join(_q(str(f)) for f in files) + "]"
        source = f"read_parquet({listed}, union_by_name = {str(union).lower()})"
        schema = {row[0]: str(row[1]) for row in self._con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}

        def column(name: str, kind: str) -> str:
            sql_type = _KINDS[kind]
            # A flat file names the column itself; a nested one may hold a struct of that name (``cost``).
            flat = name in schema and not schema[name].startswith("STRUCT(")
            path = (name,) if flat else _NESTED.get(name, (name,))
            top = schema.get(path[0])
            if top is None:
                return f"NULL::{sql_type}"
            have, expr = top, _ident(path[0])
            for part in path[1:]:
                if not have.startswith("STRUCT("):
                    return f"NULL::{sql_type}"
                fields = _struct_fields(have)
                if part not in fields:
                    return f"NULL::{sql_type}"
                have, expr = fields[part], f"{expr}.{_ident(part)}"
            base = have.split("(")[0]
            if name == "time_s":
                if base == "VARCHAR":
                    return f"t_epoch({expr})"
                if base.startswith("TIMESTAMP"):
                    return f"epoch_us({expr}) / 1e6"
                return f"TRY_CAST({expr} AS DOUBLE)" if base in _NUMERIC + _FLOATS else "NULL::DOUBLE"
            if kind == "str":
                return expr if base == "VARCHAR" else "NULL::VARCHAR"
            if kind == "bool":
                return f"coalesce({expr}, false)" if base == "BOOLEAN" else "false"
            if kind == "int":
                return f"TRY_CAST({expr} AS BIGINT)" if base in _NUMERIC else "NULL::BIGINT"
            if base in _NUMERIC + _FLOATS:
                return f"CASE WHEN isfinite({expr}::DOUBLE) THEN {expr}::DOUBLE END"
            return "NULL::DOUBLE"

        from proxy.store import COLUMNS

        if "llmtap_record" in schema:
            kind = "CASE WHEN llmtap_record IN (1, 2) THEN 'record' ELSE 'other_schema' END"
        else:
            kind = "'record'"
        columns = ",\n  ".join(f"{column(name, COLUMNS[name])} AS {name}" for name in _JSON_COLUMNS)
        return f"SELECT {kind} AS kind,\n  {columns}\nFROM {source}"

    def _parts(self) -> Iterator[list[Callable[[], str]]]:
        """The files in parts of at most ``PART_FILES`` files of one kind, each as the statements that may
        read it, in order: Parquet read as one schema (a reader that unions ten thousand files' schemas
        peaked at 1.9 GB of RSS at 10M records), or by column name when its files differ (written by two
        versions of llmtap)."""
        parquet = [f for f in self.files if f.name.endswith(".parquet")]
        lines = [f for f in self.files if not f.name.endswith(".parquet")]
        for i in range(0, len(lines), PART_FILES):
            yield [partial(self._json_sql, lines[i : i + PART_FILES])]
        for i in range(0, len(parquet), PART_FILES):
            batch = parquet[i : i + PART_FILES]
            yield [partial(self._parquet_sql, batch, union=False), partial(self._parquet_sql, batch, union=True)]

    @staticmethod
    def _where(where: Filter) -> tuple[str, list[Any]]:
        clauses, params = ["kind = 'record'", "time_s IS NOT NULL"], []
        for name in ("route", "model", "shape"):
            value = getattr(where, name)
            if value is not None:
                clauses.append(f"{name} = ?")
                params.append(value)
        if where.start is not None:
            clauses.append("time_s >= ?")
            params.append(where.start)
        if where.end is not None:
            clauses.append("time_s < ?" if where.open_end else "time_s <= ?")
            params.append(where.end)
        return " AND ".join(clauses), params

    @staticmethod
    def _key(by: By) -> tuple[str, list[Any]]:
        if by == VERSION:
            return "prompt_version", []
        if isinstance(by, float):
            return "CASE WHEN time_s < ? THEN 'before' ELSE 'after' END", [by]
        return "NULL::VARCHAR", []

    # -- the interface ---------------------------------------------------------------------------------

    def scan(self, where: Filter, by: By) -> Scan:
        """The grouped facts, in one read of the files: each part's rows held in a temporary table while
        its groups are aggregated (merged into the groups so far) and its figures' values fetched."""
        import duckdb
        import numpy as np

        cond, params = self._where(where)
        key, key_params = self._key(by)
        ok_stream = "outcome = 'ok' AND stream AND ttft IS NOT NULL"
        rank = (
            "(time_s, obj_percentile, coalesce(obj_ttft, -1), coalesce(obj_tpot, -1), coalesce(obj_e2e, -1),"
            " coalesce(obj_shape, ''))"
        )
        grouping = f"""
SELECT key, route, shape, gh,
  count(*), count(*) FILTER (outcome IS DISTINCT FROM 'ok'), count(*) FILTER (slo = 'met'),
  min(time_s), max(time_s),
  coalesce(sum(input_tokens) FILTER (outcome = 'ok' AND input_tokens IS NOT NULL), 0),
  coalesce(sum(coalesce(cache_read_tokens, 0)) FILTER (outcome = 'ok' AND input_tokens IS NOT NULL), 0),
  arg_max({{'s': obj_shape, 'p': obj_percentile, 't': obj_ttft, 'o': obj_tpot, 'e': obj_e2e, 'at': time_s}},
          {rank}) FILTER ({_OBJ_VALID}),
  histogram(cache_class) FILTER (cache_class IS NOT NULL),
  list(DISTINCT coalesce(prefill_source, 'unknown')) FILTER ({ok_stream} AND prefill IS NOT NULL),
  count(cost), coalesce(sum(cost), 0)
FROM part_rows WHERE kind = 'record' GROUP BY ALL"""
        nan = "'nan'::DOUBLE"
        values = f"""
SELECT gh, coalesce(outcome = 'ok', false) AS ok, coalesce(stream, false) AS stream,
  coalesce(ttft, {nan}) AS ttft, coalesce(tpot, {nan}) AS tpot, coalesce(e2e, {nan}) AS e2e,
  coalesce(prefill, {nan}) AS prefill
FROM part_rows WHERE kind = 'record'"""
        slow = f"""
SELECT gh, ttft, coalesce(trace_id, '') AS trace FROM part_rows WHERE kind = 'record' AND {ok_stream}
QUALIFY row_number() OVER (PARTITION BY gh ORDER BY ttft DESC, trace) <= {SLOWEST}"""
        groups: dict[int, Group] = {}
        ranks: dict[int, Any] = {}
        counts: dict[str, int] = {}
        kept: dict[tuple[int, str], list[Any]] = {}
        self._ok, self._ok_of = {}, None
        for part in self._parts():
            # The part's rows that pass the filter, and its other lines as kinds (for the counts).
            for i, read in enumerate(part):
                try:
                    self._con.execute(
                        f"""CREATE OR REPLACE TEMP TABLE part_rows AS
SELECT * EXCLUDE (kind), {key} AS key, hash({key}, route, shape) AS gh,
  CASE WHEN kind <> 'record' THEN kind WHEN {cond} THEN 'record' ELSE 'out' END AS kind
FROM ({read()})""",
                        key_params + key_params + params,
                    )
                    break
                except duckdb.Error:
                    if i == len(part) - 1:
                        raise
            for k, n in self._con.execute("SELECT kind, count(*) FROM part_rows GROUP BY kind").fetchall():
                counts[str(k)] = counts.get(str(k), 0) + int(n)
            for r in self._con.execute(grouping).fetchall():
                gh = int(r[3])
                g = groups.get(gh)
                if g is None:
                    g = groups[gh] = Group(r[0], r[1], r[2], 0, 0, 0, float(r[7]), float(r[8]))
                g.requests += int(r[4])
                g.errors += int(r[5])
                g.met += int(r[6])
                g.first, g.last = min(g.first, float(r[7])), max(g.last, float(r[8]))
                g.input_tokens += int(r[9])
                g.cached_tokens += int(r[10])
                o = r[11]
                if o is not None:
                    # The rank the part's arg_max chose by, again: the newest, then the objective's order.
                    rank_of = (o["at"], o["p"], *(-1 if o[f] is None else o[f] for f in "toe"), o["s"] or "")
                    if gh not in ranks or rank_of > ranks[gh]:
                        ranks[gh] = rank_of
                        g.objective = Objective(o["s"], float(o["p"]), o["t"], o["o"], o["e"])
                        g.objective_time = float(o["at"])
                for cls, n in (r[12] or {}).items():
                    g.classes[str(cls)] = g.classes.get(str(cls), 0) + int(n)
                g.prefill_sources.update(r[13] or ())
                g.priced += int(r[14])
                g.cost += float(r[15])
            # The part's slowest ok streams of each group, with their trace ids (merged with the parts before).
            for gh, ttft, trace in self._con.execute(slow).fetchall():
                top = groups[int(gh)].slowest
                top.append((float(ttft), str(trace)))
                if len(top) > 8 * SLOWEST:
                    groups[int(gh)].slowest = slowest([top])
            got = self._con.execute(values).fetchnumpy()
            self._keep(got, kept)
            del got
        self._con.execute("DROP TABLE IF EXISTS part_rows")
        for g in groups.values():
            g.slowest = slowest([g.slowest])
        self._counts = counts
        for (code, attr), chunks in kept.items():
            joined = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            chunks.clear()
            if attr.startswith("ok_"):
                self._ok[(code, attr)] = joined  # count_met's values: ok records' (ttft, tpot, e2e), unsorted
            else:
                setattr(groups[code], attr, array("d", np.sort(joined).tobytes()))
        self._ok_of = (where, by, {gh: (g.key, g.route, g.shape) for gh, g in groups.items()})
        skipped = {k: counts.get(k, 0) for k in ("truncated", "foreign", "other_schema")}
        records = counts.get("record", 0) + counts.get("out", 0)
        return Scan(list(groups.values()), self.describe(), records, len(self.files), skipped)

    def _keep(self, got: dict[str, Any], kept: dict[tuple[int, str], list[Any]]) -> None:
        """A part's values, as numpy buffers (a null as NaN: no figure is NaN), appended per group."""
        import numpy as np

        gh = np.asarray(got["gh"], dtype=np.uint64)
        if not len(gh):
            return
        ok, stream = np.asarray(got["ok"], dtype=bool), np.asarray(got["stream"], dtype=bool)
        ttft, tpot = np.asarray(got["ttft"], dtype=np.float64), np.asarray(got["tpot"], dtype=np.float64)
        e2e, prefill = np.asarray(got["e2e"], dtype=np.float64), np.asarray(got["prefill"], dtype=np.float64)
        streamed = stream & ~np.isnan(ttft)
        ttft_ok = streamed & ok
        masks = {
            "ttft_ok": (ttft, ttft_ok),
            "ttft_failed": (ttft, streamed & ~ok),
            "prefill": (prefill, ttft_ok & ~np.isnan(prefill)),
            "tpot": (tpot, ok & ~np.isnan(tpot)),
            "e2e": (e2e, ~np.isnan(e2e)),
            # count_met's TTFT: a non-stream has none, and its TTFT limit does not apply (as the proxy judges it).
            "ok_ttft": (np.where(~stream & np.isnan(ttft), 0.0, ttft), ok),
            "ok_tpot": (tpot, ok),
            "ok_e2e": (e2e, ok),
        }
        codes, inverse = np.unique(gh, return_inverse=True)
        for c, code in enumerate(codes.tolist()):
            mine = inverse == c
            for attr, (column, mask) in masks.items():
                picked = column[mine & mask]
                if len(picked):
                    kept.setdefault((int(code), attr), []).append(picked)

    def count_met(
        self, where: Filter, by: By, limits: dict[tuple[str, str], dict[str, float]]
    ) -> dict[tuple[str | None, str, str], int]:
        """Ok records within every limit of their route and shape (a null tpot as 0, another null as missed):
        from the values the scan of the same filter and side kept (else after such a scan)."""
        import numpy as np

        if not limits:
            return {}
        if self._ok_of is None or self._ok_of[0] != where or self._ok_of[1] != by:
            self.scan(where, by)
        assert self._ok_of is not None
        out: dict[tuple[str | None, str, str], int] = {}
        for gh, (key, route, shape) in self._ok_of[2].items():
            if route is None or shape is None or (route, shape) not in limits:
                continue
            lim = limits[(route, shape)]
            ttft = self._ok.get((gh, "ok_ttft"))
            if ttft is None:
                continue
            tpot, e2e = self._ok[(gh, "ok_tpot")], self._ok[(gh, "ok_e2e")]
            met = np.ones(len(ttft), dtype=bool)
            if lim.get("ttft") is not None:
                met &= ttft <= lim["ttft"]
            if lim.get("tpot") is not None:
                met &= np.nan_to_num(tpot, nan=0.0) <= lim["tpot"]
            if lim.get("e2e") is not None:
                met &= e2e <= lim["e2e"]
            n = int(np.count_nonzero(met))
            if n:
                out[(key, route, shape)] = n
        return out
