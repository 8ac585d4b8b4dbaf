"""Embeddings: OpenAI's ``POST …/embeddings`` and Ollama's ``POST …/api/embed`` (operation ``embeddings``).

Neither streams: the whole answer is one JSON body. OpenAI's carries ``usage.prompt_tokens`` (the input's
tokens; there is no output) and the model; Ollama's ``/api/embed`` carries ``prompt_eval_count`` and its
durations in nanoseconds (``load_duration`` is the wait for a loaded runner, as for generation). Ollama's
older ``/api/embeddings`` answers with a vector and nothing else: it is recognised, its tokens are
counted offline. The input's text stands for the prompt (what tiktoken counts when usage is missing).
"""

from __future__ import annotations

from llmtap.providers.base import Framing, StreamParser
from llmtap.providers.ollama import OLLAMA_TIMING
from llmtap.providers.openai_common import (
    JSONObject,
    ObjectStreamParser,
    as_count,
    as_dict,
    as_str,
    body_facts,
    error_facts,
    load_object,
    matches_suffix,
    openai_end_user,
)
from llmtap.providers.protocol import ForwardsUnchanged
from llmtap.providers.timing import from_body
from llmtap.types import Facts, RequestInfo, Usage

__all__ = ["OllamaEmbed", "OpenAIEmbeddings"]

#: ``gen_ai.operation.name`` of an embeddings request (gen-ai-spans.md, "Embeddings").
OPERATION = "embeddings"


def _input_text(value: object) -> str:
    # A string or a list of strings; token-id arrays carry no text to count and are skipped.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(v for v in value if isinstance(v, str))
    return ""


def _openai_facts(obj: JSONObject) -> Facts:
    if obj.get("error") is not None:
        return error_facts(obj["error"])
    usage = as_dict(obj.get("usage"))
    tokens = as_count(usage.get("prompt_tokens"))
    if tokens is None:
        tokens = as_count(usage.get("total_tokens"))
    return Facts(
        usage=None if tokens is None else Usage(input_tokens=tokens),
        response_model=as_str(obj.get("model")),
        done=True,
    )


def _ollama_facts(obj: JSONObject) -> Facts:
    if obj.get("error") is not None:
        return error_facts(obj["error"])
    tokens = as_count(obj.get("prompt_eval_count"))
    return Facts(
        usage=None if tokens is None else Usage(input_tokens=tokens),
        response_model=as_str(obj.get("model")),
        server_timing=from_body(obj, {"queue": OLLAMA_TIMING["queue"]}),
        done=True,
    )


class OpenAIEmbeddings(ForwardsUnchanged):
    """OpenAI's Embeddings API (and every server that copies it: vLLM, llama.cpp, TEI's OpenAI route).

    The answer always carries its usage, so requests go unchanged.
    """

    name: str = "openai_embeddings"
    family: str = "openai"
    framing: Framing = "sse"

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/embeddings``, except Ollama's ``…/api/embeddings``."""
        return matches_suffix(method, path, "/embeddings") and not matches_suffix(method, path, "/api/embeddings")

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model, the input's text and the end user; never a stream."""
        obj, error = load_object(body)
        if obj is None:
            return RequestInfo(operation=OPERATION, parse_error=error)
        return RequestInfo(
            operation=OPERATION,
            model=as_str(obj.get("model")),
            prompt_text=_input_text(obj.get("input")),
            end_user=openai_end_user(obj),
        )

    def stream_parser(self) -> StreamParser:
        """Embeddings do not stream: an answer framed as events is read event by event all the same."""
        return ObjectStreamParser(_openai_facts)

    def parse_body(self, body: bytes) -> Facts:
        """Facts of an ``embedding`` list (its usage and model) or of an error body."""
        return body_facts(body, _openai_facts)


class OllamaEmbed(ForwardsUnchanged):
    """Ollama's ``/api/embed`` (and its older ``/api/embeddings``); usage comes unasked, so requests go unchanged."""

    name: str = "ollama_embed"
    family: str = "ollama"
    framing: Framing = "ndjson"

    def matches(self, method: str, path: str) -> bool:
        """True for ``POST …/api/embed`` or ``…/api/embeddings``."""
        return matches_suffix(method, path, "/api/embed") or matches_suffix(method, path, "/api/embeddings")

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Model and the input's text (``input``, or the older endpoint's ``prompt``); never a stream."""
        obj, error = load_object(body)
        if obj is None:
            return RequestInfo(operation=OPERATION, parse_error=error)
        text = _input_text(obj.get("input")) or _input_text(obj.get("prompt"))
        return RequestInfo(operation=OPERATION, model=as_str(obj.get("model")), prompt_text=text)

    def stream_parser(self) -> StreamParser:
        """Embeddings do not stream: an answer framed as lines is read line by line all the same."""
        return ObjectStreamParser(_ollama_facts)

    def parse_body(self, body: bytes) -> Facts:
        """Facts of an ``/api/embed`` answer (``prompt_eval_count``, durations) or of ``{"error": ...}``."""
        return body_facts(body, _ollama_facts)
