"""Request records (``--record DIR``): one JSON object per finished request, for ``llmtap compare`` and any engine.

A record holds the request's timings and their sources, its tokens and their sources, its prompt fingerprint
and version, its cache class and its SLO outcome, and who wrote it (instance id, host, pid, llmtap version) and
which trace it is (trace and root span ids, the upstream's response id); never prompt or completion text,
headers or error messages (which can quote a prompt). Its JSON Schema is published in
``docs/record.schema.json``. This module builds a record from a finished request; where records go is
``llmtap.telemetry.records.sinks`` (the dataset of files is ``llmtap.telemetry.records.dataset``, which writes them),
and reading them back, from a dataset folder or from the single file and its rotated siblings that versions before
schema 2 wrote, is ``llmtap.store.files`` (``read_records``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from llmtap.analysis.attribution import record_part
from llmtap.analysis.cachediag import Diagnosis
from llmtap.analysis.cost import Cost
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import SLO
from llmtap.labels import clean_or_none
from llmtap.store import files
from llmtap.telemetry.identity import Identity

__all__ = ["SCHEMA_KEY", "SCHEMA_VERSION", "record_line"]

#: The key that marks a line as a request record (its value is the schema version), as the reader knows it.
SCHEMA_KEY = files.SCHEMA_KEY
#: Version 2 added who wrote the record and which trace it is (``instance_id`` .. ``response_id``).
SCHEMA_VERSION = 2


def _round(value: float | None) -> float | None:
    # Microseconds are more than the clock's honesty allows; shorter lines are cheaper to keep.
    return None if value is None else round(value, 6)


def _gaps(s: Summary) -> dict[str, Any]:
    gaps = s.gaps
    if not gaps:
        return {"n": 0}
    return {"n": len(gaps), "p50": _round(s.gap_p50), "p95": _round(s.gap_p95), "max": _round(max(gaps))}


def objective_line(slo: SLO | None) -> dict[str, Any] | None:
    """The objective a request was judged by, as its record keeps it (so ``llmtap slo`` needs no config)."""
    if slo is None:
        return None
    return {"shape": slo.shape, "percentile": slo.percentile, **slo.limits()}


def request_objective_part(tl: Timeline, s: Summary) -> dict[str, Any] | None:
    """The request's own objectives (``x-slo-*``), their outcomes and the headers ignored; None without any."""
    objective = tl.request_objective
    if objective is None:
        return None
    return {
        "ttft": objective.ttft,
        "tpot": objective.tpot,
        "ttft_outcome": s.request_outcomes.get("ttft"),
        "tpot_outcome": s.request_outcomes.get("tpot"),
        "invalid": list(objective.invalid),
    }


def record_line(tl: Timeline, s: Summary, diag: Diagnosis | None, writer: Identity) -> dict[str, Any]:
    """The record of one finished request (schema version 2), written by ``writer``.

    The strings a client or an upstream chose are ``clean``: a lone surrogate cannot be written as UTF-8,
    and the whole line would be lost. The record's fields in the order of its schema, one line each (the nested
    parts by name), so the line and ``docs/records.md`` read side by side."""
    req = tl.request
    out: dict[str, Any] = {
        SCHEMA_KEY: SCHEMA_VERSION,
        "time": datetime.fromtimestamp(tl.received_wall_ns / 1e9, UTC).isoformat(timespec="milliseconds"),
        "trace_id": tl.trace_id,
        "span_id": tl.span_id,
        "record_id": tl.record_id,
        "response_id": clean_or_none(tl.response_id),
        "instance_id": writer.instance_id,
        "host": writer.host,
        "pid": writer.pid,
        "llmtap_version": writer.version,
        "route": tl.route,
        "upstream": tl.upstream,
        "protocol": tl.protocol,
        "operation": req.operation if req else None,
        "model": clean_or_none(req.model) if req else None,
        "response_model": clean_or_none(tl.response_model),
        "stream": bool(req and req.stream),
        "status": tl.status_code,
        "outcome": tl.outcome,
        "error_type": clean_or_none(tl.error_type),
        "slo": s.slo,
        "shape": s.shape,
        "objective": objective_line(s.objective),
        "prompt_version": tl.prompt_version,
        "ttft": _round(s.ttft),
        "ttfot": _round(s.ttfot),
        "ttst": _round(s.ttst),
        "ttfb": _round(s.ttfb),
        "upstream_ttft": _round(s.upstream_ttft),
        "tpot": _round(s.tpot),
        "e2e": _round(s.e2e),
        "queue": _round(s.queue),
        "queue_source": s.queue_source if s.queue is not None else None,
        "prefill": _round(s.prefill),
        "prefill_source": s.prefill_source if s.prefill is not None else None,
        "decode": _round(s.decode),
        "server_decode": _round(s.server_decode),
        "upstream_unattributed": _round(s.upstream_unattributed),
        "slots": _slots_part(s),
        "gaps": _gaps(s),
        "tokens": _tokens_part(tl, s),
    }
    # Attribution and cost: who sent it (bounded values), and what it cost or why that is unknown.
    out["attribution"] = record_part(tl.attribution)
    out["request_objective"] = request_objective_part(tl, s)
    out["cost"] = _cost_part(s.cost)
    out["prompt"] = _prompt_part(diag)
    out["cache"] = _cache_part(diag)
    return out


def _slots_part(s: Summary) -> dict[str, Any] | None:
    """The server's concurrent slots as the request saw them, with their source; None when unknown."""
    if s.slots is None:
        return None
    return {"value": s.slots.slots, "source": s.slots.source, "confidence": s.slots.confidence}


def _tokens_part(tl: Timeline, s: Summary) -> dict[str, Any]:
    """The request's token counts and where each came from."""
    return {
        "input": s.input_tokens,
        "input_source": s.input_source or None,
        "output": s.output_tokens,
        "output_source": s.output_source or None,
        "cache_read": s.cache_read_tokens,
        "cache_write": s.cache_write_tokens,
        "cache_write_1h": tl.usage.cache_write_1h_tokens if tl.usage is not None else None,
        "reasoning": s.reasoning_tokens,
    }


def _cost_part(cost: Cost | None) -> dict[str, Any] | None:
    """What the request cost, or why that is unknown (its status); None when nothing was priced."""
    if cost is None:
        return None
    return {
        "amount": cost.amount,
        "currency": cost.currency,
        "status": cost.status,
        "prices": cost.prices,
        "source": cost.source,
    }


def _prompt_part(diag: Diagnosis | None) -> dict[str, Any] | None:
    """The prompt's regions by hash and token count (never its text), and the prefix it shares."""
    fp = diag.fingerprint if diag is not None else None
    if fp is None:
        return None
    return {
        "regions": [{"name": r.name, "hash": r.digest, "tokens": r.tokens} for r in fp.regions],
        "shared_prefix_tokens": diag.shared_prefix_tokens if diag else 0,
    }


def _cache_part(diag: Diagnosis | None) -> dict[str, Any] | None:
    """The request's cache class and what decided it; None without a diagnosis."""
    if diag is None:
        return None
    return {
        "class": diag.cache_class,
        "changed_region": diag.changed_region,
        "expected_prefix_tokens": diag.expected_prefix_tokens,
        "cached_tokens": diag.cached_tokens,
        "min_tokens": diag.min_tokens,
    }
