"""Anthropic Messages (``POST …/messages``), as served by Anthropic and by vLLM's Anthropic endpoint.

Wire format: standards D.4. ``message_start`` carries the id, model and first usage; text, tool input and
thinking arrive in ``content_block_delta``; ``message_delta`` carries stop_reason and cumulative usage;
``message_stop`` ends it. ``ping`` may come anywhere and an ``error`` event may come after HTTP 200.
"""

from __future__ import annotations

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import (
    JSONObject,
    as_count,
    as_dict,
    as_str,
    body_facts,
    collect_text,
    error_facts,
    load_object,
    matches_suffix,
    prompt_regions,
    prompt_text,
    read_request,
)
from llmtap.providers.protocol import ForwardsUnchanged
from llmtap.providers.sse import Event
from llmtap.types import Facts, PromptRegion, RequestInfo, Usage

__all__ = ["AnthropicMessages"]

# The delta field that carries generated text, per content_block_delta type. signature_delta and
# citations_delta carry no generated tokens and are not content.
_DELTA_TEXT = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}
_USAGE_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def merge_usage(reported: dict[str, int], raw: object) -> Usage | None:
    """Fold one usage object into ``reported`` (later values replace earlier ones, never add) and normalize.

    message_delta usage is cumulative (D.4), so replacing field by field is right. Input follows the
    OTel Anthropic mapping: input_tokens + cache_read_input_tokens + cache_creation_input_tokens.
    """
    obj = as_dict(raw)
    for key in _USAGE_KEYS:
        value = as_count(obj.get(key))
        if value is not None:
            reported[key] = value
    thinking = as_count(as_dict(obj.get("output_tokens_details")).get("thinking_tokens"))
    if thinking is not None:
        reported["thinking_tokens"] = thinking
    # Writes split by lifetime (``usage.cache_creation``): the hour-long ones are priced above the 5-minute ones.
    hour = as_count(as_dict(obj.get("cache_creation")).get("ephemeral_1h_input_tokens"))
    if hour is not None:
        reported["cache_write_1h"] = hour
    if not reported:
        return None
    cache_read = reported.get("cache_read_input_tokens")
    cache_write = reported.get("cache_creation_input_tokens")
    uncached = reported.get("input_tokens")
    return Usage(
        input_tokens=None if uncached is None else uncached + (cache_read or 0) + (cache_write or 0),
        output_tokens=reported.get("output_tokens"),
        cache_read_tokens=cache_read,
        cache_write_tokens=cache_write,
        reasoning_tokens=reported.get("thinking_tokens"),
        cache_write_1h_tokens=reported.get("cache_write_1h"),
    )


def _error(obj: JSONObject) -> Facts:
    # Anthropic nests the error ({"type": "error", "error": {"type": "overloaded_error", ...}}).
    return error_facts(obj.get("error"))


class AnthropicStreamParser:
    """Reads one Messages event stream; keeps the usage reported so far."""

    def __init__(self) -> None:
        self.malformed = 0
        self._usage: dict[str, int] = {}

    def feed(self, event: Event) -> Facts | None:
        """Facts of one event; None for ping, block start/stop and unknown events."""
        if event.event == "ping" or not event.data:
            return None
        obj, _ = load_object(event.data)
        if obj is None:
            self.malformed += 1
            return None
        event_type = event.event or as_str(obj.get("type"))
        if event_type == "content_block_delta":
            delta = as_dict(obj.get("delta"))
            kind = as_str(delta.get("type")) or ""
            text = as_str(delta.get(_DELTA_TEXT.get(kind, "")))
            return Facts(has_content=True, content=text, reasoning=kind == "thinking_delta") if text else None
        if event_type == "message_start":
            message = as_dict(obj.get("message"))
            return Facts(
                usage=merge_usage(self._usage, message.get("usage")),
                response_id=as_str(message.get("id")),
                response_model=as_str(message.get("model")),
            )
        if event_type == "message_delta":
            reason = as_str(as_dict(obj.get("delta")).get("stop_reason"))
            return Facts(usage=merge_usage(self._usage, obj.get("usage")), finish_reasons=[reason] if reason else [])
        if event_type == "message_stop":
            return Facts(done=True)
        if event_type == "error":
            return _error(obj)
        return None


def _prompt(obj: JSONObject) -> str:
    return prompt_text(system=obj.get("system"), messages=obj.get("messages"), tools=obj.get("tools"))


def _regions(obj: JSONObject) -> list[PromptRegion]:
    return prompt_regions(tools=obj.get("tools"), system=obj.get("system"), messages=obj.get("messages"))


def _end_user(obj: JSONObject) -> str | None:
    # Messages names the end user in ``metadata.user_id``, where OpenAI has ``user``.
    return as_str(as_dict(obj.get("metadata")).get("user_id"))


def _body_facts(obj: JSONObject) -> Facts:
    """Facts of a ``message`` body or an error body (Anthropic or OpenAI shaped)."""
    if obj.get("type") == "error" or obj.get("error") is not None:
        return _error(obj)
    out: list[str] = []
    collect_text(obj.get("content"), out)
    content = "".join(out)
    reason = as_str(obj.get("stop_reason"))
    return Facts(
        has_content=bool(content),
        content=content,
        usage=merge_usage({}, obj.get("usage")),
        finish_reasons=[reason] if reason else [],
        response_id=as_str(obj.get("id")),
        response_model=as_str(obj.get("model")),
    )


class AnthropicMessages(ForwardsUnchanged):
    """The Anthropic Messages protocol; its streams always carry usage (D.4), so requests go unchanged."""

    name: str = "anthropic"
    family: str = "anthropic"
    framing: Framing = "sse"

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/messages``, except OpenAI Assistants' ``…/threads/{id}/messages``."""
        return matches_suffix(method, path, "/messages") and "/threads/" not in path

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, stream flag, params (top_k included) and prompt text; never rewritten."""
        info, _ = read_request(
            body,
            operation="chat",
            max_tokens_keys=("max_tokens",),
            stop_key="stop_sequences",
            prompt=_prompt,
            regions=_regions,
            end_user=_end_user,
        )
        return info

    def stream_parser(self) -> StreamParser:
        """A parser for one Messages event stream."""
        return AnthropicStreamParser()

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a ``message`` body or an error body (Anthropic or OpenAI shaped)."""
        return body_facts(body, _body_facts)
