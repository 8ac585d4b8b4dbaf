"""Which llmtap replica owns a request: the ``llmtap`` entry of the W3C ``tracestate`` sent upstream.

A tracing model server nests its span of a request under the ``traceparent`` llmtap sent, and an
OpenTelemetry SDK gives the child the parent's ``tracestate`` (its sampler keeps the parent's trace state),
which OTLP exports as ``Span.trace_state``. So when the relay adds ``llmtap=<admin address>~<tag>``, the
server's span says which replica's admin listener relayed the request, wherever the server sent it; the
replica that receives it passes it there (``llmtap.telemetry.fleet.peers``).

The tag is an HMAC of the address under the replicas' shared token: a replica sends a span (and its
token) only to an address a replica signed, never to one a forged span names. The entry goes first and
replaces an older ``llmtap`` entry (W3C Trace Context, section 3.5: a vendor's updated entry moves to the
left); the client's own entries follow, within the standard's bounds (32 entries, 512 characters, longer
entries dropped first). Pure code, used by both processes.
"""

from __future__ import annotations

import hashlib
import hmac
import re

__all__ = ["KEY", "MAX_LENGTH", "MAX_MEMBERS", "entry", "owner", "upstream_tracestate"]

KEY = "llmtap"
#: W3C Trace Context, section 3.3.1.1: at most 32 list members; 512 characters is what every vendor
#: should pass on, and entries over 128 characters are the first to go past it.
MAX_MEMBERS = 32
MAX_LENGTH = 512
LONG_MEMBER = 128
#: An address the entry may carry: ``host:port``, in characters a tracestate value allows (section 3.3.1.3.2).
ADDRESS = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,200}:[0-9]{1,5}")
#: A list member as section 3.3.1.3 has it (a simple or multi-tenant key, then a value).
_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_TAG_HEX = 16


def tag(address: str, token: str) -> str:
    """The entry's proof that a replica holding ``token`` signed ``address``: 64 bits of HMAC-SHA256."""
    return hmac.new(token.encode(), address.encode(), hashlib.sha256).hexdigest()[:_TAG_HEX]


def entry(address: str, token: str) -> str:
    """The ``llmtap`` list member naming ``address`` (``host:port`` of the owner's admin listener)."""
    if ADDRESS.fullmatch(address) is None:
        raise ValueError(f"{address!r} is not host:port")
    return f"{KEY}={address}~{tag(address, token)}"


def upstream_tracestate(client: str | None, own: str) -> str:
    """The ``tracestate`` that goes upstream: ``own`` first, then the client's valid members, within bounds.

    A member that does not parse is left out: a receiving SDK drops the whole header at one bad member
    (OpenTelemetry's ``TraceState.from_header``), which would lose the owner entry with it.
    """
    members = [own]
    if client:
        for raw in client.split(","):
            member = raw.strip(" \t")
            if member and not member.startswith(KEY + "=") and _MEMBER.fullmatch(member) is not None:
                members.append(member)
    del members[MAX_MEMBERS:]
    while len(",".join(members)) > MAX_LENGTH:
        long = [i for i in range(1, len(members)) if len(members[i]) > LONG_MEMBER]
        del members[long[-1] if long else -1]
    return ",".join(members)


def owner(trace_state: str, token: str) -> str | None:
    """The address the ``llmtap`` entry of ``trace_state`` names, when a replica holding ``token`` signed it."""
    for raw in trace_state.split(","):
        member = raw.strip(" \t")
        if not member.startswith(KEY + "="):
            continue
        address, _, proof = member[len(KEY) + 1 :].rpartition("~")
        if ADDRESS.fullmatch(address) is None or len(proof) != _TAG_HEX:
            return None
        return address if hmac.compare_digest(proof, tag(address, token)) else None
    return None
