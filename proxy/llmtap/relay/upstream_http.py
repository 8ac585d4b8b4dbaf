"""A lean HTTP/1.1 client for HTTP and HTTPS upstreams: an httpx transport on asyncio protocols, httptools parsing.

httpcore's pool, anyio and h11 cost about a third of the relay's CPU per chunk (bench/RESULTS.md, "Where
the time goes"); here one protocol object per connection parses the response as it arrives and queues its
body parts. The relay calls it directly (``LeanTransport.send``: an ``Answer``, no httpx ``Request`` or
``Response``, which cost the relay about 150 µs of CPU a request, issue 29); as an httpx transport it
serves httpx's client the same way (tests, tools). What the relay relies on, and this module keeps:

* the errors it maps: ``ConnectError``, ``ConnectTimeout``, ``PoolTimeout``, ``ReadTimeout``,
  ``WriteTimeout``, ``ReadError`` (reset), ``RemoteProtocolError`` (closed early, malformed);
* timeouts read from the request's timeout mapping (``request.extensions["timeout"]`` through httpx) at
  every wait, so its switch to the idle timeout after the headers applies;
* body parts as they arrive, never merged or held back: one per socket read, and within a read one per
  HTTP chunk of a chunked body (as httpcore yields them: the relay's tap counts each as an upstream chunk);
* backpressure: past ``QUEUE_BYTES`` unread, the socket stops being read, and ``SO_RCVBUF`` bounds the rest;
* RFC 9112 section 6.3: bytes past the end of a response never reach the parser, are counted
  (``response.extensions[SURPLUS]``) and close the connection.

A relay may instead take the body in the read callback (``response.extensions[PIPE]``, ``_Body.pipe``): each
part goes to its sink the moment the parser has it, stamped once per socket read, and the relay's task
wakes only when the response ends, fails or is held (``hold``: its client stopped taking bytes, so the
socket stops being read until ``release``). No queue, no task switch per chunk (issue 29). Whole chunks of a
chunked body, a stream's usual read, reach the sink without the parser (``_Connection._whole``).

HTTPS is the event loop's own TLS transport (``create_connection(ssl=...)``, asyncio's or uvloop's) under
the same protocol, with the context of ``llmtap.relay.tls``: certificate and handshake failures are
``ConnectError``s that say what failed (``certificate verify failed: self-signed certificate``). asyncio
cannot hand a TLS session to ``create_connection`` for resumption; keeping connections alive in the pool
is the session reuse: one handshake per connection, and a connection serves request after request.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Any

import httptools
import httpx

from llmtap.relay import tls
from llmtap.relay.heads import BadHead

__all__ = ["MAX_HEAD_BYTES", "PIPE", "SURPLUS", "Answer", "LeanTransport", "Origin", "Pieces"]

#: Response extension: a callable returning how many bytes the upstream sent past the response's end.
SURPLUS = "llmtap.surplus"
#: Response extension: the body (``_Body``), whose ``pipe`` hands each part to a sink in the read callback.
PIPE = "llmtap.pipe"
#: A sink: called with the moment a socket read arrived and one body part it carried.
Sink = Callable[[float, bytes], None]
#: Body bytes queued and not yet taken by the relay past which the socket stops being read.
QUEUE_BYTES = 64 * 1024
#: The largest response head (interim responses included); a longer one is a protocol error.
MAX_HEAD_BYTES = 256 * 1024
#: A request body past this is written beside its head rather than joined to it.
_JOINED_BYTES = 64 * 1024
#: A request body in memory, in pieces (the relay's spliced body of megabytes: its parts and the bytes it adds),
#: sent with a Content-Length a slice of ``WRITE_SLICE`` bytes at a time, the loop getting a turn between slices.
Pieces = tuple[bytes | memoryview, ...]
WRITE_SLICE = 256 * 1024
#: The digits of a chunk's size (RFC 9112 section 7.1).
_HEX_DIGITS = b"0123456789abcdefABCDEF"
# A response head, a chunked body (last chunk and trailers) and so every message whose length is not
# counted in advance ends with this; the parser only ever sees input up to such a point or a counted end.
_END = b"\r\n\r\n"

#: ``request.extensions["timeout"]``: connect, read, write and pool, in seconds or None.
_Timeouts = Mapping[str, Any]


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _wake(waiter: asyncio.Future[bool] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(True)


def _readable(fd: int) -> bool:
    """True when an idle connection has something to read: the server closed it, or sent what nobody asked for."""
    # poll, not select: select cannot watch a descriptor numbered past 1023, which a busy proxy reaches.
    poller = select.poll()
    try:
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class _Connection(asyncio.Protocol):
    """One upstream connection and the exchange running on it; body parts queue here until the relay reads them."""

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.idle = False
        self.closed = False
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._fd = -1
        self._parser = httptools.HttpResponseParser(self)
        self._reader: asyncio.Future[bool] | None = None
        self._writer: asyncio.Future[bool] | None = None
        self._writing_paused = False
        self._reading_paused = False
        self.active = False
        #: Where body parts go as they arrive (``_Body.pipe``); None: they queue in ``parts``.
        self.sink: Sink | None = None
        #: Reading is paused because the sink's client takes no more (``hold``).
        self.held = False
        #: When the socket last brought anything, under a sink (its idle timeout counts from here).
        self.heard = 0.0
        #: A TLS connection's TLS object, until its session is handed to its context (``tls.ResumingContext``).
        self.unkept: ssl.SSLObject | None = None
        self._reset(head_only=False)

    def begin(self, *, head_only: bool) -> None:
        """A new exchange: the previous response ended exactly where the parser stopped."""
        self.active = True
        self._reset(head_only=head_only)

    def _reset(self, *, head_only: bool) -> None:
        self.head_only = head_only
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.sent_all = False
        self.error: httpx.TransportError | None = None
        self.surplus = 0
        self.parts: deque[bytes] = deque()
        self._pending: list[bytes] = []
        self._queued = 0
        self._interim = False
        self._chunked = False
        #: Body bytes still due under Content-Length; None when the length is not counted in advance.
        self._remaining: int | None = None
        self._head_bytes = 0
        self._tail = b""
        #: A chunked body's parser stands between two chunks: the next bytes are a chunk's size line.
        self._boundary = False

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self.unkept = transport.get_extra_info("ssl_object")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.active and not self.done and self.error is None:
            if isinstance(exc, ssl.SSLError) and self._head_bytes == 0:
                # TLS 1.3: the server checks our certificate after our side of the handshake is done, so
                # its refusal (an alert) comes in place of the response.
                self.error = httpx.ConnectError(tls.describe(exc))
            elif exc is not None:
                self.error = httpx.ReadError(f"upstream reset the connection: {exc}")
            elif self.head_done and not self._chunked and self._remaining is None and not self._interim:
                self.done = True  # a body delimited by the end of the connection (RFC 9112 section 6.3, item 8)
            else:
                what = "mid-response" if self.head_done else "before the response headers"
                self.error = httpx.RemoteProtocolError(f"upstream closed the connection {what}")
        _wake(self._reader)
        _wake(self._writer)
        if self.idle:
            self.pool.lost(self)

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        _wake(self._writer)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.done:
            self._past_end(len(data))
            return
        sink = self.sink
        if sink is not None:
            self._sink_read(sink, data)
            return
        size = len(data)
        start = 0
        while start < size and not self.done and self.error is None:
            end = self._piece_end(data, start)
            piece: bytes | memoryview = data if start == 0 and end == size else memoryview(data)[start:end]
            self._feed(piece)
            start = end
        if self._pending:
            self._flush()
        if self._queued > QUEUE_BYTES and not self._reading_paused and not self.closed:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading_paused = True
        if start < size and self.done:
            self._past_end(size - start)
        _wake(self._reader)

    def _sink_read(self, sink: Sink, data: bytes) -> None:
        """``data_received`` under a sink: parse, hand each part over with the read's one timestamp, wake
        the relay's task only when the response ended, failed or is held."""
        self.heard = t = time.perf_counter()
        size = len(data)
        start = 0
        if self._boundary and self.error is None:
            # Whole chunks of a chunked body, the usual read of a stream, go without the parser (see ``_whole``).
            start = self._whole(sink, t, data)
            if start == size:
                self._tail = data[-3:]
                if self.held:
                    _wake(self._reader)
                return
        while start < size and not self.done and self.error is None:
            end = self._piece_end(data, start)
            self._feed(data if start == 0 and end == size else memoryview(data)[start:end])
            start = end
        if self._pending:
            self._flush()
        parts = self.parts
        while parts:
            sink(t, parts.popleft())
        self._queued = 0
        if start < size and self.done:
            self._past_end(size - start)
        if self.done or self.error is not None or self.held:
            _wake(self._reader)

    def _whole(self, sink: Sink, t: float, data: bytes) -> int:
        """Hand each whole chunk at the start of ``data`` to ``sink``, the parser standing between two chunks;
        returns where the rest begins (the parser's to read: a chunk split across reads, the last chunk, a
        size line with an extension, anything malformed).

        Only what the parser would read the same way is taken (RFC 9112 section 7.1: hex digits, CRLF, that
        many bytes, CRLF), and the parser is left where it would stand after it: between two chunks. So the
        parts are those the parser would give, with no callback per chunk (issue 29).
        """
        at = 0
        size = len(data)
        while at < size:
            line = data.find(b"\r\n", at, at + 18)
            if line <= at:
                break
            digits = data[at:line]
            if digits.lstrip(_HEX_DIGITS):
                break
            count = int(digits, 16)
            end = line + 2 + count
            if count == 0 or end + 2 > size or data[end : end + 2] != b"\r\n":
                break
            sink(t, data[line + 2 : end])
            at = end + 2
        return at

    def hold(self) -> None:
        """Stop reading the socket until ``release`` (the sink's client stopped taking bytes); wakes the relay."""
        if not self.held:
            self.held = True
            if self._transport is not None and not self.closed:
                self._transport.pause_reading()
        _wake(self._reader)

    def release(self) -> None:
        """Read the socket again after ``hold``; the silence the hold caused does not count as the upstream's."""
        self.heard = time.perf_counter()
        if self.held:
            self.held = False
            if self._transport is not None and not self.closed:
                self._transport.resume_reading()

    async def until_moved(self, seconds: float | None) -> None:
        """Under a sink: until the response ends, fails or is held; ``httpx.ReadTimeout`` once the socket
        brought nothing for ``seconds`` (one timer for the wait, checked against ``heard`` when it fires)."""
        remaining = seconds
        while not (self.done or self.error is not None or self.held):
            self._reader = self._loop.create_future()
            try:
                moved = await self._until(self._reader, remaining)
            finally:
                self._reader = None
            if not moved and seconds is not None:
                silence = time.perf_counter() - self.heard
                if silence >= seconds:
                    raise httpx.ReadTimeout(f"upstream sent nothing for {seconds:g} s")
                remaining = seconds - silence

    # -- parsing ---------------------------------------------------------------------------------

    def _piece_end(self, data: bytes, start: int) -> int:
        """Where the input may next end a message: the parser is fed up to there, and no further at once."""
        if self.head_done and not self._chunked:
            if self._remaining is None:
                return len(data)
            return min(len(data), start + self._remaining)
        if start == 0 and self._tail:
            # A head or a chunked body's end that began in the previous read.
            found = (self._tail + data[:3]).find(_END)
            if found >= 0:
                return found + 4 - len(self._tail)
        found = data.find(_END, max(start - 3, 0))
        while 0 <= found and found + 4 <= start:
            found = data.find(_END, found + 1)
        return len(data) if found < 0 else found + 4

    def _feed(self, piece: bytes | memoryview) -> None:
        if not self.head_done:
            self._head_bytes += len(piece)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(BadHead(f"response head longer than {MAX_HEAD_BYTES} bytes"))
                return
        try:
            self._parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self._fail(BadHead("upstream switched protocols unasked"))
        except httptools.HttpParserError as exc:
            # In the head, what the relay cannot pass on (``llmtap.relay.heads``); in the body, a stream broken.
            error = BadHead if not self.head_done else httpx.RemoteProtocolError
            self._fail(error(f"malformed response from upstream: {exc}"))
        self._tail = bytes(piece[-3:]) if len(piece) >= 3 else (self._tail + bytes(piece))[-3:]
        if self._boundary and not self._tail.endswith(b"\r\n"):
            self._boundary = False  # the next chunk's size line began: the parser holds part of it

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interim = True  # 1xx: skipped, the final response follows (101 stops the parser: refused)
            self.headers = []
            self.reason = b""
            return
        self.status = status
        self.head_done = True
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                self._chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
            elif lowered == b"content-length":
                self._remaining = int(value)  # the parser refuses malformed or conflicting lengths
        if self._chunked:
            self._remaining = None
            self._boundary = not self.head_only
        if status in (204, 304):
            self._remaining = 0  # never a body, whatever Content-Length says (RFC 9112 section 6.3)
        if self.head_only:
            # The parser cannot be told the request was HEAD: the message ends here, and the connection
            # is closed after it rather than trusted with a parser expecting a body.
            self.done = True

    def on_body(self, body: bytes) -> None:
        self._pending.append(body)
        if self._remaining is not None:
            self._remaining -= len(body)

    def on_chunk_header(self) -> None:
        self._boundary = False

    def on_chunk_complete(self) -> None:
        # After the CRLF that ends the chunk's data: the parser stands between two chunks unless more follows.
        self._boundary = True
        if self._pending:
            self._flush()

    def _flush(self) -> None:
        """Queue what the parser gave of one HTTP chunk (or one read of a counted body) as one part."""
        pending = self._pending
        part = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        self.parts.append(part)
        self._queued += len(part)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.keep_alive = self._parser.should_keep_alive() and not self.head_only
        self.done = True

    def _fail(self, error: httpx.TransportError) -> None:
        if self.error is None:
            self.error = error
        self.abort()

    def _past_end(self, count: int) -> None:
        """Bytes after the response's end (or on an idle connection): never parsed, the connection is closed."""
        self.surplus += count
        self.keep_alive = False
        self.abort()

    # -- used by the transport and the body ------------------------------------------------------

    def usable(self) -> bool:
        """An idle connection still open, with nothing unread on it.

        The descriptor polled is the TCP socket's, under TLS too: the TLS transport reads all the socket
        has whenever the loop runs, so on an idle connection anything there is news (a close_notify, a
        FIN, bytes nobody asked for) and the connection is not trusted with a request.
        """
        return (
            not self.closed
            and self._transport is not None
            and not self._transport.is_closing()
            and not (self._fd >= 0 and _readable(self._fd))
        )

    def reusable(self) -> bool:
        """The exchange ended cleanly: whole request sent, whole response read, nothing past its end."""
        return (
            self.done
            and self.keep_alive
            and self.sent_all
            and self.error is None
            and self.surplus == 0
            and not self.closed
        )

    def keep_session(self) -> None:
        """Hand the TLS session to the context, for the next connection's handshake: once, after the first
        exchange (by then a TLS 1.3 server's tickets have been read)."""
        connection, self.unkept = self.unkept, None
        keep = getattr(getattr(connection, "context", None), "keep", None)
        if keep is not None:
            keep(connection)

    def park(self) -> None:
        """Between exchanges in the pool."""
        self.active = False
        self.sink = None
        self.parts.clear()
        self._queued = 0
        if (self._reading_paused or self.held) and self._transport is not None:
            self._transport.resume_reading()
        self._reading_paused = self.held = False

    def abort(self) -> None:
        """Close at once (the server sees the client leave), dropping anything unsent."""
        if self._transport is not None and not self.closed:
            self._transport.abort()

    def write(self, data: bytes, more: bytes = b"") -> None:
        """``data`` and then ``more`` onto the connection; a large ``more`` is written without copying it into one
        buffer with ``data`` first (a request body of megabytes: a copy of milliseconds on the relay's loop)."""
        if self.closed or self._transport is None or self._transport.is_closing():
            raise httpx.RemoteProtocolError("upstream closed the connection before the request was sent")
        if len(more) > _JOINED_BYTES:
            self._transport.writelines((data, more))
        else:
            self._transport.write(data + more)

    async def send_pieces(self, pieces: Pieces, timeouts: _Timeouts) -> None:
        """A body in memory, a slice at a time: the kernel's copy of a body of megabytes never holds the loop."""
        assert self._transport is not None
        transport = self._transport
        for piece in pieces:
            view = memoryview(piece)
            for at in range(0, len(view), WRITE_SLICE):
                if self.closed or self.head_done:
                    return  # the upstream answered (or left) before the body's end: read what it said
                transport.write(view[at : at + WRITE_SLICE])
                if self._writing_paused:
                    await self._drain(timeouts.get("write"))
                else:
                    await asyncio.sleep(0)
        if not self.closed and not self.head_done:
            self.sent_all = True

    async def send_stream(self, stream: AsyncIterable[bytes], *, chunked: bool, timeouts: _Timeouts) -> None:
        """A streamed body, in chunked framing when the head says so, at the pace the upstream takes it."""
        assert self._transport is not None
        transport = self._transport
        async for part in stream:
            if self.closed or self.head_done:
                return  # the upstream answered (or left) before the body's end: read what it said
            if part:
                if chunked:
                    transport.writelines((b"%x\r\n" % len(part), part, b"\r\n"))
                else:
                    transport.write(part)
            if self._writing_paused:
                await self._drain(timeouts.get("write"))
        if not self.closed and not self.head_done:
            if chunked:
                transport.write(b"0\r\n\r\n")
            self.sent_all = True

    async def _drain(self, seconds: float | None) -> None:
        while self._writing_paused and not self.closed and not self.head_done:
            self._writer = self._loop.create_future()
            try:
                taken = await self._until(self._writer, seconds)
            finally:
                self._writer = None
            if not taken:
                raise httpx.WriteTimeout(f"upstream took no request body for {seconds:g} s")

    async def wait_readable(self, seconds: float | None) -> None:
        """Until the response moves on (a part, its end, an error); ``httpx.ReadTimeout`` after ``seconds``."""
        self._reader = self._loop.create_future()
        try:
            moved = await self._until(self._reader, seconds)
        finally:
            self._reader = None
        if not moved:
            raise httpx.ReadTimeout(f"upstream sent nothing for {seconds:g} s")

    async def _until(self, waiter: asyncio.Future[bool], seconds: float | None) -> bool:
        if seconds is None:
            return await waiter
        timer = self._loop.call_later(seconds, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    def version(self) -> bytes:
        """The response's HTTP version as the parser read it (``1.1``)."""
        return self._parser.get_http_version().encode("ascii")

    def take(self) -> bytes:
        """The oldest queued body part; reading resumes once the queue has drained to half its bound."""
        part = self.parts.popleft()
        self._queued -= len(part)
        if self._reading_paused and self._queued <= QUEUE_BYTES // 2 and not self.closed:
            assert self._transport is not None
            self._transport.resume_reading()
            self._reading_paused = False
        return part


class _Pool:
    """The connections to one host and port: at most ``limit``, busy and idle together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.idle: list[_Connection] = []
        self.connections: set[_Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, seconds: float | None) -> _Connection | None:
        """An idle connection, or None when a slot for a new one is reserved; ``httpx.PoolTimeout`` when none frees."""
        while True:
            while self.idle:
                conn = self.idle.pop()  # the most recently used: the likeliest to be open
                conn.idle = False
                if conn.usable():
                    return conn
                conn.abort()
                self._forget(conn)
            if self.size < self.limit:
                self.size += 1
                return None
            await self._wait(seconds)

    async def _wait(self, seconds: float | None) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._next()  # woken just as we gave up: the turn goes on to the next in line
            waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout(f"no upstream connection free within {seconds:g} s") from None
            raise

    def _next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def added(self, conn: _Connection) -> None:
        self.connections.add(conn)

    def unreserve(self) -> None:
        """A reserved slot whose connection was never made."""
        self.size -= 1
        self._next()

    def release(self, conn: _Connection) -> None:
        """An exchange is over: its connection goes back idle when clean, else it is closed."""
        if conn.unkept is not None:
            conn.keep_session()
        if conn.reusable():
            conn.park()
            conn.idle = True
            self.idle.append(conn)
        else:
            conn.abort()
            self._forget(conn)
        self._next()

    def lost(self, conn: _Connection) -> None:
        """An idle connection the server closed."""
        if conn in self.idle:
            self.idle.remove(conn)
            conn.idle = False
            self._forget(conn)
            self._next()

    def _forget(self, conn: _Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.size -= 1

    def close(self) -> None:
        for conn in list(self.connections):
            conn.idle = False
            conn.abort()
        self.connections.clear()
        self.idle.clear()
        self.size = 0


class _Body(httpx.AsyncByteStream):
    """A response body: what each socket read carried, in order; the connection is released exactly once."""

    def __init__(self, conn: _Connection, timeouts: _Timeouts) -> None:
        self._conn = conn
        self._timeouts = timeouts
        self._released = False
        self._surplus = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        timeouts = self._timeouts
        while not self._released:
            if conn.parts:
                yield conn.take()
            elif conn.done:
                return  # httpx closes the response at the end of the body: the connection is released then
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait_readable(timeouts.get("read"))

    async def aclose(self) -> None:
        self._release()

    @property
    def connection(self) -> _Connection:
        """The connection this body arrives on (a sink holds and releases it, the relay waits on it)."""
        return self._conn

    def pipe(self, sink: Sink) -> _Connection:
        """From now on each body part goes to ``sink`` in the read callback (those queued already, at once);
        the relay then waits on the returned connection's ``until_moved`` and ``hold``/``release``."""
        conn = self._conn
        conn.heard = t = time.perf_counter()
        conn.sink = sink
        parts = conn.parts
        while parts:
            sink(t, parts.popleft())
        conn._queued = 0
        if conn._reading_paused:
            # Paused for a full queue before the pipe: the queue is gone (a hold by the sink keeps its own pause).
            conn._reading_paused = False
            if not conn.held and conn._transport is not None and not conn.closed:
                conn._transport.resume_reading()
        return conn

    def surplus(self) -> int:
        """Bytes the upstream sent past this response's end (its connection was closed for them)."""
        return self._surplus if self._released else self._conn.surplus

    def close(self) -> None:
        """Release the connection (``aclose`` without the wait): exactly once, whoever asks."""
        self._release()

    def _release(self) -> None:
        if self._released:
            return  # a second close must not touch a connection that may serve another response by now
        self._released = True
        conn = self._conn
        self._surplus = conn.surplus
        conn.pool.release(conn)


def _head(request: httpx.Request) -> bytes:
    """Request line and headers exactly as httpx built them (Host included)."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    lines.extend(name + b": " + value for name, value in request.headers.raw)
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    # One CR and one LF per line and no more: a header cannot smuggle a line of its own.
    if head.count(b"\n") != len(lines) + 1 or head.count(b"\r") != len(lines) + 1:
        raise httpx.LocalProtocolError("CR or LF inside a request header")
    return head


def _chunked(request: httpx.Request) -> bool:
    codings: str = request.headers.get("transfer-encoding", "")
    return codings.rsplit(",", 1)[-1].strip().lower() == "chunked"


_PORTS = {"http": 80, "https": 443}
#: A pool's key: scheme, host, port and, under TLS, the name sent as SNI and verified.
_Key = tuple[str, str, int, str | None]

#: The methods whose empty body httpx announces with ``Content-Length: 0`` (and so ``request_head`` does).
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class Origin:
    """Where a relay's requests go: the pool's key and the ``Host`` header (``LeanTransport.origin``)."""

    __slots__ = ("host", "key")

    def __init__(self, key: _Key, host: bytes) -> None:
        self.key = key
        self.host = host


class Answer:
    """A response as the relay takes it from ``LeanTransport.send``: status, head and body, nothing else."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: _Body) -> None:
        self.status_code = status
        self.headers = headers
        #: The body, to read (``aiter_raw``) or to take in the read callback (``_Body.pipe``).
        self.body = body

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body parts as they arrive, the connection released at the body's end (as ``httpx.Response.aiter_raw``
        yields them over this client, and closes the response)."""
        async for part in self.body:
            yield part
        self.body.close()

    async def surplus(self) -> int:
        """Bytes the upstream sent past the response's end (its connection is closed for them)."""
        return self.body.surplus()

    async def aclose(self) -> None:
        """Release the connection: back to the pool when the exchange ended cleanly, else closed. Never waits."""
        self.body.close()

    def abandon(self) -> None:
        """Release the connection closed, however cleanly the exchange ended: the relay refused this response."""
        self.body.connection.keep_alive = False
        self.body.close()


def request_head(
    method: str,
    target: bytes,
    host: bytes,
    headers: list[tuple[bytes, bytes]],
    content: bytes | Pieces | AsyncIterable[bytes],
) -> tuple[bytes, bool]:
    """The request line and headers, and whether the body goes chunked, as ``httpx.Request`` builds them from
    the same method, target, headers and content (and ``_head`` writes them): ``Host`` first, then
    ``Content-Length: 0`` for an empty POST, PUT or PATCH that names no length, then ``headers``, then the
    body's ``Content-Length`` (bytes, or ``Pieces``: their total) or ``Transfer-Encoding: chunked`` (a stream)
    unless a length is named.
    """
    method = method.upper()
    names = {name.lower() for name, _ in headers}
    extra: list[tuple[bytes, bytes]] = []
    if isinstance(content, (bytes, tuple)):
        length = len(content) if isinstance(content, bytes) else sum(map(len, content))
        if length and b"content-length" not in names:
            extra.append((b"Content-Length", b"%d" % length))
            names.add(b"content-length")
    elif b"content-length" not in names and b"transfer-encoding" not in names:
        extra.append((b"Transfer-Encoding", b"chunked"))
        names.add(b"transfer-encoding")
    auto: list[tuple[bytes, bytes]] = []
    if b"host" not in names:
        auto.append((b"Host", host))
    if b"content-length" not in names and b"transfer-encoding" not in names and method in _BODY_METHODS:
        auto.append((b"Content-Length", b"0"))
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), target)]
    lines.extend(name + b": " + value for name, value in (*auto, *headers, *extra))
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    # One CR and one LF per line and no more: a header cannot smuggle a line of its own.
    if head.count(b"\n") != len(lines) + 1 or head.count(b"\r") != len(lines) + 1:
        raise httpx.LocalProtocolError("CR or LF inside a request header")
    codings = b", ".join(value for name, value in (*headers, *extra) if name.lower() == b"transfer-encoding")
    return head, codings.rsplit(b",", 1)[-1].strip().lower() == b"chunked"


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
        self._pools: dict[_Key, _Pool] = {}

    def origin(self, url: str) -> Origin:
        """Where requests to ``url`` go (its scheme, host and port), parsed once: what ``send`` takes."""
        parsed = httpx.URL(url)
        if parsed.scheme not in _PORTS:
            raise httpx.UnsupportedProtocol(f"{parsed.scheme!r} upstreams are not HTTP")
        name = (self._server_hostname or parsed.host) if parsed.scheme == "https" else None
        return Origin((parsed.scheme, parsed.host, parsed.port or _PORTS[parsed.scheme], name), parsed.netloc)

    async def send(
        self,
        origin: Origin,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: bytes | Pieces | AsyncIterable[bytes],
        timeouts: _Timeouts,
        leaving: Callable[[], None] | None = None,
    ) -> Answer:
        """One request, straight from the relay: no ``httpx.Request`` or ``Response`` is built (issue 29).

        The bytes on the wire are those ``handle_async_request`` sends for the ``httpx.Request`` made of the
        same parts (``request_head``); ``target`` is the request target as httpx encodes it (``raw_path``).
        ``leaving`` is called once a connection is ready, just before the request's first byte is written to it.
        """
        head, chunked = request_head(method, target, origin.host, headers, content)
        conn = await self._exchange(origin.key, head, content, chunked, method == "HEAD", timeouts, leaving)
        return Answer(conn.status, conn.headers, _Body(conn, timeouts))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in _PORTS:
            raise httpx.UnsupportedProtocol(f"{url.scheme!r} upstreams are not HTTP")
        timeouts: _Timeouts = request.extensions.get("timeout", {})
        name = None
        if url.scheme == "https":
            name = request.extensions.get("sni_hostname") or self._server_hostname or url.host
        key: _Key = (url.scheme, url.host, url.port or _PORTS[url.scheme], name)
        head = _head(request)
        stream = request.stream
        content: bytes | AsyncIterable[bytes]
        if isinstance(stream, httpx.ByteStream):
            content = await request.aread()
        else:
            assert isinstance(stream, AsyncIterable)
            content = stream
        conn = await self._exchange(key, head, content, _chunked(request), request.method == "HEAD", timeouts)
        body = _Body(conn, timeouts)
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
        timeouts: _Timeouts,
        leaving: Callable[[], None] | None = None,
    ) -> _Connection:
        """A connection of ``key``'s pool with the request sent on it and the response's head read (``leaving``:
        called as the request's first byte is about to be written)."""
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self._limit)
        conn = await pool.acquire(timeouts.get("pool"))
        if conn is None:
            try:
                conn = await self._connect(pool, key, timeouts.get("connect"))
            except BaseException:
                pool.unreserve()
                raise
            pool.added(conn)
        try:
            conn.begin(head_only=head_only)
            if leaving is not None:
                leaving()
            if isinstance(content, bytes):
                conn.write(head, content)  # one write: the head and a body already in memory
                conn.sent_all = True
            elif isinstance(content, tuple):
                conn.write(head)
                await conn.send_pieces(content, timeouts)
            else:
                conn.write(head)
                await conn.send_stream(content, chunked=chunked, timeouts=timeouts)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait_readable(timeouts.get("read"))
        except BaseException:
            # Failed or cancelled mid-exchange (a body iterator's own error included, which goes on as is).
            pool.release(conn)
            raise
        return conn

    async def _connect(self, pool: _Pool, key: _Key, seconds: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        _, host, port, _ = key
        try:
            async with asyncio.timeout(seconds):
                return await self._open(pool, key, loop)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {seconds:g} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc}") from exc

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = tls.context(tls.TLSOptions())
        return self._ssl

    async def _open(self, pool: _Pool, key: _Key, loop: asyncio.AbstractEventLoop) -> _Connection:
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
                _, conn = await loop.create_connection(lambda: _Connection(pool, loop), sock=sock)
                return conn
            try:
                # The loop owns the socket from here: on failure it closes it itself.
                _, conn = await loop.create_connection(
                    lambda: _Connection(pool, loop), sock=sock, ssl=self._context(), server_hostname=name
                )
            except ssl.SSLError as exc:
                raise httpx.ConnectError(tls.describe(exc)) from exc
            except OSError as exc:
                # Connected, then the handshake broke off (the server reset or closed the connection).
                raise httpx.ConnectError(f"TLS handshake failed: {exc.strerror or exc}") from exc
            return conn
        raise error

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
