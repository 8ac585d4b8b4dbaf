"""The connections to one upstream host and port: at most a limit, busy and idle together, waited for in order."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from llmtap.relay.upstream.errors import PoolTimeout

if TYPE_CHECKING:
    from llmtap.relay.upstream.connection import Connection

__all__ = ["Pool"]


class Pool:
    """The connections to one host and port: at most ``limit``, busy and idle together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.idle: list[Connection] = []
        self.connections: set[Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, seconds: float | None) -> Connection | None:
        """An idle connection, or None when a slot for a new one is reserved; ``PoolTimeout`` when none frees.
        The idle connection is checked as its exchange begins (``Connection.exchange``; ``drop`` when unfit)."""
        while True:
            conn = self.take_idle()
            if conn is not None:
                return conn
            if self.size < self.limit:
                self.size += 1
                return None
            await self._wait(seconds)

    def take_idle(self) -> Connection | None:
        """An idle connection, the most recently used (the likeliest to be open), without waiting; None when
        none is idle (``acquire`` then reserves a slot or waits)."""
        if not self.idle:
            return None
        conn = self.idle.pop()
        conn.idle = False
        return conn

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
                raise PoolTimeout(f"no upstream connection free within {seconds:g} s") from None
            raise

    def _next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def added(self, conn: Connection) -> None:
        self.connections.add(conn)

    def unreserve(self) -> None:
        """A reserved slot whose connection was never made."""
        self.size -= 1
        self._next()

    def release(self, conn: Connection, *, kept: bool) -> None:
        """An exchange is over (``Connection.settle``): its connection goes back idle when kept, else it is gone."""
        if kept:
            conn.idle = True
            self.idle.append(conn)
        else:
            self._forget(conn)
        if self._waiters:
            self._next()

    def drop(self, conn: Connection) -> None:
        """An idle connection taken and found unfit (closed by then): its slot is free for the taker."""
        self._forget(conn)

    def lost(self, conn: Connection) -> None:
        """An idle connection the server closed."""
        if conn in self.idle:
            self.idle.remove(conn)
            conn.idle = False
            self._forget(conn)
            self._next()

    def _forget(self, conn: Connection) -> None:
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
