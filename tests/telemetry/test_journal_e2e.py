"""The record journal end to end: ``llmtap serve`` in front of the simulator, killed and stopped as
production kills and stops it; every request sent ends as a record or as a loss counted with its cause."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import pytest

from llmtap.store.files import ReadStats, read_records
from tests.conftest import PATIENCE, require_real
from tests.support.clickhouse_server import PASSWORD, USER, ClickHouseProcess, installed
from tests.support.procs import Llmtap, Simulator, metric_value

BODY = {"model": "llmtap-sim", "stream": True, "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
TAPES_DROPPED = "llmtap_telemetry_tapes_dropped_total"
#: Why a whole tape is lost (``partial`` and the tap's limits keep a record: not counted here).
WHOLE = ("channel_full", "queue_full", "evicted", "split", "in_transit", "in_flight", "shutdown")


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator("fast")
    yield simulator
    simulator.close()


def ask(url: str) -> int | str:
    """One streamed request: its status, or the name of what cut it."""
    try:
        with httpx.Client(timeout=PATIENCE) as client:
            return client.post(url + "/v1/chat/completions", json=BODY).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def load(url: str, n: int, act: Callable[[], object], *, after: int) -> list[int | str]:
    """``n`` requests, 16 at a time; ``act()`` runs once ``after`` of them were answered (a loaded machine may take
    seconds for the first: a time would find none)."""
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, url) for _ in range(n)]
        for done, _ in enumerate(as_completed(futures), 1):
            if done == after:
                act()
        return [f.result() for f in futures]


def unique_records(folder: Path) -> set[tuple[str, str]]:
    """The records' ids, each once (a replayed record may be written twice: readers count it once)."""
    return {(r["trace_id"], r["span_id"]) for r in read_records(folder, ReadStats())}


def counted(metrics: str) -> int:
    return int(sum(metric_value(metrics, TAPES_DROPPED, llmtap_telemetry_reason=r) for r in WHOLE))


def wait_for(what: str, check: object, patience: float = PATIENCE) -> None:
    deadline = time.monotonic() + patience
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen within {patience:.0f} s"
        time.sleep(0.2)


def recovered_line(proxy: Llmtap) -> re.Match[str] | None:
    return re.search(r"(\d+) records of the last run recovered, (\d+) could not be", proxy.logs())


@pytest.mark.e2e
def test_telemetry_killed_under_load_every_request_is_a_record_or_counted(sim: Simulator, tmp_path: Path) -> None:
    records = tmp_path / "records"
    proxy = Llmtap(sim.url, tmp_path / "llmtap.log", "--record", str(records), "--log-level", "info")
    try:
        wait_for("the first /metrics", lambda: "llmtap_telemetry_start_time_seconds" in proxy.metrics())
        started = metric_value(proxy.metrics(), "llmtap_telemetry_start_time_seconds")
        killed: list[int] = []
        answers = load(proxy.url, 300, lambda: killed.append(_kill(proxy.telemetry_pid())), after=60)
        assert answers.count(200) == 300, answers
        wait_for("the restarted telemetry's replay", lambda: recovered_line(proxy) is not None)
        # Every tape is in, or counted: the relays report their drops at least once a second.
        wait_for("every request a record or counted", lambda: _settled(proxy, records, 300))
        metrics = proxy.metrics()
        assert metric_value(metrics, "llmtap_telemetry_records_recovered_total") >= 0
        # The restarted process counts from 0: its start time says so, for increase() and for a reader.
        assert metric_value(metrics, "llmtap_telemetry_start_time_seconds") > started > 0
        err = _stop(proxy)
    finally:
        proxy.close()
    assert killed and "exited with code -9; starting it again" in err
    assert len(unique_records(records)) + counted(metrics) == 300


def _kill(pid: int) -> int:
    os.kill(pid, signal.SIGKILL)
    return pid


def _settled(proxy: Llmtap, records: Path, sent: int) -> bool:
    with_counted = len(unique_records(records)) + counted(proxy.metrics())
    assert with_counted <= sent  # never more: a record replayed twice is one record
    return with_counted == sent


def _stop(proxy: Llmtap) -> str:
    proxy.terminate()
    assert proxy.proc.wait(PATIENCE) == 0
    return proxy.logs()


@pytest.mark.e2e
def test_the_whole_tree_killed_the_next_start_says_what_it_recovered(sim: Simulator, tmp_path: Path) -> None:
    """SIGKILL to every process at once (an OOM kill of the pod), then ``llmtap serve`` again on the same folder:
    the requests that got their answer are records, or counted with a cause at the next start."""
    records = tmp_path / "records"
    args = ("--record", str(records), "--log-level", "info")
    first = Llmtap(sim.url, tmp_path / "first.log", *args, preexec_fn=os.setsid)
    try:
        answers = load(first.url, 400, lambda: os.killpg(first.proc.pid, signal.SIGKILL), after=100)
    finally:
        first.close()
    answered = answers.count(200)
    assert 0 < answered < 400, answers
    second = Llmtap(sim.url, tmp_path / "second.log", *args)
    try:
        wait_for("the replay's closing line", lambda: recovered_line(second) is not None)
        line = recovered_line(second)
        assert line is not None
        metrics = second.metrics()
        lost = counted(metrics)
        _stop(second)
    finally:
        second.close()
    got = len(unique_records(records))
    # Each answered request is a record or counted lost (in_transit, in_flight); a request cut mid-way may be either.
    assert got + lost >= answered, (got, lost, answered, second.logs()[-2000:])
    assert got + lost <= answered + 16  # at most those in flight when the tree died, besides
    assert int(line.group(2)) == lost


@pytest.mark.e2e
def test_clickhouse_down_across_a_restart_every_row_arrives_after_it(sim: Simulator, tmp_path: Path) -> None:
    """ClickHouse stopped, 30 requests, SIGTERM: the log says they are kept; ClickHouse and llmtap back on the same
    journal: every row arrives."""
    require_real(installed(), "ClickHouse (clickhouse-server)", ".ci/install.d/35-clickhouse.sh")
    clickhouse = ClickHouseProcess(tmp_path / "clickhouse")
    clickhouse.start(PATIENCE)
    env = {"LLMTAP_RECORD_CLICKHOUSE_USER": USER, "LLMTAP_RECORD_CLICKHOUSE_PASSWORD": PASSWORD}
    args = ("--record-clickhouse", clickhouse.url, "--record-journal", str(tmp_path / "journal"))
    try:
        first = Llmtap(sim.url, tmp_path / "first.log", *args, env=env)
        try:
            assert ask(first.url) == 200
            wait_for("the first row", lambda: _rows(clickhouse) == 1)
            clickhouse.stop()
            assert [ask(first.url) for _ in range(30)] == [200] * 30
            err = _stop(first)
        finally:
            first.close()
        assert "30 records kept in the journal for the next start" in err, err[-3000:]
        assert 'clickhouse_unsent"} 0' not in err
        clickhouse.start(PATIENCE)
        second = Llmtap(sim.url, tmp_path / "second.log", *args, env=env)
        try:
            wait_for("every row", lambda: _rows(clickhouse) == 31)
            assert metric_value(second.metrics(), "llmtap_telemetry_records_recovered_total") == 30
            _stop(second)
        finally:
            second.close()
        assert "30 records of the last run recovered, 0 could not be" in second.logs()
    finally:
        clickhouse.stop()


def _rows(clickhouse: ClickHouseProcess) -> int:
    try:
        return int(clickhouse.query("SELECT count() FROM llmtap_records").strip())
    except OSError:
        return -1
