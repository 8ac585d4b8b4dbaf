"""Span attributes of a finished request, as pure functions of its timeline and summary (GenAI semconv).

Every string a client or an upstream chose goes through ``llmtap.labels.clean``: bounded and valid UTF-8,
so one hostile value can neither fail a whole export batch nor fill it.
"""

from __future__ import annotations

import json
from typing import Any

from llmtap.analysis.cachediag import Diagnosis
from llmtap.analysis.cost import Cost
from llmtap.analysis.summary import USAGE, Summary
from llmtap.analysis.timeline import CANCELLED, KEEP_CHARS, OK, Timeline
from llmtap.labels import LABEL_CAP, clean, clean_list, clean_or_none
from llmtap.providers.openai_common import collect_text
from llmtap.telemetry import semconv as sc
from llmtap.types import PromptRegion
from llmtap.wire.tracecontext import parse_traceparent

__all__ = [
    "as_hop",
    "cache_attributes",
    "cost_attributes",
    "end_attributes",
    "hop_name",
    "is_hop",
    "queue_attributes",
    "root_name",
    "start_attributes",
    "usage_value",
]

#: Captured content (opt-in) is cut at this many characters: as much as a timeline keeps of the output.
CONTENT_CAP = KEEP_CHARS
#: ``openai.api.type`` (openai.md) of the protocols it names; legacy Completions has no value there.
OPENAI_API_TYPES = {"openai_chat": "chat_completions", "openai_responses": "responses"}


def root_name(tl: Timeline) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` for LLM calls; ``{method}`` for plain relays."""
    req = tl.request
    if tl.protocol is None or req is None:
        return clean(tl.method, LABEL_CAP, label=True)
    return f"{req.operation} {clean(req.model, LABEL_CAP, label=True)}" if req.model else req.operation


def start_attributes(tl: Timeline) -> dict[str, Any]:
    """Attributes known when the request arrives; samplers see these (gen-ai-spans.md: set at creation)."""
    attrs: dict[str, Any] = {
        sc.SERVER_ADDRESS: tl.server_address,
        sc.SERVER_PORT: tl.server_port,
        sc.HTTP_METHOD: clean(tl.method),
        sc.URL_PATH: clean(tl.path),
        sc.ROUTE: tl.route,
    }
    if tl.attribution:
        attrs.update(attribution_attributes(tl))
    req = tl.request
    if tl.protocol is None or req is None:
        return attrs
    attrs[sc.OPERATION_NAME] = req.operation
    attrs[sc.PROVIDER_NAME] = tl.provider_name
    attrs[sc.PROTOCOL] = tl.protocol
    _put(attrs, sc.OPENAI_API_TYPE, OPENAI_API_TYPES.get(tl.protocol))
    if req.model:
        attrs[sc.REQUEST_MODEL] = clean(req.model)
    if req.stream:
        attrs[sc.REQUEST_STREAM] = True
    if req.parse_error:
        attrs[sc.REQUEST_PARSE_ERROR] = clean(req.parse_error)
    # Provider params are keyed by their gen_ai.request.* suffix (max_tokens, temperature, choice.count, ...);
    # the only strings among them are stop sequences, a list as long as the client likes.
    for key, value in req.params.items():
        if value is not None:
            attrs[f"gen_ai.request.{key}"] = clean_list(value) if isinstance(value, list) else value
    if tl.prompt_version:
        attrs[sc.PROMPT_VERSION] = tl.prompt_version
    return attrs


def _put(attrs: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        attrs[key] = value


def queue_attributes(s: Summary) -> dict[str, Any]:
    """The queue and its two parts: the proxy's own line (measured) and the server's (reported or estimated)."""
    attrs: dict[str, Any] = {}
    if s.queue is not None:
        attrs[sc.QUEUE_DURATION] = s.queue
        attrs[sc.QUEUE_SOURCE] = s.queue_source
    _put(attrs, sc.QUEUE_PROXY_DURATION, s.proxy_queue)
    if s.upstream_queue is not None:
        attrs[sc.QUEUE_UPSTREAM_DURATION] = s.upstream_queue
        attrs[sc.QUEUE_UPSTREAM_SOURCE] = s.upstream_queue_source
    return attrs


def cache_attributes(diag: Diagnosis) -> dict[str, Any]:
    """The prompt's fingerprint (hash and tokens per region) and its cache class, for the root span."""
    attrs: dict[str, Any] = {
        sc.CACHE_CLASS: diag.cache_class,
        sc.CACHE_EXPECTED_PREFIX: diag.expected_prefix_tokens,
        sc.PROMPT_SHARED_PREFIX: diag.shared_prefix_tokens,
    }
    _put(attrs, sc.CACHE_CHANGED_REGION, diag.changed_region)
    if diag.fingerprint is not None:
        for region in diag.fingerprint.regions:
            attrs[f"{sc.PROMPT_FINGERPRINT}.{region.name}"] = region.digest
            attrs[f"{sc.PROMPT_REGION_TOKENS}.{region.name}"] = region.tokens
    return attrs


def input_messages(regions: list[PromptRegion], cap: int) -> str:
    """``gen_ai.input.messages`` (content capture only): the system part and messages, ``cap`` characters of text."""
    messages: list[dict[str, Any]] = []
    room = cap
    for region in regions:
        if region.kind == "tools":
            continue
        value = region.value
        role = value.get("role") if isinstance(value, dict) else None
        parts: list[str] = []
        collect_text(value, parts)
        text = clean("\n".join(parts)[:room], cap)
        room -= len(text)
        content = [{"type": "text", "content": text}]
        messages.append({"role": "system" if region.kind == "system" else role or "user", "parts": content})
        if room <= 0:
            break
    return json.dumps(messages, ensure_ascii=False)


def usage_value(count: int | None, source: str, offline: bool) -> int | None:
    """A token count as ``gen_ai.usage.*`` shows it: the upstream's report, or with ``offline`` any count."""
    return count if source == USAGE or offline else None


#: What a hop span keeps of the GenAI attributes, under llmtap's names; every other ``gen_ai.*`` is left out.
_HOP_NAMES = {
    sc.OPERATION_NAME: sc.HOP_OPERATION,
    sc.PROVIDER_NAME: sc.HOP_PROVIDER,
    sc.REQUEST_MODEL: sc.HOP_REQUEST_MODEL,
    sc.RESPONSE_MODEL: sc.HOP_RESPONSE_MODEL,
    sc.RESPONSE_ID: sc.HOP_RESPONSE_ID,
    sc.RESPONSE_FINISH_REASONS: sc.HOP_FINISH_REASONS,
    sc.RESPONSE_TIME_TO_FIRST_CHUNK: sc.HOP_TIME_TO_FIRST_CHUNK,
    sc.COST_AMOUNT: sc.HOP_COST_AMOUNT,
}


def as_hop(attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes of a hop span: no ``gen_ai.*`` (trace backends take any of them for a generation).

    The client's own span under which this one runs is the generation, with its usage; this span says
    what the proxy saw, in llmtap's names, so tokens are counted once.
    """
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if key.startswith("gen_ai."):
            renamed = _HOP_NAMES.get(key)
            if renamed is not None:
                out[renamed] = value
        else:
            out[key] = value
    return out


def is_hop(tl: Timeline, role: str) -> bool:
    """True when the request is a hop, its client's own instrumentation reporting the generation
    (``telemetry.span_role``): always with ``hop``; with ``auto``, when the request came with a valid
    ``traceparent``. An invalid one is treated as none (the request starts a new trace, so no span of the
    client's is its parent). A hop's root span and its ``gen_ai.client.*`` metrics are left to the client."""
    if tl.protocol is None:
        return False
    if role == "hop":
        return True
    return role == "auto" and tl.parent is not None and parse_traceparent(tl.parent[0]) is not None


def hop_name(tl: Timeline) -> str:
    """A hop span's name, as HTTP server spans are named: ``{method} {path}``."""
    return f"{clean(tl.method, LABEL_CAP, label=True)} {clean(tl.path, LABEL_CAP, label=True)}"


def end_attributes(
    tl: Timeline, s: Summary, *, capture: bool, latest: bool = False, offline: bool = False
) -> dict[str, Any]:
    """Attributes known when the stream ends.

    One attribute per line, in the order the conventions list them: the response, the usage, the timings, then
    llmtap's outcome, shape and content."""
    attrs: dict[str, Any] = {}
    _put_response(attrs, tl)
    _put_usage(attrs, s, latest=latest, offline=offline)
    _put_timings(attrs, tl, s)
    attrs[sc.OUTCOME] = tl.outcome
    attrs[sc.SLO_OUTCOME] = s.slo
    if tl.request_objective is not None:
        attrs.update(objective_attributes(tl, s))
    attrs[sc.INPUT_SIZE] = s.input_size
    attrs[sc.SHAPE] = s.shape
    attrs[sc.RESPONSE_BYTES] = tl.response_bytes
    if tl.malformed_events:
        attrs[sc.MALFORMED_EVENTS] = tl.malformed_events
    if tl.oversized_events:
        attrs[sc.OVERSIZED_EVENTS] = tl.oversized_events
    if tl.unread is not None:
        attrs[sc.STREAM_UNREAD] = tl.unread
    if capture and tl.request is not None and tl.request.regions:
        attrs[sc.INPUT_MESSAGES] = input_messages(tl.request.regions, CONTENT_CAP)
    if capture and tl.output is not None:
        text = clean(tl.output.text[:CONTENT_CAP], CONTENT_CAP)
        attrs[sc.OUTPUT_MESSAGES] = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}]}])
    if tl.outcome == CANCELLED:
        attrs[sc.ERROR_TYPE] = "cancelled"
    return attrs


def _put_response(attrs: dict[str, Any], tl: Timeline) -> None:
    """The response's id, model, fingerprint and finish reasons."""
    _put(attrs, sc.RESPONSE_ID, clean_or_none(tl.response_id))
    _put(attrs, sc.RESPONSE_MODEL, clean_or_none(tl.response_model))
    _put(attrs, sc.OPENAI_SYSTEM_FINGERPRINT, clean_or_none(tl.system_fingerprint))
    if tl.finish_reasons:
        attrs[sc.RESPONSE_FINISH_REASONS] = clean_list(tl.finish_reasons)
    elif tl.outcome != OK and tl.request is not None:
        # semantic-conventions-genai: a missing or aborted finish is reported as "error".
        attrs[sc.RESPONSE_FINISH_REASONS] = ["error"]


def _put_usage(attrs: dict[str, Any], s: Summary, *, latest: bool, offline: bool) -> None:
    """The token counts: ``gen_ai.usage.*`` as the conventions define them, and llmtap's with their sources."""
    # gen_ai.usage.* is what the upstream reported (or, when the user enabled offline counting, tiktoken's
    # count where it reported nothing); every count is under llmtap.usage.* with its source.
    _put(attrs, sc.USAGE_INPUT_TOKENS, usage_value(s.input_tokens, s.input_source, offline))
    _put(attrs, sc.USAGE_OUTPUT_TOKENS, usage_value(s.output_tokens, s.output_source, offline))
    _put(attrs, sc.USAGE_CACHE_READ, s.cache_read_tokens)
    # semantic-conventions-genai migration.md: cache_creation.input_tokens -> cache_write.input_tokens.
    _put(attrs, sc.USAGE_CACHE_WRITE if latest else sc.USAGE_CACHE_CREATION, s.cache_write_tokens)
    _put(attrs, sc.USAGE_REASONING, s.reasoning_tokens)
    if s.input_tokens is not None:
        attrs[sc.INPUT_TOKENS] = s.input_tokens
        attrs[sc.INPUT_TOKENS_SOURCE] = s.input_source
    if s.output_tokens is not None:
        attrs[sc.OUTPUT_TOKENS] = s.output_tokens
        attrs[sc.OUTPUT_TOKENS_SOURCE] = s.output_source


def _put_timings(attrs: dict[str, Any], tl: Timeline, s: Summary) -> None:
    """Where the request's time went (the latencies, the queue, prefill and decode) and the server's slots."""
    if tl.request is not None and tl.request.stream:
        _put(attrs, sc.RESPONSE_TIME_TO_FIRST_CHUNK, s.ttft)
        # Under llmtap's name too, on every root span (a hop's keeps only this one): what a collector's
        # sampling rule keys on, whatever the span's role.
        _put(attrs, sc.HOP_TIME_TO_FIRST_CHUNK, s.ttft)
    _put(attrs, sc.TTFB, s.ttfb)
    _put(attrs, sc.TTFOT, s.ttfot)
    _put(attrs, sc.TTST, s.ttst)
    _put(attrs, sc.UPSTREAM_TTFT, s.upstream_ttft)
    _put(attrs, sc.TPOT, s.tpot)
    _put(attrs, sc.E2E, s.e2e)
    attrs.update(queue_attributes(s))
    _put(attrs, sc.PREFILL_DURATION, s.prefill)
    _put(attrs, sc.DECODE_DURATION, s.decode)
    _put(attrs, sc.DECODE_SERVER_DURATION, s.server_decode)
    _put(attrs, sc.UPSTREAM_UNATTRIBUTED_DURATION, s.upstream_unattributed)
    if s.prefill is not None:
        attrs[sc.PREFILL_SOURCE] = s.prefill_source
    if s.slots is not None:
        attrs[sc.UPSTREAM_SLOTS] = s.slots.slots
        attrs[sc.UPSTREAM_SLOTS_SOURCE] = s.slots.source
        attrs[sc.UPSTREAM_SLOTS_CONFIDENCE] = s.slots.confidence


# -- attribution and cost ----------------------------------------------------------------


def attribution_attributes(tl: Timeline) -> dict[str, Any]:
    """Who sent the request (``llmtap.analysis.attribution``: values already bounded and clean), on the root span."""
    return {sc.dimension_attribute(name): value for name, value in tl.attribution.items()}


def cost_attributes(cost: Cost, *, hop: bool = False) -> dict[str, Any]:
    """What the request cost, by the proposed ``gen_ai.usage.cost.*`` convention (on a hop, ``llmtap.cost.amount``
    in USD: the client's span is the generation) with its source (``provider`` or ``local``); its status and the
    price table's name either way. An unknown cost has no amount, never 0."""
    attrs: dict[str, Any] = {sc.COST_STATUS: cost.status}
    if cost.amount is not None:
        attrs[sc.COST_AMOUNT] = cost.amount
        attrs[sc.COST_CURRENCY] = cost.currency
        _put(attrs, sc.COST_SOURCE, cost.source)
    _put(attrs, sc.COST_PRICES, cost.prices)
    return as_hop(attrs) if hop else attrs


# -- per-request objectives --------------------------------------------------------------------------


def objective_attributes(tl: Timeline, s: Summary) -> dict[str, Any]:
    """The request's own objectives (``x-slo-*`` headers, in seconds), each one's outcome, the headers ignored."""
    objective = tl.request_objective
    attrs: dict[str, Any] = {}
    if objective is None:
        return attrs
    limits = ((objective.ttft, sc.OBJECTIVE_TTFT_LIMIT, "ttft", sc.OBJECTIVE_TTFT_OUTCOME),
              (objective.tpot, sc.OBJECTIVE_TPOT_LIMIT, "tpot", sc.OBJECTIVE_TPOT_OUTCOME))  # fmt: skip
    for limit, limit_name, figure, outcome_name in limits:
        if limit is not None:
            attrs[limit_name] = limit
        if figure in s.request_outcomes:
            attrs[outcome_name] = s.request_outcomes[figure]
    if objective.invalid:
        attrs[sc.OBJECTIVE_IGNORED] = list(objective.invalid)
    return attrs
