"""The telemetry process hands the core back on its own (``llmtap.telemetry.sched.checkpoint``): a yield once it has
worked ``telemetry_yield`` microseconds since the last, in the ``idle`` and ``nice`` schedulings where it may run on one
CPU only, none in ``normal`` or on several CPUs.
What it buys a relay sharing the core is measured by ``python -m bench.yield_cpu``, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmtap.telemetry import sched
from tests.test_tape import event, play, tape_of


class Clock:
    """A ``perf_counter`` the test moves, and the yields ``checkpoint`` made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, every: float) -> None:
        self.now = 100.0
        self.yields = 0
        monkeypatch.setattr(sched, "_every", every)
        monkeypatch.setattr(sched, "_next", 0.0)
        monkeypatch.setattr("llmtap.telemetry.sched.time.perf_counter", lambda: self.now)
        monkeypatch.setattr("llmtap.telemetry.sched.os.sched_yield", self._yield)

    def _yield(self) -> None:
        self.yields += 1


def test_a_checkpoint_yields_once_per_interval_of_work(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch, every=100e-6)
    sched.checkpoint()
    assert clock.yields == 1  # the first stretch of work: due at once
    for _ in range(9):
        clock.now += 10e-6
        sched.checkpoint()
    assert clock.yields == 1  # 90 µs since: not yet
    clock.now += 10e-6
    sched.checkpoint()
    assert clock.yields == 2  # 100 µs
    clock.now += 5.0  # asleep for a while: the next checkpoint yields, once
    sched.checkpoint()
    sched.checkpoint()
    assert clock.yields == 3


def test_no_yield_when_the_interval_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch, every=0.0)
    for _ in range(100):
        clock.now += 1.0
        sched.checkpoint()
    assert clock.yields == 0


def test_playing_back_a_long_stream_pauses_at_every_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The playback of a tape is where a long stream's work is: a checkpoint per read, so a yield falls due within
    one read's work however long the stream."""
    reads = [event(f"w{i} ") for i in range(300)]
    _, messages = tape_of(reads)
    clock = Clock(monkeypatch, every=100e-6)
    ticking = sched.checkpoint

    def checkpoint() -> None:
        clock.now += 100e-6  # each read's work takes the whole interval
        ticking()

    monkeypatch.setattr("llmtap.telemetry.replay.checkpoint", checkpoint)
    tl = play(messages)
    assert len(tl.chunk_times) == 300
    assert clock.yields >= 300


@pytest.mark.parametrize(
    ("how", "cpus", "every"),
    [("nice", 1, 100e-6), ("idle", 1, 100e-6), ("normal", 1, 0.0), ("nice", 2, 0.0)],
)
def test_telemetry_yields_on_one_cpu_in_the_classes_that_yield(how: str, cpus: int, every: float) -> None:
    """``apply`` in a process of its own (its nice value cannot be undone), its affinity ``cpus`` CPUs: the interval as
    set on one CPU, none in ``normal`` or where it may run on several (a yield would hand its core to every other
    process there)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < cpus:
        pytest.skip(f"this machine lets the test run on {len(allowed)} CPU(s)")
    code = (
        f"import json, os; os.sched_setaffinity(0, {allowed[:cpus]!r}); from llmtap.telemetry import sched;"
        f"got = sched.apply({how!r}, 100); print(json.dumps([got, sched._every]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    got, interval = json.loads(done.stdout)
    assert got == how
    assert interval == pytest.approx(every)
