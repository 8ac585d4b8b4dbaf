"""One request as the live view draws it: phase bars, chunk ticks and the facts beside them.

Times are milliseconds from the moment the proxy received the request. No prompt or completion
text, no headers and no error messages (an upstream's message can quote the prompt) ever go in:
only timings, token counts, their sources, and bounded labels.
"""

from __future__ import annotations

from typing import Any

from llmtap.analysis.estimator import ESTIMATED
from llmtap.analysis.summary import PROXY, SERVER, Summary
from llmtap.analysis.timeline import Timeline
from llmtap.labels import clean, clean_or_none

__all__ = ["TICK_CAP", "waterfall"]

#: Chunk ticks kept per request; past it the rest are counted, not drawn.
TICK_CAP = 1000


def source_class(source: str) -> str:
    """How the page colours a phase: reported by the server, estimated, or measured at the proxy."""
    if source == SERVER:
        return "server"
    if source == ESTIMATED:
        return "estimated"
    return "measured"


def _ms(t: float | None) -> float | None:
    return None if t is None else round(t * 1000, 3)


def _phases(tl: Timeline, s: Summary) -> list[dict[str, Any]]:
    """Queue, prefill and decode bars, each placed where that time was spent (as the spans place them).

    The proxy's own queue runs from reading the body to admission; the server's queue (reported or
    estimated) starts when the request went upstream; prefill ends at the first content chunk and
    decode runs from the first content chunk to the last. Where the server reported its queue and its
    prefill, the upstream time they leave out is a bar of its own between them (``unattributed``), as
    the spans place it.
    """
    r = tl.received
    sent = tl.sent if tl.sent is not None else tl.admitted
    out: list[dict[str, Any]] = []
    if s.proxy_queue and tl.body_read is not None:
        out.append(_bar("queue", tl.body_read - r, s.proxy_queue, PROXY))
    upstream_end = sent
    if s.upstream_queue is not None and sent is not None:
        out.append(_bar("queue", sent - r, s.upstream_queue, s.upstream_queue_source or SERVER))
        upstream_end = sent + s.upstream_queue
    if s.prefill is not None and tl.first_content is not None:
        begin = tl.first_content - s.prefill
        if upstream_end is not None:
            begin = max(begin, upstream_end)
            if s.upstream_unattributed is not None:
                out.append(_bar("unattributed", upstream_end - r, begin - upstream_end, SERVER))
                out[-1]["class"] = "unattributed"
        out.append(_bar("prefill", begin - r, tl.first_content - begin, s.prefill_source))
    if s.decode is not None and tl.first_content is not None:
        out.append(_bar("decode", tl.first_content - r, s.decode, PROXY))
    return out


def _bar(phase: str, start: float, length: float, source: str) -> dict[str, Any]:
    return {
        "phase": phase,
        "start": _ms(start),
        "length": _ms(max(length, 0.0)),
        "source": source,
        "class": source_class(source),
    }


def waterfall(seq: int, tl: Timeline, s: Summary, *, route: str, model: str, trace: bool) -> dict[str, Any]:
    """The JSON the page draws one request from."""
    r = tl.received
    ticks = [round((t - r) * 1000, 2) for t in tl.chunk_times[:TICK_CAP]]
    req = tl.request
    return {
        "id": seq,
        "at": tl.received_wall_ns // 1_000_000,
        "route": route,
        "model": model,
        "response_model": clean_or_none(tl.response_model),
        "operation": req.operation if req else None,
        "provider": tl.provider_name,
        "protocol": tl.protocol,
        "path": clean(tl.path),
        "stream": bool(req and req.stream),
        "status": tl.status_code,
        "outcome": tl.outcome,
        "error_type": clean_or_none(tl.error_type),
        "slo": s.slo,
        "ttfb": _ms(s.ttfb),
        "ttft": _ms(s.ttft),
        "tpot": _ms(s.tpot),
        "e2e": _ms(s.e2e),
        "ttfot": _ms(s.ttfot),
        "ttst": _ms(s.ttst),
        "upstream_unattributed": _ms(s.upstream_unattributed),
        "phases": _phases(tl, s),
        "chunks": len(tl.chunk_times),
        "ticks": ticks,
        "input_tokens": s.input_tokens,
        "input_source": s.input_source or None,
        "output_tokens": s.output_tokens,
        "output_source": s.output_source or None,
        "cache_read_tokens": s.cache_read_tokens,
        "cache_write_tokens": s.cache_write_tokens,
        "input_size": s.input_size,
        "shape": s.shape,
        "cache_class": s.cache_class,
        "prompt_version": tl.prompt_version,
        # Who sent it and what it cost: the tenant and user as bounded on the span; USD or why none.
        "tenant": tl.attribution.get("tenant"),
        "user": tl.attribution.get("user"),
        "cost": s.cost.amount if s.cost is not None else None,
        "cost_status": s.cost.status if s.cost is not None else None,
        "response_id": clean_or_none(tl.response_id),
        "trace_id": tl.trace_id if trace else None,
    }
