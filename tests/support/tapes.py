"""Tapes as the relay hands them to the telemetry side, built without a relay: one streamed chat request's tape
and the messages for it, for the tests and the benchmark alike."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmtap.wire.messages import End, Raw, decode
from llmtap.wire.tape import Tape


def content_event(text: str) -> bytes:
    """One OpenAI chat chunk of content ``text`` as an SSE event, in the short form a tape's reads need."""
    chunk = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chat_tape(
    key: int,
    reads: Sequence[bytes],
    *,
    received: float = 1000.0,
    body: bytes = b'{"model": "m", "stream": true, "messages": []}',
    gap: float = 0.02,
    trace_id: int | None = None,
    span_id: int | None = None,
    fail: tuple[str, str | None, bool] | None = None,
    upstream: tuple[int, int] | None = None,
) -> tuple[Tape, list[tuple[Any, ...]]]:
    """A relay's tape of one streamed chat request whose upstream sent ``reads``, ``gap`` seconds apart from
    ``received + 0.1``, and the messages the relay would hand over for it (segments, then the end).

    ``fail`` is the relay's own failure, if any: ``(error_type, message, cancelled)``; ``upstream``: the relay's
    number for the request among those to its upstream, and how many were in flight ahead of it. What the tests
    and the benchmark build their tapes with.
    """
    t = Tape(
        key,
        method="POST",
        path="/v1/chat/completions",
        inner_path="/v1/chat/completions",
        route="default",
        protocol="openai_chat",
        received=received,
        received_wall_ns=1_700_000_000_000_000_000,
    )
    t.trace_id = trace_id if trace_id is not None else key + 1
    t.span_id = span_id if span_id is not None else key + 1
    t.body, t.body_read, t.admitted, t.sent = body, received + 0.001, received + 0.002, received + 0.003
    t.headers_at, t.status_code = received + 0.05, 200
    t.response_headers = [(b"content-type", b"text/event-stream")]
    if upstream is not None:
        t.upstream_seq, t.upstream_ahead = upstream
    messages: list[tuple[Any, ...]] = []
    for i, data in enumerate(reads):
        at = received + 0.1 + i * gap
        full = t.read(at, data)
        t.delivered(at + 0.0001)
        if full:
            messages.append(t.segment_message())
    t.end = received + 0.1 + len(reads) * gap
    if fail is not None:
        t.fail(fail[0], fail[1], cancelled=fail[2])
    messages.append(t.end_message())
    return t, messages


class KeptChannel:
    """A relay's telemetry channel that keeps every message the relay hands over, for a test to read."""

    dropped = 0
    shards = 1

    def __init__(self) -> None:
        self.messages: list[Raw] = []

    def send(self, message: Raw, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        self.messages.append(message)
        return True

    async def aclose(self) -> None:
        return None

    def ends(self) -> list[End]:
        """The requests' end messages handed over so far."""
        return [m for m in map(decode, self.messages) if isinstance(m, End)]
