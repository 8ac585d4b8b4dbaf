"""OpenAI Responses (``POST …/responses``), as served by OpenAI and vLLM.

Wire format: standards D.3. Every event is ``event: <type>`` + ``data: {"type": <type>, …}``; the stream
opens with ``response.created``/``in_progress`` and ends with a terminal ``response.completed`` |
``response.incomplete`` | ``response.failed`` carrying the whole response, whose ``usage`` is the only usage.
There is no include_usage option, so requests are never rewritten.
"""

from __future__ import annotations

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import (
    JSONObject,
    as_dict,
    as_str,
    body_facts,
    collect_text,
    error_facts,
    load_object,
    matches_suffix,
    openai_end_user,
    prompt_regions,
    prompt_text,
    read_request,
    usage_from_openai,
)
from llmtap.providers.protocol import ForwardsUnchanged
from llmtap.providers.sse import Event
from llmtap.types import Facts, PromptRegion, RequestInfo

__all__ = ["OpenAIResponses"]

_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_OPENING = frozenset({"response.created", "response.in_progress", "response.queued"})
# Statuses after which a response is over; ``in_progress``/``queued`` bodies (background mode) have none.
_FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


def response_facts(resp: JSONObject, *, with_content: bool) -> Facts:
    """Facts of a Responses ``response`` object; ``with_content`` False for the streamed terminal copy.

    The finish reason is ``incomplete_details.reason`` (e.g. ``max_output_tokens``) when there is one,
    else the status: the API has no per-choice finish_reason.
    """
    out: list[str] = []
    if with_content:
        collect_text(resp.get("output"), out)
    content = "".join(out)
    status = as_str(resp.get("status"))
    reason = as_str(as_dict(resp.get("incomplete_details")).get("reason")) or status
    facts = Facts(
        has_content=bool(content),
        content=content,
        usage=usage_from_openai(resp.get("usage")),
        finish_reasons=[reason] if reason and status in _FINAL_STATUSES else [],
        response_id=as_str(resp.get("id")),
        response_model=as_str(resp.get("model")),
    )
    if status == "failed" or resp.get("error") is not None:
        failure = error_facts(resp.get("error"))  # ResponseError{code, message}
        facts.error_type, facts.error_message = failure.error_type, failure.error_message
    return facts


def _delta_facts(event_type: str, obj: JSONObject) -> Facts | None:
    # Every text-bearing stream delta is ``response.<thing>.delta`` with a string ``delta``: output_text,
    # refusal, reasoning_text, reasoning_summary_text, function_call_arguments, custom tool input, ...
    delta = obj.get("delta")
    if not isinstance(delta, str) or not delta:
        return None
    if "audio" in event_type and "transcript" not in event_type:
        return Facts(has_content=True)  # base64 audio is generated content but not text to count
    return Facts(has_content=True, content=delta, reasoning=event_type.startswith("response.reasoning"))


class ResponsesStreamParser:
    """Reads one Responses event stream."""

    def __init__(self) -> None:
        self.malformed = 0

    def feed(self, event: Event) -> Facts | None:
        """Facts of one event; None for lifecycle events that say nothing new."""
        data = event.data
        if not data:
            return None
        if data.strip() == "[DONE]":  # some OpenAI-compatible servers append it anyway
            return Facts(done=True)
        obj, _ = load_object(data)
        if obj is None:
            self.malformed += 1
            return None
        event_type = event.event or as_str(obj.get("type")) or ""
        if event_type.endswith(".delta"):
            return _delta_facts(event_type, obj)
        if event_type in _TERMINAL:
            facts = response_facts(as_dict(obj.get("response")), with_content=False)
            facts.done = True
            return facts
        if event_type in _OPENING:
            resp = as_dict(obj.get("response"))
            return Facts(response_id=as_str(resp.get("id")), response_model=as_str(resp.get("model")))
        if event_type == "error":
            # The event itself is the error ({code, message, param}); its own "type" is just "error".
            nested = obj.get("error")
            return error_facts(
                nested if nested is not None else {"code": obj.get("code"), "message": obj.get("message")}
            )
        return None


def _prompt(obj: JSONObject) -> str:
    return prompt_text(system=obj.get("instructions"), messages=obj.get("input"), tools=obj.get("tools"))


def _regions(obj: JSONObject) -> list[PromptRegion]:
    return prompt_regions(tools=obj.get("tools"), system=obj.get("instructions"), messages=obj.get("input"))


def _body_facts(obj: JSONObject) -> Facts:
    """Facts of a ``response`` object or of a JSON error body."""
    if obj.get("object") != "response" and obj.get("error") is not None:
        return error_facts(obj["error"])
    return response_facts(obj, with_content=True)


class OpenAIResponses(ForwardsUnchanged):
    """The Responses protocol; it has no include_usage option and needs none (usage always arrives)."""

    name: str = "openai_responses"
    family: str = "openai"
    framing: Framing = "sse"

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/responses``."""
        return matches_suffix(method, path, "/responses")

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, stream flag, params and prompt text; never rewritten (usage always arrives)."""
        info, _ = read_request(
            body,
            operation="chat",
            max_tokens_keys=("max_output_tokens",),
            stop_key="stop",
            prompt=_prompt,
            regions=_regions,
            end_user=openai_end_user,
        )
        return info

    def stream_parser(self) -> StreamParser:
        """A parser for one Responses event stream."""
        return ResponsesStreamParser()

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a ``response`` object or a JSON error body."""
        return body_facts(body, _body_facts)
