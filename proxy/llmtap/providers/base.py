"""The seam between the relay and one wire protocol: a provider inspects requests and reads events."""

from __future__ import annotations

from typing import Literal, Protocol

from llmtap.providers.sse import Event
from llmtap.types import Facts, Prepared, RequestInfo

__all__ = ["Framing", "Provider", "StreamParser"]

Framing = Literal["sse", "ndjson", "json-array"]


class StreamParser(Protocol):
    """Reads one response stream event by event; one instance per request.

    ``feed`` returns the facts one decoded event carries, or None for an event that says nothing
    (a comment, ``[DONE]``, an unknown event type). It never raises on bad input: a malformed event
    is counted in ``malformed`` and skipped, because telemetry must never break the user's stream.
    """

    malformed: int

    def feed(self, event: Event) -> Facts | None: ...


class Provider(Protocol):
    """One wire protocol (OpenAI Chat Completions, Anthropic Messages, ...).

    Providers return values and never touch OpenTelemetry; the telemetry process's emitters do that.
    """

    #: Module id, e.g. ``openai_chat``; used as ``llmtap.protocol``.
    name: str
    #: ``gen_ai.provider.name`` when the route does not say (the telemetry format flavour).
    family: str
    #: How a streamed response body is framed.
    framing: Framing
    #: True when ``prepare`` asks a stream for usage by splicing bytes into the body (``providers/splice.py``): the
    #: relay then scans a large body as it arrives (``providers/bodyscan.py``) and splices between its pieces,
    #: never parsing or copying it whole. False: ``prepare`` changes nothing and the relay need not scan.
    splices_usage: bool

    def matches(self, method: str, path: str) -> bool:
        """True when this provider speaks the protocol of ``method path`` (path without query)."""
        ...

    def inspect(self, body: bytes, *, inject_usage: bool, path: str = "") -> RequestInfo:
        """Read the request body: model, stream flag, parameters; rewrite it to ask for usage.

        ``path`` is the request path as the provider matched it (without query): Gemini names the model
        and the stream flag there, not in the body. Never raises: a malformed body gives
        ``RequestInfo.parse_error`` and is forwarded unchanged.
        """
        ...

    def prepare(self, body: bytes, *, inject_usage: bool, path: str = "") -> Prepared:
        """Only what the relay must do to the body before forwarding it: ask a stream for usage.

        Cheap and never raises. Only OpenAI Chat Completions and Completions change anything (usage
        injection, bytes spliced in, see ``providers/splice.py``); every other protocol returns
        ``Prepared(None, False)`` without parsing the body.
        """
        ...

    def stream_parser(self) -> StreamParser:
        """A fresh parser for one streamed response."""
        ...

    def parse_body(self, body: bytes) -> Facts:
        """The facts of a whole non-streamed response body; equal to folding the streamed events."""
        ...
