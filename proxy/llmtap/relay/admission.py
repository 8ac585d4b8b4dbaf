"""The optional admission queue: at most N requests in flight to an upstream, the rest wait in line.

First come, first served, with a bound on the line's length and, optionally, on the wait. The time a
request spends here is measured, not estimated: it is the proxy's own queue (DESIGN, "proxy queue").
Runs on the event loop; every operation is O(1) apart from skipping waiters that gave up.

The limit and the bound are the server's: with ``--workers N`` the relays keep each line's counts in their
shared table (``llmtap.relay.shared``), each relay its admitted requests, its waiters and when its first
waiter came. A request is admitted at once only when the server has a slot free and nobody waits in any
relay's line; a freed slot goes to the first waiter of the relay whose first waiter came first, handed
over by the relay that freed it when that waiter is its own, else taken by the waiter's relay, which looks
every ``POLL`` seconds while anyone waits in its line.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from llmtap.errors import LlmtapError
from llmtap.relay.shared import Table, line_columns

__all__ = ["POLL", "Admission", "QueueFull"]

#: Seconds between two looks at the other relays' lines while this relay has waiters (``--workers``).
POLL = 0.002


class QueueFull(LlmtapError):
    """The line is at its bound, or the wait passed its limit; the request is refused, not relayed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Admission:
    """A FIFO semaphore with a bounded line, one per route with ``max_concurrency``; shared by the relays of a
    server through ``table`` (the route's ``line_columns``), else this relay's alone."""

    def __init__(
        self, limit: int, queue_limit: int, timeout: float | None = None, *, table: Table | None = None, route: str = ""
    ) -> None:
        self.limit = limit
        self.queue_limit = queue_limit
        self.timeout = timeout
        columns = line_columns(route)
        if table is None or table.column(columns[0]) is None:
            table = Table(columns)
        self._table = table
        active, waiting, head = (table.column(c) for c in columns)
        assert active is not None and waiting is not None and head is not None
        self._active, self._waiting, self._head = active, waiting, head
        # This relay's line: each waiter and when it began waiting (``time.perf_counter_ns``).
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        """Requests this relay admitted that have not finished."""
        return self._table.mine(self._active)

    @property
    def waiting(self) -> int:
        """Requests in this relay's line now (a waiter that gave up is removed when it does)."""
        return len(self._waiters)

    @property
    def free(self) -> bool:
        """True when ``acquire`` would take a slot at once, without waiting."""
        table = self._table
        return not self._waiters and table.total(self._active) < self.limit and not any(table.cells(self._head))

    async def acquire(self) -> None:
        """Take a slot, waiting in line for one; raises ``QueueFull`` when the line cannot take us."""
        table = self._table
        with table.locked():
            if self.free:
                table.add(self._active, 1)
                return
            if table.total(self._waiting) >= self.queue_limit:
                raise QueueFull("queue_full")
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            came = time.perf_counter_ns()
            self._waiters.append((waiter, came))
            table.add(self._waiting, 1)
            if len(self._waiters) == 1:
                table.set(self._head, came)
        if table.rows > 1 and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch())
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
        for i, (other, _) in enumerate(self._waiters):
            if other is waiter:
                with self._table.locked():
                    del self._waiters[i]
                    self._table.add(self._waiting, -1)
                    if i == 0:
                        self._table.set(self._head, self._waiters[0][1] if self._waiters else 0)
                return

    def release(self) -> None:
        """Free a slot: the first in line takes it over directly, so nobody can jump the line."""
        with self._table.locked():
            self._table.add(self._active, -1)
            self._hand_over()

    def _hand_over(self) -> None:
        """Free slots to this relay's first waiters while theirs are the longest waits of the server (locked)."""
        table, waiters = self._table, self._waiters
        while waiters and table.total(self._active) < self.limit:
            came = waiters[0][1]
            if any(0 < head < came for head in table.cells(self._head)):
                return  # another relay's waiter came first: it takes the slot
            waiter, _ = waiters.popleft()
            table.add(self._waiting, -1)
            table.set(self._head, waiters[0][1] if waiters else 0)
            if not waiter.done():
                table.add(self._active, 1)
                waiter.set_result(None)

    async def _watch(self) -> None:
        """While this relay has waiters: take the slots other relays free (``POLL``)."""
        try:
            while self._waiters:
                await asyncio.sleep(POLL)
                with self._table.locked():
                    self._hand_over()
        finally:
            self._watcher = None
