"""The embedded engine: record files read, filtered, grouped and sorted by DuckDB.

DuckDB reads the files once (the SQL is ``llmtap.store.engine_sql``): JSON lines (``.jsonl``, ``.jsonl.gz``,
rotated ``PATH.N``) as raw lines, each validated and its fields extracted with an explicit type check, Parquet
files by their columns. They are read in parts of ``PART_FILES`` files, one statement per part, which groups the
part's records (and its other lines by kind and file, for the counts) and gathers each group's figures as lists
that come back as numpy buffers (masked by numpy into the figures); the parts' facts are merged at the end, where
each figure is sorted once and handed over as ``array('d')``. ``count_met`` reads the values the scan kept, not
the files again (why one statement, and why DuckDB: docs/development.md, "The record engine").

A damaged input never stops the scan. A file that cannot be opened or is not what its name says is counted
before the read (``llmtap.store.files.inspect``). A part whose statement fails is read again in halves down to
the file that fails: a Parquet file that DuckDB cannot read is counted as damaged; a JSON-lines file is read by
Python instead (``llmtap.store.files.file_lines``: up to the damage of a compressed file, and with the lines
DuckDB's CSV reader cannot take, a stray carriage return or delimiter, settled as the reference settles them)
into a plain copy that DuckDB then reads; so is a file with a carriage return and no newline from the start,
whose one line ``read_csv`` ends at the carriage return without failing (``files.splits_at_cr``). What
``read_csv`` refuses is counted from its rejects table.

Each record counts once (a journal replays at least once): the statement also lists the hash of each record's
identity (its record_id, or in a record of an older version its trace_id and span_id); when a hash is seen twice
over the whole scan, the parts that hold it are read once more for those records' positions and identities, every
copy after the first is marked, and those parts grouped again without them. Without a duplicate that costs one
hash per record. (ClickHouse, for the fleet, is a ``Source`` of its own.)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from llmtap.store import (
    REQUEST_OBJECTIVES,
    REQUEST_OUTCOMES,
    VERSION,
    By,
    Filter,
    Group,
    Objective,
    Scan,
    Skips,
    count_request_objective,
    slowest,
)
from llmtap.store.engine_sql import BUCKET, LISTS, MACROS, grouping, json_ids, json_read, locate, parquet_read, q
from llmtap.store.files import file_lines, find, inspect, settle, splits_at_cr

__all__ = ["EngineSource"]

#: What the engine may hold in memory before it spills to its temporary directory.
MEMORY_LIMIT = "512MB"
#: Files read by one statement at most (a part: its rows are held at once, in memory or spilled).
PART_FILES = 256
#: What ``read_csv``'s rejects count as, by error type; another (a stray delimiter) is a line that is not JSON.
_REJECTS = {"INVALID ENCODING": "not_utf8", "LINE SIZE OVER MAXIMUM": "too_long"}

#: A group's side key, route and shape.
_GroupKey = tuple[str | None, str | None, str | None]


def _cell(got: dict[str, Any], name: str, row: int) -> Any:
    """One value of a column ``fetchnumpy`` gave (a masked entry as None)."""
    import numpy as np

    column = got[name]
    if np.ma.getmaskarray(column)[row]:
        return None
    return np.ma.getdata(column)[row]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(eq=False)
class _Part:
    """Files read by one statement: what the engine reads, how each is named, and which statement read it."""

    files: list[Path]
    names: list[str]
    parquet: bool
    chosen: int | None = None

    def halves(self) -> list[_Part]:
        mid = len(self.files) // 2
        return [
            _Part(self.files[:mid], self.names[:mid], self.parquet),
            _Part(self.files[mid:], self.names[mid:], self.parquet),
        ]


@dataclass(eq=False)
class _Facts:
    """One part's share of a scan, merged with the others' at the end."""

    part: _Part
    rejected: Skips
    skips: Skips = field(default_factory=Skips)
    counts: dict[str, int] = field(default_factory=dict)
    groups: dict[_GroupKey, Group] = field(default_factory=dict)
    ranks: dict[_GroupKey, Any] = field(default_factory=dict)
    kept: dict[tuple[_GroupKey, str], list[Any]] = field(default_factory=dict)
    ok: dict[_GroupKey, list[tuple[Any, Any, Any, Any]]] = field(default_factory=dict)
    ids: Any = None  # the hashes of its records' identities (numpy uint64)


class _Unread(Exception):
    """No statement could read a part."""


class EngineSource:
    """Record files through DuckDB."""

    def __init__(self, paths: Iterable[str | Path], *, threads: int | None = None) -> None:
        import duckdb

        self.paths = [str(p) for p in paths]
        listing = find(self.paths)
        self.files, self.odd = listing.files, listing.odd
        self._dir = tempfile.mkdtemp(prefix="llmtap-engine-")
        self._con = duckdb.connect()
        settings = [
            f"SET memory_limit = {q(MEMORY_LIMIT)}",
            f"SET temp_directory = {q(str(Path(self._dir) / 'spill'))}",
            "SET TimeZone = 'UTC'",
            "SET enable_progress_bar = false",
            "SET preserve_insertion_order = false",
        ]
        if threads is not None:
            settings.append(f"SET threads = {int(threads)}")
        for statement in settings:
            self._con.execute(statement)
        self._con.execute(MACROS)
        #: Per group, each part's (ok, ttft, tpot, e2e, ttfot, ttst) as fetched: what count_met reads (unsorted).
        self._ok: dict[_GroupKey, list[tuple[Any, ...]]] = {}
        self._ok_of: tuple[Filter, By, dict[_GroupKey, _GroupKey]] | None = None
        #: Files DuckDB could not read: a plain copy of what Python read of them (None: nothing), and what that
        #: read counted; kept for the next scan.
        self._settled: dict[Path, tuple[Path | None, Skips]] = {}

    def close(self) -> None:
        """Close the engine and remove its temporary database (and the copies it read)."""
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

    def _columns(self, source: str) -> dict[str, str]:
        return {row[0]: str(row[1]) for row in self._con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}

    def _reads(self, part: _Part, *, positions: bool = False) -> list[Callable[[], str]]:
        """The statements that may read a part, in order: Parquet read as one schema (a reader that unions ten
        thousand files' schemas peaked at 1.9 GB of RSS at 10M records), or by column name when its files
        differ (written by two versions of llmtap)."""
        if not part.parquet:
            return [partial(json_read, part.files, positions=positions)]
        return [
            partial(parquet_read, part.files, self._columns, union=union, positions=positions)
            for union in (False, True)
        ]

    def _parts(self, skips: Skips) -> list[_Part]:
        """The readable files in parts of at most ``PART_FILES`` files of one kind, in order; a file read before
        by Python (``_settled``) as its copy, in a part of its own."""
        for name, what in self.odd.items():
            skips.add("unreadable", name, why=what)
        parts: list[_Part] = []
        lines: list[Path] = []

        def flush() -> None:
            for i in range(0, len(lines), PART_FILES):
                batch = lines[i : i + PART_FILES]
                parts.append(_Part(batch, [str(f) for f in batch], False))
            lines.clear()

        parquet: list[Path] = []
        for f in self.files:
            if f in self._settled:
                copy, counted = self._settled[f]
                skips.merge(counted)
                if copy is not None:
                    flush()
                    parts.append(_Part([copy], [str(f)], False))
                continue
            bad = inspect(f)
            if bad is not None:
                skips.add(bad[0], str(f), why=bad[1])
            elif f.name.endswith(".parquet"):
                parquet.append(f)
            elif _size(f) and splits_at_cr(f):  # read_csv would end its one line at a carriage return
                copy, counted = self._settled[f] = self._copy(f, str(f))
                skips.merge(counted)
                flush()
                parts.append(_Part([copy], [str(f)], False))
            elif _size(f):  # an empty file (one just opened) has no line
                lines.append(f)
            elif not f.exists():
                skips.add("unreadable", str(f), why="removed before it was read")
        flush()
        for i in range(0, len(parquet), PART_FILES):
            batch = parquet[i : i + PART_FILES]
            parts.append(_Part(batch, [str(f) for f in batch], True))
        return parts

    def _rejects(self, part: _Part) -> Skips:
        """What ``read_csv`` refused of the part's lines, by cause and file."""
        import duckdb

        out = Skips()
        if part.parquet:
            return out
        names = {str(f): n for f, n in zip(part.files, part.names, strict=True)}
        try:
            rows = self._con.execute(
                "SELECT s.file_path, e.error_type::VARCHAR, own_line(e.csv_line), count(*) FROM reject_errors e "
                "JOIN reject_scans s ON e.scan_id = s.scan_id AND e.file_id = s.file_id GROUP BY ALL"
            ).fetchall()
        except duckdb.CatalogException:  # nothing refused: no table
            rows = []
        for path, error, own, n in rows:
            cause = _REJECTS.get(error) or ("truncated" if own else "foreign")
            out.add(cause, names.get(path, path), int(n))
        return out

    def _run(self, part: _Part, sql: str, params: list[Any]) -> tuple[dict[str, Any], Skips]:
        """The part grouped by ``sql`` (``__READ__`` its read), and what its read refused; ``_Unread`` when no
        statement can read it."""
        import duckdb

        error: Exception | None = None
        for i, read in enumerate(self._reads(part)):
            if part.chosen is not None and i != part.chosen:
                continue
            self._con.execute("DROP TABLE IF EXISTS reject_errors; DROP TABLE IF EXISTS reject_scans")
            try:
                got = self._con.execute(sql.replace("__READ__", read()), params).fetchnumpy()
            except duckdb.Error as exc:
                error = exc
                continue
            part.chosen = i
            return got, self._rejects(part)
        raise _Unread(str(error).strip().splitlines()[0] if error else "no statement")

    def _read(self, part: _Part, sql: str, params: list[Any], skips: Skips) -> list[_Facts]:
        """A part's facts; a part that fails read in halves, down to the file that fails (``_unread``)."""
        try:
            got, rejected = self._run(part, sql, params)
        except _Unread as exc:
            if len(part.files) > 1:
                return [f for half in part.halves() for f in self._read(half, sql, params, skips)]
            return self._unread(part, str(exc), sql, params, skips)
        return self._fold(part, got, rejected)

    def _unread(self, part: _Part, error: str, sql: str, params: list[Any], skips: Skips) -> list[_Facts]:
        """A file DuckDB cannot read: a Parquet file is damaged; a JSON-lines file is read by Python into a plain
        copy that DuckDB can read (its damage, and the lines the copy leaves out, counted as Python counts them)."""
        file, name = part.files[0], part.names[0]
        counted = Skips()
        copy: Path | None = None
        if part.parquet:
            counted.add("damaged", name, why=f"Parquet unreadable: {error[:200]}")
        elif file in self._settled or file.parent == Path(self._dir):
            counted.add("unreadable", name, why=error[:200])
        else:
            copy, counted = self._copy(file, name)
        self._settled[file] = (copy, counted)
        skips.merge(counted)
        if copy is None:
            return []
        return self._read(_Part([copy], [name], False), sql, params, skips)

    def _copy(self, file: Path, name: str) -> tuple[Path, Skips]:
        """A plain copy of what Python reads of a JSON-lines file, that DuckDB can read as Python reads it, and what
        that read counted: a line with a byte ``read_csv`` may end a line at is settled here, and written as JSON
        again (or left out, counted)."""
        counted = Skips()
        copy = Path(self._dir) / f"copy-{len(self._settled)}.jsonl"
        with copy.open("wb") as out:
            for line in file_lines(file, counted):
                if b"\r" in line or b"\x01" in line:  # what read_csv may split: settled as Python reads it
                    obj = settle(line, counted, name)
                    if obj is None:
                        continue
                    line = json.dumps(obj).encode()
                out.write(line + b"\n")
        return copy, counted

    def _fold(self, part: _Part, got: dict[str, Any], rejected: Skips) -> list[_Facts]:
        """A part's statement's rows as facts, one per ``BUCKET`` of its files (what a record's copies read again):
        the groups' counts and lists, the other rows' kinds by file; what the read refused with the first."""
        import numpy as np

        buckets: dict[int, _Facts] = {}
        ids: dict[int, list[Any]] = {}
        for r in range(len(got["kind"])):
            b = int(_cell(got, "bucket", r))
            facts = buckets.get(b)
            if facts is None:
                files, names = part.files[b * BUCKET : (b + 1) * BUCKET], part.names[b * BUCKET : (b + 1) * BUCKET]
                facts = buckets[b] = _Facts(_Part(files, names, part.parquet, part.chosen), Skips())
            kind, n = str(_cell(got, "kind", r)), int(_cell(got, "n", r))
            found = _cell(got, "ids", r)
            if found is not None and len(found):
                ids.setdefault(b, []).append(np.asarray(found, dtype=np.uint64))
            if kind in ("record", "out"):
                facts.counts[kind] = facts.counts.get(kind, 0) + n
                facts.skips.add("wrong_type", None, int(_cell(got, "wrong", r)))
            else:
                fi = _cell(got, "fi", r)
                name = part.names[int(fi)] if fi is not None else None
                if kind == "wrong_schema":
                    facts.skips.add(kind, name, why="none of a record's columns")
                else:
                    facts.skips.add(kind, name, n)
            if kind == "record":
                self._group(facts, got, r)
        out = [buckets[b] for b in sorted(buckets)] or [_Facts(part, Skips())]
        out[0].rejected = rejected
        out[0].skips.merge(rejected)
        for b, facts in buckets.items():
            facts.ids = np.concatenate(ids[b]) if b in ids else np.empty(0, dtype=np.uint64)
        if not buckets:
            out[0].ids = np.empty(0, dtype=np.uint64)
        return out

    def _group(self, facts: _Facts, got: dict[str, Any], r: int) -> None:
        """One group's row of a part's statement, into the part's facts."""
        gk = (_text(_cell(got, "key", r)), _text(_cell(got, "route", r)), _text(_cell(got, "shape", r)))
        first, last = float(_cell(got, "first", r)), float(_cell(got, "last", r))
        g = facts.groups[gk] = Group(*gk, int(_cell(got, "n", r)), int(_cell(got, "errors", r)), 0, first, last)
        g.met = int(_cell(got, "met", r))
        g.input_tokens = int(_cell(got, "input_tokens", r))
        g.cached_tokens = int(_cell(got, "cached", r))
        o = _cell(got, "objective", r)
        if o is not None:
            # The rank the part's arg_max chose by, again: the newest, then the objective's order.
            facts.ranks[gk] = (o["at"], o["p"], *(-1 if o[f] is None else o[f] for f in "toefn"), o["s"] or "")
            g.objective = Objective(o["s"], float(o["p"]), o["t"], o["o"], o["e"], o["f"], o["n"])
            g.objective_time = float(o["at"])
        for cls, n in (_cell(got, "classes", r) or {}).items():
            g.classes[str(cls)] = g.classes.get(str(cls), 0) + int(n)
        sources = _cell(got, "sources", r)
        if sources is not None:
            g.prefill_sources.update(str(v) for v in sources)
        g.priced = int(_cell(got, "priced", r))
        g.cost = float(_cell(got, "cost_sum", r))
        for figure, column in REQUEST_OBJECTIVES.items():
            for outcome in REQUEST_OUTCOMES:
                count_request_objective(g, figure, outcome, int(_cell(got, f"{column}_{outcome}", r)))
        # The part's slowest ok streams of the group, with their trace ids (merged with the parts' after).
        top = _cell(got, "slowest", r)
        if top is not None:
            g.slowest.extend((float(v["t"]), str(v["id"])) for v in top)
        self._keep(gk, {name: _cell(got, name, r) for name in LISTS}, facts.kept, facts.ok)

    def _dedupe(self, facts: list[_Facts], sql: str, params: list[Any]) -> None:
        """Each identity once: when the hash of an identity was read more than once, the buckets of files that
        hold it are located (positions and ids of those records, in the order read), every copy after the first
        marked, and those buckets grouped again without them (``sql``, the grouping with ``llmtap_drop``)."""
        import numpy as np

        every = np.concatenate([f.ids for f in facts]) if facts else np.empty(0, dtype=np.uint64)
        every.sort()
        dups = np.unique(every[1:][every[1:] == every[:-1]])
        del every
        # What a record of an older version holds when no span was made (tracing off): no identity, and the same in
        # every such record.
        none = self._con.execute("SELECT hash(?)", ["0" * 32 + ":" + "0" * 16]).fetchone()
        dups = dups[dups != np.uint64(none[0] if none else 0)]
        if not len(dups):
            return
        self._con.execute(
            "CREATE OR REPLACE TEMP TABLE llmtap_dups AS SELECT unnest(?::UBIGINT[]) AS h", [dups.tolist()]
        )
        seen: set[str] = set()
        again: dict[int, list[_Facts]] = {}  # the facts read again, by the index of those they replace
        # Positions follow the order of the files' lines only while the engine keeps the order it read.
        self._con.execute("SET preserve_insertion_order = true")
        try:
            for i, f in enumerate(facts):
                if not np.isin(f.ids, dups).any():
                    continue
                read = self._reads(f.part, positions=True)[f.part.chosen or 0]
                # Where the copies are: a JSON-lines part read for its ids alone (Parquet reads only the columns asked).
                ids = read() if f.part.parquet else json_ids(f.part.files)
                drop = []
                for pos, ident in self._con.execute(locate(ids)).fetchall():
                    if ident in seen:
                        drop.append(pos)
                    seen.add(ident)
                if drop:
                    self._con.execute(
                        "CREATE OR REPLACE TEMP TABLE llmtap_drop AS SELECT unnest(?::BIGINT[]) AS pos", [drop]
                    )
                    got = self._con.execute(sql.replace("__READ__", read()), params).fetchnumpy()
                    again[i] = self._fold(f.part, got, f.rejected)
        finally:
            self._con.execute("SET preserve_insertion_order = false")
        facts[:] = [g for i, f in enumerate(facts) for g in again.get(i, [f])]

    @staticmethod
    def _where(where: Filter) -> tuple[str, list[Any]]:
        clauses, params = ["true"], []
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
        """The grouped facts, in one read of the files: one statement per part groups its rows (the lines
        that are not records by their kind and file) and gathers each group's figures as lists, which come back
        as numpy buffers; a record read twice is counted once (``_dedupe``); the parts' groups are merged, and
        each figure sorted once at the end."""
        cond, params = self._where(where)
        key, key_params = self._key(by)
        skips = Skips()
        facts: list[_Facts] = []
        for part in self._parts(skips):
            facts += self._read(part, grouping(key, cond), key_params + params, skips)
        self._dedupe(facts, grouping(key, cond, dedupe=True), key_params + params)
        groups, counts = self._merge(facts, skips)
        self._ok_of = (where, by, {gk: gk for gk in groups})
        records = counts.get("record", 0) + counts.get("out", 0)
        return Scan(list(groups.values()), self.describe(), records, len(self.files), skips)

    def _merge(self, facts: list[_Facts], skips: Skips) -> tuple[dict[_GroupKey, Group], dict[str, int]]:
        """The parts' facts as one: groups summed (the newest objective kept), figures joined and sorted."""
        import numpy as np

        groups: dict[_GroupKey, Group] = {}
        ranks: dict[_GroupKey, Any] = {}
        counts: dict[str, int] = {}
        kept: dict[tuple[_GroupKey, str], list[Any]] = {}
        self._ok = {}
        for f in facts:
            skips.merge(f.skips)
            for kind, n in f.counts.items():
                counts[kind] = counts.get(kind, 0) + n
            for gk, part in f.groups.items():
                g = groups.get(gk)
                if g is None:
                    g = groups[gk] = Group(*gk, 0, 0, 0, part.first, part.last)
                g.requests += part.requests
                g.errors += part.errors
                g.met += part.met
                g.first, g.last = min(g.first, part.first), max(g.last, part.last)
                g.input_tokens += part.input_tokens
                g.cached_tokens += part.cached_tokens
                if gk in f.ranks and (gk not in ranks or f.ranks[gk] > ranks[gk]):
                    ranks[gk] = f.ranks[gk]
                    g.objective, g.objective_time = part.objective, part.objective_time
                for cls, n in part.classes.items():
                    g.classes[cls] = g.classes.get(cls, 0) + n
                g.prefill_sources |= part.prefill_sources
                g.priced += part.priced
                g.cost += part.cost
                for figure, outcomes in part.request_objectives.items():
                    for outcome, n in outcomes.items():
                        count_request_objective(g, figure, outcome, n)
                g.slowest.extend(part.slowest)
            for k, chunks in f.kept.items():
                kept.setdefault(k, []).extend(chunks)
            for gk, values in f.ok.items():
                self._ok.setdefault(gk, []).extend(values)
        facts.clear()
        for g in groups.values():
            g.slowest = slowest([g.slowest])
        for (gk, attr), chunks in kept.items():
            joined = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            chunks.clear()
            joined.sort()
            setattr(groups[gk], attr, array("d", joined.tobytes()))
            del joined
        return groups, counts

    @staticmethod
    def _keep(
        gk: _GroupKey,
        got: dict[str, Any],
        kept: dict[tuple[_GroupKey, str], list[Any]],
        ok_values: dict[_GroupKey, list[tuple[Any, ...]]],
    ) -> None:
        """A group's values in one part, as numpy buffers (a null as NaN), appended per figure; and the
        part's columns as they are, for ``count_met`` (which picks the ok records' only when asked)."""
        import numpy as np

        if got["flags"] is None or not len(got["flags"]):
            return
        flags = np.asarray(got["flags"], dtype=np.uint8)
        ok, stream = (flags & 2) != 0, (flags & 1) != 0
        ttft, tpot = np.asarray(got["ttft"], dtype=np.float64), np.asarray(got["tpot"], dtype=np.float64)
        e2e, prefill = np.asarray(got["e2e"], dtype=np.float64), np.asarray(got["prefill"], dtype=np.float64)
        ttfot, ttst = np.asarray(got["ttfot"], dtype=np.float64), np.asarray(got["ttst"], dtype=np.float64)
        streamed = stream & ~np.isnan(ttft)
        ttft_ok = streamed & ok
        masks = {
            "ttft_ok": (ttft, ttft_ok),
            "ttft_failed": (ttft, streamed & ~ok),
            "prefill": (prefill, ttft_ok & ~np.isnan(prefill)),
            "tpot": (tpot, ok & ~np.isnan(tpot)),
            "e2e": (e2e, ~np.isnan(e2e)),
            "ttfot": (ttfot, ok & stream & ~np.isnan(ttfot)),
            "ttst": (ttst, ok & stream & ~np.isnan(ttst)),
        }
        # count_met's TTFT and TTFOT: a non-stream has none, and those limits do not apply (as the proxy judges it).
        unstreamed = ~stream
        ok_values.setdefault(gk, []).append(
            (
                ok,
                np.where(unstreamed & np.isnan(ttft), 0.0, ttft),
                tpot,
                e2e,
                np.where(unstreamed & np.isnan(ttfot), 0.0, ttfot),
                ttst,
            )
        )
        for attr, (column, mask) in masks.items():
            picked = column[mask]
            if len(picked):
                kept.setdefault((gk, attr), []).append(picked)

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
            parts = self._ok.get(gh)
            if not parts:
                continue
            ttft, tpot, e2e, ttfot, ttst = (np.concatenate([p[i][p[0]] for p in parts]) for i in (1, 2, 3, 4, 5))
            # A null TPOT or TTST (one chunk) is within any limit; any other null (NaN) is past it.
            values = {
                "ttft": ttft,
                "tpot": np.nan_to_num(tpot, nan=0.0),
                "e2e": e2e,
                "ttfot": ttfot,
                "ttst": np.nan_to_num(ttst, nan=0.0),
            }
            met = np.ones(len(ttft), dtype=bool)
            for figure, limit in lim.items():
                met &= values[figure] <= limit
            n = int(np.count_nonzero(met))
            if n:
                out[(key, route, shape)] = n
        return out
