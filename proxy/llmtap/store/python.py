"""The reference source: record files read in one pass in plain Python, no engine.

Each line is parsed with ``json``, checked for the record key and a schema version llmtap writes (1 or 2),
flattened to the columns analysis reads (``llmtap.store.COLUMNS``: a wrong-typed value reads as null) and
folded into its group at once; only the figures' values are kept, as ``array('d')``, and sorted at the
end. What is not read is counted as ``llmtap.store.files`` counts it (``llmtap.store.skips.CAUSES``: damaged
and unreadable files, lines that are not records, records without a time), and a record read again (the same
identity, ``llmtap.store.files.identity``) counts once. Reads ``.jsonl``, ``.jsonl.gz`` and rotated files; a
Parquet file is named and passed over (the engine reads it).
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmtap.store import (
    REQUEST_OBJECTIVES,
    SLOWEST,
    TIME_GRAMMAR,
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
from llmtap.store.files import find, identity, inspect, read_file

__all__ = ["PythonSource"]

_TIME = re.compile(TIME_GRAMMAR)

_INT64 = 2**63
_Order = tuple[float, float, float, float, float, float, str]
#: The limits a record's objective may hold, in ``Objective``'s order.
OBJECTIVE_FIGURES = ("ttft", "tpot", "e2e", "ttfot", "ttst")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if -_INT64 <= value < _INT64 else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


#: The fields a record is read by (as ``llmtap.store.COLUMNS``), each with what reads it; time apart.
_FIELDS: tuple[tuple[tuple[str, ...], Any], ...] = (
    *(((name,), _str) for name in ("route", "model", "shape", "prompt_version", "outcome", "slo", "prefill_source")),
    *(((name,), _num) for name in ("ttft", "tpot", "e2e", "ttfot", "ttst", "prefill")),
    (("tokens", "input"), _int),
    (("tokens", "cache_read"), _int),
    (("cache", "class"), _str),
    (("objective", "shape"), _str),
    *((("objective", name), _num) for name in ("percentile", *OBJECTIVE_FIGURES)),
    (("trace_id",), _str),
    (("span_id",), _str),
    (("record_id",), _str),
    (("cost", "amount"), _num),
    *((("request_objective", f"{figure}_outcome"), _str) for figure in REQUEST_OBJECTIVES),
)


def wrong_typed(rec: dict[str, Any]) -> bool:
    """Whether a field the record is read by holds a value of the wrong type (which reads as null)."""
    stream = rec.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return True
    for path, read in _FIELDS:
        value: Any = rec
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and read(value) is None:
            return True
    return False


def time_s(value: Any) -> float | None:
    """Epoch seconds of a record's ``time`` (``TIME_GRAMMAR``; without a zone, UTC), or None."""
    if not isinstance(value, str):
        return None
    text = value.strip(" \t\n\r")
    if _TIME.fullmatch(text) is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:  # a date the calendar has not (February 30th)
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def objective(raw: Any) -> Objective | None:
    """A record's objective, when valid: 0 < percentile < 1 and at least one limit."""
    obj = _dict(raw)
    share = _num(obj.get("percentile"))
    limits = [_num(obj.get(k)) for k in OBJECTIVE_FIGURES]
    if share is None or not 0 < share < 1 or all(v is None for v in limits):
        return None
    return Objective(_str(obj.get("shape")), share, *limits)


def _figures(g: Group, rec: dict[str, Any], ok: bool, stream: bool) -> None:
    """A record's figures into its group's values (sorted at the end of the scan)."""
    ttft, prefill = _num(rec.get("ttft")), _num(rec.get("prefill"))
    if stream and ttft is not None:
        (g.ttft_ok if ok else g.ttft_failed).append(ttft)
        if ok:
            g.slowest.append((ttft, _str(rec.get("trace_id")) or ""))
            if len(g.slowest) > 8 * SLOWEST:  # kept short as it grows: only the slowest few count
                g.slowest = slowest([g.slowest])
        if ok and prefill is not None:
            g.prefill.append(prefill)
            g.prefill_sources.add(_str(rec.get("prefill_source")) or "unknown")
    ttfot, ttst = _num(rec.get("ttfot")), _num(rec.get("ttst"))
    if ok and stream and ttfot is not None:
        g.ttfot.append(ttfot)
    if ok and stream and ttst is not None:
        g.ttst.append(ttst)
    tpot, e2e = _num(rec.get("tpot")), _num(rec.get("e2e"))
    if ok and tpot is not None:
        g.tpot.append(tpot)
    if e2e is not None:
        g.e2e.append(e2e)


class PythonSource:
    """Record files, read line by line."""

    def __init__(self, paths: Iterable[str | Path]) -> None:
        self.paths = [str(p) for p in paths]
        listing = find(self.paths)
        self.files, self.odd = listing.files, listing.odd

    def close(self) -> None:
        """Nothing to release: each file is closed as soon as it is read."""

    def describe(self) -> str:
        """The paths as a report names them."""
        return ", ".join(self.paths)

    def records(self, skips: Skips) -> Iterator[dict[str, Any]]:
        """Every record with a time (as ``time_s``) of every file, each identity once (the first read); what was
        passed over counted in ``skips``."""
        for name, what in self.odd.items():
            skips.add("unreadable", name, why=what)
        seen: set[str] = set()
        for file in self.files:
            bad = inspect(file)
            if bad is None and file.name.endswith(".parquet"):
                bad = ("unreadable", "Parquet: read by the engine (--engine duckdb)")
            if bad is not None:
                skips.add(bad[0], str(file), why=bad[1])
                continue
            for rec in read_file(file, skips):
                t = time_s(rec.get("time"))
                if t is None:
                    skips.add("no_time", str(file))
                    continue
                key = identity(rec)
                if key is not None:
                    if key in seen:
                        skips.add("duplicate", str(file))
                        continue
                    seen.add(key)
                if wrong_typed(rec):
                    skips.add("wrong_type", None)
                rec["time_s"] = t
                yield rec

    def _rows(self, where: Filter, skips: Skips, counts: list[int]) -> Iterator[dict[str, Any]]:
        for rec in self.records(skips):
            counts[0] += 1
            t: float = rec["time_s"]
            if (where.start is not None and t < where.start) or (
                where.end is not None and (t >= where.end if where.open_end else t > where.end)
            ):
                continue
            route, model, shape = _str(rec.get("route")), _str(rec.get("model")), _str(rec.get("shape"))
            if (
                (where.route is not None and route != where.route)
                or (where.model is not None and model != where.model)
                or (where.shape is not None and shape != where.shape)
            ):
                continue
            yield rec

    def scan(self, where: Filter, by: By) -> Scan:
        """One pass: each record folded into its group, the figures sorted at the end."""
        skips = Skips()
        counts = [0]
        groups: dict[tuple[str | None, str | None, str | None], Group] = {}
        ranks: dict[tuple[str | None, str | None, str | None], tuple[float, _Order]]
        ranks = {}
        for rec in self._rows(where, skips, counts):
            t: float = rec["time_s"]
            if by == VERSION:
                key = _str(rec.get("prompt_version"))
            elif isinstance(by, float):
                key = "before" if t < by else "after"
            else:
                key = None
            gk = (key, _str(rec.get("route")), _str(rec.get("shape")))
            g = groups.get(gk)
            if g is None:
                g = groups[gk] = Group(*gk, first=t, last=t)
            g.requests += 1
            g.first, g.last = min(g.first, t), max(g.last, t)
            ok = rec.get("outcome") == "ok"
            g.errors += not ok
            g.met += rec.get("slo") == "met"
            stream = rec.get("stream") is True
            tokens, cache = _dict(rec.get("tokens")), _dict(rec.get("cache"))
            cls = _str(cache.get("class"))
            if cls is not None:
                g.classes[cls] = g.classes.get(cls, 0) + 1
            obj = objective(rec.get("objective"))
            if obj is not None:
                rank = (t, obj.order())
                if gk not in ranks or rank > ranks[gk]:
                    ranks[gk] = rank
                    g.objective, g.objective_time = obj, t
            _figures(g, rec, ok, stream)
            asked = _dict(rec.get("request_objective"))
            for figure in REQUEST_OBJECTIVES:
                count_request_objective(g, figure, _str(asked.get(f"{figure}_outcome")))
            cost = _num(_dict(rec.get("cost")).get("amount"))
            if cost is not None:
                g.priced += 1
                g.cost += cost
            inp = _int(tokens.get("input"))
            if ok and inp is not None:
                g.input_tokens += inp
                g.cached_tokens += _int(tokens.get("cache_read")) or 0
        for g in groups.values():
            for name in ("ttft_ok", "ttft_failed", "prefill", "tpot", "e2e", "ttfot", "ttst"):
                setattr(g, name, array("d", sorted(getattr(g, name))))
            g.slowest = slowest([g.slowest])
        return Scan(list(groups.values()), self.describe(), counts[0], len(self.files), skips)

    def count_met(
        self, where: Filter, by: By, limits: dict[tuple[str, str], dict[str, float]]
    ) -> dict[tuple[str | None, str, str], int]:
        """Ok records within every limit of their route and shape (a null tpot as 0, another null as missed)."""
        out: dict[tuple[str | None, str, str], int] = {}
        for rec in self._rows(where, Skips(), [0]):
            route, shape = _str(rec.get("route")), _str(rec.get("shape"))
            if route is None or shape is None or (route, shape) not in limits or rec.get("outcome") != "ok":
                continue
            met = True
            for figure, limit in limits[(route, shape)].items():
                value = _num(rec.get(figure))
                if value is None and (
                    figure in ("tpot", "ttst") or (figure in ("ttft", "ttfot") and rec.get("stream") is not True)
                ):
                    value = 0.0  # no TPOT or TTST (one chunk), or no TTFT (not streamed): that limit does not apply
                if value is None or value > limit:
                    met = False
            if met:
                t: float = rec["time_s"]
                key = (
                    _str(rec.get("prompt_version"))
                    if by == VERSION
                    else ("before" if t < by else "after")
                    if isinstance(by, float)
                    else None
                )
                out[(key, route, shape)] = out.get((key, route, shape), 0) + 1
        return out
