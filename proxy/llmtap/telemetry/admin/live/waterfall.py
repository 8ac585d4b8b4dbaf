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

__all__ = ["TICK_CAP", "Facts", "draw", "facts", "waterfall"]

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


#: What a waterfall is drawn from, in plain values read off a finished request (``facts``): the live view keeps
#: these and draws the page's JSON (``draw``) only for the requests someone reads, where building the dict, its
#: rounded milliseconds and its cleaned labels for every request cost a third of the view's work per request.
Facts = tuple[Any, ...]


def facts(tl: Timeline, s: Summary, *, route: str, model: str, trace: bool) -> Facts:
    """The values ``draw`` makes one request's waterfall of, read now (the chunk times copied)."""
    req = tl.request
    cost = s.cost
    attribution = tl.attribution
    return (
        tl.received_wall_ns,
        route,
        model,
        tl.response_model,
        req.operation if req else None,
        tl.provider_name,
        tl.protocol,
        tl.path,
        bool(req and req.stream),
        tl.status_code,
        tl.outcome,
        tl.error_type,
        s.slo,
        (s.ttfb, s.ttft, s.tpot, s.e2e, s.ttfot, s.ttst, s.upstream_unattributed),
        (
            tl.received,
            tl.sent if tl.sent is not None else tl.admitted,
            tl.body_read,
            tl.first_content,
            s.proxy_queue,
            s.upstream_queue,
            s.upstream_queue_source,
            s.prefill,
            s.prefill_source,
            s.upstream_unattributed,
            s.decode,
        ),
        len(tl.chunk_times),
        tl.chunk_times[:TICK_CAP],
        (s.input_tokens, s.input_source, s.output_tokens, s.output_source),
        (s.cache_read_tokens, s.cache_write_tokens, s.input_size, s.shape, s.cache_class),
        tl.prompt_version,
        attribution.get("tenant"),
        attribution.get("user"),
        (cost.amount, cost.status) if cost is not None else (None, None),
        tl.response_id,
        tl.trace_id if trace else None,
    )


def _phases(
    r: float,
    sent: float | None,
    body_read: float | None,
    first_content: float | None,
    proxy_queue: float | None,
    upstream_queue: float | None,
    upstream_queue_source: str | None,
    prefill: float | None,
    prefill_source: str,
    upstream_unattributed: float | None,
    decode: float | None,
) -> list[dict[str, Any]]:
    """Queue, prefill and decode bars, each placed where that time was spent (as the spans place them).

    The proxy's own queue runs from reading the body to admission; the server's queue (reported or
    estimated) starts when the request went upstream; prefill ends at the first content chunk and
    decode runs from the first content chunk to the last. Where the server reported its queue and its
    prefill, the upstream time they leave out is a bar of its own between them (``unattributed``), as
    the spans place it.
    """
    out: list[dict[str, Any]] = []
    if proxy_queue and body_read is not None:
        out.append(_bar("queue", body_read - r, proxy_queue, PROXY))
    upstream_end = sent
    if upstream_queue is not None and sent is not None:
        out.append(_bar("queue", sent - r, upstream_queue, upstream_queue_source or SERVER))
        upstream_end = sent + upstream_queue
    if prefill is not None and first_content is not None:
        begin = first_content - prefill
        if upstream_end is not None:
            begin = max(begin, upstream_end)
            if upstream_unattributed is not None:
                out.append(_bar("unattributed", upstream_end - r, begin - upstream_end, SERVER))
                out[-1]["class"] = "unattributed"
        out.append(_bar("prefill", begin - r, first_content - begin, prefill_source))
    if decode is not None and first_content is not None:
        out.append(_bar("decode", first_content - r, decode, PROXY))
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
    return draw(seq, facts(tl, s, route=route, model=model, trace=trace))


def draw(seq: int, f: Facts) -> dict[str, Any]:
    """The JSON the page draws one request from, out of its ``facts``."""
    (at, route, model, response_model, operation, provider, protocol, path, stream, status, outcome, error_type, slo,
     latencies, phases, chunks, chunk_times, tokens, cache, prompt_version, tenant, user, cost, response_id,
     trace_id) = f  # fmt: skip
    ttfb, ttft, tpot, e2e, ttfot, ttst, unattributed = latencies
    input_tokens, input_source, output_tokens, output_source = tokens
    cache_read_tokens, cache_write_tokens, input_size, shape, cache_class = cache
    r = phases[0]
    return {
        "id": seq,
        "at": at // 1_000_000,
        "route": route,
        "model": model,
        "response_model": clean_or_none(response_model),
        "operation": operation,
        "provider": provider,
        "protocol": protocol,
        "path": clean(path),
        "stream": stream,
        "status": status,
        "outcome": outcome,
        "error_type": clean_or_none(error_type),
        "slo": slo,
        "ttfb": _ms(ttfb),
        "ttft": _ms(ttft),
        "tpot": _ms(tpot),
        "e2e": _ms(e2e),
        "ttfot": _ms(ttfot),
        "ttst": _ms(ttst),
        "upstream_unattributed": _ms(unattributed),
        "phases": _phases(*phases),
        "chunks": chunks,
        "ticks": [round((t - r) * 1000, 2) for t in chunk_times],
        "input_tokens": input_tokens,
        "input_source": input_source or None,
        "output_tokens": output_tokens,
        "output_source": output_source or None,
        "cache_read_tokens": cache_read_tokens,
        "cache_write_tokens": cache_write_tokens,
        "input_size": input_size,
        "shape": shape,
        "cache_class": cache_class,
        "prompt_version": prompt_version,
        # Who sent it and what it cost: the tenant and user as bounded on the span; USD or why none.
        "tenant": tenant,
        "user": user,
        "cost": cost[0],
        "cost_status": cost[1],
        "response_id": clean_or_none(response_id),
        "trace_id": trace_id,
    }
