"""An upstream's response head the relay can pass on faithfully, or why it cannot.

The relay sends the client the upstream's status and headers as they came (hop-by-hop ones aside) and the body
as it came, re-framed by the listener. Some heads cannot be passed on that way, and forwarding them leaves the
client with a dropped connection (a status the listener cannot write) or bytes it cannot read (a body in a
transfer coding whose label the relay drops). Each is answered ``502 upstream_protocol_error`` with the reason,
logged, and recorded with that ``error.type``:

* a status outside 200-599: a number HTTP does not define (RFC 9110 section 15: three digits, 100-599), or a
  1xx as the final answer (1xx are interim; llmtap's client skips them and waits for the final one, so one
  reaching the relay means none came);
* a transfer coding other than exactly ``chunked`` (RFC 9112 section 6.1): llmtap asks for none (it never sends
  ``TE``), decodes only ``chunked``, and does not decode others (``gzip, chunked`` relayed as ``chunked`` alone
  reached the client as gzip bytes nobody labelled);
* both ``Transfer-Encoding`` and ``Content-Length`` (RFC 9112 section 6.3: ambiguous framing, the mark of request
  smuggling; llmtap's client refuses it);
* a header name that is not a token or a value with a control character (RFC 9110 section 5.5), which the
  listener would refuse to write.

A malformed head (a status line or header block the parser refuses) is the same failure, seen earlier: llmtap's
client raises ``BadHead`` for it (``llmtap.relay.upstream.errors``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["unrelayable"]

# RFC 9110 section 5.6.2: a field name is a token. What the listener (uvicorn) refuses to write as a name or value.
_BAD_NAME = re.compile(rb'[\x00-\x20\x7f()<>@,;:\[\]={}\\"/?]|^$')
#: ``_BAD_NAME``'s bytes alone: searched over every name at once (an empty name is looked for apart).
_BAD_NAME_BYTE = re.compile(rb'[\x00-\x20\x7f()<>@,;:\[\]={}\\"/?]')
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def unrelayable(status: int, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a response head cannot be relayed faithfully, or None when it can. Runs once per response."""
    if not 200 <= status <= 599:
        if 100 <= status < 200:
            return f"status {status} is interim (1xx) and no final response followed it"
        return f"status {status} is not an HTTP status (100-599)"
    headers = list(headers)
    names = [name for name, _ in headers]
    if (
        _BAD_NAME_BYTE.search(b"".join(names))
        or not all(names)
        or _BAD_VALUE.search(b"".join([value for _, value in headers]))
    ):
        return _unwritable(headers)
    codings: list[bytes] = []
    length = False
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            codings.extend(c for c in (c.strip().lower() for c in value.split(b",")) if c)
        elif lowered == b"content-length":
            length = True
    if codings and codings != [b"chunked"]:
        named = b", ".join(codings).decode("latin-1")[:64]
        return f"transfer coding {named!r}: llmtap takes chunked only, and decodes no other"
    if codings and length:
        return "both Transfer-Encoding and Content-Length (RFC 9112 section 6.3)"
    return None


def _unwritable(headers: list[tuple[bytes, bytes]]) -> str:
    """The reason naming the first header that cannot be written (the joined search said one of them)."""
    for name, value in headers:
        if _BAD_NAME.search(name) or _BAD_VALUE.search(value):
            return f"header {name[:64]!r} cannot be written as sent (RFC 9110 section 5.5)"
    raise AssertionError("no header is unwritable")
