"""OpenAI Chat Completions (``POST …/chat/completions``), as served by OpenAI, vLLM, SGLang, TGI, llama.cpp.

Wire format: standards D.1. A stream is ``data: {chat.completion.chunk}`` events ending in ``data: [DONE]``;
vLLM opens with a role-only delta and sends empty-content deltas, neither of which is content.
"""

from __future__ import annotations

from llmtap.providers.openai_common import (
    JSONObject,
    as_dict,
    collect_text,
    matches_suffix,
    prompt_regions,
    prompt_text,
)
from llmtap.providers.protocol import ChoicesProtocol
from llmtap.types import PromptRegion

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


class OpenAIChat(ChoicesProtocol):
    """The Chat Completions protocol."""

    def __init__(self) -> None:
        super().__init__(
            name="openai_chat",
            operation="chat",
            # max_completion_tokens replaced max_tokens in the OpenAI API; clients send either.
            max_tokens_keys=("max_completion_tokens", "max_tokens"),
            prompt=_prompt,
            regions=_regions,
            choice_text=chat_choice_text,
            choice_reasoning=chat_choice_reasoning,
        )

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/chat/completions``."""
        return matches_suffix(method, path, "/chat/completions")
