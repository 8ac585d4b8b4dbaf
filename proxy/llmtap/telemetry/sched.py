"""Where the telemetry process's threads run beside the relays on a shared core (issue 29).

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

The class alone does not keep the relay's waits short. Once a telemetry thread has the core, Linux gives it
back to a runnable relay at its next scheduler tick (4 ms at HZ=250) or another wake-up: a relay that just ran
is not yet eligible when the kernel picks, and nothing makes it pick again sooner, SCHED_IDLE or niced alike.
So with ``telemetry_yield`` set (100 µs for a one-core sidecar whose core is its own), in ``idle`` and ``nice``,
where the process may run on one CPU only (its affinity: ``taskset``, a container given one CPU of its own),
the telemetry threads hand the core back themselves (``checkpoint``, at every tape message, read played back,
emitter, chunk span and span encoded): a ``sched_yield`` once the process has worked that long since its last,
about 1 µs each. A yield with nobody waiting returns at once. Measured with the whole tree on one core and 64
staggered keep-alive streams: the relay's average wait each time it woke, 1.1 to 1.3 ms without and 0.13 to
0.21 ms with (``perf sched``), and llmtap's added median TTFT about halved (``python -m bench.yield_cpu
--staggered``, ``bench/RESULTS.md``).

Off by default, and never where the process may run on several CPUs: a yield hands the core to whatever else
waits for it, every other process there too, each time. On a test machine busy with other processes, telemetry
pinned to one CPU and yielding every 100 µs recorded 1,972 of 2,004 small requests in two minutes, where it takes
a few seconds, and a soak run's telemetry fell behind (its spans dropped, its memory up 24%). Yielding only while
a relay waits would need the relays' run states (``/proc/PID/stat``), read every interval: not built.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

__all__ = ["MODES", "NICE", "apply", "checkpoint", "idle_here", "idle_others"]

MODES = ("idle", "nice", "normal")
#: How far the telemetry process's main thread (and every thread, in ``nice``) stands below the relays.
NICE = 5

_idle = False
#: Seconds of work between two yields of the core (0: none), and when the next is due (``checkpoint``).
_every = 0.0
_next = 0.0


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
    _every = yield_us / 1e6 if how in ("idle", "nice") and _one_cpu() else 0.0
    return how


def _one_cpu() -> bool:
    """Whether this process may run on one CPU only (its affinity), which it then shares with the relays."""
    try:
        return len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):
        return False


def checkpoint() -> None:
    """Where telemetry work may pause: yields the core when the process has worked long enough since it last did.

    Shared by the process's threads: the interpreter runs one at a time, so the time since the last yield is the
    process's own uninterrupted stretch, near enough.
    """
    global _next
    if _every:
        now = time.perf_counter()
        if now >= _next:
            os.sched_yield()
            _next = now + _every


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
