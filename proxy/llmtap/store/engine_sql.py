"""The embedded engine's SQL: how DuckDB reads record files into the flat columns, and groups them.

A JSON-lines file is read as raw lines (``read_csv`` with a delimiter no line holds, ``DELIMITER``), each
validated and its fields extracted by path with an explicit type check (a wrong-typed value reads as null, as in
``llmtap.store.python``); a line that is not a record keeps its kind (``truncated``, ``foreign``,
``other_schema``) for the counts, and what ``read_csv`` refuses (not UTF-8, too long, a stray delimiter) is kept
in its rejects table (``store_rejects``). A Parquet file is read by its columns: the record's nested structure,
or the flat columns themselves; only the columns analysis reads. A record's ``time`` in the form llmtap writes it
(``...+00:00``) is cast at once; another form is trimmed and its ``Z`` read as UTC first (that took a third of the
read). Every read also gives each row its file (``fi``, its index in the part) and, when asked, its position in
the part (``pos``: where the engine counts a record read twice once, the first copy).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmtap.store import COLUMNS, REQUEST_OBJECTIVES, REQUEST_OUTCOMES, SLOWEST, TIME_GRAMMAR
from llmtap.store.files import SCHEMA_KEY
from llmtap.store.skips import MAX_LINE

__all__ = ["BUCKET", "DELIMITER", "LISTS", "MACROS", "grouping", "json_ids", "json_read", "locate", "parquet_read", "q"]

_SCHEMA_PREFIX = '{"' + SCHEMA_KEY + '":'
#: What ``read_csv`` splits a line's fields at: four control characters, which a record never holds (JSON
#: escapes them) and damage all but never makes. Not one: ``read_csv`` drops a delimiter that ends a line, and a
#: line of a stray byte and nothing else would read differently than Python reads it. The one difference left:
#: ``read_csv`` ends a line at a carriage return that follows the first of these bytes (Python reads on).
DELIMITER = "\x01\x02\x03\x04"
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
    "$.trace_id",  # the slowest requests' names (Group.slowest), and with span_id an older record's identity
    "$.cost.amount",
    "$.span_id",
    "$.record_id",  # a record's identity (``_IDENT``)
    "$.request_objective.ttft_outcome",
    "$.request_objective.tpot_outcome",
    "$.ttfot",
    "$.ttst",
    "$.objective.ttfot",
    "$.objective.ttst",
)
#: A value's JSON type read from its first character (the extracted text is minimal JSON): cheaper than
#: parsing it again, and exactly Python's view (a string is never a number, a boolean never a number).
MACROS = """
CREATE OR REPLACE TEMP MACRO j_num(x) AS
  CASE WHEN regexp_full_match(x::VARCHAR, '-?[0-9][0-9.eE+-]*') AND isfinite(TRY_CAST(x::VARCHAR AS DOUBLE))
       THEN TRY_CAST(x::VARCHAR AS DOUBLE) END;
CREATE OR REPLACE TEMP MACRO j_int(x) AS
  CASE WHEN regexp_full_match(x::VARCHAR, '-?[0-9]+') THEN TRY_CAST(x::VARCHAR AS BIGINT) END;
CREATE OR REPLACE TEMP MACRO j_str(x) AS CASE WHEN starts_with(x::VARCHAR, '"') THEN x ->> '$' END;
CREATE OR REPLACE TEMP MACRO j_true(x) AS coalesce(x::VARCHAR = 'true', false);
CREATE OR REPLACE TEMP MACRO t_epoch(s) AS
  epoch_us(CASE WHEN s[1] BETWEEN '0' AND '9' AND s[1:4] <> '0000' AND s[12:13] < '24' AND NOT contains(s, ' ')
                     AND (s LIKE '____-__-__T__:__:__+00:00' OR s LIKE '____-__-__T__:__:__.___+00:00'
                          OR s LIKE '____-__-__T__:__:__.______+00:00')
                THEN TRY_CAST(s AS TIMESTAMPTZ)
                WHEN regexp_full_match(trim(s, ' \t\n\r'), '__TIME__')
                THEN TRY_CAST(replace(trim(s, ' \t\n\r'), 'Z', '+00:00') AS TIMESTAMPTZ) END) / 1e6;
CREATE OR REPLACE TEMP MACRO own_text(t) AS starts_with(t, __OWN__) OR (t <> '' AND starts_with(__OWN__, t));
CREATE OR REPLACE TEMP MACRO own_line(s) AS own_text(trim(s, ' \t\r'));
""".replace("__OWN__", "'" + _SCHEMA_PREFIX + "'").replace("__TIME__", TIME_GRAMMAR)
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
    "span_id": "j_str(j[25])",
    "record_id": "j_str(j[26])",
    "ro_ttft": "j_str(j[27])",
    "ro_tpot": "j_str(j[28])",
    "ttfot": "j_num(j[29])",
    "ttst": "j_num(j[30])",
    "obj_ttfot": "j_num(j[31])",
    "obj_ttst": "j_num(j[32])",
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
    "obj_ttfot": ("objective", "ttfot"),
    "obj_ttst": ("objective", "ttst"),
    "cost": ("cost", "amount"),
    "ro_ttft": ("request_objective", "ttft_outcome"),
    "ro_tpot": ("request_objective", "tpot_outcome"),
}
_NUMERIC = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT")
_FLOATS = ("FLOAT", "DOUBLE", "DECIMAL")
_OBJ_VALID = (
    "obj_percentile > 0 AND obj_percentile < 1 "
    "AND coalesce(obj_ttft, obj_tpot, obj_e2e, obj_ttfot, obj_ttst) IS NOT NULL"
)
#: What a record's identity is hashed from: its ``record_id``, else (a record of an older version) its trace and span
#: ids; cheap enough for every row, and equal for two copies of one record (``llmtap.store.files.identity``).
_HASHED = "coalesce(record_id, trace_id || ':' || span_id)"
#: A record's identity exactly as ``llmtap.store.files.identity`` has it: its ``record_id`` string when it has one
#: (none when that is empty or all zeros), else both its trace and span ids (neither empty nor all zeros, W3C's
#: invalid id); NULL for a record that has none, which counts as it is.
_IDENT = (
    "CASE WHEN record_id IS NOT NULL THEN CASE WHEN trim(record_id, '0') <> '' THEN record_id END "
    "WHEN trim(coalesce(trace_id, ''), '0') <> '' AND trim(coalesce(span_id, ''), '0') <> '' "
    "THEN trace_id || ':' || span_id END"
)


def q(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _listed(files: list[Path]) -> str:
    return "[" + ", ".join(q(str(f)) for f in files) + "]"


def _wrong_json() -> str:
    """A line's field of the wrong type (present, not null, and read as null): whether it has one."""
    checks = []
    for name, expr in _JSON_COLUMNS.items():
        j = expr[expr.index("j[") : expr.index("]") + 1]
        if name == "time_s":
            continue  # a record without a readable time is counted apart (no_time)
        if name == "stream":
            checks.append(f"{j}::VARCHAR NOT IN ('true', 'false', 'null')")
        else:
            checks.append(f"({j}::VARCHAR <> 'null' AND {name} IS NULL)")
    return "coalesce(" + " OR ".join(checks) + ", false)"


def _lines(files: list[Path], positions: bool) -> str:
    """The non-blank lines of JSON-lines files, with their file (``fi``) and, when asked, position (``pos``)."""
    pos = ", row_number() OVER () AS pos" if positions else ""
    return f"""
    SELECT line, fi{", pos" if positions else ""}
    FROM (
      SELECT line, file_index AS fi{pos}
      FROM read_csv({_listed(files)}, columns = {{'line': 'VARCHAR'}}, delim = {q(DELIMITER)}, quote = '', escape = '',
                    header = false, auto_detect = false, ignore_errors = true, store_rejects = true,
                    max_line_size = {MAX_LINE}, filename = false)
    )
    -- a blank line is no line (a long one is never blank: trim only the short)
    WHERE line IS NOT NULL AND CASE WHEN length(line) < 64 THEN trim(line, ' \t\r') <> '' ELSE true END"""


def json_ids(files: list[Path]) -> str:
    """The rows of JSON-lines files as ``locate`` reads them: kind, position, time and ids only (a fifth of the
    paths to extract), the positions those of ``json_read``'s."""
    return f"""
SELECT CASE WHEN j[1]::VARCHAR IN ('1', '2') THEN 'record' ELSE 'other' END AS kind, pos,
  t_epoch(j_str(j[2])) AS time_s, j_str(j[3]) AS trace_id, j_str(j[4]) AS span_id, j_str(j[5]) AS record_id
FROM (
  SELECT try(json_extract(line, ['$.llmtap_record', '$.time', '$.trace_id', '$.span_id', '$.record_id'])) AS j, pos
  FROM ({_lines(files, True)})
)"""


def json_read(files: list[Path], *, positions: bool = False) -> str:
    """The rows of JSON-lines files: each line's kind, file (``fi``), [position,] flat columns, and whether a field
    had the wrong type (``wrong``)."""
    paths = "[" + ", ".join(q(p) for p in _PATHS) + "]"
    columns = ",\n  ".join(f"{expr} AS {name}" for name, expr in _JSON_COLUMNS.items())
    columns += f",\n  {_wrong_json()} AS wrong"
    return f"""
SELECT kind, fi{", pos" if positions else ""},
  {columns}
FROM (
  SELECT j, fi{", pos" if positions else ""}, CASE
      WHEN j IS NULL THEN CASE WHEN own_line(line) THEN 'truncated' ELSE 'foreign' END
      WHEN j[1] IS NULL THEN 'foreign'
      WHEN j[1]::VARCHAR IN ('1', '2') THEN 'record'
      ELSE 'other_schema' END AS kind
  FROM (
    -- try(): a line that is not JSON reads as NULL (cheaper than validating every line first)
    SELECT line, try(json_extract(line, {paths})) AS j, fi{", pos" if positions else ""}
    FROM ({_lines(files, positions)})
  )
)"""


def _source(schema: dict[str, str], name: str) -> str | None:
    """Where a flat column sits in a Parquet file of ``schema`` (its expression), or None when it is not there."""
    flat = name in schema and not schema[name].startswith("STRUCT(")
    path = (name,) if flat else _NESTED.get(name, (name,))
    have = schema.get(path[0])
    expr = _ident(path[0])
    for part in path[1:]:
        if have is None or not have.startswith("STRUCT("):
            return None
        have = _struct_fields(have).get(part)
        expr = f"{expr}.{_ident(part)}"
    return expr if have is not None else None


def _column(schema: dict[str, str], name: str, kind: str) -> str:
    """How a flat column reads from a Parquet file of ``schema`` (a missing or wrong-typed column as null)."""
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


def parquet_read(
    files: list[Path], describe: Callable[[str], dict[str, str]], *, union: bool, positions: bool = False
) -> str:
    """The rows of Parquet files (``describe`` gives the columns of a ``FROM`` clause): kind, file, [position,]
    flat columns. Files without a record's time (``time`` or ``time_s``) and record key hold no records: their
    rows are of kind ``wrong_schema``."""
    source = f"read_parquet({_listed(files)}, union_by_name = {str(union).lower()}, file_row_number = true)"
    schema = describe(source)
    if SCHEMA_KEY in schema:
        kind = f"CASE WHEN {SCHEMA_KEY} IN (1, 2) THEN 'record' ELSE 'other_schema' END"
    elif "time" in schema or "time_s" in schema:
        kind = "'record'"
    else:
        kind = "'wrong_schema'"
    read = {name: _column(schema, name, COLUMNS[name]) for name in _JSON_COLUMNS}
    columns = ",\n  ".join(f"{expr} AS {name}" for name, expr in read.items())
    # A column of the wrong type reads as null: the rows that hold a value there had a field of the wrong type.
    wrong = [
        _source(schema, name)
        for name, expr in read.items()
        if name != "time_s" and expr.startswith(("NULL::", "false"))
    ]
    present = [w for w in wrong if w is not None]
    columns += f",\n  {' OR '.join(f'{w} IS NOT NULL' for w in present) or 'false'} AS wrong"
    # A position that orders the part's rows as the files hold them, without a window.
    pos = ", (file_index::BIGINT << 40) + file_row_number AS pos" if positions else ""
    return f"SELECT {kind} AS kind, file_index AS fi{pos},\n  {columns}\nFROM {source}"


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


#: Files of a part whose facts are kept apart (``grouping``'s ``bucket``): what a part read again for a record's
#: copies reads (eight times fewer files than the part).
BUCKET = 32
#: Each group's records as lists (a null figure as NaN: no figure is NaN), split by numpy after.
LISTS = {
    "flags": "list(coalesce(outcome = 'ok', false)::UTINYINT * 2 + coalesce(stream, false)::UTINYINT)",
    **{name: f"list(coalesce({name}, 'nan'::DOUBLE))" for name in ("ttft", "tpot", "e2e", "prefill", "ttfot", "ttst")},
}


#: Each group's records judged by their own objectives, by figure and outcome (``ro_ttft_met``, ...).
_REQUEST_COUNTS = ", ".join(
    f"count(*) FILTER ({column} = '{outcome}') AS {column}_{outcome}"
    for column in REQUEST_OBJECTIVES.values()
    for outcome in REQUEST_OUTCOMES
)


def grouping(key: str, cond: str, *, dedupe: bool = False) -> str:
    """The statement that groups one part's rows (``__READ__`` is its read), each ``BUCKET`` of its files apart:
    the records that pass ``cond`` by side ``key``, route and shape, with their figures as lists and the hashes of
    their identities (``ids``, the records outside ``cond`` too; ids that identify nothing, empty or all zeros, are
    told apart only when their hash comes twice: a check on every row cost a fifth of the read); every other row by its
    kind and file. With ``dedupe``, the rows whose position is in the temporary table ``llmtap_drop`` are of kind
    ``duplicate``."""
    ok_stream = "outcome = 'ok' AND stream AND ttft IS NOT NULL"
    rank = (
        "(time_s, obj_percentile, coalesce(obj_ttft, -1), coalesce(obj_tpot, -1), coalesce(obj_e2e, -1),"
        " coalesce(obj_ttfot, -1), coalesce(obj_ttst, -1), coalesce(obj_shape, ''))"
    )
    on_record = ", ".join(f"CASE WHEN kind = 'record' THEN {c} END AS {c}" for c in ("key", "route", "shape"))
    dropped = "WHEN pos IN (SELECT pos FROM llmtap_drop) THEN 'duplicate'" if dedupe else ""
    return f"""
SELECT kind, key, route, shape, fi, bucket,
  count(*) AS n, count(*) FILTER (outcome IS DISTINCT FROM 'ok') AS errors, count(*) FILTER (slo = 'met') AS met,
  min(time_s) AS first, max(time_s) AS last,
  coalesce(sum(input_tokens) FILTER (outcome = 'ok' AND input_tokens IS NOT NULL), 0) AS input_tokens,
  coalesce(sum(coalesce(cache_read_tokens, 0)) FILTER (outcome = 'ok' AND input_tokens IS NOT NULL), 0) AS cached,
  arg_max({{'s': obj_shape, 'p': obj_percentile, 't': obj_ttft, 'o': obj_tpot, 'e': obj_e2e, 'f': obj_ttfot,
           'n': obj_ttst, 'at': time_s}},
          {rank}) FILTER ({_OBJ_VALID}) AS objective,
  histogram(cache_class) FILTER (cache_class IS NOT NULL) AS classes,
  list(DISTINCT coalesce(prefill_source, 'unknown')) FILTER ({ok_stream} AND prefill IS NOT NULL) AS sources,
  count(cost) AS priced, coalesce(sum(cost), 0) AS cost_sum,
  {_REQUEST_COUNTS},
  count(*) FILTER (kind IN ('record', 'out') AND wrong) AS wrong,
  min_by({{'t': ttft, 'id': coalesce(trace_id, '')}}, {{'a': -ttft, 'b': coalesce(trace_id, '')}}, {SLOWEST})
    FILTER (kind = 'record' AND {ok_stream}) AS slowest,
  list(hash({_HASHED})) FILTER (kind IN ('record', 'out') AND {_HASHED} IS NOT NULL) AS ids,
  {", ".join(f"{expr} FILTER (kind = 'record') AS {name}" for name, expr in LISTS.items())}
FROM (
  SELECT * EXCLUDE (kind, key, route, shape, fi), {on_record}, kind,
    CASE WHEN kind NOT IN ('record', 'out') THEN fi END AS fi, fi // {BUCKET} AS bucket
  FROM (
    SELECT * EXCLUDE (kind), {key} AS key,
      CASE WHEN kind <> 'record' THEN kind WHEN time_s IS NULL THEN 'no_time' {dropped}
           WHEN {cond} THEN 'record' ELSE 'out' END AS kind
    FROM (__READ__)
  )
)
GROUP BY ALL"""


def locate(read: str) -> str:
    """The records of a read (with positions) whose identity's hash is in the temporary table ``llmtap_dups``:
    their position and identity (``_IDENT``), in the order read."""
    return f"""
SELECT pos, ident FROM (
  SELECT pos, {_IDENT} AS ident FROM ({read})
  WHERE kind = 'record' AND time_s IS NOT NULL AND hash({_HASHED}) IN (SELECT h FROM llmtap_dups)
)
WHERE ident IS NOT NULL
ORDER BY pos"""
