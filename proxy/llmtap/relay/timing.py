"""The opt-in ``Server-Timing`` response header: what the relay knows of its own cost when the headers go out.

W3C Server Timing (``server-timing-header-field``): ``metric;dur=<ms>;desc="..."``, several metrics in one
comma-separated field. With ``server_timing`` on, the relay adds one such field beside whatever the upstream
sent (a list header: both reach the client, RFC 9110 section 5.3); nothing else of the response changes.
At that moment the relay knows:

* ``llmtap``: its own time before the request left, the request's first byte to its send upstream, less
  the admission wait (the part of ``llmtap.proxy.overhead`` known before any content);
* ``llmtap-queue``: the wait in the route's admission line (only on routes that limit concurrency);
* ``llmtap-upstream``: the request's send upstream to the upstream's response headers.

The delay each later chunk gets is on the request's span and the ``llmtap.relay.chunk_delay`` histogram.
"""

from __future__ import annotations

from llmtap.wire.tape import Tape

__all__ = ["HEADER", "server_timing"]

HEADER = b"server-timing"


def server_timing(tape: Tape, *, queued: bool) -> bytes:
    """The field's value for ``tape`` once its response headers are in (``queued``: the route has a line)."""
    received, body_read, admitted, sent = tape.received, tape.body_read, tape.admitted, tape.sent
    parts = []
    if body_read is not None and admitted is not None and sent is not None:
        own = (body_read - received) + (sent - admitted)
        parts.append(b'llmtap;dur=%.3f;desc="proxy"' % (max(own, 0.0) * 1000))
        if queued:
            parts.append(b'llmtap-queue;dur=%.3f;desc="admission"' % (max(admitted - body_read, 0.0) * 1000))
    if sent is not None and tape.headers_at is not None:
        parts.append(b'llmtap-upstream;dur=%.3f;desc="upstream headers"' % (max(tape.headers_at - sent, 0.0) * 1000))
    return b", ".join(parts)
