"""The upstream side of the relay: routing, one connection pool per upstream, and header hygiene."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Iterable
from urllib.parse import urlsplit

import h11
import httpx

from llmtap.config.types import Route, Settings
from llmtap.relay import tls
from llmtap.relay.tls import TLSOptions
from llmtap.relay.upstream_http import SURPLUS, LeanTransport
from llmtap.types import OBJECTIVE_HEADERS

__all__ = [
    "PRIVATE_PREFIX",
    "Router",
    "Upstreams",
    "close_if_surplus",
    "request_headers",
    "response_headers",
    "upstream_url",
]

log = logging.getLogger("llmtap.upstream")

# RFC 9110 section 7.6.1: connection-specific fields never travel past one hop. Host is the
# upstream's, set by httpx from the configured URL; Content-Length is recomputed when a body changes.
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
    drop = HOP_BY_HOP | _connection_listed(headers) | {b"host"}
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


#: Statuses whose responses never have a body (RFC 9110 sections 15.3.5 and 15.4.5).
BODILESS = frozenset({204, 304})


def response_headers(
    headers: Iterable[tuple[bytes, bytes]], *, body_changed: bool, status: int = 200, decoded: bool = False
) -> list[tuple[bytes, bytes]]:
    """Upstream response headers as they go to the client: unchanged but for hop-by-hop ones.

    A 204 or 304 goes without Content-Length: a 204 must never carry one (RFC 9110 section 8.6), and a
    304's describes a body that is not sent, which the server below would wait for. ``decoded``: the
    relay sends the body decompressed, so without its Content-Encoding.
    """
    headers = list(headers)
    drop = HOP_BY_HOP | _connection_listed(headers)
    if body_changed or status in BODILESS:
        drop |= {b"content-length"}
    if decoded:
        drop |= {b"content-encoding"}
    return [(k, v) for k, v in headers if k.lower() not in drop]


class Router:
    """Picks the route of a request path; the upstream host comes only from configuration."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        # Settings sorts routes longest prefix first.
        self.routes = routes

    def match(self, path: str) -> Route | None:
        """The route whose prefix is the longest one that ``path`` starts with, on a segment boundary."""
        for route in self.routes:
            prefix = route.prefix
            if prefix == "/" or path == prefix or path.startswith(prefix + "/"):
                return route
        return None


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


async def close_if_surplus(response: httpx.Response) -> int:
    """Close the connection of a finished response when the upstream sent bytes past its end; return their count.

    RFC 9112 section 6.3: a client "MUST NOT process, cache, or forward such extra data as a separate
    response". httpcore returns the connection to its pool with those bytes still buffered in h11, where
    they would answer the next request on it (another client's). Reaching the h11 state takes httpx's and
    httpcore's internal attributes; if their shape changes this does nothing, and tests/test_faults.py
    (the Content-Length fault) fails. Runs once per response, never per chunk.
    """
    counted = response.extensions.get(SURPLUS)
    if callable(counted):
        # llmtap.relay.upstream_http counts these bytes itself, never parses them, and has closed the connection.
        return int(counted())
    stream = getattr(getattr(response.stream, "_stream", None), "_httpcore_stream", None)
    connection = getattr(getattr(stream, "_stream", None), "_connection", None)
    state = getattr(connection, "_h11_state", None)
    if not isinstance(state, h11.Connection):
        return 0
    surplus, _ = state.trailing_data
    if surplus:
        await connection.aclose()  # type: ignore[union-attr]
    return len(surplus)


class _HttpxTLS(httpx.AsyncBaseTransport):
    """httpx's transport to an HTTPS upstream: a route's ``tls_server_name`` as every request's SNI (and the
    name verified), and TLS failures before the response named as ``llmtap.relay.upstream_http`` names them
    (httpcore wraps a certificate failure in ``ConnectError`` with OpenSSL's text, and lets an alert that
    comes after the handshake, TLS 1.3's certificate required, out as a bare ``ssl.SSLError``)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, server_name: str | None) -> None:
        self._inner = inner
        self._name = server_name

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._name is not None:
            request.extensions["sni_hostname"] = self._name
        try:
            return await self._inner.handle_async_request(request)
        except ssl.SSLError as exc:
            raise httpx.ConnectError(tls.describe(exc)) from exc
        except httpx.ConnectError as exc:
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, ssl.SSLError):
                cause = cause.__cause__ or cause.__context__  # httpx's error, from httpcore's, from ssl's
            if isinstance(cause, ssl.SSLError):
                raise httpx.ConnectError(tls.describe(cause)) from cause
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


def _pool_key(route: Route) -> tuple[str, TLSOptions | None]:
    return route.upstream, TLSOptions.of(route) if route.upstream.startswith("https://") else None


class Upstreams:
    """One shared ``httpx.AsyncClient`` (one connection pool) per upstream base URL and TLS settings."""

    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        t = settings.timeouts
        self._clients: dict[tuple[str, TLSOptions | None], httpx.AsyncClient] = {}
        #: The pools the relay calls directly, without httpx's request machinery (llmtap's own client).
        self._lean: dict[tuple[str, TLSOptions | None], LeanTransport] = {}
        limits = httpx.Limits(
            max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections
        )
        timeout = httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool)
        # Backpressure: when a client reads slower than its upstream writes, the relay stops reading, but
        # the event loop may already have drained the socket's whole receive buffer (uvloop reads up to
        # 32 times per wake-up), and Linux grows that buffer to megabytes. A fixed SO_RCVBUF bounds what
        # one stream can make the proxy hold (tests/test_faults.py measures it).
        buffer = settings.stream_buffer_bytes
        options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)] if buffer else None
        for route in settings.routes:
            key = _pool_key(route)
            if key in self._clients:
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
            # trust_env=False: an HTTP_PROXY variable must not silently reroute traffic (nor SSL_CERT_FILE
            # be read by httpx: llmtap.relay.tls read it for the context), and redirects are relayed to the
            # client, never followed here.
            pool: httpx.AsyncBaseTransport
            if transport is not None:
                pool = transport
            elif settings.upstream_client == "lean":
                pool = LeanTransport(
                    max_connections=settings.max_connections,
                    receive_buffer=buffer,
                    ssl_context=context,
                    server_hostname=route.tls_server_name,
                )
                self._lean[key] = pool
            else:
                pool = httpx.AsyncHTTPTransport(
                    verify=context if context is not None else True,
                    limits=limits,
                    trust_env=False,
                    socket_options=options,
                )
                if context is not None:
                    pool = _HttpxTLS(pool, route.tls_server_name)
            self._clients[key] = httpx.AsyncClient(
                transport=pool, timeout=timeout, trust_env=False, follow_redirects=False
            )

    def client(self, route: Route) -> httpx.AsyncClient:
        """The pool for a route's upstream."""
        return self._clients[_pool_key(route)]

    def lean(self, route: Route) -> LeanTransport | None:
        """A route's pool when it is llmtap's own client, which the relay then calls directly; else None."""
        return self._lean.get(_pool_key(route))

    async def aclose(self) -> None:
        """Close every pool."""
        for client in self._clients.values():
            await client.aclose()
