"""The upstream side of the relay: one pool of llmtap's own client per upstream, and header hygiene."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import httpx

from llmtap.config.types import Route, Settings
from llmtap.relay import tls
from llmtap.relay.tls import TLSOptions
from llmtap.relay.upstream import Answer, LeanTransport, Origin, Pieces
from llmtap.relay.upstream.errors import BadRequestHead
from llmtap.relay.upstream.http11 import request_head
from llmtap.types import OBJECTIVE_HEADERS, Scope

__all__ = [
    "PRIVATE_PREFIX",
    "TARGETS",
    "Upstreams",
    "dropped",
    "request_headers",
    "response_headers",
    "upstream_head",
    "upstream_url",
]

log = logging.getLogger("llmtap.upstream")

# RFC 9110 section 7.6.1: connection-specific fields never travel past one hop. Host is the
# upstream's, set by the client from the configured URL; Content-Length is recomputed when a body changes.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Headers llmtap reads from the client and keeps to itself.
PRIVATE_PREFIX = b"x-llmtap-"
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


def _connection_listed(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    listed: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            listed.update(token.strip().lower() for token in value.split(b",") if token.strip())
    return listed


def request_headers(
    headers: list[tuple[bytes, bytes]],
    *,
    trace: list[tuple[bytes, bytes]] | None,
    body_changed: bool,
    plain: bool = False,
    private: bool = False,
    objectives: bool = False,
) -> list[tuple[bytes, bytes]]:
    """Client headers as they go upstream: hop-by-hop, Host and llmtap's own removed; our trace context added.

    Nothing else is added: Host (the upstream's) and the body's length come from the request itself.
    ``trace`` replaces the client's trace headers; None (tracing off) lets them pass as sent. ``plain``
    asks for an uncompressed response (``accept-encoding: identity``, which every client accepts): llmtap
    must read the events of a stream whose usage event it removes. ``private``: the caller's ``x-llmtap-*``
    headers go too (the operator's ``forward_llmtap_headers``). ``objectives``: the caller's per-request objectives
    (``x-slo-ttft-ms``, ``x-slo-tpot-ms``) go too (``forward_slo_headers``: an upstream that routes by them).
    """
    drop = _connection_listed(headers) | HOP_BY_HOP | {b"host"}
    if not objectives:
        drop |= OBJECTIVE_HEADERS.keys()
    if trace is not None:
        drop |= TRACE_HEADERS
    if body_changed:
        drop |= {b"content-length"}
    if plain:
        drop |= {b"accept-encoding"}
    if private:
        out = [(k, v) for k, v in headers if k.lower() not in drop]
    else:
        out = [(k, v) for k, v in headers if (kl := k.lower()) not in drop and not kl.startswith(PRIVATE_PREFIX)]
    if plain:
        out.append((b"accept-encoding", b"identity"))
    if trace:
        out.extend(trace)
    return out


def dropped(*, trace: bool, body_changed: bool, plain: bool, objectives: bool) -> frozenset[bytes]:
    """The client headers ``request_headers`` never sends upstream for these flags, the ``Connection`` field's own
    list aside (``upstream_head`` takes them once per relay, per set of flags)."""
    drop = {b"host", *HOP_BY_HOP}
    if not objectives:
        drop |= OBJECTIVE_HEADERS.keys()
    if trace:
        drop |= TRACE_HEADERS
    if body_changed:
        drop |= {b"content-length"}
    if plain:
        drop |= {b"accept-encoding"}
    return frozenset(drop)


#: Methods whose empty body is announced with ``Content-Length: 0`` (as ``request_head`` does).
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def upstream_head(
    method: str,
    target: bytes,
    host: bytes,
    headers: list[tuple[bytes, bytes]],
    content: bytes | Pieces | AsyncIterator[bytes],
    *,
    drop: frozenset[bytes],
    trace: list[tuple[bytes, bytes]] | None,
    plain: bool,
    private: bool,
) -> tuple[bytes, bool]:
    """The upstream request's head and whether its body goes chunked: the bytes ``request_head`` makes of
    ``request_headers``'s output, in one pass over the client's headers (``drop``: ``dropped`` for the flags).

    A short request's head is built in one buffer rather than its headers first and its head from them: each
    client field is lowered once, and the set of fields never sent is the relay's, not one made per request.
    Host and Transfer-Encoding are among them, so the head always names the upstream's Host and says a body's
    length itself: only the client's Content-Length is looked for.
    """
    lowered = [name.lower() for name, _ in headers]
    if b"connection" in lowered:
        drop = drop | _connection_listed(headers)
    if not _ALWAYS_DROPPED <= drop:
        kept = [(k, v) for (k, v), low in zip(headers, lowered, strict=True) if low not in drop]
        kept = [(k, v) for k, v in kept if private or not k.lower().startswith(PRIVATE_PREFIX)]
        return request_head(method, target, host, [*kept, *_added(plain, trace)], content)
    method = method.upper()
    pieces = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode("ascii"), target, host)]
    lines = 2
    length = False
    for at, (name, value) in enumerate(headers):
        low = lowered[at]  # indexed: a strict ``zip`` costs a tenth of this loop
        if low in drop or (not private and low.startswith(PRIVATE_PREFIX)):
            continue
        length = length or low == b"content-length"
        pieces += (name, b": ", value, b"\r\n")
        lines += 1
    for name, value in _added(plain, trace):
        pieces += (name, b": ", value, b"\r\n")
        lines += 1
    added, chunked = _frame_body(pieces, content, method, length=length)
    lines += added
    pieces.append(b"\r\n")
    head = b"".join(pieces)
    # One CR and one LF per line and no more: a header cannot smuggle a line of its own.
    if head.count(b"\n") != lines + 1 or head.count(b"\r") != lines + 1:
        raise BadRequestHead("CR or LF inside a request header")
    return head, chunked


def _frame_body(
    pieces: list[bytes], content: bytes | Pieces | AsyncIterator[bytes], method: str, *, length: bool
) -> tuple[int, bool]:
    """The fields that say the body's length, added to ``pieces`` where ``request_head`` puts them (``length``: the
    client named a Content-Length); the lines added, and whether the body goes chunked."""
    if isinstance(content, (bytes, tuple)):
        size = len(content) if isinstance(content, bytes) else sum(map(len, content))
        if size and not length:
            pieces.append(b"Content-Length: %d\r\n" % size)
            return 1, False
    elif not length:
        pieces.append(b"Transfer-Encoding: chunked\r\n")
        return 1, True
    if not length and method in _BODY_METHODS:
        pieces[0] += b"Content-Length: 0\r\n"  # right after Host
        return 1, False
    return 0, False


#: What ``dropped`` always holds, which ``upstream_head``'s one pass relies on.
_ALWAYS_DROPPED = frozenset({b"host", b"transfer-encoding"})


def _added(plain: bool, trace: list[tuple[bytes, bytes]] | None) -> list[tuple[bytes, bytes]]:
    """The fields the relay adds after the client's (``request_headers``): plain answers asked for, the trace."""
    added = [(b"accept-encoding", b"identity")] if plain else []
    if trace:
        added.extend(trace)
    return added


#: Statuses whose responses never have a body (RFC 9110 sections 15.3.5 and 15.4.5).
BODILESS = frozenset({204, 304})


def response_headers(
    headers: Iterable[tuple[bytes, bytes]], *, body_changed: bool, status: int = 200, decoded: bool = False
) -> list[tuple[bytes, bytes]]:
    """Upstream response headers as they go to the client: unchanged but for hop-by-hop ones.

    A 204 or 304 goes without Content-Length: a 204 must never carry one (RFC 9110 section 8.6), and a
    304's describes a body that is not sent, which the server below would wait for. ``decoded``: the
    relay sends the body decompressed, so without its Content-Encoding.

    Each name is lowered once; the Connection field's list is read only when there is one, and when no field is to
    be dropped (a short answer's usual head) the copy goes as it is, without a second pass.
    """
    headers = list(headers)
    lowered = [name.lower() for name, _ in headers]
    drop = _connection_listed(headers) | HOP_BY_HOP if b"connection" in lowered else HOP_BY_HOP
    if body_changed or status in BODILESS:
        drop = drop | _LENGTH
    if decoded:
        drop = drop | _ENCODING
    if drop.isdisjoint(lowered):
        return headers
    return [field for field, low in zip(headers, lowered, strict=True) if low not in drop]


_LENGTH = frozenset({b"content-length"})
_ENCODING = frozenset({b"content-encoding"})


def upstream_url(route: Route, raw_path: bytes, query: bytes) -> str:
    """The upstream URL: the route's base URL joined with the request's path, never another host.

    The raw (still percent-encoded) path is appended to the configured base, so neither an absolute
    request target nor an encoded slash nor ``..`` can name another host.
    """
    path = raw_path.decode("latin-1") or "/"
    if not path.startswith("/"):
        path = "/" + path
    if route.strip_prefix and route.prefix != "/":
        path = path[len(route.prefix) :] or "/"
        if not path.startswith("/"):
            path = "/" + path
    base = urlsplit(route.upstream)
    url = f"{base.scheme}://{base.netloc}{base.path.rstrip('/')}{path}"
    if query:
        url += "?" + query.decode("latin-1")
    return url


def _pool_key(route: Route) -> tuple[str, TLSOptions | None]:
    return route.upstream, TLSOptions.of(route) if route.upstream.startswith("https://") else None


class Upstreams:
    """One pool of llmtap's own HTTP/1.1 client (``llmtap.relay.upstream``) per upstream base URL and TLS
    settings, and the requests the relay sends through them."""

    def __init__(self, settings: Settings) -> None:
        self._pools: dict[tuple[str, TLSOptions | None], LeanTransport] = {}
        #: The caller's ``x-llmtap-*`` headers go upstream too (``forward_llmtap_headers``).
        self._private = settings.attribution.forward_headers
        #: The caller's ``x-slo-*`` objectives go upstream too (read either way).
        self._objectives = settings.forward_slo_headers
        #: Per route: its pool and the upstream's origin, parsed at the route's first request.
        self._origins: dict[str, tuple[LeanTransport, Origin]] = {}
        #: Route, raw path and query -> the request target, percent-encoded and normalized (``_target``).
        self._targets: dict[tuple[str, bytes, bytes], bytes] = {}
        #: The client headers never sent upstream, per (trace, body changed, plain) (``dropped``).
        self._drops: dict[tuple[bool, bool, bool], frozenset[bytes]] = {}
        # Backpressure: when a client reads slower than its upstream writes, the relay stops reading, but
        # the event loop may already have drained the socket's whole receive buffer (uvloop reads up to
        # 32 times per wake-up), and Linux grows that buffer to megabytes. A fixed SO_RCVBUF bounds what
        # one stream can make the proxy hold (tests/e2e/test_faults.py measures it).
        buffer = settings.stream_buffer_bytes
        for route in settings.routes:
            key = _pool_key(route)
            if key in self._pools:
                continue
            tls_options = key[1]
            # Built here, once per TLS settings (cached): ``llmtap.relay.tls.check`` may have built it at start.
            context = None if tls_options is None else tls.route_context(route)
            if tls_options is not None and not tls_options.verify:
                log.warning(
                    "route %r: the certificate of %s is NOT verified (tls_verify: false / --upstream-insecure): "
                    "anyone on the path can read and change its traffic",
                    route.name,
                    route.upstream,
                )
            # No proxy variable (HTTP_PROXY) reroutes this traffic, and redirects are relayed to the client, never
            # followed here.
            self._pools[key] = LeanTransport(
                max_connections=settings.max_connections,
                receive_buffer=buffer,
                ssl_context=context,
                server_hostname=route.tls_server_name,
            )

    def pool(self, route: Route) -> LeanTransport:
        """The pool for a route's upstream."""
        return self._pools[_pool_key(route)]

    async def send(
        self,
        route: Route,
        scope: Scope,
        headers: list[tuple[bytes, bytes]],
        content: bytes | Pieces | AsyncIterator[bytes],
        timeouts: dict[str, float | None],
        leaving: Callable[[], None],
        *,
        trace: list[tuple[bytes, bytes]] | None,
        body_changed: bool,
        plain: bool,
    ) -> Answer:
        """The request of ``scope`` to its route's upstream, its response's head read.

        ``headers`` are the client's, sent as ``request_headers`` makes them; ``leaving`` is called as the request's
        first byte is about to be written; ``timeouts`` is read at every wait (the relay changes its read timeout
        once the head is in).
        """
        known = self._origins.get(route.name)
        if known is None:
            pool = self.pool(route)
            known = self._origins[route.name] = (pool, pool.origin(route.upstream))
        pool, origin = known
        method: str = scope["method"]
        flags = (trace is not None, body_changed, plain)
        drop = self._drops.get(flags)
        if drop is None:
            drop = self._drops[flags] = dropped(
                trace=flags[0], body_changed=body_changed, plain=plain, objectives=self._objectives
            )
        target = self._target(route, scope.get("raw_path") or scope["path"].encode(), scope.get("query_string", b""))
        head, chunked = upstream_head(
            method, target, origin.host, headers, content, drop=drop, trace=trace, plain=plain, private=self._private
        )
        return await pool.send_head(origin, head, chunked, method == "HEAD", content, timeouts, leaving)

    def _target(self, route: Route, raw_path: bytes, query: bytes) -> bytes:
        """The request target of the route's upstream URL for this path and query (percent-encoded and normalized
        as httpx's URL does), remembered: a relay sees the same few paths again and again."""
        key = (route.name, raw_path, query)
        target = self._targets.get(key)
        if target is None:
            if len(self._targets) >= TARGETS:
                self._targets.clear()
            target = self._targets[key] = httpx.URL(upstream_url(route, raw_path, query)).raw_path
        return target

    async def aclose(self) -> None:
        """Close every pool."""
        for pool in self._pools.values():
            await pool.aclose()


#: Request targets ``Upstreams._target`` remembers, past which it starts again.
TARGETS = 1024
