"""The shared vocabulary: ASGI aliases and the plain value types every layer passes around."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OBJECTIVE_HEADERS",
    "UNCHANGED",
    "ASGIApp",
    "Facts",
    "Message",
    "Prepared",
    "PromptRegion",
    "Receive",
    "RequestInfo",
    "Scope",
    "Send",
    "ServerTiming",
    "Usage",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: A request's own latency objectives, by the Gateway API Inference Extension's header names (lower case): the
#: relay passes them to the telemetry side and keeps them from the upstream; ``llmtap.analysis.objectives`` reads them.
OBJECTIVE_HEADERS = {b"x-slo-ttft-ms": "ttft", b"x-slo-tpot-ms": "tpot"}


@dataclass(slots=True)
class Usage:
    """Token usage as the upstream reported it, normalized.

    ``input_tokens`` includes cached tokens (OTel GenAI: "SHOULD include all types of input tokens,
    including cached tokens"); for Anthropic it is input + cache_read + cache_creation.
    A field left ``None`` was not reported; it is never reported as 0.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None
    #: Of ``cache_write_tokens``, those written for an hour (Anthropic's ``ephemeral_1h_input_tokens``, priced
    #: above the 5-minute writes); None where the upstream does not split its writes by lifetime.
    cache_write_1h_tokens: int | None = None
    #: What the upstream or a gateway before it said the request cost, in USD (``usage.cost`` as OpenRouter and
    #: LiteLLM send it); None when the response names no cost.
    cost: float | None = None


@dataclass(slots=True)
class ServerTiming:
    """Phase durations in seconds that the server itself reported (Ollama durations, TGI headers, ...).

    ``rejected`` names the reported fields that were dropped as unusable (wrong type, negative, not
    finite, absurd; see ``providers/timing.py``): they are counted, never used.
    """

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    rejected: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Facts:
    """What one stream event (or one whole non-streamed body) says, in protocol-neutral terms.

    Providers return these; they never touch OpenTelemetry. ``content`` is the generated text the
    event carries (text, tool-call arguments, reasoning or refusal); an event with ``has_content``
    False (role-only deltas, ``response.created``, ``message_start``, ``ping``) does not end TTFT.
    """

    has_content: bool = False
    content: str = ""
    #: The content is reasoning alone (OpenAI-style ``reasoning_content``, Anthropic ``thinking``): it ends TTFT,
    #: not the time to the first output token (the answer's first token, after the thinking).
    reasoning: bool = False
    usage: Usage | None = None
    finish_reasons: list[str] = field(default_factory=list)
    response_id: str | None = None
    response_model: str | None = None
    #: OpenAI's ``system_fingerprint``: the backend configuration that answered.
    system_fingerprint: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    server_timing: ServerTiming | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class PromptRegion:
    """One part of a prompt as the client sent it: ``tools``, ``system`` or one ``message``.

    ``value`` is the part's parsed JSON (a string for a plain text prompt). Kept in memory only: the
    recorder's worker thread hashes and counts it (``llmtap.analysis.fingerprint``); it is never exported.
    """

    kind: str
    value: Any


@dataclass(frozen=True, slots=True)
class Prepared:
    """What the relay changes in a request body before forwarding it (``Provider.prepare``)."""

    # The bytes to send upstream when the provider changed the body (usage injection), else None.
    body: bytes | None
    # True when llmtap asked for usage the client did not: the relay removes the extra usage event.
    strip_usage: bool


#: The body goes upstream as the client sent it; nothing to strip.
UNCHANGED = Prepared(None, False)


@dataclass(slots=True)
class RequestInfo:
    """What the proxy learned from the client's request body before forwarding it."""

    operation: str
    model: str | None = None
    stream: bool = False
    parse_error: str | None = None
    # The body to send upstream when the provider rewrote it (usage injection), else None.
    rewritten_body: bytes | None = None
    # True when the proxy asked for usage the client did not: the extra usage event is removed.
    strip_usage: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    # The prompt's text, joined, for counting when the server reports no usage (never exported).
    prompt_text: str = ""
    # The prompt's parts in the order servers cache them (tools, system, messages): for fingerprints.
    regions: list[PromptRegion] = field(default_factory=list)
    # The end user the body names (OpenAI ``safety_identifier`` or ``user``, Anthropic ``metadata.user_id``).
    end_user: str | None = None
