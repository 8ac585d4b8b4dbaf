"""The telemetry workers' base (``llmtap.worker``): bounds, what it counts, how it stops."""

from __future__ import annotations

import threading

from llmtap.worker import QueueWorker
from tests.conftest import PATIENCE


class Collect(QueueWorker[str]):
    """Takes nothing until ``gate`` opens, then serves its items one at a time into ``done``."""

    def __init__(self, *, max_items: int | None = None, max_bytes: int | None = None, restart: bool = False) -> None:
        super().__init__("llmtap-test-worker", max_items=max_items, max_bytes=max_bytes, restart=restart)
        self.gate = threading.Event()
        self.done: list[str] = []
        self.lost: list[tuple[str, str]] = []
        self.thread_names: list[str] = []

    def offer(self, item: str) -> bool:
        return self._put(item, len(item))

    def _serve(self) -> None:
        self.thread_names.append(threading.current_thread().name)
        self.gate.wait(PATIENCE)
        for item in self._items():
            self.done.append(item)

    def _dropped(self, items: list[str], why: str) -> None:
        self.lost += [(item, why) for item in items]


def test_past_either_bound_an_item_is_refused_and_counted_never_waited_for() -> None:
    by_count = Collect(max_items=3)
    assert all(by_count.offer(item) for item in ("a", "b", "c"))
    assert not by_count.offer("d") and by_count.lost == [("d", "full")] and by_count.queued == 3
    by_bytes = Collect(max_bytes=10)
    assert by_bytes.offer("aaaa") and by_bytes.offer("bbbbbb")  # 10 bytes: at the bound, not past it
    assert not by_bytes.offer("c") and by_bytes.lost == [("c", "full")]
    for w in (by_count, by_bytes):
        w.gate.set()
        assert w._stop(PATIENCE)
    assert by_count.done == ["a", "b", "c"] and by_bytes.done == ["aaaa", "bbbbbb"]
    assert by_count.thread_names == ["llmtap-test-worker"]


def test_close_waits_its_deadline_and_counts_what_is_left() -> None:
    w = Collect()
    for i in range(5):
        assert w.offer(f"r{i}")
    assert not w._stop(0.2)  # the gate is shut: the thread cannot finish in time
    assert w.lost == [(f"r{i}", "unsent") for i in range(5)] and w.queued == 0
    assert not w.offer("late") and w.lost[-1] == ("late", "closed")
    w.gate.set()
    assert w._thread is not None
    w._thread.join(PATIENCE)
    assert not w._alive() and w.done == []


def test_a_restartable_worker_serves_again_after_close() -> None:
    w = Collect(restart=True)
    w.gate.set()
    assert w.offer("one")
    assert w._stop(PATIENCE)
    assert w.offer("two")
    assert w._stop(PATIENCE)
    assert w.done == ["one", "two"] and len(w.thread_names) == 2 and not w.lost
