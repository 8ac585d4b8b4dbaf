"""A simulated LLM server: the offline upstream that tests and benchmarks of the proxy run against.

It speaks every protocol llmtap reads that a server serves: OpenAI Chat Completions, legacy
Completions, Responses and Anthropic Messages in the exact shapes vLLM writes; Ollama's ``/api/chat``
and ``/api/generate`` (NDJSON, with its nanosecond metrics); and Gemini's ``:generateContent`` and
``:streamGenerateContent`` (SSE with ``?alt=sse``, else a JSON array). All share one engine, which
times answers with a continuous-batching scheduler (queue, prefill, decode) and a block-granular
prefix cache, and publishes its own truth per request at ``GET /debug/requests`` and as Prometheus
text at ``GET /metrics``.

Prompt tokens are ``tokens.count(prompt_text)`` in the profile's encoding, where ``prompt_text`` joins
the request's text pieces with "\\n" (``llmtap.simulator.requests`` says which pieces, per protocol): for
chat, every message's content text, in order; for /v1/messages, the ``system`` text first, then the
messages likewise; for /v1/completions, the prompt string. Roles and templates are not counted.
Output tokens are exactly the request's limit (``max_tokens``, ``max_completion_tokens``,
``max_output_tokens``, Ollama's ``num_predict``, Gemini's ``maxOutputTokens``; else the profile's
default): there is no EOS, so ``ignore_eos`` changes nothing and every answer finishes on its length.
"""

from __future__ import annotations

from llmtap.simulator.app import create_app
from llmtap.simulator.profiles import PROFILES, Profile, get_profile
from llmtap.simulator.server import Background, run_in_thread, serve

__all__ = ["PROFILES", "Background", "Profile", "create_app", "get_profile", "run_in_thread", "serve"]
