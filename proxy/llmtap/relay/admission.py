"""The optional admission queue: at most N requests in flight to an upstream, the rest wait in line.

First come, first served, with a bound on the line's length and, optionally, on the wait. The time a
request spends here is measured, not estimated: it is the proxy's own queue (DESIGN, "proxy queue").
Runs on the event loop; every operation is O(1) apart from skipping waiters that gave up.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Admission", "QueueFull"]


class QueueFull(Exception):
    """The line is at its bound, or the wait passed its limit; the request is refused, not relayed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Admission:
    """A FIFO semaphore with a bounded line, one per route with ``max_concurrency``."""

    def __init__(self, limit: int, queue_limit: int, timeout: float | None = None) -> None:
        self.limit = limit
        self.queue_limit = queue_limit
        self.timeout = timeout
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Requests in line now (a waiter that gave up is removed when it does)."""
        return len(self._waiters)

    @property
    def free(self) -> bool:
        """True when ``acquire`` would take a slot at once, without waiting."""
        return self.active < self.limit and not self._waiters

    async def acquire(self) -> None:
        """Take a slot, waiting in line for one; raises ``QueueFull`` when the line cannot take us."""
        if self.free:
            self.active += 1
            return
        if len(self._waiters) >= self.queue_limit:
            raise QueueFull("queue_full")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            if self.timeout is None:
                await waiter
            else:
                await asyncio.wait_for(asyncio.shield(waiter), self.timeout)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed to us just as we gave up: pass it on.
                self.release()
            else:
                waiter.cancel()
                self._remove(waiter)
            if isinstance(exc, TimeoutError):
                raise QueueFull("queue_timeout") from None
            raise

    def _remove(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def release(self) -> None:
        """Free a slot: the first in line takes it over directly, so nobody can jump the line."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1
