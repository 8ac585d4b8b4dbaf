"""Helpers shared by the JSON wire protocols: tolerant parsing, usage, errors, requests, prompt text, bodies.

Named for the OpenAI family, whose Chat Completions and legacy Completions share a chunk shape
(standards D.1, D.2); the tolerant-JSON, params and prompt-text helpers serve Anthropic as well.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import partial
from typing import Any

from llmtap.providers.splice import splice_usage
from llmtap.providers.sse import Event
from llmtap.providers.timing import MS, FieldMap, from_body
from llmtap.types import Facts, PromptRegion, RequestInfo, ServerTiming, Usage

__all__ = [
    "ChoicesStreamParser",
    "JSONObject",
    "ObjectStreamParser",
    "as_count",
    "as_dict",
    "as_str",
    "body_facts",
    "collect_text",
    "error_facts",
    "inspect_openai",
    "load_object",
    "matches_suffix",
    "openai_end_user",
    "parse_choices_body",
    "prompt_regions",
    "prompt_text",
    "read_request",
    "reported_cost",
    "request_params",
    "usage_from_openai",
]

JSONObject = dict[str, Any]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Content values nest a few levels at most (message → parts → tool_result → parts); stop well before
# anything pathological so prompt extraction stays cheap and cannot recurse deeply.
_TEXT_DEPTH = 8
# Keys under which message-like JSON carries text the model reads or wrote (OpenAI parts' ``text``,
# tool calls' ``arguments``, Responses ``output`` and ``summary``, Anthropic ``thinking`` and tool results).
_TEXT_KEYS = ("text", "thinking", "refusal", "content", "arguments", "output", "summary", "tool_calls", "function")
# An error label becomes ``error.type``, a metric attribute: keep it short (bounded cardinality).
_LABEL_MAX = 64


#: The JSON decoder's scanner (C), called directly for a text that starts with ``{``: ``json.loads`` adds two
#: Python calls and a whitespace match per call, a third of a streamed chunk's parse.
_scan: Callable[[str, int], tuple[Any, int]] = getattr(json.JSONDecoder(), "scan_once")  # noqa: B009 - not in the stubs


def load_object(raw: bytes | str) -> tuple[JSONObject | None, str | None]:
    """Parse a JSON object once; return ``(object, None)`` or ``(None, reason)``, never raising."""
    if type(raw) is str and raw[:1] == "{":
        try:
            value, end = _scan(raw, 0)
        except Exception:  # what json.loads says of it is the reason, below
            value, end = None, -1
        if end == len(raw) and type(value) is dict:
            return value, None
    try:
        value = json.loads(raw)
    except RecursionError:
        return None, "too_deep"
    except ValueError:  # JSONDecodeError, bad UTF-8, and ints past Python's 4300-digit limit
        return None, "invalid_json"
    if not isinstance(value, dict):
        return None, "not_an_object"
    return value, None


def as_dict(value: object) -> JSONObject:
    """``value`` when it is a JSON object, else an empty one (absent and wrong-typed read alike)."""
    return value if isinstance(value, dict) else {}


def as_str(value: object) -> str | None:
    """``value`` when it is a non-empty string, else None."""
    return value if isinstance(value, str) and value else None


def as_count(value: object) -> int | None:
    """A token count: a non-negative JSON integer that fits in int64 (OTLP's int), else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _INT64_MAX else None


def _as_int64(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if _INT64_MIN <= value <= _INT64_MAX else None


def _as_float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def usage_from_openai(raw: object) -> Usage | None:
    """Normalize an OpenAI ``CompletionUsage`` (D.1) or Responses ``ResponseUsage`` (D.3); None if empty.

    Cached and reasoning tokens are already inside the prompt/completion totals (D.1), so nothing is added.
    """
    if not isinstance(raw, dict):
        return None
    in_details = as_dict(raw.get("prompt_tokens_details") or raw.get("input_tokens_details"))
    out_details = as_dict(raw.get("completion_tokens_details") or raw.get("output_tokens_details"))
    usage = Usage(
        input_tokens=as_count(raw.get("prompt_tokens", raw.get("input_tokens"))),
        output_tokens=as_count(raw.get("completion_tokens", raw.get("output_tokens"))),
        cache_read_tokens=as_count(in_details.get("cached_tokens")),
        cache_write_tokens=as_count(in_details.get("cache_write_tokens")),
        reasoning_tokens=as_count(out_details.get("reasoning_tokens")),
        cost=reported_cost(raw.get("cost")),
    )
    return None if usage == Usage() else usage


def reported_cost(value: object) -> float | None:
    """A cost the response states (OpenRouter's and LiteLLM's ``usage.cost``, USD): a finite number >= 0, a
    numeric string read as one; anything else None, so a malformed cost is never taken for a price."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    number = _as_float(value)
    return number if number is not None and number >= 0 else None


def _label(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    return value[:_LABEL_MAX] if isinstance(value, str) and value else None


def error_facts(raw: object) -> Facts:
    """Facts for an error object: its ``type`` (else ``code``) as error_type, ``_OTHER`` when it has neither.

    Covers OpenAI/vLLM ``{"error": {message, type, code}}`` and Anthropic ``{"type": "error", "error":
    {type, message}}`` (D.4); a bare string error (``{"error": "..."}``) becomes the message.
    """
    if isinstance(raw, str):
        return Facts(error_type="_OTHER", error_message=raw)
    obj = as_dict(raw)
    message = obj.get("message")
    return Facts(
        error_type=_label(obj.get("type")) or _label(obj.get("code")) or "_OTHER",
        error_message=message if isinstance(message, str) else None,
    )


# vLLM ``--enable-per-request-metrics`` (standards B.3; docs/features/per_request_metrics.md): ``metrics``
# in ms. Its time_to_first_token_ms runs from scheduling to the first token, i.e. prefill, and
# generation_time_ms is documented as "first output token to the last output token", i.e. decode.
VLLM_METRICS: FieldMap = {
    "queue": ("queue_time_ms", MS),
    "prefill": ("time_to_first_token_ms", MS),
    "decode": ("generation_time_ms", MS),
}
# NVIDIA NIM ``NIM_PER_REQ_METRICS_ENABLE=1`` (docs.nvidia.com/nim/large-language-models, "Per-Request
# Metrics"): ``stats.time_in_queue_in_ms``. Its ``response_tokens.time_to_first_token_in_ms`` runs
# "from processing start", which the documentation does not place before or after the queue, and
# ``generation_time_in_ms`` is "total time for LLM processing": neither is a phase, so neither is read.
NIM_STATS: FieldMap = {"queue": ("time_in_queue_in_ms", MS)}
# Fireworks' ``perf_metrics`` (``perf_metrics_in_response``) is not read: Fireworks' documentation says
# where it arrives (the chunk with finish_reason) but not its fields' meaning or units.


def reported_timing(obj: JSONObject) -> ServerTiming | None:
    """The phases a body or chunk reports: vLLM's ``metrics``, else NIM's ``stats``; None when neither."""
    return from_body(obj.get("metrics"), VLLM_METRICS) or from_body(obj.get("stats"), NIM_STATS)


def request_params(obj: JSONObject, *, max_tokens_keys: tuple[str, ...], stop_key: str) -> dict[str, Any]:
    """The request parameters GenAI spans record, keyed by their ``gen_ai.request.`` suffix.

    Keys: max_tokens, temperature, top_p, top_k, frequency_penalty, presence_penalty, stop_sequences,
    seed, choice.count (only when not 1: semconv "if in the request and != 1"). Wrong-typed values are dropped.
    """
    params: dict[str, Any] = {}
    for key in max_tokens_keys:
        max_tokens = as_count(obj.get(key))
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
            break
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        number = _as_float(obj.get(key))
        if number is not None:
            params[key] = number
    for key in ("top_k", "seed"):
        integer = _as_int64(obj.get(key))
        if integer is not None:
            params[key] = integer
    stop = obj.get(stop_key)
    if isinstance(stop, str):
        params["stop_sequences"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and stop:
        params["stop_sequences"] = list(stop)
    choices = as_count(obj.get("n"))
    if choices is not None and choices != 1:
        params["choice.count"] = choices
    return params


def collect_text(value: object, out: list[str], depth: int = 0) -> None:
    """Append the text inside a message-like JSON value: strings, content parts, tool calls and results."""
    if depth > _TEXT_DEPTH:
        return
    if isinstance(value, str):
        if value:
            out.append(value)
    elif isinstance(value, list):
        for item in value:
            collect_text(item, out, depth + 1)
    elif isinstance(value, dict):
        for key in _TEXT_KEYS:
            if key in value:
                collect_text(value[key], out, depth + 1)
        tool_input = value.get("input")  # Anthropic tool_use blocks carry their arguments as an object
        if isinstance(tool_input, dict) and tool_input:
            out.append(json.dumps(tool_input, ensure_ascii=False))


def prompt_text(*, system: object = None, messages: object = None, tools: object = None) -> str:
    """The prompt's text joined (system, messages, tools JSON): only for offline token counting."""
    out: list[str] = []
    collect_text(system, out)
    collect_text(messages, out)
    if isinstance(tools, list | dict) and tools:
        out.append(json.dumps(tools, ensure_ascii=False))
    return "\n".join(out)


def prompt_regions(*, tools: object = None, system: object = None, messages: object = None) -> list[PromptRegion]:
    """The prompt's parts in the order servers cache them: tools, system, then each message.

    Only references to the parsed body: ``llmtap.analysis.fingerprint`` hashes and counts them off the event loop.
    """
    regions: list[PromptRegion] = []
    if isinstance(tools, list | dict) and tools:
        regions.append(PromptRegion("tools", tools))
    if system is not None and system != "" and system != []:
        regions.append(PromptRegion("system", system))
    if isinstance(messages, list):
        regions.extend(PromptRegion("message", m) for m in messages)
    elif isinstance(messages, str | dict) and messages:
        regions.append(PromptRegion("message", messages))
    return regions


def openai_end_user(obj: JSONObject) -> str | None:
    """The end user an OpenAI request names: ``safety_identifier`` (its newer name), else ``user``."""
    return as_str(obj.get("safety_identifier")) or as_str(obj.get("user"))


def read_request(
    body: bytes,
    *,
    operation: str,
    max_tokens_keys: tuple[str, ...],
    stop_key: str,
    prompt: Callable[[JSONObject], str],
    regions: Callable[[JSONObject], list[PromptRegion]],
    end_user: Callable[[JSONObject], str | None],
) -> tuple[RequestInfo, JSONObject | None]:
    """Read a request whose body names its ``model`` and asks to stream with ``"stream": true`` at the top.

    OpenAI's Chat Completions, Completions and Responses and Anthropic Messages put these alike; where each keeps
    its max-tokens, stop sequences, prompt and end user is given. Returns the parsed body too (None with
    ``parse_error`` set when it is not a JSON object), for a caller that reads more of it.
    """
    obj, error = load_object(body)
    if obj is None:
        return RequestInfo(operation=operation, parse_error=error), None
    info = RequestInfo(
        operation=operation,
        model=as_str(obj.get("model")),
        stream=obj.get("stream") is True,
        params=request_params(obj, max_tokens_keys=max_tokens_keys, stop_key=stop_key),
        prompt_text=prompt(obj),
        regions=regions(obj),
        end_user=end_user(obj),
    )
    return info, obj


def inspect_openai(
    body: bytes,
    *,
    inject_usage: bool,
    operation: str,
    max_tokens_keys: tuple[str, ...],
    prompt: Callable[[JSONObject], str],
    regions: Callable[[JSONObject], list[PromptRegion]],
) -> RequestInfo:
    """Inspect a Chat Completions or Completions request; ask for streamed usage when the client did not.

    ``rewritten_body`` and ``strip_usage`` are what ``prepare`` gives for the same body.
    """
    info, obj = read_request(
        body,
        operation=operation,
        max_tokens_keys=max_tokens_keys,
        stop_key="stop",
        prompt=prompt,
        regions=regions,
        end_user=openai_end_user,
    )
    if obj is None:
        return info
    # Without include_usage a stream carries no usage at all (D.1); with it, one extra chunk with
    # ``choices: []`` arrives before [DONE], which UsageEventFilter removes again for this client.
    # The same splice as ``prepare`` (providers/splice.py), on the object already parsed here.
    if inject_usage:
        prepared = splice_usage(body, obj)
        info.rewritten_body, info.strip_usage = prepared.body, prepared.strip_usage
    return info


def choices_facts(obj: JSONObject, choice_text: Callable[[JSONObject], str]) -> Facts:
    """Facts of one chunk or whole body in the ``choices`` shape (chat.completion[.chunk], text_completion)."""
    if obj.get("error") is not None:
        return error_facts(obj["error"])
    if obj.get("object") == "error":  # older vLLM streams its ErrorResponse at the top level
        return error_facts(obj)
    parts: list[str] = []
    reasons: list[str] = []
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        text = choice_text(choice)
        if text:
            parts.append(text)
        reason = as_str(choice.get("finish_reason"))
        if reason is not None:
            reasons.append(reason)
    content = parts[0] if len(parts) == 1 else "".join(parts)
    usage = obj.get("usage")
    return Facts(
        has_content=bool(content),
        content=content,
        usage=None if usage is None else usage_from_openai(usage),
        finish_reasons=reasons,
        response_id=as_str(obj.get("id")),
        response_model=as_str(obj.get("model")),
        system_fingerprint=as_str(obj.get("system_fingerprint")),
        server_timing=reported_timing(obj) if "metrics" in obj or "stats" in obj else None,
    )


class ChoicesStreamParser:
    """Reads the ``data:`` chunks of a Chat Completions or legacy Completions stream (D.1, D.2)."""

    def __init__(
        self, choice_text: Callable[[JSONObject], str], reasoning: Callable[[JSONObject], bool] | None = None
    ) -> None:
        self.malformed = 0
        self._choice_text = choice_text
        #: Whether a choice's delta is reasoning alone (chat completions); None: never.
        self._reasoning = reasoning

    def feed(self, event: Event) -> Facts | None:
        """Facts of one chunk; ``done`` on ``[DONE]``; None for an empty or malformed event."""
        data = event.data
        if not data:
            return None
        if data[0] != "{" and data.strip() == "[DONE]":
            return Facts(done=True)
        obj, _ = load_object(data)
        if obj is None:
            self.malformed += 1
            return None
        facts = choices_facts(obj, self._choice_text)
        if facts.has_content and self._reasoning is not None:
            facts.reasoning = _reasoning_only(obj, self._reasoning)
        return facts


def _reasoning_only(obj: JSONObject, reasoning: Callable[[JSONObject], bool]) -> bool:
    """Every choice of the chunk that carries text carries reasoning alone."""
    choices = obj.get("choices")
    listed = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
    return bool(listed) and all(reasoning(c) for c in listed if c.get("delta"))


def parse_choices_body(body: bytes, choice_text: Callable[[JSONObject], str]) -> Facts:
    """Facts of a whole non-streamed body in the ``choices`` shape, or of its JSON error."""
    return body_facts(body, partial(choices_facts, choice_text=choice_text))


def body_facts(body: bytes, facts: Callable[[JSONObject], Facts]) -> Facts:
    """Facts of a whole non-streamed body that should be one JSON object, as ``facts`` reads it.

    A body that is not JSON (an HTML 502 page from a load balancer) says nothing; the status code does.
    """
    obj, _ = load_object(body)
    return Facts() if obj is None else facts(obj)


class ObjectStreamParser:
    """Reads a stream whose every event is one JSON object read alone: Ollama's lines, Gemini's chunks, an
    embeddings answer framed as events. What a protocol keeps from event to event lives in ``facts``."""

    def __init__(self, facts: Callable[[JSONObject], Facts]) -> None:
        self.malformed = 0
        self._facts = facts

    def feed(self, event: Event) -> Facts | None:
        """Facts of one event; None for an event that is not a JSON object (counted as malformed)."""
        obj, _ = load_object(event.data)
        if obj is None:
            self.malformed += 1
            return None
        return self._facts(obj)


def matches_suffix(method: str, path: str, suffix: str) -> bool:
    """True for a POST whose path (query and trailing slash ignored) ends with ``suffix``."""
    return method.upper() == "POST" and path.split("?", 1)[0].rstrip("/").endswith(suffix)
