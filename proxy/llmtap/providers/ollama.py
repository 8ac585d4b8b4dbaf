"""Ollama's native API: ``POST …/api/chat`` and ``…/api/generate``, streamed as NDJSON or whole.

Wire format: standards D.5, docs.ollama.com/api/usage. Every line of a stream is one JSON object; chat
lines carry ``message`` (``content``, ``thinking``, ``tool_calls``), generate lines carry ``response``
and ``thinking``. The last line has ``done: true``, ``done_reason`` and the request's metrics; an error
arrives as a line ``{"error": "..."}``. A request streams unless it says ``"stream": false``, and then
the whole body is one object shaped like the last line with all the text in it.

Metrics (nanoseconds): ``prompt_eval_count`` is the prompt's tokens and ``prompt_eval_cached_count``
those of them read from the cache; ``eval_count`` the generated tokens. The phases:

* queue = ``load_duration``. Ollama sets it from the handler's start to the moment a loaded runner is
  ready for the request (``server/routes.go``: ``checkpointLoaded.Sub(checkpointStart)``): loading the
  model, or waiting for the scheduler to hand one over. No work on this request happens in it, so to
  the caller it is waiting, which is what llmtap's queue means; Ollama reports no other queue time.
* prefill = ``prompt_eval_duration`` (the uncached prompt tokens), decode = ``eval_duration``.

Ollama omits zero metrics (``omitempty``), so an absent field is left unknown, never read as 0.
"""

from __future__ import annotations

import json

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import (
    JSONObject,
    ObjectStreamParser,
    as_count,
    as_dict,
    as_str,
    body_facts,
    error_facts,
    load_object,
    matches_suffix,
    prompt_text,
    request_params,
)
from llmtap.providers.protocol import ForwardsUnchanged
from llmtap.providers.timing import NS, FieldMap, from_body
from llmtap.types import Facts, RequestInfo, Usage

__all__ = ["OLLAMA_TIMING", "Ollama"]

OLLAMA_TIMING: FieldMap = {
    "queue": ("load_duration", NS),
    "prefill": ("prompt_eval_duration", NS),
    "decode": ("eval_duration", NS),
}


def _tool_call_text(calls: object) -> list[str]:
    # Ollama sends tool arguments as a JSON object, not as the string OpenAI streams.
    out: list[str] = []
    for call in calls if isinstance(calls, list) else ():
        arguments = as_dict(as_dict(call).get("function")).get("arguments")
        if isinstance(arguments, dict) and arguments:
            out.append(json.dumps(arguments, ensure_ascii=False))
        elif isinstance(arguments, str) and arguments:
            out.append(arguments)
    return out


def _generated_text(obj: JSONObject) -> str:
    """Thinking, text and tool-call arguments of a chat line (``message``) or a generate line."""
    message = obj.get("message")
    source = message if isinstance(message, dict) else obj
    out: list[str] = []
    for key in ("thinking", "content" if isinstance(message, dict) else "response"):
        text = source.get(key)
        if isinstance(text, str) and text:
            out.append(text)
    out += _tool_call_text(source.get("tool_calls"))
    return "".join(out)


def _usage(obj: JSONObject) -> Usage | None:
    usage = Usage(
        input_tokens=as_count(obj.get("prompt_eval_count")),
        output_tokens=as_count(obj.get("eval_count")),
        cache_read_tokens=as_count(obj.get("prompt_eval_cached_count")),
    )
    return None if usage == Usage() else usage


def line_facts(obj: JSONObject) -> Facts:
    """Facts of one NDJSON line or of a whole non-streamed body (the same shape)."""
    if obj.get("error") is not None:
        return error_facts(obj["error"])
    text = _generated_text(obj)
    done = obj.get("done") is True
    reason = as_str(obj.get("done_reason")) if done else None
    return Facts(
        has_content=bool(text),
        content=text,
        usage=_usage(obj),
        finish_reasons=[reason] if reason else [],
        response_model=as_str(obj.get("model")),
        server_timing=from_body(obj, OLLAMA_TIMING),
        done=done,
    )


class Ollama(ForwardsUnchanged):
    """One of Ollama's two generation endpoints; they differ only in request shape and operation name.

    Ollama reports usage in its final event, so requests go unchanged.
    """

    family: str = "ollama"
    framing: Framing = "ndjson"

    def __init__(self, *, generate: bool) -> None:
        self._generate = generate
        self.name = "ollama_generate" if generate else "ollama_chat"
        self._suffix = "/api/generate" if generate else "/api/chat"
        self._operation = "text_completion" if generate else "chat"

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/api/chat`` (or ``…/api/generate``)."""
        return matches_suffix(method, path, self._suffix)

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, stream flag (true unless ``"stream": false``), ``options`` params and prompt text."""
        obj, error = load_object(body)
        if obj is None:
            return RequestInfo(operation=self._operation, parse_error=error)
        if self._generate:
            prompt = prompt_text(system=obj.get("system"), messages=obj.get("prompt"))
        else:
            prompt = prompt_text(messages=obj.get("messages"), tools=obj.get("tools"))
        return RequestInfo(
            operation=self._operation,
            model=as_str(obj.get("model")),
            # Ollama streams by default: only an explicit false turns it off.
            stream=obj.get("stream") is not False,
            params=request_params(as_dict(obj.get("options")), max_tokens_keys=("num_predict",), stop_key="stop"),
            prompt_text=prompt,
        )

    def stream_parser(self) -> StreamParser:
        """A parser for one NDJSON stream; each line stands alone, so it keeps no state."""
        return ObjectStreamParser(line_facts)

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a ``"stream": false`` body or an error body ``{"error": "..."}``."""
        return body_facts(body, line_facts)
