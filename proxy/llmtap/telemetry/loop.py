"""The recorder's worker thread: it takes each item off the inbox and hands it to the recorder's dispatch.

Between items it keeps time for what is due (the server-span waits, the siblings' batches, the journal's
acknowledgements), plays the last run's journal back a slice at a time, emits what the recorder held
(``llmtap.telemetry.emit.batch``) once the queue is empty, and, idle, pushes record lines out and gives freed memory
back to the system. A flush marker is answered once everything before it is written; the stop signal ends it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Protocol

from llmtap.deadline import Deadline
from llmtap.telemetry import sched
from llmtap.telemetry.emit.batch import STAGED, Emission
from llmtap.telemetry.intake.inbox import STOP, Inbox, Marker

__all__ = ["REPLAY_EVERY", "Dispatch", "Worker"]

log = logging.getLogger("llmtap.telemetry")

#: Messages of the relays the worker takes between two slices of the last run's replay, when both wait.
REPLAY_EVERY = 64


class Dispatch(Protocol):
    """What the worker drives: the recorder."""

    def dispatch(self, source: int, item: Any) -> None:
        """Take one queued item."""

    def next_deadline(self) -> float | None:
        """When something is next due, or None."""

    def due(self) -> None:
        """Do what is due now."""

    def settle(self, *, write: bool) -> None:
        """Everything waiting goes out now (a flush, ``write``: and is written; the stop): what waits for a
        server span included."""

    def idle(self, *, trim: bool) -> None:
        """Nothing to take: push record lines out (and, ``trim``, give memory back)."""

    def replay(self) -> Any:
        """The last run's journal replay still under way, or None."""

    def take_replayed(self, replay: Any) -> None:
        """Take one slice of the last run's replay."""


class Worker:
    """One thread over ``inbox``; started on the first item (``start``)."""

    def __init__(self, inbox: Inbox, owner: Dispatch, emission: Emission) -> None:
        self.inbox = inbox
        self.owner = owner
        self.emission = emission
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread unless it runs."""
        if self.thread is not None:
            return
        with self._lock:
            if self.thread is None:
                # Published only once started: ``stop`` on another thread may join it at any moment.
                thread = threading.Thread(target=self._run, name="llmtap-recorder", daemon=True)
                thread.start()
                self.thread = thread

    def flush(self, timeout: float) -> bool:
        """Wait until every queued item is taken and written; True when it was in time."""
        if self.thread is None:
            return True
        done = threading.Event()
        try:
            self.inbox.queue.put(Marker(done), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def stop(self, timeout: float) -> bool:
        """Let the thread take what is queued, then stop it, within ``timeout`` seconds; False when it was still at
        work then (what it had not taken is still queued: ``Inbox.abandon``)."""
        if self.thread is None:
            return True
        deadline = Deadline(timeout)
        try:
            self.inbox.queue.put(STOP, timeout=timeout)
        except queue.Full:
            return False
        self.thread.join(deadline.left())
        return not self.thread.is_alive()

    def _run(self) -> None:
        sched.idle_here()
        self.emission.hold_here()
        try:
            self._work()
        finally:
            self.emission.stop_holding()

    def _work(self) -> None:
        taken = 0
        q = self.inbox.queue
        while True:
            if self.emission.held and (self.emission.held >= STAGED or q.empty()):
                self.emission.release()
            replay = self.owner.replay()
            if replay is not None and (q.empty() or taken >= REPLAY_EVERY):
                # The last run's tapes, a slice at a time: between the relays' messages, never before them all.
                taken = 0
                self.owner.take_replayed(replay)
                continue
            taken += 1
            if not self._take_one(q):
                return

    def _take_one(self, q: queue.Queue[Any]) -> bool:
        """Take the next item (or time out for what is due); False once the stop signal came."""
        deadline = self.owner.next_deadline()
        try:
            item = q.get() if deadline is None else q.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            # A wait ran out with nothing else to do: what it released is written now, not with the next request
            # (the record line included).
            self.owner.due()
            self.owner.idle(trim=False)
            return True
        if item is STOP:
            self.owner.settle(write=False)
            return False
        if isinstance(item, Marker):
            # Flushed means written: what waits for its server span is written as it is.
            self.owner.settle(write=True)
            item.event.set()
            return True
        source, message, size = item
        self.inbox.taken(size)
        try:
            self.owner.dispatch(source, message)
        except Exception:
            log.exception("telemetry: could not take a tape message")
        if deadline is not None and deadline <= time.monotonic():
            self.owner.due()
        sched.checkpoint()
        if q.empty():
            # Idle: push record lines out now, so ``llmtap compare`` can read a live file; and now and then give
            # what a backlog left free back to the system.
            self.owner.idle(trim=True)
        return True
