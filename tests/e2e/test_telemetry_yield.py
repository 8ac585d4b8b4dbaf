"""The telemetry process yields the CPU to the relays: its worker threads run at SCHED_IDLE and its main
thread (the admin listener: health probes, scrapes) in the normal class, niced; and
when it cannot keep up at all (stopped), what the relay's channel cannot hold is dropped and counted while streams
go on undelayed."""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PATIENCE
from tests.support.procs import FaultUpstream, Llmtap, metric_value, upstream as upstream  # the fixture

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")

CHAT = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
DROPPED = "llmtap_telemetry_tapes_dropped_total"


def telemetry_pid(parent: int) -> int:
    """The telemetry process among ``parent``'s children (its ``comm``, cut to 15 bytes by Linux)."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == parent and comm == "llmtap-telemetr":
                return int(entry)
        time.sleep(0.05)
    raise AssertionError("no telemetry process")


def policies(pid: int) -> dict[int, int]:
    """The scheduling policy of every thread of ``pid``."""
    return {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def stream(client: httpx.Client, **headers: str) -> float:
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=CHAT, headers=headers) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            pass
    return time.perf_counter() - start


def test_telemetry_runs_at_sched_idle_and_niced_when_asked(upstream: FaultUpstream, tmp_path: Path) -> None:
    idle = Llmtap(upstream.url, tmp_path / "idle.log", env={"LLMTAP_TELEMETRY_SCHEDULING": "idle"})
    try:
        nice = Llmtap(upstream.url, tmp_path / "nice.log")  # the default
    except BaseException:
        idle.close()
        raise
    try:
        stream(idle.client, **{"x-chunks": "5"})  # the recorder's worker and the exporters' threads are running
        pid = telemetry_pid(idle.proc.pid)
        threads = policies(pid)
        # The main thread (its id is the process's) answers probes in the normal class, niced; every other
        # thread (the recorder's worker, the exporters') is at SCHED_IDLE.
        assert threads.pop(pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, idle.proc.pid) + 5
        assert len(threads) > 1 and set(threads.values()) == {os.SCHED_IDLE}, threads
        # The relay itself keeps the normal class.
        assert os.sched_getscheduler(idle.proc.pid) == os.SCHED_OTHER
        niced = telemetry_pid(nice.proc.pid)
        assert set(policies(niced).values()) == {os.SCHED_OTHER}
        assert os.getpriority(os.PRIO_PROCESS, niced) == os.getpriority(os.PRIO_PROCESS, nice.proc.pid) + 5
    finally:
        idle.close()
        nice.close()


def test_a_stopped_telemetry_process_costs_tapes_never_a_streams_time(upstream: FaultUpstream, tmp_path: Path) -> None:
    """Telemetry that keeps up with nothing (stopped): the relay drops what its channel cannot hold, and counts it."""
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log")
    pid = 0
    try:
        normal = {"x-chunks": "20", "x-gap-ms": "5"}
        stream(proxy.client, **normal)
        control = statistics.median(stream(proxy.client, **normal) for _ in range(5))
        pid = telemetry_pid(proxy.proc.pid)
        os.kill(pid, signal.SIGSTOP)
        # 40 MiB of tapes, past the 16 MiB the relay's channel holds: the rest is dropped, never waited for.
        for _ in range(10):
            stream(proxy.client, **{"x-fault": "flood", "x-fault-arg": str(4 << 20)})
        stopped = statistics.median(stream(proxy.client, **normal) for _ in range(5))
        assert stopped < 2 * control + 0.05, (stopped, control)
        os.kill(pid, signal.SIGCONT)
        pid = 0
        admin = f"http://127.0.0.1:{proxy.admin_port}/metrics"
        deadline = time.monotonic() + PATIENCE
        lost = 0.0
        while time.monotonic() < deadline:
            text = httpx.get(admin, timeout=5).text
            # Whole tapes (channel_full) or their bytes (partial: the timing kept, the stream read no further).
            lost = sum(metric_value(text, DROPPED, llmtap_telemetry_reason=r) for r in ("channel_full", "partial"))
            if lost > 0:
                break
            time.sleep(0.2)
        assert lost > 0, proxy.logs()
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        proxy.close()
