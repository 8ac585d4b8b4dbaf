"""A bounded queue and the one daemon thread that serves it: the shape of every telemetry worker (the span
forwarder, the record files' closer, the ClickHouse sink).

The caller's side never blocks: ``_put`` queues an item or, past the bound (items or bytes) or once closed,
refuses it and hands it to ``_dropped`` to be counted. The thread starts with the first item (or at once), and
runs ``on_thread`` before it serves anything (the telemetry process moves it to its scheduling class there,
``llmtap.telemetry.sched.idle_here``). ``_stop`` closes
the queue, gives the thread ``timeout`` seconds to finish, and hands what is still waiting to ``_dropped``.

A subclass writes ``_serve`` (the thread's loop, which returns once ``_closed`` is set and it is done): over
``_items()`` one at a time, or with the condition ``_cond`` and ``_queue`` (items with their sizes, oldest first)
as a batching one does; and says what it counts in ``_dropped``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Progress", "QueueWorker"]

T = TypeVar("T")


class Progress:
    """How far a record sink got with what it was given: the records it holds, oldest first, until each is settled
    (sent, or dropped and counted); ``settled`` counts the first records given that are all settled.

    The record journal (``llmtap.telemetry.journal.spool``) reads it to know which records every sink has. One thread
    gives (``hold``, ``settle_now``, ``withdraw``: the recorder's worker, which also reads ``settled``); any thread may
    ``release`` the oldest held in the order they were given (a sink's own thread, as it sends them).
    """

    __slots__ = ("_held", "given")

    def __init__(self) -> None:
        #: Records given so far.
        self.given = 0
        self._held: deque[int] = deque()

    def hold(self) -> None:
        """One more record given, held until it is released."""
        self._held.append(self.given)  # before ``given`` moves: ``settled`` must never pass it
        self.given += 1

    def settle_now(self) -> None:
        """One more record given, settled at once (dropped and counted, or written in the same call)."""
        self.given += 1

    def withdraw(self) -> None:
        """The record just held was refused after all (dropped and counted): settled."""
        self._held.pop()

    def release(self, n: int) -> None:
        """The ``n`` oldest held records are settled."""
        for _ in range(n):
            try:
                self._held.popleft()
            except IndexError:
                return

    @property
    def settled(self) -> int:
        """How many of the first records given are settled, all of them."""
        try:
            return self._held[0]
        except IndexError:
            return self.given

    @property
    def held(self) -> int:
        """Records given and not settled yet."""
        return len(self._held)


class QueueWorker(Generic[T]):
    """A queue bounded by ``max_items`` and ``max_bytes`` (None: no bound) and the daemon thread ``name``.

    ``start``: the thread starts now rather than with the first item; ``restart``: after ``_stop`` the queue
    opens again, and the next item starts a new thread; ``on_thread``: called first on every thread it starts.
    """

    def __init__(
        self,
        name: str,
        *,
        max_items: int | None = None,
        max_bytes: int | None = None,
        start: bool = False,
        restart: bool = False,
        on_thread: Callable[[], None] | None = None,
    ) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._name = name
        self._restart = restart
        self._on_thread = on_thread
        self._cond = threading.Condition()
        self._queue: deque[tuple[T, int]] = deque()
        self._bytes = 0
        self._closed = False
        #: Items ever queued.
        self._put_count = 0
        self._thread: threading.Thread | None = None
        if start:
            with self._cond:
                self._start()

    @property
    def queued(self) -> int:
        """Items waiting now."""
        with self._cond:
            return len(self._queue)

    def _put(self, item: T, size: int = 0) -> bool:
        """Queue ``item`` (``size`` bytes) and wake the thread if ``_wake_now`` says so; False, and the item
        handed to ``_dropped`` as ``full`` (or ``closed``), when it cannot wait."""
        with self._cond:
            if self._closed:
                refused = "closed"
            elif (self.max_items is not None and len(self._queue) >= self.max_items) or (
                self.max_bytes is not None and self._bytes + size > self.max_bytes
            ):
                refused = "full"
            else:
                self._queue.append((item, size))
                self._bytes += size
                self._put_count += 1
                if self._thread is None:
                    self._start()
                if self._wake_now():
                    self._cond.notify()
                return True
        self._dropped([item], refused)
        return False

    def _pop(self, n: int = 1) -> list[T]:
        """Take the ``n`` oldest items off the queue (the caller holds ``_cond``)."""
        out: list[T] = []
        for _ in range(min(n, len(self._queue))):
            item, size = self._queue.popleft()
            self._bytes -= size
            out.append(item)
        return out

    def _items(self) -> Iterator[T]:
        """For ``_serve``: the items one at a time, oldest first, waiting for each; ends once the queue is closed
        and empty."""
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                (item,) = self._pop()
            yield item

    def _stop(self, timeout: float) -> bool:
        """Close the queue, wake the thread and wait ``timeout`` seconds for it; what still waits then is handed
        to ``_dropped`` as ``unsent``. True when the thread is done (or never ran)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        finished = thread is None or not thread.is_alive()
        with self._cond:
            left = self._pop(len(self._queue))
            if self._restart and finished:
                self._closed = False
                self._thread = None
        if left:
            self._dropped(left, "unsent")
        return finished

    def _alive(self) -> bool:
        """The thread runs."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._on_thread is not None:
            self._on_thread()
        self._serve()

    # -- what a subclass says --

    def _serve(self) -> None:
        """The thread's loop; returns once ``_closed`` is set and it is done."""
        raise NotImplementedError

    def _wake_now(self) -> bool:
        """Whether the item just queued wakes the thread (``_cond`` held); by default every one does."""
        return True

    def _dropped(self, items: list[T], why: str) -> None:
        """Count ``items`` lost: ``full`` or ``closed`` (refused by ``_put``), ``unsent`` (left at ``_stop``)."""
