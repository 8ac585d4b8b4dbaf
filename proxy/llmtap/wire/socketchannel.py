"""A channel to a telemetry process over a Unix socket: bounded, reconnecting, and it never makes its caller wait.

The relays send their tapes through one (``llmtap.relay.channel``), the telemetry processes their lessons to one
another (``llmtap.telemetry.fleet.siblings``). Messages go in frames (``llmtap.wire.framing``); those sent in one turn
of the event loop leave in one write, or, with ``gather``, those sent within that many seconds of the first. Bounded by
the bytes waiting in the socket's write buffer and here; while the other process is away, messages are dropped (counted)
and the channel connects again.

Why gather: the telemetry process wakes for each write it reads. Woken for each finished stream's tape (one every 16 ms
at 64 streams of one second each), a process that idles in between runs its work cold, at nearly twice the CPU a chunk
it spends on the same tapes taken together (``bench.probes.telemetry --pace``); a relay that gathers for 50 ms cut the
telemetry process's CPU a chunk by a sixth (``bench.probes.relay_cpu``, ``bench/archive/RESULTS-2026-12.md``). Gathering
costs the records and metrics that delay; what must not wait (a relay's change of readiness) is sent ``at_once``, and
everything gathered before it leaves with it, in order. With several relays the relay process gathers nothing
(``llmtap.serve.relay``): two relays' gathers would reorder their tapes by up to the gather.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import cast

from llmtap.wire.framing import encode_frames
from llmtap.wire.messages import Raw, WireError

__all__ = ["CLOSE_WAIT", "CONNECT_WAIT", "GATHER_BYTES", "RECONNECT_EVERY", "SOCKET_BUFFER_LIMIT", "SocketChannel"]

log = logging.getLogger("llmtap.relay")

#: Bytes that may wait for the telemetry process before messages are dropped.
SOCKET_BUFFER_LIMIT = 16 * 1024 * 1024
#: Bytes past which what a gather holds leaves at this turn's end: a gather is for many small tapes, and a fast
#: long stream's segments (32 KiB each) would otherwise wait in the relay's memory by the megabyte.
GATHER_BYTES = 256 * 1024
#: Seconds between two attempts to reach the telemetry process.
RECONNECT_EVERY = 0.5
#: How long the relay waits for the telemetry process at start, and for its last writes at the end.
CONNECT_WAIT = 10.0
CLOSE_WAIT = 5.0


class SocketChannel(asyncio.Protocol):
    """The telemetry process at ``path``; connects on ``start`` and again whenever the connection is lost."""

    #: One telemetry process at the other end.
    shards = 1

    def __init__(
        self, path: str, *, limit: int = SOCKET_BUFFER_LIMIT, gather: float = 0.0, quiet: bool = False
    ) -> None:
        self.path = path
        self.limit = limit
        self.gather = gather
        # ``quiet``: the other end going away is said at debug level only (a sibling telemetry process: the parent
        # says when one dies, and at shutdown they all go).
        self._warn = log.debug if quiet else log.warning
        self.dropped = 0
        self._transport: asyncio.WriteTransport | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._pending_messages = 0
        #: A frame past ``GATHER_BYTES`` waits: the next write leaves the frames as they are, not joined.
        self._large = False
        #: The write to come (a handle of the event loop), and whether it is a gather's (later than this turn).
        self._flush_due: asyncio.Handle | None = None
        self._gathering = False
        self._closing = False
        self._connector: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()
        #: Called each time the connection is made (again): a telemetry process started anew knows nothing of what
        #: the relay reported to the one before (its counts are absolute: the relay sends them again).
        self.on_connected: Callable[[], None] | None = None

    async def start(self) -> None:
        """Connect (retrying for up to ``CONNECT_WAIT`` seconds) and keep the connection up from then on."""
        self._connector = asyncio.create_task(self._keep_connected())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONNECT_WAIT):
                await self._connected.wait()
        if self._transport is None:
            self._warn("telemetry process at %s not reachable yet; telemetry is dropped until it is", self.path)

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        warned = False
        while not self._closing:
            if self._transport is None:
                try:
                    await loop.create_unix_connection(lambda: self, self.path)
                except OSError as exc:
                    if not warned and self._connected.is_set():
                        self._warn("telemetry process unreachable (%s); telemetry is dropped meanwhile", exc)
                        warned = True
                else:
                    warned = False
            await asyncio.sleep(RECONNECT_EVERY)

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Connected: messages flow from now on."""
        # uvloop's transports implement WriteTransport without subclassing it.
        self._transport = cast(asyncio.WriteTransport, transport)
        self._lost.clear()
        self._connected.set()
        if self.on_connected is not None:
            self.on_connected()

    def connection_lost(self, exc: Exception | None) -> None:
        """The telemetry process went away: drop until it is back."""
        self._transport = None
        self._lost.set()
        if not self._closing:
            self._warn("lost the connection to the telemetry process at %s; reconnecting", self.path)

    def data_received(self, data: bytes) -> None:
        """The telemetry process sends nothing back."""

    # -- the relay's side ---------------------------------------------------------------------

    def send(self, message: Raw, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        """Queue one message for the next write, or drop it when the buffer is full or nobody listens.

        A ``reserve`` message may use another quarter of the bound: so a stream whose bytes no longer fit
        can still send its timing. An ``at_once`` message leaves at this turn's end, with all that waits.
        """
        transport = self._transport
        try:
            parts = encode_frames(message)
        except WireError:
            log.exception("telemetry: a tape could not be encoded")
            self.dropped += 1
            return False
        size = sum(map(len, parts))
        limit = self.limit + (self.limit >> 2 if reserve else 0)
        if transport is None or transport.get_write_buffer_size() + self._pending_bytes + size > limit:
            self.dropped += 1
            return False
        self._pending.extend(parts)
        self._pending_bytes += size
        self._pending_messages += 1
        if size > GATHER_BYTES:
            self._large = True
        due = self._flush_due
        if due is None or self._gathering:
            soon = at_once or not self.gather or self._pending_bytes >= GATHER_BYTES
            if due is None or soon:
                if due is not None:
                    due.cancel()
                loop = asyncio.get_running_loop()
                self._flush_due = loop.call_soon(self._flush) if soon else loop.call_later(self.gather, self._flush)
                self._gathering = not soon
        return True

    def _flush(self) -> None:
        if self._flush_due is not None:
            self._flush_due.cancel()  # when called before it was due (``aclose``)
            self._flush_due = None
            self._gathering = False
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        large, self._large = self._large, False
        messages, self._pending_messages = self._pending_messages, 0
        transport = self._transport
        if transport is None or not pending:
            self.dropped += messages
            return
        if large:
            # A frame of megabytes (a request body the tape carries) is not copied into one buffer with the rest.
            transport.writelines(pending)
        else:
            transport.write(b"".join(pending))

    async def aclose(self) -> None:
        """Write what waits (for up to ``CLOSE_WAIT`` seconds) and close."""
        self._flush()
        self._closing = True
        if self._connector is not None:
            self._connector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connector
        transport = self._transport
        if transport is None:
            return
        # Closing a transport writes out what it buffered first; the connection is lost once it did.
        transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT):
                await self._lost.wait()
        if not self._lost.is_set():
            transport.abort()
