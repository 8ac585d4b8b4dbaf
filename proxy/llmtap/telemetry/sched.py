"""Where the telemetry process's threads run beside the relays on a shared core.

``nice`` (the default): every thread niced by ``NICE``; on a core the relays keep busy telemetry still gets a
share. ``idle``: every worker thread (the recorder's, the record writers', the exporters') runs at
SCHED_IDLE, the lowest class Linux has: on a core the relay shares with it, the relay always runs first and
telemetry takes only what the relay leaves. When that is not enough, the relay's channel fills and tapes are
dropped and counted (``llmtap_telemetry_tapes_dropped_total``), never a stream delayed. The main thread stays in
the normal class, niced by ``NICE``: it serves the admin listener (health probes, scrapes, the live view) and
takes the relays' tapes off the channel, little work that must answer in time even on a core the relays keep
busy (a liveness probe that waits behind the relays restarts the pod). ``idle`` is not the default: under load
that keeps every core busy its workers get next to no time (a 256 MiB stream that kept both cores busy lost its
tape, counted; on a fully loaded test machine, checks that wait for telemetry failed at random with it as the
default). ``normal``: no change. Where SCHED_IDLE is not permitted (another OS, a seccomp profile), ``idle``
becomes ``nice``.

A thread enters the class itself (``idle_here``) when it starts; threads the OpenTelemetry SDK starts are moved
once they exist (``idle_others``).

The class alone does not keep the relay's waits short. Once a telemetry thread has the core, Linux gives it back to a
runnable relay at its next scheduler tick (4 ms at HZ=250) or another wake-up: a relay that just ran is not yet eligible
when the kernel picks, and nothing makes it pick again sooner, SCHED_IDLE or niced alike. So, in ``idle`` and ``nice``,
the telemetry threads hand the core back themselves when a relay waits for it (``checkpoint``, at every tape message,
read played back, emitter, chunk span and span encoded): once the process has worked ``telemetry_yield`` microseconds
(500 by default; 0: never) since the last look, it reads the run state of each relay's event-loop thread
(``/proc/PID/task/PID/stat``, kept open: one ``pread``, about 4 µs) and calls ``sched_yield`` when one is runnable on
the CPU this thread is running on, so waiting behind it. A relay running on another CPU, or asleep, costs nothing but
the look. Measured with the whole tree on one core and 64 staggered keep-alive streams (``python -m
bench.probes.yield_cpu --staggered``, ``bench/archive/RESULTS-2026-12.md``): the relay's wait for the core each time it
ran fell from 0.06 to 0.08 ms to 0.01 to 0.02, and llmtap's added TTFT p99 from about 4 ms to under 2.2, at any interval
from 100 to 1,000 µs. The looks cost telemetry CPU while it is busy: about 15% more at 100 µs, 5% at 500
(``bench.probes.telemetry`` with a relay watched).

Only a waiting relay is yielded to. ``sched_yield`` hands the core to whatever else waits for it: an
earlier version yielded whenever the process might run on one CPU only, and on a test machine busy with other
processes, telemetry pinned to one CPU yielding every 100 µs to all of them recorded 1,972 of 2,004 small requests
in two minutes, where it takes a few seconds. Yielding to the relays only, telemetry gives up no more than the
relays' own work, which they would take from it at the next tick anyway.

The relays are the processes on the other end of the telemetry channel (``SO_PEERCRED``, ``watch``); a relay
in another PID namespace (its PID unknown here) is not watched, and the yields then never happen.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["MODES", "NICE", "apply", "checkpoint", "forget", "idle_here", "idle_others", "watch"]

MODES = ("idle", "nice", "normal")
#: How far the telemetry process's main thread (and every thread, in ``nice``) stands below the relays.
NICE = 5

_idle = False
#: Seconds of work between two looks at the relays (0: never), and when the next is due (``checkpoint``).
_every = 0.0
_next = 0.0
#: Each watched relay's PID and the open descriptor of its event-loop thread's ``stat``; replaced, never changed
#: in place, so that a thread reading it meanwhile sees a whole tuple.
_relays: tuple[tuple[int, int], ...] = ()
_relays_lock = threading.Lock()


def _cpu_reader() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu`` (a few hundred ns), or None where there is none."""
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu


_getcpu = _cpu_reader()


def _set_idle(tid: int = 0) -> bool:
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (OSError, AttributeError):
        return False
    return True


def _idle_permitted() -> bool:
    """Whether a thread of this process may enter SCHED_IDLE (tried on a thread of its own, which then ends)."""
    got: list[bool] = []
    probe = threading.Thread(target=lambda: got.append(_set_idle()), name="llmtap-sched-probe")
    probe.start()
    probe.join()
    return bool(got and got[0])


def apply(how: str, yield_us: int = 0) -> str:
    """Set this process's class as ``how`` says, from its main thread before other threads start; the mode got.

    In ``idle`` and ``nice``, on one CPU, ``checkpoint`` yields the core after ``yield_us`` microseconds of work
    (0: never).
    """
    global _idle, _every
    if how == "idle" and not _idle_permitted():
        how = "nice"
    if how in ("idle", "nice"):
        try:
            os.nice(NICE)
        except OSError:
            return "normal"
    _idle = how == "idle"
    _every = yield_us / 1e6 if how in ("idle", "nice") and _getcpu is not None else 0.0
    return how


def watch(pid: int) -> bool:
    """Watch relay ``pid``'s event-loop thread from now on (``checkpoint`` yields when it waits); False when its
    state cannot be read (gone, or in another PID namespace)."""
    if pid <= 0:
        return False
    try:
        fd = os.open(f"/proc/{pid}/task/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    _replace(pid, fd)
    return True


def forget(pid: int) -> None:
    """Stop watching relay ``pid`` (its channel closed)."""
    _replace(pid, None)


def _replace(pid: int, fd: int | None) -> None:
    """``pid``'s descriptor in the watched relays now ``fd`` (None: not watched); the one it had is closed."""
    global _relays
    with _relays_lock:
        old = [held for p, held in _relays if p == pid]
        kept = tuple((p, held) for p, held in _relays if p != pid)
        _relays = kept if fd is None else (*kept, (pid, fd))
    for stale in old:
        # A reader holding the old tuple may read this descriptor once more, or what reuses it: ``_waits`` takes
        # any error or unexpected content as "not waiting".
        os.close(stale)


def _waits(relays: tuple[tuple[int, int], ...], cpu: int) -> bool:
    """Whether one of ``relays`` is runnable on ``cpu``: on the CPU this thread holds, so queued behind it."""
    for _, fd in relays:
        try:
            stat = os.pread(fd, 1024, 0)
            # After the command's closing parenthesis: state (field 3), ... processor (field 39).
            fields = stat[stat.rindex(b")") + 2 :].split(None, 37)
            if fields[0] == b"R" and int(fields[36]) == cpu:
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def checkpoint() -> None:
    """Where telemetry work may pause: once the process has worked ``telemetry_yield`` since the last look, yields
    the core if a relay waits for it.

    Shared by the process's threads: the interpreter runs one at a time, so the time since the last look is the
    process's own uninterrupted stretch, near enough.
    """
    global _next
    if _every:
        now = time.perf_counter()
        if now >= _next:
            _next = now + _every
            relays = _relays
            if relays and _getcpu is not None and _waits(relays, _getcpu()):
                os.sched_yield()


def idle_here() -> None:
    """The calling worker thread enters SCHED_IDLE when the process runs ``idle``."""
    if _idle:
        _set_idle()


def idle_others() -> None:
    """Every thread of this process but the main one enters SCHED_IDLE when the process runs ``idle`` (the SDK's
    exporter threads, started where llmtap cannot reach)."""
    if not _idle:
        return
    main = threading.main_thread().native_id
    with contextlib.suppress(OSError):
        for entry in Path("/proc/self/task").iterdir():
            tid = int(entry.name)
            if tid != main:
                _set_idle(tid)
