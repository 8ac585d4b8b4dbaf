"""llmtap's own upstream client: a pool per scheme, host and port, the connect (plain or TLS), and one exchange.

``LeanTransport.send`` is what the relay calls (an ``Answer``, no httpx ``Request`` or ``Response``);
``handle_async_request`` serves httpx's client the same way (tests, tools).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterable, Callable

import httpx

from llmtap.relay import tls
from llmtap.relay.upstream.body import Answer, Body
from llmtap.relay.upstream.connection import Connection, Stale, Timeouts
from llmtap.relay.upstream.errors import ConnectFailed, ConnectTimeout, UnsupportedScheme
from llmtap.relay.upstream.http11 import Pieces, chunked_of, head_of, request_head
from llmtap.relay.upstream.pool import Pool

__all__ = ["PIPE", "SURPLUS", "LeanTransport", "Origin"]

#: Response extension: a callable returning how many bytes the upstream sent past the response's end.
SURPLUS = "llmtap.surplus"
#: Response extension: the body (``Body``), whose ``pipe`` hands each part to a sink in the read callback.
PIPE = "llmtap.pipe"

_PORTS = {"http": 80, "https": 443}
#: A pool's key: scheme, host, port and, under TLS, the name sent as SNI and verified.
_Key = tuple[str, str, int, str | None]


class Origin:
    """Where a relay's requests go: the pool's key and the ``Host`` header (``LeanTransport.origin``)."""

    __slots__ = ("host", "key")

    def __init__(self, key: _Key, host: bytes) -> None:
        self.key = key
        self.host = host


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio protocols, plain or TLS, with a keep-alive pool per scheme, host and port.

    ``ssl_context`` verifies HTTPS upstreams (default: ``llmtap.relay.tls``'s default context); ``server_hostname``
    is the name sent as SNI and verified when it is not the URL's host (a request's ``sni_hostname``
    extension, as httpcore reads it, wins).
    """

    def __init__(
        self,
        *,
        max_connections: int = 100,
        receive_buffer: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self._limit = max_connections
        self._receive_buffer = receive_buffer
        self._ssl = ssl_context
        self._server_hostname = server_hostname
        self._pools: dict[_Key, Pool] = {}

    def origin(self, url: str) -> Origin:
        """Where requests to ``url`` go (its scheme, host and port), parsed once: what ``send`` takes."""
        parsed = httpx.URL(url)
        if parsed.scheme not in _PORTS:
            raise UnsupportedScheme(f"{parsed.scheme!r} upstreams are not HTTP")
        name = (self._server_hostname or parsed.host) if parsed.scheme == "https" else None
        return Origin((parsed.scheme, parsed.host, parsed.port or _PORTS[parsed.scheme], name), parsed.netloc)

    async def send(
        self,
        origin: Origin,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: bytes | Pieces | AsyncIterable[bytes],
        timeouts: Timeouts,
        leaving: Callable[[], None] | None = None,
    ) -> Answer:
        """One request, straight from the relay: no ``httpx.Request`` or ``Response`` is built.

        The bytes on the wire are those ``handle_async_request`` sends for the ``httpx.Request`` made of the
        same parts (``request_head``); ``target`` is the request target as httpx encodes it (``raw_path``).
        ``leaving`` is called once a connection is ready, just before the request's first byte is written to it.
        """
        head, chunked = request_head(method, target, origin.host, headers, content)
        return await self.send_head(origin, head, chunked, method == "HEAD", content, timeouts, leaving)

    async def send_head(
        self,
        origin: Origin,
        head: bytes,
        chunked: bool,
        head_only: bool,
        content: bytes | Pieces | AsyncIterable[bytes],
        timeouts: Timeouts,
        leaving: Callable[[], None] | None = None,
    ) -> Answer:
        """``send`` with the request's head already built (``llmtap.relay.forward.upstream_head``: the bytes
        ``request_head`` makes); ``head_only``: the request is HEAD, its response has no body."""
        conn = await self._exchange(origin.key, head, content, chunked, head_only, timeouts, leaving)
        return Answer(conn, timeouts)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in _PORTS:
            raise UnsupportedScheme(f"{url.scheme!r} upstreams are not HTTP")
        timeouts: Timeouts = request.extensions.get("timeout", {})
        name = None
        if url.scheme == "https":
            name = request.extensions.get("sni_hostname") or self._server_hostname or url.host
        key: _Key = (url.scheme, url.host, url.port or _PORTS[url.scheme], name)
        head = head_of(request)
        stream = request.stream
        content: bytes | AsyncIterable[bytes]
        if isinstance(stream, httpx.ByteStream):
            content = await request.aread()
        else:
            assert isinstance(stream, AsyncIterable)
            content = stream
        conn = await self._exchange(key, head, content, chunked_of(request), request.method == "HEAD", timeouts)
        body = Body(conn, timeouts)
        surplus: Callable[[], int] = body.surplus
        version = b"HTTP/" + conn.version()
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=body,
            extensions={"http_version": version, "reason_phrase": conn.reason, SURPLUS: surplus, PIPE: body},
        )

    async def _exchange(
        self,
        key: _Key,
        head: bytes,
        content: bytes | Pieces | AsyncIterable[bytes],
        chunked: bool,
        head_only: bool,
        timeouts: Timeouts,
        leaving: Callable[[], None] | None = None,
    ) -> Connection:
        """A connection of ``key``'s pool with the request sent on it and the response's head read (``leaving``:
        called as the request's first byte is about to be written)."""
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = Pool(self._limit)
        while True:
            # An idle connection is taken at once; ``acquire`` (a coroutine) only when a slot or a wait is needed.
            conn = pool.take_idle() or await pool.acquire(timeouts.get("pool"))
            if conn is None:
                try:
                    conn = await self._connect(pool, key, timeouts.get("connect"))
                except BaseException:
                    pool.unreserve()
                    raise
                pool.added(conn)
            try:
                await conn.exchange(head, content, timeouts, leaving, chunked=chunked, head_only=head_only)
            except Stale:
                pool.drop(conn)  # an idle connection the server closed meanwhile: nothing was sent on it
                continue
            except BaseException:
                # Failed or cancelled mid-exchange (a body iterator's own error included, which goes on as is).
                conn.settle()
                raise
            return conn

    async def _connect(self, pool: Pool, key: _Key, seconds: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        _, host, port, _ = key
        try:
            async with asyncio.timeout(seconds):
                return await self._open(pool, key, loop)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} within {seconds:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{host}:{port}: {exc}") from exc

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = tls.context(tls.TLSOptions())
        return self._ssl

    async def _open(self, pool: Pool, key: _Key, loop: asyncio.AbstractEventLoop) -> Connection:
        """Each address in turn; SO_RCVBUF is set before connecting, as the TCP window is agreed then."""
        scheme, host, port, name = key
        error: OSError = OSError(f"no address for {host}")
        for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                if self._receive_buffer:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._receive_buffer)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            if scheme == "http":
                _, conn = await loop.create_connection(lambda: Connection(pool, loop), sock=sock)
                return conn
            try:
                # The loop owns the socket from here: on failure it closes it itself.
                _, conn = await loop.create_connection(
                    lambda: Connection(pool, loop), sock=sock, ssl=self._context(), server_hostname=name
                )
            except ssl.SSLError as exc:
                raise ConnectFailed(tls.describe(exc)) from exc
            except OSError as exc:
                # Connected, then the handshake broke off (the server reset or closed the connection).
                raise ConnectFailed(f"TLS handshake failed: {exc.strerror or exc}") from exc
            return conn
        raise error

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
