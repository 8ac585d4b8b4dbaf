"""Wire shapes, byte for byte as vLLM 0.32 writes them (``/work/shared/data/transcripts/vllm-0.32-cpu``).

Key order, null fields and framing follow the recordings: ``data: {...}\\n\\n`` with compact JSON and raw
UTF-8; the chat stream opens with a role-only delta whose content is ""; ``finish_reason`` rides on the
last content chunk; the usage chunk (``"choices": []``) comes before ``data: [DONE]`` only with
``stream_options.include_usage``. One addition on /v1/messages: a ``ping`` after ``content_block_start``,
as Anthropic's own API sends (standards D.4), so clients' ping handling is exercised. The Responses
stream names its events (``event: response.created`` ...) and numbers them (``sequence_number``); its
only usage rides on the terminal ``response.completed`` (``llmtap.simulator.responses``). Ollama's and Gemini's
own shapes are in ``llmtap.simulator.native``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from llmtap.simulator.parts import ARGUMENT_KEY, arguments_piece, signature, tool_call_id
from llmtap.simulator.requests import SimError
from llmtap.simulator.truth import RequestRecord

__all__ = [
    "SSE_TYPE",
    "ChatFormat",
    "CompletionsFormat",
    "Format",
    "MessagesFormat",
    "Reply",
    "dumps",
    "openai_error",
    "sse",
]

# We never see an EOS token (ignore_eos in effect), so every answer stops on its length limit.
_FINISH = "length"
_ANTHROPIC_FINISH = "max_tokens"
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


def dumps(obj: Any) -> bytes:
    """Compact JSON with raw UTF-8, as pydantic's ``model_dump_json`` writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any, event: str | None = None) -> bytes:
    """One SSE event; ``event:`` only where the protocol names its events (Anthropic)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
SSE_TYPE = b"text/event-stream; charset=utf-8"


@dataclass(slots=True)
class Reply:
    """The facts one response is written from; cache fields are filled in at admission."""

    id: str
    created: int
    model: str
    fingerprint: str
    prompt_tokens: int
    output_tokens: int
    #: The server's own record of the request, for protocols that report their phases (Ollama).
    truth: RequestRecord
    include_usage: bool = False
    continuous_usage: bool = False
    cached_tokens: int = 0
    created_cache_tokens: int = 0
    #: Events written so far: the Responses API numbers them, a Gemini array puts commas between them.
    events: int = 0
    #: Chat chunks in OpenAI's own shape (``Profile.openai_chunks``).
    openai_chunks: bool = False
    #: Chat ``n``; the leading reasoning tokens; the function called with the answer's tokens (``parts``).
    choices: int = 1
    reasoning_tokens: int = 0
    tool: str | None = None
    #: The reasoning text, for a whole body (a stream writes it as it goes).
    reasoning_text: str = ""
    #: A stream has written its first answer (non-reasoning) chunk.
    answering: bool = False

    @property
    def generated(self) -> int:
        """Tokens generated over all choices (usage counts them all, reasoning included)."""
        return self.output_tokens * self.choices

    def part(self, done: int) -> str:
        """What the chunk that ends at token ``done`` is: ``reasoning``, ``tool`` (arguments) or ``content``."""
        if done <= self.reasoning_tokens:
            return "reasoning"
        return "tool" if self.tool is not None else "content"


class Format(Protocol):
    """How one protocol writes a stream (prelude, chunks, tail), a whole body, and an error body."""

    id_prefix: str
    #: Content type of a streamed response.
    stream_type: bytes

    def prelude(self, r: Reply) -> list[bytes]:
        """Events before the first token (role chunk, message_start, ...)."""
        ...

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """Events for one chunk of text; ``done`` counts the tokens written so far, this chunk included."""
        ...

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """Events after the last token (usage, [DONE], message_stop, ...); ``text`` is the whole answer."""
        ...

    def body(self, r: Reply, text: str) -> bytes:
        """The non-streamed response body."""
        ...

    def error(self, err: SimError) -> bytes:
        """The error body in this protocol's shape."""
        ...


def openai_error(err: SimError) -> bytes:
    """vLLM's error body: ``{"error": {message, type, param, code}}``."""
    return dumps({"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}})


def _head(r: Reply, obj: str) -> dict[str, Any]:
    return {"id": r.id, "object": obj, "created": r.created, "model": r.model}


def _running_usage(r: Reply, done: int) -> dict[str, Any]:
    return {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens + done, "completion_tokens": done}


class ChatFormat:
    """OpenAI Chat Completions as vLLM serves it: text, reasoning (``reasoning`` deltas), a tool call with streamed
    arguments, and ``n`` choices (each chunk once per choice, with its ``index``)."""

    id_prefix = "chatcmpl-"
    stream_type = SSE_TYPE
    error = staticmethod(openai_error)

    def _usage(self, r: Reply) -> dict[str, Any]:
        return _running_usage(r, r.generated) | {
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens, "created_cache_tokens": r.created_cache_tokens}
        }

    def prelude(self, r: Reply) -> list[bytes]:
        """The role-only first chunk, one per choice."""
        return [self._prelude_chunk(r, i) for i in range(r.choices)]

    def _prelude_chunk(self, r: Reply, index: int) -> bytes:
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        if r.openai_chunks:
            return sse(self._openai_chunk(r, role))
        obj = _head(r, "chat.completion.chunk")
        obj["choices"] = [role]
        if r.continuous_usage:
            obj["usage"] = _running_usage(r, 0) | {"completion_tokens_details": None}
        obj |= {"prompt_token_ids": None, "prompt_text": None}
        return sse(obj)

    def _delta(self, r: Reply, text: str, done: int) -> dict[str, Any]:
        part = r.part(done)
        if part == "reasoning":
            return {"reasoning": text}
        if part == "content":
            return {"content": text}
        first, last = not r.answering, done == r.output_tokens
        call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments_piece(text, first=first, last=last)}}
        if first:
            call = {"id": tool_call_id(r.id, "chatcmpl-tool-"), "type": "function", "index": 0}
            call["function"] = {"name": r.tool, "arguments": arguments_piece(text, first=True, last=last)}
        return {"tool_calls": [call]}

    def _finish(self, r: Reply) -> str:
        return "tool_calls" if r.tool is not None else _FINISH

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """A delta per choice (reasoning, content or tool-call arguments); the last ones carry ``finish_reason``."""
        delta = self._delta(r, text, done)
        r.answering = r.answering or r.part(done) != "reasoning"
        return [self._chunk(r, i, delta, done) for i in range(r.choices)]

    def _chunk(self, r: Reply, index: int, delta: dict[str, Any], done: int) -> bytes:
        last = done == r.output_tokens
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None}
        choice |= {"finish_reason": self._finish(r), "stop_reason": None} if last else {"finish_reason": None}
        choice["token_ids"] = None
        if r.openai_chunks:
            return sse(self._openai_chunk(r, choice))
        obj = _head(r, "chat.completion.chunk") | {"choices": [choice]}
        if r.continuous_usage:
            obj["usage"] = _running_usage(r, done) | {"completion_tokens_details": None}
        if last and not r.include_usage:
            obj["system_fingerprint"] = r.fingerprint
        return sse(obj)

    def _openai_chunk(self, r: Reply, choice: dict[str, Any]) -> dict[str, Any]:
        """A chunk as OpenAI writes it: the fingerprint on each, ``"usage": null`` on each once usage is asked."""
        obj = _head(r, "chat.completion.chunk") | {"system_fingerprint": r.fingerprint, "choices": [choice]}
        return obj | {"usage": None} if r.include_usage else obj

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """The usage chunk when asked for, then ``[DONE]``."""
        out = []
        if r.include_usage and r.openai_chunks:
            out.append(sse(self._openai_chunk(r, {}) | {"choices": [], "usage": self._usage(r)}))
        elif r.include_usage:
            obj = _head(r, "chat.completion.chunk") | {"choices": [], "usage": self._usage(r)}
            out.append(sse(obj | {"system_fingerprint": r.fingerprint}))
        return [*out, DONE]

    def _message(self, r: Reply, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if r.tool is not None else text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if r.tool is not None:
            arguments = arguments_piece(text, first=True, last=True)
            function = {"name": r.tool, "arguments": arguments}
            message["tool_calls"] = [
                {"id": tool_call_id(r.id, "chatcmpl-tool-"), "type": "function", "function": function}
            ]
        message["reasoning"] = r.reasoning_text or None
        return message

    def body(self, r: Reply, text: str) -> bytes:
        """A ``chat.completion`` object, one choice per ``n``."""
        choices = [
            {
                "index": i,
                "message": self._message(r, text),
                "logprobs": None,
                "finish_reason": self._finish(r),
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            for i in range(r.choices)
        ]
        usage = self._usage(r)
        usage["prompt_tokens_details"]["multimodal_tokens"] = None
        usage["completion_tokens_details"] = None
        obj = _head(r, "chat.completion") | {
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": r.fingerprint,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return dumps(obj)


class CompletionsFormat:
    """OpenAI legacy Completions as vLLM serves it (no role chunk)."""

    id_prefix = "cmpl-"
    stream_type = SSE_TYPE
    error = staticmethod(openai_error)

    def _usage(self, r: Reply) -> dict[str, Any]:
        return _running_usage(r, r.output_tokens) | {"prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def _choice(self, text: str, last: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": _FINISH if last else None,
            "stop_reason": None,
        }

    def prelude(self, r: Reply) -> list[bytes]:
        """Nothing: the first event already carries text."""
        return []

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """A ``text_completion`` chunk; the last one carries ``finish_reason``."""
        choice = self._choice(text, done == r.output_tokens) | {"prompt_token_ids": None, "token_ids": None}
        obj = _head(r, "text_completion") | {"choices": [choice]}
        if r.continuous_usage:
            obj["usage"] = _running_usage(r, done)
        return [sse(obj)]

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """The usage chunk when asked for, then ``[DONE]``."""
        out = []
        if r.include_usage:
            obj = _head(r, "text_completion") | {"choices": [], "usage": self._usage(r)}
            out.append(sse(obj | {"system_fingerprint": r.fingerprint}))
        return [*out, DONE]

    def body(self, r: Reply, text: str) -> bytes:
        """A ``text_completion`` object (vLLM ``CompletionResponse``)."""
        choice = self._choice(text, True) | {"prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}
        obj = _head(r, "text_completion") | {
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": r.fingerprint,
            "usage": self._usage(r),
            "kv_transfer_params": None,
        }
        return dumps(obj)


def anthropic_error(err: SimError) -> bytes:
    """Anthropic's error body: ``{"type": "error", "error": {type, message}}``."""
    kind = _ANTHROPIC_ERRORS.get(err.status, "api_error")
    return dumps({"type": "error", "error": {"type": kind, "message": err.message}})


class MessagesFormat:
    """Anthropic Messages as vLLM serves it, plus Anthropic's ``ping``."""

    id_prefix = "chatcmpl-"  # vLLM reuses its chat ids on /v1/messages
    stream_type = SSE_TYPE
    error = staticmethod(anthropic_error)

    def _usage(self, r: Reply) -> dict[str, Any]:
        # Anthropic counts cache reads outside input_tokens: total = input + cache_read + cache_creation.
        # Automatic prefix caching writes no billed cache entries, so cache_creation stays 0.
        return {
            "input_tokens": r.prompt_tokens - r.cached_tokens,
            "output_tokens": r.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": r.cached_tokens,
        }

    def _block(self, r: Reply, answer: bool) -> dict[str, Any]:
        """The empty block a ``content_block_start`` opens: thinking, a tool_use, or text."""
        if not answer:
            return {"type": "thinking", "thinking": "", "signature": ""}
        if r.tool is not None:
            return {"type": "tool_use", "id": tool_call_id(r.id, "toolu_"), "name": r.tool, "input": {}}
        return {"type": "text", "text": ""}

    def _start(self, r: Reply, index: int, answer: bool) -> bytes:
        start = {"type": "content_block_start", "content_block": self._block(r, answer), "index": index}
        return sse(start, "content_block_start")

    def prelude(self, r: Reply) -> list[bytes]:
        """message_start, the first block's content_block_start (thinking when asked for) and a ping."""
        message: dict[str, Any] = {
            "id": r.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": r.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": r.prompt_tokens - r.cached_tokens, "output_tokens": 0},
        }
        return [
            sse({"type": "message_start", "message": message}, "message_start"),
            self._start(r, 0, answer=not r.reasoning_tokens),
            sse({"type": "ping"}, "ping"),
        ]

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """A thinking_delta, text_delta or input_json_delta; the thinking block is signed and closed before the
        answer's block opens."""
        part = r.part(done)
        index = 1 if r.reasoning_tokens else 0
        out: list[bytes] = []
        if part == "reasoning":
            delta: dict[str, Any] = {"type": "thinking_delta", "thinking": text}
            index = 0
        elif part == "content":
            delta = {"type": "text_delta", "text": text}
        else:
            json_text = arguments_piece(text, first=not r.answering, last=done == r.output_tokens)
            delta = {"type": "input_json_delta", "partial_json": json_text}
        if part != "reasoning" and not r.answering:
            r.answering = True
            if r.reasoning_tokens:
                sign = {"type": "signature_delta", "signature": signature(r.id)}
                out.append(sse({"type": "content_block_delta", "delta": sign, "index": 0}, "content_block_delta"))
                out.append(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
                out.append(self._start(r, 1, answer=True))
        out.append(sse({"type": "content_block_delta", "delta": delta, "index": index}, "content_block_delta"))
        return out

    def _stop_reason(self, r: Reply) -> str:
        return "tool_use" if r.tool is not None else _ANTHROPIC_FINISH

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """content_block_stop, message_delta with the usage, message_stop."""
        delta = {"stop_reason": self._stop_reason(r), "stop_sequence": None}
        return [
            sse({"type": "content_block_stop", "index": 1 if r.reasoning_tokens else 0}, "content_block_stop"),
            sse({"type": "message_delta", "delta": delta, "usage": self._usage(r)}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop"),
        ]

    def _content(self, r: Reply, text: str) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if r.reasoning_tokens:
            blocks.append({"type": "thinking", "thinking": r.reasoning_text, "signature": signature(r.id)})
        if r.tool is not None:
            blocks.append(self._block(r, answer=True) | {"input": {ARGUMENT_KEY: text}})
        else:
            blocks.append({"type": "text", "text": text})
        return blocks

    def body(self, r: Reply, text: str) -> bytes:
        """A ``message`` object."""
        obj = {
            "id": r.id,
            "type": "message",
            "role": "assistant",
            "content": self._content(r, text),
            "model": r.model,
            "stop_reason": self._stop_reason(r),
            "usage": self._usage(r),
        }
        return dumps(obj)
