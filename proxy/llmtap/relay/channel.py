"""The channel from the relay to the telemetry side: bounded, and it never makes a stream wait.

``send`` takes one encoded message (``llmtap.wire.messages``) and returns at once. When the other side falls behind,
the message is dropped and counted: a stream is never held up for its telemetry. Two kinds:

* ``LocalChannel``: the telemetry side in this process (tests, the demo, benchmarks: ``llmtap.serve.local``):
  the message goes straight into the recorder's bounded queue, played back on its thread; closing the channel
  closes the recorder.
* ``SocketChannel`` (``llmtap.wire.socketchannel``): the telemetry process, over a Unix socket, in frames; those
  sent in one turn of the event loop leave in one write. Bounded by the bytes waiting in the socket's write
  buffer; while the telemetry process is away, messages are dropped (counted) and the channel connects again.
  ``ShardedChannel``: one of those to each of several telemetry processes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from llmtap.wire.messages import Raw
from llmtap.wire.socketchannel import SocketChannel

__all__ = ["Channel", "LocalChannel", "ShardedChannel", "SocketChannel"]

log = logging.getLogger("llmtap.relay")


class Receiver(Protocol):
    """Where a local channel puts messages: the recorder's ``submit`` (False: its queue is full)."""

    def submit(self, message: Raw, source: int = 0) -> bool: ...

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every message so far is recorded; True when done in time."""
        ...

    def close(self, timeout: float = 5.0) -> None:
        """Record what waits (bounded by ``timeout``) and stop."""
        ...


class Channel(Protocol):
    """What the relay sends its tapes through."""

    @property
    def dropped(self) -> int:
        """Messages dropped so far because the telemetry side was full or away."""
        ...

    @property
    def shards(self) -> int:
        """How many telemetry processes take the messages (``send``'s ``shard`` is taken modulo this)."""
        ...

    def send(self, message: Raw, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        """Hand over one message; False when it was dropped. Never blocks, never raises.

        ``reserve``: a message that may use room kept back for it (a stream's end, its timing without bytes).
        ``shard``: which telemetry process takes it, where there are several (all of a stream's messages
        name the same one). ``at_once``: it may not wait for a gather (``telemetry_gather``): readiness.
        """
        ...

    async def aclose(self) -> None:
        """Hand over what waits and close."""
        ...


class LocalChannel:
    """The telemetry side in this process."""

    #: One recorder, in this process.
    shards = 1

    def __init__(self, sink: Receiver) -> None:
        self.sink = sink
        self.dropped = 0

    def send(self, message: Raw, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        """Into the recorder's queue, or dropped when it is full (at once: nothing here gathers, so ``at_once``
        changes nothing)."""
        if self.sink.submit(message):
            return True
        self.dropped += 1
        return False

    def flush(self, timeout: float) -> bool:
        """Wait (from another thread) until the recorder has recorded every message so far."""
        return self.sink.flush(timeout)

    async def aclose(self) -> None:
        """Drain and close the recorder (on a thread: it waits for its queue)."""
        await asyncio.to_thread(self.sink.close)


class ShardedChannel:
    """One socket channel to each of several telemetry processes; ``shard`` picks the one a message goes to."""

    def __init__(self, channels: list[SocketChannel]) -> None:
        self.channels = channels

    @property
    def dropped(self) -> int:
        """Messages dropped by any of the channels."""
        return sum(c.dropped for c in self.channels)

    @property
    def shards(self) -> int:
        """One per telemetry process."""
        return len(self.channels)

    async def start(self) -> None:
        """Connect every channel."""
        for channel in self.channels:
            await channel.start()

    def send(self, message: Raw, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        """Into the channel of telemetry process ``shard`` (modulo their number)."""
        return self.channels[shard % len(self.channels)].send(message, reserve=reserve, at_once=at_once)

    async def aclose(self) -> None:
        """Close every channel."""
        for channel in self.channels:
            await channel.aclose()
