"""The telemetry process hands the core back on its own (``llmtap.telemetry.sched.checkpoint``): once it has worked
``telemetry_yield`` microseconds since the last look, a yield if a relay waits for the CPU it runs on, in the ``idle``
and ``nice`` schedulings; none in ``normal``, none while no relay waits there.
What it buys a relay sharing the core is measured by ``python -m bench.probes.yield_cpu``, not here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from llmtap.telemetry import sched
from llmtap.telemetry.process import _Intake, peer_pid
from tests.wire.test_tape import event, play, tape_of


class Clock:
    """A ``perf_counter`` the test moves, and the yields ``checkpoint`` made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, every: float) -> None:
        self.now = 100.0
        self.yields = 0
        self.looks = 0
        #: Whether a relay waits for this thread's CPU at the next look.
        self.waiting = True
        monkeypatch.setattr(sched, "_every", every)
        monkeypatch.setattr(sched, "_next", 0.0)
        monkeypatch.setattr(sched, "_relays", ((1, -1),))
        monkeypatch.setattr(sched, "_waits", self._waits)
        monkeypatch.setattr("llmtap.telemetry.sched.time.perf_counter", lambda: self.now)
        monkeypatch.setattr("llmtap.telemetry.sched.os.sched_yield", self._yield)

    def _waits(self, relays: Any, cpu: int) -> bool:
        self.looks += 1
        return self.waiting

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
    assert clock.looks == 0


def test_no_yield_while_no_relay_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The look is made once per interval; the core is handed over only when it finds a relay waiting."""
    clock = Clock(monkeypatch, every=100e-6)
    clock.waiting = False
    for _ in range(10):
        clock.now += 100e-6
        sched.checkpoint()
    assert (clock.looks, clock.yields) == (10, 0)
    clock.waiting = True
    clock.now += 100e-6
    sched.checkpoint()
    assert (clock.looks, clock.yields) == (11, 1)


def test_no_look_without_a_watched_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch, every=100e-6)
    monkeypatch.setattr(sched, "_relays", ())
    for _ in range(10):
        clock.now += 1.0
        sched.checkpoint()
    assert (clock.looks, clock.yields) == (0, 0)


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

    monkeypatch.setattr("llmtap.telemetry.intake.replay.checkpoint", checkpoint)
    tl = play(messages)
    assert len(tl.chunk_times) == 300
    assert clock.yields >= 300


@pytest.mark.parametrize(
    ("how", "cpus", "every"),
    [("nice", 1, 100e-6), ("idle", 1, 100e-6), ("normal", 1, 0.0), ("nice", 2, 100e-6)],
)
def test_telemetry_yields_in_the_classes_that_yield(how: str, cpus: int, every: float) -> None:
    """``apply`` in a process of its own (its nice value cannot be undone), its affinity ``cpus`` CPUs: the interval as
    set, on one CPU or several (a relay waits behind telemetry only on the CPU telemetry holds), none in ``normal``."""
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


#: Run in a process of its own (it pins itself): whether ``_waits`` finds a relay (here a child process) waiting
#: behind this thread, for each of the child's states. Prints JSON.
WAITS = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from llmtap.telemetry import sched
    allowed = sorted(os.sched_getaffinity(0))
    here = allowed[0]
    os.sched_setaffinity(0, {here})
    spin = "import time\\nwhile True: pass"
    def child(code, cpu):
        p = subprocess.Popen([sys.executable, "-c", code])
        os.sched_setaffinity(p.pid, {cpu})
        time.sleep(0.3)
        return p
    out = {}
    cases = [("same_cpu_spinning", spin, here), ("asleep", "import time; time.sleep(60)", here)]
    if len(allowed) > 1:
        cases.append(("other_cpu_spinning", spin, allowed[1]))
    for name, code, cpu in cases:
        p = child(code, cpu)
        try:
            assert sched.watch(p.pid)
            seen = [sched._waits(sched._relays, sched._getcpu()) for _ in range(20)]
            out[name] = sum(seen)
            sched.forget(p.pid)
            out[name + "_forgotten"] = sched._relays == ()
        finally:
            p.kill()
            p.wait()
    out["gone"] = sched.watch(p.pid)
    print(json.dumps(out))
    """
)


def test_a_relay_runnable_on_this_cpu_is_seen_waiting_and_no_other() -> None:
    """Real processes, real ``/proc``: a child spinning on the CPU this thread holds is runnable and waits (every look
    says so); asleep, or spinning on another CPU, it does not wait for this one; a process gone cannot be watched."""
    if sched._getcpu is None:
        pytest.skip("no sched_getcpu in this C library")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sched.__file__).parents[2]), *sys.path])}
    done = subprocess.run([sys.executable, "-c", WAITS], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["same_cpu_spinning"] == 20
    assert got["asleep"] == 0
    assert got.get("other_cpu_spinning", 0) == 0
    assert got["same_cpu_spinning_forgotten"] and got["asleep_forgotten"]
    assert got["gone"] is False


class _Receiver:
    """What the intake hands messages to: here, only whether its relay went."""

    def __init__(self) -> None:
        self.gone: list[int] = []
        self.spool = None  # no record journal: the intake takes reads straight to the queue

    def submit(self, message: Any, source: int = 0) -> bool:
        return True

    def submit_all(self, messages: Any, source: int = 0) -> None:
        """Taking messages is not this test's."""

    def relay_ready(self, source: int, ready: bool) -> None:
        """Readiness is not this test's."""

    def relay_gone(self, source: int) -> None:
        self.gone.append(source)


def test_the_intake_watches_the_relay_on_the_other_end(tmp_path: Path) -> None:
    """A relay's channel connects: its process (here this one, by ``SO_PEERCRED``) is watched until it closes."""

    async def scenario() -> tuple[int, bool, bool, list[int]]:
        loop = asyncio.get_running_loop()
        receiver = _Receiver()
        intakes: list[_Intake] = []

        def intake() -> _Intake:
            made = _Intake(receiver, 0, set())
            intakes.append(made)
            return made

        path = str(tmp_path / "channel.sock")
        server = await loop.create_unix_server(intake, path=path)
        _, writer = await asyncio.open_unix_connection(path)
        for _ in range(100):
            if intakes and intakes[0]._transport is not None:
                break
            await asyncio.sleep(0.01)
        transport = intakes[0]._transport
        assert transport is not None
        pid = peer_pid(transport)
        watched = any(p == os.getpid() for p, _ in sched._relays)
        writer.close()
        for _ in range(100):
            if receiver.gone:
                break
            await asyncio.sleep(0.01)
        server.close()
        await server.wait_closed()
        return pid, watched, any(p == os.getpid() for p, _ in sched._relays), receiver.gone

    pid, watched, still, gone = asyncio.run(scenario())
    assert pid == os.getpid()
    assert watched
    assert gone == [0]
    assert not still
