"""The OpenAI chat stream's events as the upstreams here write them: compact JSON, one ``data:`` event each, in the
key order vLLM writes (``id``, ``object``, ``created``, ``model``, ``choices``, then ``usage``)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["chat_chunk", "usage_chunk"]

CREATED = 1700000000


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(
    delta: dict[str, Any], finish: str | None = None, *, model: str, ident: str, usage: dict[str, Any] | None = None
) -> bytes:
    """One choice's ``delta`` (and ``finish`` reason), with ``usage`` when the stream reports it on every chunk."""
    body: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return _event(body)


def usage_chunk(prompt: int, completion: int, *, model: str, ident: str) -> bytes:
    """The extra usage event ``stream_options.include_usage`` asks for: ``choices`` empty."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    body = {"id": ident, "object": "chat.completion.chunk", "created": CREATED, "model": model, "choices": []}
    return _event({**body, "usage": usage})
