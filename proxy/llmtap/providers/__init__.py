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


def provider_for(method: str, path: str) -> Provider | None:
    """The provider whose protocol ``method path`` speaks, or None when no provider speaks it."""
    for provider in PROVIDERS:
        if provider.matches(method, path):
            return provider
    return None
