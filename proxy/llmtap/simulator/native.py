"""Wire shapes of the servers with APIs of their own: Ollama (``/api/chat``, ``/api/generate``) and Gemini.

Ollama (docs/api.md, the field order of its Go types ``api.ChatResponse``/``api.GenerateResponse``/
``api.Metrics``): a stream is NDJSON, one object per line and ``application/x-ndjson``; the last line has
``done: true``, ``done_reason`` and the metrics, durations in nanoseconds and zero metrics left out
(``omitempty``). The simulator reports its own phases there, as Ollama does: ``load_duration`` is the
wait for a slot, ``prompt_eval_duration`` the prefill, ``eval_duration`` first token to last;
``prompt_eval_count`` is the whole prompt and ``prompt_eval_cached_count`` the part read from the cache.

Gemini (``GenerateContentResponse``, ``UsageMetadata``): with ``?alt=sse`` each chunk is one
``data: {...}`` event with CRLF line ends; without it the chunks are the elements of one JSON array,
pretty-printed like a whole response. Usage is cumulative on every chunk; ``promptTokenCount`` includes
``cachedContentTokenCount``, which appears only on a cache hit. The last chunk carries ``finishReason``;
there is no end sentinel.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from llmtap.simulator.requests import SimError
from llmtap.simulator.shapes import Reply, dumps

__all__ = ["GeminiFormat", "OllamaFormat"]

_NDJSON_TYPE = b"application/x-ndjson"
_GEMINI_STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "INVALID_ARGUMENT"}


def _ns(start: float | None, end: float | None) -> int:
    return 0 if start is None or end is None else max(0, round((end - start) * 1e9))


def ollama_error(err: SimError) -> bytes:
    """Ollama's error body: ``{"error": "..."}``."""
    return dumps({"error": err.message})


class OllamaFormat:
    """``/api/chat`` (``message.content``) or ``/api/generate`` (``response``), streamed as NDJSON."""

    id_prefix = ""
    stream_type = _NDJSON_TYPE
    error = staticmethod(ollama_error)

    def __init__(self, *, generate: bool, clock: Callable[[], float]) -> None:
        self._generate, self._clock = generate, clock

    def _line(self, r: Reply, text: str) -> dict[str, Any]:
        stamp = datetime.fromtimestamp(self._clock(), UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        head: dict[str, Any] = {"model": r.model, "created_at": stamp}
        if self._generate:
            return head | {"response": text}
        return head | {"message": {"role": "assistant", "content": text}}

    def _last(self, r: Reply, text: str) -> dict[str, Any]:
        """The final object: ``done``, the reason and the metrics (zero ones left out, as Ollama does)."""
        rec = r.truth
        # Chat writes done_reason before done, generate after it (the Go types' field order).
        finish = {"done": True, "done_reason": "length"} if self._generate else {"done_reason": "length", "done": True}
        metrics = {
            "total_duration": _ns(rec.arrival, time.monotonic()),
            "load_duration": _ns(rec.arrival, rec.admitted),
            "prompt_eval_count": r.prompt_tokens,
            "prompt_eval_cached_count": r.cached_tokens,
            "prompt_eval_duration": _ns(rec.admitted, rec.first_token),
            "eval_count": r.output_tokens,
            "eval_duration": _ns(rec.first_token, rec.last_token),
        }
        return self._line(r, text) | finish | {k: v for k, v in metrics.items() if v}

    def prelude(self, r: Reply) -> list[bytes]:
        """Nothing: the first line already carries text."""
        return []

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """One line with the chunk's text and ``done: false``."""
        return [dumps(self._line(r, text) | {"done": False}) + b"\n"]

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """The ``done: true`` line, empty text, with the metrics."""
        return [dumps(self._last(r, "")) + b"\n"]

    def body(self, r: Reply, text: str) -> bytes:
        """The whole answer: the last line's shape with all the text in it."""
        return dumps(self._last(r, text))


def gemini_error(err: SimError) -> bytes:
    """Google's error body: ``{"error": {code, message, status}}``, pretty-printed."""
    status = _GEMINI_STATUS.get(err.status, "INTERNAL")
    return _pretty({"error": {"code": err.status, "message": err.message, "status": status}})


def _pretty(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, ensure_ascii=False).encode()


class GeminiFormat:
    """``:generateContent`` and ``:streamGenerateContent``, as SSE (``alt=sse``) or as one JSON array."""

    id_prefix = ""
    error = staticmethod(gemini_error)

    def __init__(self, *, sse: bool) -> None:
        self._sse = sse
        self.stream_type = b"text/event-stream" if sse else b"application/json; charset=UTF-8"

    def _usage(self, r: Reply, done: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "promptTokenCount": r.prompt_tokens,
            "candidatesTokenCount": done,
            "totalTokenCount": r.prompt_tokens + done,
        }
        if r.cached_tokens:
            usage["cachedContentTokenCount"] = r.cached_tokens
        usage["promptTokensDetails"] = [{"modality": "TEXT", "tokenCount": r.prompt_tokens}]
        if r.cached_tokens:
            usage["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": r.cached_tokens}]
        return usage

    def _response(self, r: Reply, text: str, done: int) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}}
        if done == r.output_tokens:
            candidate["finishReason"] = "MAX_TOKENS"  # no EOS: every answer stops on its length
        candidate["index"] = 0
        return {
            "candidates": [candidate],
            "usageMetadata": self._usage(r, done),
            "modelVersion": r.model,
            "responseId": r.id,
        }

    def prelude(self, r: Reply) -> list[bytes]:
        """Nothing: the first chunk already carries text."""
        return []

    def chunk(self, r: Reply, text: str, done: int) -> list[bytes]:
        """One chunk with the usage so far; an array element after a comma from the second on."""
        obj = self._response(r, text, done)
        r.events += 1
        if self._sse:
            return [b"data: " + dumps(obj) + b"\r\n\r\n"]
        return [(b"[" if r.events == 1 else b",\n") + _pretty(obj)]

    def tail(self, r: Reply, text: str) -> list[bytes]:
        """Nothing for SSE; the array's closing bracket."""
        return [] if self._sse else [b"]"]

    def body(self, r: Reply, text: str) -> bytes:
        """A whole ``GenerateContentResponse``, pretty-printed."""
        return _pretty(self._response(r, text, r.output_tokens))
