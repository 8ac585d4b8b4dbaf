"""Embeddings: OpenAI's ``POST /v1/embeddings`` and Ollama's ``POST /api/embed``, as the servers answer them.

The input is tokenized with the profile's encoding, so the usage the answer reports is a true count; each
vector is a few floats derived from its text's hash (the same text, the same vector). The answer takes
as long as the profile's prefill of those tokens would: enough for a duration to measure.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmtap.simulator.profiles import Profile
from llmtap.simulator.text import tokenize

__all__ = ["embeddings_endpoint"]

#: Floats in each simulated vector.
DIMENSIONS = 8
#: Inputs in one request at most (OpenAI's own bound is 2048).
MAX_INPUTS = 2048


def _vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode("utf-8", "replace")).digest()
    return [round((b - 127.5) / 127.5, 6) for b in digest[:DIMENSIONS]]


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def _inputs(value: Any) -> list[str] | None:
    """The texts of an ``input``: a string or a list of strings (token-id arrays are not simulated)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and len(value) <= MAX_INPUTS:
        return list(value)
    return None


def embeddings_endpoint(profile: Profile, *, ollama: bool) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    """The endpoint for ``/v1/embeddings`` (or Ollama's ``/api/embed`` when ``ollama``)."""

    async def embeddings(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return _error(400, "'model' is required")
        texts = _inputs(body.get("input"))
        if texts is None:
            return _error(400, "'input' must be a string or a list of strings")
        tokens = 0
        for text in texts:
            tokens += len(await tokenize(text, profile.encoding))
        await asyncio.sleep(profile.prefill_s(tokens))
        model = body["model"]
        if ollama:
            elapsed = int((time.perf_counter() - started) * 1e9)
            return JSONResponse(
                {
                    "model": model,
                    "embeddings": [_vector(t) for t in texts],
                    "total_duration": elapsed,
                    "load_duration": 0,
                    "prompt_eval_count": tokens,
                }
            )
        return JSONResponse(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": _vector(t)} for i, t in enumerate(texts)],
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    return embeddings
