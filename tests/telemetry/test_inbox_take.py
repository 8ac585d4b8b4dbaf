"""The worker takes what the inbox holds at once: in order, no more than asked, waiting for the first."""

from __future__ import annotations

import threading
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llmtap.config.types import Settings, TelemetrySettings
from llmtap.telemetry.recorder import Recorder
from tests.telemetry.test_recorder import ROUTES


def recorder() -> tuple[Recorder, MeterProvider]:
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    return Recorder(
        Settings(routes=ROUTES, telemetry=TelemetrySettings(queue_size=8)), meter_provider=provider
    ), provider


def test_take_gives_the_queued_items_in_order_up_to_most() -> None:
    rec, provider = recorder()
    try:
        q = rec.inbox.queue  # nothing submitted: the worker is not started, the test takes
        for i in range(5):
            q.put_nowait((0, f"m{i}", i))
        assert rec.inbox.take(3, 0.0) == [(0, "m0", 0), (0, "m1", 1), (0, "m2", 2)]
        assert rec.inbox.take(64, 0.0) == [(0, "m3", 3), (0, "m4", 4)]
        assert q.empty()
        started = time.monotonic()
        assert rec.inbox.take(64, 0.05) == []  # the wait runs out
        assert time.monotonic() - started >= 0.04
    finally:
        rec.close()
        provider.shutdown()


def test_take_waits_for_the_first_item_and_frees_room_for_a_waiting_producer() -> None:
    rec, provider = recorder()
    try:
        q = rec.inbox.queue
        while not q.full():
            q.put_nowait((0, "filler", 0))
        put = threading.Event()

        def producer() -> None:
            q.put((0, "late", 0), timeout=30)  # waits for room
            put.set()

        thread = threading.Thread(target=producer)
        thread.start()
        room = q.maxsize
        taken = rec.inbox.take(room, None)
        assert len(taken) == room
        assert put.wait(30)  # woken by the take, not by a timeout
        thread.join(30)
        assert rec.inbox.take(room, None) == [(0, "late", 0)]  # waited for nothing: it was there
    finally:
        rec.close()
        provider.shutdown()
