"""The wire-protocol registry: one stateless provider per protocol, chosen by the request path's suffix.

Suffix matching lets one provider serve ``/v1/chat/completions`` and ``/openai/v1/chat/completions``
alike (gateways and Azure-style deployments prefix paths). Order matters only in that
``…/chat/completions`` must not be read as legacy ``…/completions``, which that provider excludes itself.
"""

from __future__ import annotations

from llmtap.providers.anthropic import AnthropicMessages
from llmtap.providers.base import Framing, Provider, StreamParser
from llmtap.providers.embeddings import OllamaEmbed, OpenAIEmbeddings
from llmtap.providers.gemini import Gemini
from llmtap.providers.ollama import Ollama
from llmtap.providers.openai_chat import OpenAIChat
from llmtap.providers.openai_completions import OpenAICompletions
from llmtap.providers.openai_responses import OpenAIResponses
from llmtap.providers.usage_filter import UsageEventFilter

__all__ = [
    "CHOSEN_MAX",
    "PROVIDERS",
    "AnthropicMessages",
    "Framing",
    "Gemini",
    "Ollama",
    "OllamaEmbed",
    "OpenAIChat",
    "OpenAICompletions",
    "OpenAIEmbeddings",
    "OpenAIResponses",
    "Provider",
    "StreamParser",
    "UsageEventFilter",
    "provider_for",
]

#: Every protocol llmtap understands; providers hold no state, so one instance serves all requests.
PROVIDERS: tuple[Provider, ...] = (
    OpenAIChat(),
    OpenAICompletions(),
    OpenAIResponses(),
    AnthropicMessages(),
    Ollama(generate=False),
    Ollama(generate=True),
    Gemini(vertex=False),
    Gemini(vertex=True),
    OllamaEmbed(),
    OpenAIEmbeddings(),
)


#: ``provider_for``'s answers by method and path: a deployment's clients use a handful of paths, and asking every
#: provider in turn costs a few microseconds a request (ten suffix tests for an embeddings path). Emptied when
#: full, so paths that differ request by request (a model in a Gemini path, a hostile client) hold no more than
#: this many entries.
_CHOSEN: dict[tuple[str, str], Provider | None] = {}
CHOSEN_MAX = 512


def provider_for(method: str, path: str) -> Provider | None:
    """The provider whose protocol ``method path`` speaks, or None when no provider speaks it."""
    key = (method, path)
    try:
        return _CHOSEN[key]
    except KeyError:
        pass
    found = next((p for p in PROVIDERS if p.matches(method, path)), None)
    if len(key[1]) <= 1024:  # a long path is looked up each time rather than kept
        if len(_CHOSEN) >= CHOSEN_MAX:
            _CHOSEN.clear()
        _CHOSEN[key] = found
    return found
