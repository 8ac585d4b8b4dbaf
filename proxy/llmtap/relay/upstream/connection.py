"""One upstream connection: an asyncio protocol that owns the socket, reads it, writes the request, and waits.

Body parts queue on the connection until the relay reads them (``take``), or go to a sink in the read callback
(``attach``: the relay's pipe), stamped once per socket read; the relay's task wakes only when the response ends,
fails or is held (``hold``: its client stopped taking bytes, so the socket stops being read until ``release``).
Backpressure: past ``QUEUE_BYTES`` unread, the socket stops being read, and ``SO_RCVBUF`` bounds the rest.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections.abc import AsyncIterable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import httptools

from llmtap.relay import tls
from llmtap.relay.upstream.errors import ConnectFailed, ReadTimeout, UpstreamClosed, UpstreamReset, WriteTimeout
from llmtap.relay.upstream.http11 import Http11, Pieces, Sink

if TYPE_CHECKING:
    from llmtap.relay.upstream.pool import Pool

__all__ = ["BUFFER", "QUEUE_BYTES", "READ_BYTES", "WRITE_SLICE", "Connection", "ReadBuffer", "Stale", "Timeouts"]

#: Body bytes queued and not yet taken by the relay past which the socket stops being read.
QUEUE_BYTES = 64 * 1024
#: A request body past this is written beside its head rather than joined to it.
_JOINED_BYTES = 64 * 1024
WRITE_SLICE = 256 * 1024
#: The size of the one buffer every upstream connection of the process reads into (``ReadBuffer``): as much as the
#: event loop's TLS transport reads at once (uvloop's and asyncio's 256 KiB), so a read is never split in two.
READ_BYTES = 256 * 1024
#: ``request.extensions["timeout"]``: connect, read, write and pool, in seconds or None.
Timeouts = Mapping[str, Any]


class Stale(Exception):
    """An idle connection found unfit as an exchange began on it (``Connection.exchange``): closed, nothing
    written; the transport takes another. Never leaves the upstream client."""


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _wake(waiter: asyncio.Future[bool] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(True)


def _poller(fd: int) -> select.poll | None:
    """A poll object watching ``fd`` for reading, made once per connection (``Connection.usable`` asks it before
    each exchange but the first); None without a descriptor. poll, not select: select cannot watch a descriptor
    numbered past 1023, which a busy proxy reaches."""
    if fd < 0:
        return None
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller


def _readable(poller: select.poll) -> bool:
    """True when an idle connection has something to read: the server closed it, or sent what nobody asked for."""
    try:
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class ReadBuffer:
    """The buffer the event loop reads an upstream connection's bytes into, one for all of a process's connections.

    A read fills it and is handed over (``Connection.buffer_updated``) in the same callback, before the loop reads
    anything else, so one buffer serves every connection. Without it, the TLS transport of uvloop (and of asyncio)
    decrypts each read into a new 256 KiB ``bytes`` shrunk to the read's size: a 256 KiB allocation per read,
    which under the relay's malloc settings (``llmtap.serve.heap``) would be a mapping made and unmade each time.
    """

    def __init__(self, size: int = READ_BYTES) -> None:
        self.view = memoryview(bytearray(size))

    def get(self, hint: int) -> memoryview:
        """A writable buffer of at least ``hint`` bytes (a larger one replaces it for good, which never happens
        under uvloop's or asyncio's TLS: they ask for what is pending, at most 256 KiB and a little more)."""
        if hint > len(self.view):
            self.view = memoryview(bytearray(hint))
        return self.view


#: The buffer every upstream connection of the process reads into.
BUFFER = ReadBuffer()


class Connection(Http11, asyncio.BufferedProtocol):
    """One upstream connection and the exchange running on it; body parts queue here until the relay reads them.

    The loop reads into the process's one ``ReadBuffer`` (``get_buffer``); ``buffer_updated`` copies the read out
    as ``bytes``, the object the rest reads as before (``data_received``)."""

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.idle = False
        self.closed = False
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        #: Watches the socket for a read on an idle connection (``usable``); None without a descriptor.
        self._poller: select.poll | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._reader: asyncio.Future[bool] | None = None
        #: The loop time by which the running ``wait_readable`` gives up (None outside one), and the timer that
        #: checks it (``_read_check``), kept from one wait to the next.
        self._read_due: float | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._writer: asyncio.Future[bool] | None = None
        self._writing_paused = False
        self._reading_paused = False
        self.active = False
        #: Parked in the pool since its last exchange: checked (``usable``) before the next is written.
        self.parked = False
        #: Exchanges begun on it, the current one included: a body knows by it whether its exchange is settled.
        self.exchanges = 0
        #: Where body parts go as they arrive (``Body.pipe``); None: they queue in ``parts``.
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

    async def exchange(
        self,
        head: bytes,
        content: bytes | Pieces | AsyncIterable[bytes],
        timeouts: Timeouts,
        leaving: Callable[[], None] | None,
        *,
        chunked: bool,
        head_only: bool,
    ) -> None:
        """One request on this connection, up to its response's head: the head and body written (``leaving``
        called just before the first byte), then the wait until the head is read. One call from the transport
        for the whole of it (raises what failed: the connection is then the caller's to release). An idle
        connection from the pool is checked first: ``Stale``, closed and nothing written, when it is not usable."""
        self.exchanges += 1
        if self.parked:
            self.parked = False
            if not self.usable():
                self.abort()
                raise Stale
        self.begin(head_only=head_only)
        if leaving is not None:
            leaving()
        if isinstance(content, bytes):
            self.write(head, content)  # one write: the head and a body already in memory
            self.sent_all = True
        elif isinstance(content, tuple):
            self.write(head)
            await self.send_pieces(content, timeouts)
        else:
            self.write(head)
            await self.send_stream(content, chunked=chunked, timeouts=timeouts)
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self.wait_readable(timeouts.get("read"))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self._poller = _poller(sock.fileno()) if sock is not None else None
        self.unkept = transport.get_extra_info("ssl_object")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self.active and not self.done and self.error is None:
            if isinstance(exc, ssl.SSLError) and self._head_bytes == 0:
                # TLS 1.3: the server checks our certificate after our side of the handshake is done, so
                # its refusal (an alert) comes in place of the response.
                self.error = ConnectFailed(tls.describe(exc))
            elif exc is not None:
                self.error = UpstreamReset(f"upstream reset the connection: {exc}")
            elif self.head_done and not self._chunked and self._remaining is None and not self._interim:
                self.done = True  # a body delimited by the end of the connection (RFC 9112 section 6.3, item 8)
            else:
                what = "mid-response" if self.head_done else "before the response headers"
                self.error = UpstreamClosed(f"upstream closed the connection {what}")
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

    def get_buffer(self, sizehint: int) -> memoryview:
        return BUFFER.get(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(BUFFER.view[:nbytes]))

    def data_received(self, data: bytes) -> None:
        """One read's bytes (``buffer_updated``): parsed, queued or handed to the sink."""
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

    async def carry(self, sink: Sink, seconds: float | None) -> None:
        """Hand the body to ``sink`` (``attach``) and wait until the response ends, fails or is held
        (``until_moved``): the relay's pipe starts its body in one call. A body that ended cleanly puts its
        connection back in the pool at once, as a body read to its end does (its ``Body`` sees it settled)."""
        self.attach(sink)
        await self.until_moved(seconds)
        if self.reusable():
            self.settle(kept=True)

    async def until_moved(self, seconds: float | None) -> None:
        """Under a sink: until the response ends, fails or is held; ``ReadTimeout`` once the socket
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
                    raise ReadTimeout(f"upstream sent nothing for {seconds:g} s")
                remaining = seconds - silence

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
            and not (self._poller is not None and _readable(self._poller))
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

    def settle(self, kept: bool | None = None) -> None:
        """The exchange is over: parked in the pool for the next when it ended cleanly (``reusable``; ``kept``: the
        caller asked already), else closed. A TLS connection's session goes to its context after its first exchange
        (``keep_session``)."""
        if self.unkept is not None:
            self.keep_session()
        if kept is None:
            kept = self.reusable()
        if kept:
            self.park()
        else:
            self.abort()
        self.pool.release(self, kept=kept)

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
        self.parked = True
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
            raise UpstreamClosed("upstream closed the connection before the request was sent")
        if len(more) > _JOINED_BYTES:
            self._transport.writelines((data, more))
        else:
            self._transport.write(data + more)

    async def send_pieces(self, pieces: Pieces, timeouts: Timeouts) -> None:
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

    async def send_stream(self, stream: AsyncIterable[bytes], *, chunked: bool, timeouts: Timeouts) -> None:
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
                raise WriteTimeout(f"upstream took no request body for {seconds:g} s")

    async def wait_readable(self, seconds: float | None) -> None:
        """Until the response moves on (a part, its end, an error); ``ReadTimeout`` after ``seconds``.

        This wait is every request's (its head), so it costs no timer of its own (one made and cancelled: 1.3 µs of
        CPU on uvloop) and no coroutine beside it: the connection keeps one timer, armed by the first wait and
        left running; a wait sets its deadline (``_read_due``), and the timer, when it fires, expires the wait
        only once that deadline has passed, else comes back at it (``_read_check``). A timer set for later than
        a wait's deadline is set again, earlier."""
        loop = self._loop
        waiter = self._reader = loop.create_future()
        if seconds is not None:
            due = self._read_due = loop.time() + seconds
            timer = self._read_timer
            if timer is None or timer.when() > due:
                if timer is not None:
                    timer.cancel()
                self._read_timer = loop.call_at(due, self._read_check)
        try:
            moved = await waiter
        finally:
            self._reader = None
            self._read_due = None
        if not moved:
            raise ReadTimeout(f"upstream sent nothing for {seconds:g} s")

    def _read_check(self) -> None:
        """The connection's read timer: expire the wait whose deadline passed, come back at one still to come;
        none waiting, it stops until the next wait arms it."""
        self._read_timer = None
        due = self._read_due
        if due is None or self.closed:
            return
        if self._loop.time() >= due:
            if self._reader is not None and not self._reader.done():
                self._reader.set_result(False)
        else:
            self._read_timer = self._loop.call_at(due, self._read_check)

    async def _until(self, waiter: asyncio.Future[bool], seconds: float | None) -> bool:
        if seconds is None:
            return await waiter
        timer = self._loop.call_later(seconds, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    def take(self) -> bytes:
        """The oldest queued body part; reading resumes once the queue has drained to half its bound."""
        part = self.parts.popleft()
        self._queued -= len(part)
        if self._reading_paused and self._queued <= QUEUE_BYTES // 2 and not self.closed:
            assert self._transport is not None
            self._transport.resume_reading()
            self._reading_paused = False
        return part

    def still_to_come(self) -> int | None:
        """Body bytes of the response not yet read when its body is counted by its Content-Length; None when it
        is not (chunked, or delimited by the connection's close) or its head is not in."""
        if not self.head_done or self._chunked:
            return None
        return self._remaining

    def take_whole(self) -> bytes:
        """The body of a response read whole (its parts joined), its connection back in the pool at once when the
        exchange ended cleanly (its ``Body`` sees it settled): the relay takes both in one call."""
        parts = self.parts
        if len(parts) > 1:
            part = b"".join(parts)
            parts.clear()
        else:
            part = parts.popleft() if parts else b""
        self._queued = 0
        if self.reusable():
            self.settle(kept=True)
        return part

    def attach(self, sink: Sink) -> None:
        """From now on each body part goes to ``sink`` in the read callback (those queued already, at once)."""
        self.heard = t = time.perf_counter()
        self.sink = sink
        parts = self.parts
        while parts:
            sink(t, parts.popleft())
        self._queued = 0
        if self._reading_paused:
            # Paused for a full queue before the pipe: the queue is gone (a hold by the sink keeps its own pause).
            self._reading_paused = False
            if not self.held and self._transport is not None and not self.closed:
                self._transport.resume_reading()
