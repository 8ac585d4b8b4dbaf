"""Google Gemini ``POST …/models/{model}:generateContent`` and ``…:streamGenerateContent``.

Wire format: standards D.6. The model and the stream flag are in the path, not the body. A stream is
one ``GenerateContentResponse`` per SSE ``data:`` event with ``?alt=sse``, else the elements of one JSON
array sent as they are made; there is no end sentinel, and the last chunk carries ``finishReason``
(UPPERCASE: ``STOP``, ``MAX_TOKENS``, ``SAFETY``, ...). A whole response is one such object.

``usageMetadata`` is cumulative: each chunk repeats the counts so far (a Vertex stream may send only
``trafficType`` until the last chunk), so later values replace earlier ones, field by field. Tokens:

* input = ``promptTokenCount`` + ``toolUsePromptTokenCount``; the prompt count already includes
  ``cachedContentTokenCount`` ("When cached_content is set, this also includes the number of tokens in
  the cached content"), which is the cache read;
* output = ``candidatesTokenCount`` + ``thoughtsTokenCount``, reasoning = ``thoughtsTokenCount``: the
  thinking tokens are generated and billed but not inside the candidates count, while llmtap's output
  (like OpenAI's completion_tokens) includes reasoning.

The Gemini API (``generativelanguage.googleapis.com``, paths ``/v1beta/models/...``) and Vertex AI
(``/v1/projects/{p}/locations/{l}/publishers/google/models/...``) speak the same protocol; they differ in
``gen_ai.provider.name`` (``gcp.gemini`` against ``gcp.vertex_ai``), so each has its own provider.
"""

from __future__ import annotations

import json
from functools import partial

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import (
    JSONObject,
    ObjectStreamParser,
    as_count,
    as_dict,
    as_str,
    error_facts,
    load_object,
    matches_suffix,
    request_params,
)
from llmtap.providers.protocol import ForwardsUnchanged
from llmtap.types import Facts, RequestInfo, Usage

__all__ = ["Gemini", "model_from_path"]

_STREAM, _WHOLE = ":streamGenerateContent", ":generateContent"
_USAGE_KEYS = (
    "promptTokenCount",
    "candidatesTokenCount",
    "cachedContentTokenCount",
    "thoughtsTokenCount",
    "toolUsePromptTokenCount",
)
# The REST API accepts proto field names in lowerCamelCase and in snake_case alike.
_SNAKE = {
    "systemInstruction": "system_instruction",
    "generationConfig": "generation_config",
    "maxOutputTokens": "max_output_tokens",
    "topP": "top_p",
    "topK": "top_k",
    "stopSequences": "stop_sequences",
    "candidateCount": "candidate_count",
    "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty",
    "usageMetadata": "usage_metadata",
    "responseId": "response_id",
    "modelVersion": "model_version",
    "finishReason": "finish_reason",
    "functionCall": "function_call",
    "functionResponse": "function_response",
    "executableCode": "executable_code",
}
# request_params' keys against generationConfig's fields.
_PARAMS = {
    "max_tokens": "maxOutputTokens",
    "temperature": "temperature",
    "top_p": "topP",
    "top_k": "topK",
    "seed": "seed",
    "stop": "stopSequences",
    "n": "candidateCount",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
}


def _get(obj: JSONObject, camel: str) -> object:
    value = obj.get(camel)
    return obj.get(_SNAKE.get(camel, camel)) if value is None else value


def model_from_path(path: str) -> str | None:
    """The ``{model}`` of ``…/models/{model}:method`` (or ``tunedModels/{model}``); None for other paths."""
    head, sep, _ = path.split("?", 1)[0].rpartition(":")
    segments = head.split("/")
    if not sep or len(segments) < 2 or segments[-2] not in ("models", "tunedModels"):
        return None
    return segments[-1] or None


def merge_usage(reported: dict[str, int], raw: object) -> Usage | None:
    """Fold one cumulative ``usageMetadata`` into ``reported`` (replace, never add) and normalize."""
    obj = as_dict(raw)
    for key in _USAGE_KEYS:
        value = as_count(obj.get(key))
        if value is not None:
            reported[key] = value
    if not reported:
        return None
    prompt, tool_prompt = reported.get("promptTokenCount"), reported.get("toolUsePromptTokenCount")
    candidates, thoughts = reported.get("candidatesTokenCount"), reported.get("thoughtsTokenCount")
    return Usage(
        input_tokens=None if prompt is None and tool_prompt is None else (prompt or 0) + (tool_prompt or 0),
        output_tokens=None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0),
        cache_read_tokens=reported.get("cachedContentTokenCount"),
        reasoning_tokens=thoughts,
    )


def _part_text(part: object) -> str:
    """The text of one part: text (thoughts included), function-call arguments, executable code."""
    obj = as_dict(part)
    text = obj.get("text")
    if isinstance(text, str):
        return text
    args = as_dict(_get(obj, "functionCall")).get("args")
    if isinstance(args, dict) and args:
        return json.dumps(args, ensure_ascii=False)
    code = as_dict(_get(obj, "executableCode")).get("code")
    return code if isinstance(code, str) else ""


def _content_texts(content: object) -> list[str]:
    """The texts of one ``Content`` (``{role, parts}``), tool results included: only for token counting."""
    out: list[str] = []
    parts = as_dict(content).get("parts")
    for part in parts if isinstance(parts, list) else ():
        text = _part_text(part)
        result = as_dict(_get(as_dict(part), "functionResponse")).get("response")
        if not text and isinstance(result, dict) and result:
            text = json.dumps(result, ensure_ascii=False)
        if text:
            out.append(text)
    return out


def _prompt(obj: JSONObject) -> str:
    out = _content_texts(_get(obj, "systemInstruction"))
    contents = obj.get("contents")
    for content in contents if isinstance(contents, list) else ():
        out += _content_texts(content)
    tools = obj.get("tools")
    if isinstance(tools, list) and tools:
        out.append(json.dumps(tools, ensure_ascii=False))
    return "\n".join(out)


def _error(raw: object) -> Facts:
    # Google's error object is {code: 429, message, status: "RESOURCE_EXHAUSTED"}: the status names it.
    # A gateway in front may answer in OpenAI's shape ({type, code, message}) instead.
    err = as_dict(raw)
    kind = err.get("status") or err.get("type")
    return error_facts({"type": kind, "code": err.get("code"), "message": err.get("message")})


def response_facts(obj: JSONObject, reported: dict[str, int]) -> Facts:
    """Facts of one ``GenerateContentResponse``, folding its usage into ``reported``."""
    if obj.get("error") is not None:
        return _error(obj["error"]) if isinstance(obj["error"], dict) else error_facts(obj["error"])
    parts: list[str] = []
    reasons: list[str] = []
    candidates = obj.get("candidates")
    for raw in candidates if isinstance(candidates, list) else ():
        candidate = as_dict(raw)
        content_parts = as_dict(candidate.get("content")).get("parts")
        for part in content_parts if isinstance(content_parts, list) else ():
            parts.append(_part_text(part))
        reason = as_str(_get(candidate, "finishReason"))
        if reason is not None:
            reasons.append(reason)
    content = "".join(parts)
    return Facts(
        has_content=bool(content),
        content=content,
        usage=merge_usage(reported, _get(obj, "usageMetadata")),
        finish_reasons=reasons,
        response_id=as_str(_get(obj, "responseId")),
        response_model=as_str(_get(obj, "modelVersion")),
        done=bool(reasons),
    )


def _load(raw: bytes | str) -> object:
    """Any JSON value, or None when the text is not JSON (never raises)."""
    try:
        return json.loads(raw)
    except (RecursionError, ValueError):
        return None


def _fold(total: Facts, facts: Facts) -> None:
    total.has_content |= facts.has_content
    total.content += facts.content
    total.usage = facts.usage or total.usage
    total.finish_reasons += facts.finish_reasons
    total.response_id = total.response_id or facts.response_id
    total.response_model = total.response_model or facts.response_model
    if facts.error_type and not total.error_type:
        total.error_type, total.error_message = facts.error_type, facts.error_message
    total.done |= facts.done


class Gemini(ForwardsUnchanged):
    """The generateContent protocol, as the Gemini API (``gcp.gemini``) or Vertex AI (``gcp.vertex_ai``).

    Gemini reports usage without being asked, so requests go unchanged.
    """

    name: str = "gemini"
    # A stream without ``alt=sse`` is an ``application/json`` array sent piece by piece.
    framing: Framing = "json-array"

    def __init__(self, *, vertex: bool) -> None:
        self._vertex = vertex
        self.family = "gcp.vertex_ai" if vertex else "gcp.gemini"

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …:generateContent`` and ``…:streamGenerateContent``, Vertex paths to Vertex."""
        if not (matches_suffix(method, path, _STREAM) or matches_suffix(method, path, _WHOLE)):
            return False
        return ("/projects/" in path) == self._vertex

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model and stream flag from the path; ``generationConfig`` params and prompt text from the body."""
        stream = path.split("?", 1)[0].rstrip("/").endswith(_STREAM)
        model = model_from_path(path)
        obj, error = load_object(body)
        if obj is None:
            return RequestInfo(operation="generate_content", model=model, stream=stream, parse_error=error)
        config = as_dict(_get(obj, "generationConfig"))
        params = request_params(
            {key: _get(config, camel) for key, camel in _PARAMS.items()},
            max_tokens_keys=("max_tokens",),
            stop_key="stop",
        )
        return RequestInfo(
            operation="generate_content",
            model=model,
            stream=stream,
            params=params,
            prompt_text=_prompt(obj),
        )

    def stream_parser(self) -> StreamParser:
        """A parser for one stream's ``GenerateContentResponse`` chunks, SSE events or JSON-array elements.

        Each stream keeps its own usage so far: every chunk repeats the counts, folded field by field into it.
        """
        return ObjectStreamParser(partial(response_facts, reported={}))

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a whole response, of an error body, or of a whole streamed array read at once."""
        value = _load(body)
        reported: dict[str, int] = {}
        if isinstance(value, dict):
            return response_facts(value, reported)
        total = Facts()
        for element in value if isinstance(value, list) else ():
            if isinstance(element, dict):
                _fold(total, response_facts(element, reported))
        return total
