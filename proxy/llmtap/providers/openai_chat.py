"""OpenAI Chat Completions (``POST …/chat/completions``), as served by OpenAI, vLLM, SGLang, TGI, llama.cpp.

Wire format: standards D.1. A stream is ``data: {chat.completion.chunk}`` events ending in ``data: [DONE]``;
vLLM opens with a role-only delta and sends empty-content deltas, neither of which is content.
"""

from __future__ import annotations

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.openai_common import (
    ChoicesStreamParser,
    JSONObject,
    as_dict,
    collect_text,
    inspect_openai,
    matches_suffix,
    parse_choices_body,
    prompt_regions,
    prompt_text,
)
from llmtap.providers.splice import prepare_usage
from llmtap.types import Facts, Prepared, PromptRegion, RequestInfo

__all__ = ["OpenAIChat"]


def _message_text(message: JSONObject) -> str:
    """The generated text of a ``delta`` or ``message``: reasoning, content, refusal, tool-call arguments."""
    content = message.get("content")
    if isinstance(content, str) and not (
        message.get("reasoning_content")
        or message.get("reasoning")
        or message.get("refusal")
        or message.get("tool_calls")
        or message.get("function_call")
    ):
        # Nearly every streamed delta: text alone (empty values of the others add no text below either).
        return content
    out: list[str] = []
    # vLLM names reasoning ``reasoning_content`` in older releases and ``reasoning`` in newer ones; a
    # server that sends both sends the same text twice, so take one.
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    collect_text(reasoning, out)
    collect_text(message.get("content"), out)
    collect_text(message.get("refusal"), out)
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        collect_text(as_dict(as_dict(call).get("function")).get("arguments"), out)
    collect_text(as_dict(message.get("function_call")).get("arguments"), out)  # the deprecated single call
    return "".join(out)


def chat_choice_reasoning(choice: JSONObject) -> bool:
    """Whether a streamed choice's delta carries reasoning alone (no answer text, refusal or tool call yet)."""
    message = choice.get("delta")
    if not isinstance(message, dict) or not (message.get("reasoning_content") or message.get("reasoning")):
        return False
    return not (
        message.get("content") or message.get("refusal") or message.get("tool_calls") or message.get("function_call")
    )


def chat_choice_text(choice: JSONObject) -> str:
    """The generated text of one choice, streamed (``delta``) or whole (``message``)."""
    message = choice.get("delta")
    if not isinstance(message, dict):
        message = choice.get("message")
    return _message_text(message) if isinstance(message, dict) else ""


def _prompt(obj: JSONObject) -> str:
    # The system prompt is one of the messages here; ``functions`` is the pre-tools spelling.
    return prompt_text(messages=obj.get("messages"), tools=obj.get("tools") or obj.get("functions"))


def _regions(obj: JSONObject) -> list[PromptRegion]:
    # The leading system (or developer) messages are the system region; the messages after it follow.
    messages = obj.get("messages")
    listed = messages if isinstance(messages, list) else []
    n = 0
    while n < len(listed) and as_dict(listed[n]).get("role") in ("system", "developer"):
        n += 1
    return prompt_regions(tools=obj.get("tools") or obj.get("functions"), system=listed[:n], messages=listed[n:])


class OpenAIChat:
    """The Chat Completions protocol."""

    name: str = "openai_chat"
    family: str = "openai"
    framing: Framing = "sse"
    #: ``prepare`` is ``splice.prepare_usage``: a relay may parse a large body its own way, then splice.
    splices_usage: bool = True

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/chat/completions``."""
        return matches_suffix(method, path, "/chat/completions")

    def prepare(self, body: bytes, *, inject_usage: bool, path: str = "") -> Prepared:
        """On a stream that did not ask for usage, the client's bytes with ``include_usage: true`` spliced in."""
        return prepare_usage(body, inject_usage=inject_usage)

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, stream flag, params and prompt text; ask for usage on streams that did not."""
        return inspect_openai(
            body,
            inject_usage=inject_usage,
            operation="chat",
            # max_completion_tokens replaced max_tokens in the OpenAI API; clients send either.
            max_tokens_keys=("max_completion_tokens", "max_tokens"),
            prompt=_prompt,
            regions=_regions,
        )

    def stream_parser(self) -> StreamParser:
        """A parser for one ``chat.completion.chunk`` stream."""
        return ChoicesStreamParser(chat_choice_text, chat_choice_reasoning)

    def parse_body(self, body: bytes) -> Facts:
        """Facts of a ``chat.completion`` body or a JSON error body."""
        return parse_choices_body(body, chat_choice_text)
