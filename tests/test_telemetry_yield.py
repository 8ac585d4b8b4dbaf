"""The telemetry process yields the CPU to the relays (issue 29): it runs at SCHED_IDLE, every thread of it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PATIENCE
from tests.procs import FaultUpstream, upstream as upstream  # the fixture
from tests.test_otlp import Llmtap

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
    idle = Llmtap(upstream.url, tmp_path / "idle.log", {"OTEL_TRACES_EXPORTER": "none"})
    nice = Llmtap(
        upstream.url, tmp_path / "nice.log", {"OTEL_TRACES_EXPORTER": "none", "LLMTAP_TELEMETRY_SCHEDULING": "nice"}
    )
    try:
        idle.wait_ready()
        nice.wait_ready()
        stream(idle.client, **{"x-chunks": "5"})  # the recorder's worker and the exporters' threads are running
        pid = telemetry_pid(idle.proc.pid)
        threads = policies(pid)
        assert len(threads) > 1 and set(threads.values()) == {os.SCHED_IDLE}, threads
        # The relay itself keeps the normal class.
        assert os.sched_getscheduler(idle.proc.pid) == os.SCHED_OTHER
        niced = telemetry_pid(nice.proc.pid)
        assert set(policies(niced).values()) == {os.SCHED_OTHER}
        assert os.getpriority(os.PRIO_PROCESS, niced) == os.getpriority(os.PRIO_PROCESS, nice.proc.pid) + 5
    finally:
        idle.close()
        nice.close()
