"""A request record as a row of the ClickHouse table (``clickhouse.sql``): its columns, and their types.

Every column of the table comes from ``flat_row``: nested fields flattened with a prefix, a value of the wrong type
as null (or the type's zero where the column takes none), so one odd record cannot make ClickHouse refuse its
batch; and ``record_id``, what the table keeps one row of.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["DDL_FILE", "column_kinds", "flat_row", "record_id"]

DDL_FILE = Path(__file__).with_name("clickhouse.sql")


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


def record_id(record: Mapping[str, Any]) -> str:
    """What the table keeps one row of: the record's identity as ``llmtap.store.files.identity`` has it, its
    ``record_id`` (made with the request, traced or not), else (a record of an older version) its trace and span ids
    (each a string neither empty nor all zeros); a random id, marked by a leading ``-``, for a record without one,
    so that no other is taken for it."""
    rid = record.get("record_id")
    if isinstance(rid, str):
        return rid if rid.strip("0") and not rid.startswith("-") else "-" + uuid.uuid4().hex
    trace, span = record.get("trace_id"), record.get("span_id")
    if isinstance(trace, str) and isinstance(span, str) and trace.strip("0") and span.strip("0"):
        return f"{trace}-{span}"
    return "-" + uuid.uuid4().hex


def _json(value: Any) -> str | None:
    """A nested part kept whole as compact JSON (None stays null)."""
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _request_objective(record: Mapping[str, Any]) -> dict[str, Any]:
    """The request's own objectives (``x-slo-*``): each limit and its outcome, as columns."""
    asked = _part(record, "request_objective")
    return {
        f"request_{figure}{suffix}": asked.get(f"{figure}{suffix}")
        for figure in ("ttft", "tpot")
        for suffix in ("", "_outcome")
    }


def flat_row(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """A record as a row of the table; None for one without a readable time."""
    t = _epoch(record.get("time"))
    if t is None:
        return None
    objective, slots, gaps = _part(record, "objective"), _part(record, "slots"), _part(record, "gaps")
    tokens, cache = _part(record, "tokens"), _part(record, "cache")
    prompt, attribution = record.get("prompt"), record.get("attribution")
    cost = _part(record, "cost")
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
        "objective_ttfot": objective.get("ttfot"),
        "objective_ttst": objective.get("ttst"),
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
        "tokens_cache_write_1h": tokens.get("cache_write_1h"),
        "prompt_json": _json(prompt),
        "cache_class": cache.get("class"),
        "cache_changed_region": cache.get("changed_region"),
        "cache_expected_prefix_tokens": cache.get("expected_prefix_tokens"),
        "cache_cached_tokens": cache.get("cached_tokens"),
        "cache_min_tokens": cache.get("min_tokens"),
        "cost_amount": cost.get("amount"),
        "cost_status": cost.get("status"),
        "cost_currency": cost.get("currency"),
        "cost_source": cost.get("source"),
        "cost_prices": cost.get("prices"),
        "attribution_json": _json(attribution),
        **_request_objective(record),
        "record_id": record_id(record),
    }
    for name in ("ttft", "ttfot", "ttst", "ttfb", "upstream_ttft", "tpot", "e2e", "queue", "queue_source", "prefill"):
        row[name] = record.get(name)
    for name in ("prefill_source", "decode", "server_decode", "upstream_unattributed"):
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
        for name, kind in column_kinds().items():
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


def column_kinds() -> dict[str, str]:
    """Each column of ``clickhouse.sql`` and its type."""
    if not _KINDS:
        for match in re.finditer(r"^\s{4}(\w+) ([\w()']+),?$", DDL_FILE.read_text(encoding="utf-8"), re.M):
            _KINDS[match.group(1)] = match.group(2)
    return _KINDS
