"""An experiment: an httpx transport on raw asyncio protocols and httptools, to measure what httpcore costs the relay.

Not part of llmtap. It plugs into ``create_app(transport=...)`` unchanged (``python -m bench.probes.rawtransport
serve ...`` runs ``llmtap serve`` with it), so the benchmark can compare the same proxy with two
upstream clients. Plain HTTP/1.1 only (HTTPS upstreams go to httpx's own transport); one keep-alive
pool per host and port; the body iterator yields what one socket read carried, like httpcore's reads.
Timeouts follow ``request.extensions["timeout"]`` (connect, read), read again at every wait, so the
proxy's switch to its idle timeout after the headers applies.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
import httpx


class _Conn(asyncio.Protocol):
    """One upstream connection; a response's body parts queue up here until the relay reads them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on this connection."""
        self.generation += 1
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.parts: deque[bytes] = deque()
        self.pending: list[bytes] = []
        self.error: Exception | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.done:
            self.error = httpx.RemoteProtocolError("upstream closed the connection")
        self._wake()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(str(exc))
        if self.pending:
            self.parts.append(b"".join(self.pending) if len(self.pending) > 1 else self.pending[0])
            self.pending.clear()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # -- httptools callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pending.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    # -- used by the transport ------------------------------------------------------------------

    async def wait(self, silence: float | None) -> None:
        """Until something arrives; ``httpx.ReadTimeout`` after ``silence`` seconds without a byte."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self.waiter, silence)
        except TimeoutError:
            raise httpx.ReadTimeout("upstream silent") from None
        finally:
            self.waiter = None


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: _Conn, pool: list[_Conn], request: httpx.Request) -> None:
        self.conn = conn
        self.pool = pool
        self.request = request
        self.generation = conn.generation

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            while conn.parts:
                yield conn.parts.popleft()
            if conn.done:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.request.extensions.get("timeout", {}).get("read"))

    async def aclose(self) -> None:
        conn = self.conn
        if conn.generation != self.generation:
            return  # closed before: the connection already serves another response
        if conn.done and conn.transport is not None and conn.parser.should_keep_alive():
            conn.reset()
            self.pool.append(conn)
        elif conn.transport is not None:
            conn.transport.close()


class RawTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over raw asyncio protocols, with httptools parsing the responses."""

    def __init__(self) -> None:
        self.pools: dict[tuple[str, int], list[_Conn]] = {}
        self.fallback = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self.fallback.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        pool = self.pools.setdefault(key, [])
        conn: _Conn | None = None
        while pool:
            candidate = pool.pop()
            if candidate.transport is not None and not candidate.transport.is_closing():
                conn = candidate
                break
        if conn is None:
            loop = asyncio.get_running_loop()
            try:
                _, conn = await asyncio.wait_for(loop.create_connection(_Conn, key[0], key[1]), timeouts.get("connect"))
            except TimeoutError:
                raise httpx.ConnectTimeout("connect timed out") from None
            except OSError as exc:
                raise httpx.ConnectError(str(exc)) from None
        assert conn is not None
        return await self._exchange(conn, pool, request, timeouts)

    async def _exchange(
        self, conn: _Conn, pool: list[_Conn], request: httpx.Request, timeouts: dict[str, Any]
    ) -> httpx.Response:
        url = request.url
        body = await request.aread()
        target = url.raw_path.decode("ascii")
        lines = [f"{request.method} {target} HTTP/1.1".encode()]
        lines += [k + b": " + v for k, v in request.headers.raw]
        assert conn.transport is not None
        conn.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        while not conn.head_done:
            if conn.error is not None:
                raise conn.error
            await conn.wait(timeouts.get("read"))
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(conn, pool, request),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        for pool in self.pools.values():
            for conn in pool:
                if conn.transport is not None:
                    conn.transport.close()
        await self.fallback.aclose()


def main() -> None:
    """``llmtap`` with this transport injected into every app ``llmtap.serve.relay`` builds."""
    import llmtap.relay.app
    import llmtap.serve.relay
    from llmtap.cli import main as cli

    original = llmtap.relay.app.create_app

    def create_app(*args: Any, **kwargs: Any) -> llmtap.relay.app.ProxyApp:
        kwargs.setdefault("transport", RawTransport())
        return original(*args, **kwargs)

    setattr(llmtap.serve.relay, "create_app", create_app)  # noqa: B010 (the attribute is imported, not exported)
    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
