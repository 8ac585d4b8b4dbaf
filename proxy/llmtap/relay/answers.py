"""The relay's own answers: a JSON error in the OpenAI shape, for a request it refuses or an upstream that failed.

Each says what failed (``certificate verify failed: self-signed certificate``, ``status 999 is not an HTTP
status``), not only an exception's class, and marks the request's tape with its ``error.type``. Failures a client
or an upstream can repeat at will are logged at most once every ``LOG_EVERY`` seconds each, with their count.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from llmtap.config.types import Route
from llmtap.listener import LOG_EVERY
from llmtap.relay.guard import Refusal
from llmtap.relay.upstream.errors import BadHead, ConnectFailed, ConnectTimeout, UpstreamError, UpstreamTimeout
from llmtap.types import Send
from llmtap.wire.tape import Tape

__all__ = ["LogLimit", "bad_head", "refuse_request", "send_json", "too_large", "upstream_failed"]

log = logging.getLogger("llmtap.proxy")


async def send_json(
    send: Send, status: int, error_type: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An error of the proxy's own, in the OpenAI error shape most SDKs display."""
    body = json.dumps({"error": {"type": error_type, "message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class LogLimit:
    """Warnings said at most once every ``LOG_EVERY`` seconds per key, each with the count so far."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def warn(self, key: str, count: int, message: str, *args: Any) -> None:
        """Log ``message % args`` and the count, unless ``key`` was logged less than ``LOG_EVERY`` seconds ago."""
        clock = time.monotonic()
        if clock - self._at.get(key, -LOG_EVERY) < LOG_EVERY:
            return
        self._at[key] = clock
        log.warning(message + " (%d so far)", *args, count)


def too_large(limit: int) -> Refusal:
    """The refusal of a body past ``max_request_bytes``."""
    return Refusal(413, "request_too_large", f"request body exceeds {limit} bytes")


async def refuse_request(send: Send, refusal: Refusal) -> None:
    """A request llmtap will not relay; nothing went upstream. The connection is closed after the answer."""
    await send_json(send, refusal.status, refusal.error_type, refusal.message, [(b"connection", b"close")])


async def bad_head(send: Send, route: Route, tape: Tape, why: str) -> None:
    """The upstream's response head cannot be relayed faithfully (``llmtap.relay.heads``): 502, and nothing of
    that response reaches the client; the tape keeps no status or headers of it (the caller logs, rate-limited)."""
    tape.fail("upstream_protocol_error", why)
    message = f"upstream {route.upstream} sent a response llmtap cannot relay faithfully: {why}"
    await send_json(send, 502, "upstream_protocol_error", message)


async def upstream_failed(send: Send, route: Route, tl: Tape, exc: UpstreamError) -> bool:
    """No response headers came: 502 when the upstream could not be reached, hung up or sent a head that cannot be
    read, 504 when it was too slow. True when that head was the failure (the caller logs it, rate-limited)."""
    what = exc.label
    detail = str(exc) or what
    if isinstance(exc, BadHead):
        await bad_head(send, route, tl, detail)
        return True
    if isinstance(exc, UpstreamTimeout):
        kind = "connect_timeout" if isinstance(exc, ConnectTimeout) else "timeout"
        reason = f"{what}: {exc}" if str(exc) else what
        message = f"upstream {route.upstream} timed out ({reason})"
        tl.fail(kind, f"upstream timed out: {what}")
        log.warning("%s", message)
        await send_json(send, 504, "upstream_timeout", message)
    elif isinstance(exc, ConnectFailed):
        message = f"upstream {route.upstream} unreachable: {detail}"
        tl.fail("upstream_unreachable", detail)
        log.warning("%s", message)
        await send_json(send, 502, "upstream_unreachable", message)
    else:
        # Connected, but the connection broke (reset, closed) before any response.
        message = f"upstream {route.upstream} closed the connection: {detail}"
        tl.fail("upstream_closed", detail)
        log.warning("%s", message)
        await send_json(send, 502, "upstream_closed", message)
    return False
