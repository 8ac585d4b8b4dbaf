"""The parts of an answer beyond plain text, shared by the protocols' shapes: tool-call arguments and reasoning.

The simulator has no model, so a tool call's arguments are made of the answer's own tokens: the JSON object
``{"text": "<the tokens>"}``, streamed as its tokens are written (the first piece opens the object, the last closes
it), so the concatenated deltas always parse and their length follows the tokens, as a real call's would. A
reasoning answer spends the first half of its tokens on reasoning (``reasoning_split``), then answers.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["ARGUMENT_KEY", "arguments_piece", "reasoning_split", "signature", "tool_call_id"]

#: The one key of a simulated call's arguments.
ARGUMENT_KEY = "text"
_OPEN = '{"' + ARGUMENT_KEY + '": "'
_CLOSE = '"}'


def reasoning_split(output_tokens: int, reasoning: bool) -> int:
    """How many of an answer's tokens are reasoning: half (at least one), leaving at least one for the answer."""
    if not reasoning or output_tokens < 2:
        return 0
    return max(1, output_tokens // 2)


def arguments_piece(text: str, *, first: bool, last: bool) -> str:
    """The part of the arguments' JSON text that ``text`` (some of the answer's tokens) adds."""
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]
    return (_OPEN if first else "") + escaped + (_CLOSE if last else "")


def tool_call_id(response_id: str, prefix: str) -> str:
    """A call id derived from the response's id: unique per response, and the same in a stream and a body."""
    return prefix + hashlib.sha256(response_id.encode()).hexdigest()[:24]


def signature(response_id: str) -> str:
    """An opaque thinking-block signature (Anthropic's is a base64 blob the client sends back unchanged)."""
    return hashlib.sha256(b"thinking:" + response_id.encode()).hexdigest()
