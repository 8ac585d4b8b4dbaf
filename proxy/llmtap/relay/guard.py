"""What a request must be before llmtap relays it: an origin-form path, bounded in size, clean headers.

The upstream's address comes only from configuration (``forward.upstream_url``), so no request can name
another host. These checks keep a request on the path its route allows (no dot segments, no percent-encoded
route prefix), refuse what a reverse proxy for LLM APIs has no use for (``CONNECT``, ``TRACE``, a WebSocket or
other protocol upgrade), hold HTTP/1.1 to its one Host field (RFC 9112 section 3.2), answer an expectation other
than ``100-continue`` with 417 (RFC 9110 section 10.1.1), and bound what one request
may make the proxy hold (RFC 9110 section 15.5.14, RFC 6585 section 5). They run once per request, before
anything goes upstream, and cost a few microseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain

from llmtap.config.types import Route
from llmtap.types import Scope

__all__ = ["Refusal", "check_request", "check_route"]

#: Methods that would turn a reverse proxy into a tunnel (CONNECT) or echo credentials back (TRACE).
REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
# RFC 9110 section 5.5: CR, LF and NUL are never valid in a field; the HTTP parser refuses them first,
# and this check holds whichever parser runs.
_BAD_FIELD_BYTES = re.compile(rb"[\r\n\0]")
# A "." or ".." segment, with "/" or "\" as separators: httpx and many servers resolve them (RFC 3986
# section 5.2.4), which would leave the route's base path on the upstream. Run on the decoded path, so
# "%2e%2e" is caught too.
_DOT_SEGMENT = re.compile(r"(?:^|[/\\])\.\.?(?:$|[/\\])")
# RFC 9110 section 7.2: Host is uri-host [ ":" port ]; a reg-name, an IPv4 address or a bracketed IP literal.
_HOST = re.compile(rb"(?:\[[0-9A-Za-z:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::[0-9]*)?")
#: Upgrades an HTTP/1.1 server may ignore and answer in HTTP/1.1 (RFC 9110 section 7.8): an HTTP/2 offer over
#: cleartext (RFC 7540 section 3.2), which curl --http2 sends with every plain-HTTP request.
IGNORABLE_UPGRADES = frozenset({b"h2c"})
#: The one expectation HTTP defines (RFC 9110 section 10.1.1), which the listener meets: it says ``100 Continue``
#: once the relay reads the body.
CONTINUE = b"100-continue"
#: Host values found valid (``_valid_host``): at most ``_KEPT_HOSTS`` of them, each up to ``_KEPT_HOST_BYTES``,
#: emptied when full.
_VALID_HOSTS: set[bytes] = set()
_KEPT_HOSTS = 256
_KEPT_HOST_BYTES = 256
#: The fields the checks read (names as the server gives them, lower-cased); every other field is only measured.
_WATCHED = frozenset({b"content-length", b"host", b"upgrade", b"connection", b"transfer-encoding", b"expect"})


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused: the status, the ``error.type`` of the JSON error, and a one-line message."""

    status: int
    error_type: str
    message: str


def check_request(scope: Scope, *, max_header_bytes: int, max_request_bytes: int) -> Refusal | None:
    """The first reason to refuse this request before routing it, or None when it may be relayed."""
    method: str = scope["method"]
    if method in REFUSED_METHODS:
        return Refusal(405, "method_not_allowed", f"llmtap does not relay {method} requests")
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    if not raw_path.startswith(b"/"):
        return Refusal(400, "bad_target", "the request target must be a path starting with '/'")
    path: str = scope["path"]
    if "." in path and _DOT_SEGMENT.search(path):
        return Refusal(400, "bad_target", "the path holds a '.' or '..' segment")
    headers = scope["headers"]
    # Every name and value in one buffer: one search finds a bad byte in any of them, and its length is theirs.
    fields = b"".join(chain.from_iterable(headers))
    if _BAD_FIELD_BYTES.search(fields):
        return Refusal(400, "bad_header", "a header holds CR, LF or NUL")
    size = len(raw_path) + len(scope.get("query_string", b"")) + len(fields) + 4 * len(headers)  # ": " and CRLF
    length = b""
    hosts: list[bytes] = []
    upgrade: bytes | None = None
    connection = b""
    chunked = False
    expect: list[bytes] = []
    for name, value in headers:
        if name not in _WATCHED:
            continue
        if name == b"content-length":
            length = value
        elif name == b"host":
            hosts.append(value)
        elif name == b"upgrade":
            upgrade = value
        elif name == b"connection":
            connection += b"," + value
        elif name == b"transfer-encoding":
            chunked = True
        else:
            expect.append(value)
    if size > max_header_bytes:
        return Refusal(431, "headers_too_large", f"request line and headers exceed {max_header_bytes} bytes")
    if len(hosts) > 1 or (hosts and not _valid_host(hosts[0])):
        return Refusal(400, "bad_host", "the request has more than one Host header, or an invalid one")
    if not hosts and scope.get("http_version") == "1.1":
        return Refusal(400, "missing_host", "an HTTP/1.1 request must have a Host header (RFC 9112 section 3.2)")
    if expect:
        refusal = _expectation(expect)
        if refusal is not None:
            return refusal
    if upgrade is not None:
        refusal = _upgrade(upgrade, connection, body=bool(length.strip(b"0")) or chunked)
        if refusal is not None:
            return refusal
    if length.isdigit() and int(length) > max_request_bytes:
        return Refusal(413, "request_too_large", f"request body exceeds {max_request_bytes} bytes")
    return None


def _upgrade(upgrade: bytes, connection: bytes, *, body: bool) -> Refusal | None:
    """Why an ``Upgrade`` the ``Connection`` header asks for is refused, or None (no upgrade asked, or one the relay
    may ignore and answer in HTTP/1.1); ``body``: the request announces a body."""
    if b"upgrade" not in {t.strip().lower() for t in connection.split(b",")}:
        return None
    offered = {t.strip().split(b"/")[0].lower() for t in upgrade.split(b",") if t.strip()}
    what = upgrade.decode("latin-1")[:64]
    if not offered <= IGNORABLE_UPGRADES:
        return Refusal(
            400, "upgrade_not_supported", f"llmtap relays HTTP requests only; it does not upgrade to {what!r}"
        )
    if body:
        # The parser takes what follows an Upgrade request's head for the new protocol, not for its body.
        return Refusal(
            400, "upgrade_not_supported", f"llmtap cannot read a request body sent with an upgrade to {what!r}"
        )
    return None


def _valid_host(value: bytes) -> bool:
    """Host is ``uri-host [ ":" port ]``; the values found valid are kept (a relay sees the same few)."""
    if value in _VALID_HOSTS:
        return True
    if not _HOST.fullmatch(value.strip()):
        return False
    if len(value) <= _KEPT_HOST_BYTES:
        if len(_VALID_HOSTS) >= _KEPT_HOSTS:
            _VALID_HOSTS.clear()
        _VALID_HOSTS.add(value)
    return True


def _expectation(fields: list[bytes]) -> Refusal | None:
    """417 for an ``Expect`` naming anything but ``100-continue`` (case-insensitive, a list like any field):
    forwarded, an expectation nobody here meets would leave the upstream's answer to it undefined."""
    members = [m.strip() for value in fields for m in value.split(b",") if m.strip()]
    unmet = [m for m in members if m.lower() != CONTINUE]
    if not unmet:
        return None
    what = b", ".join(unmet).decode("latin-1")[:64]
    return Refusal(417, "expectation_failed", f"llmtap meets no expectation but 100-continue, not {what!r}")


def check_route(raw_path: bytes, route: Route) -> Refusal | None:
    """The route was chosen on the decoded path; its prefix must also be literal in the raw path that is sent.

    Otherwise ``/%6Fpenai/...`` or ``/openai%2F...`` would be routed by one reading and forwarded by another.
    """
    prefix = route.prefix.encode()
    if prefix == b"/" or raw_path == prefix or raw_path.startswith(prefix + b"/"):
        return None
    return Refusal(400, "bad_target", "the route prefix is percent-encoded in the path")
