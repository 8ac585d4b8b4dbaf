"""``llmtap serve --workers N``: the merged exposition, and real worker processes on a shared port."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.server import Background
from llmtap.store.files import ReadStats, read_records, record_files_at
from llmtap.telemetry.exposition.prometheus import merge_metrics
from llmtap.wire.tape import shard_of
from tests.conftest import PATIENCE, Scripted, free_port, require_real
from tests.support.procs import stop, stop_clean, wait_ready

ROOT = Path(__file__).parents[2]
COUNT = "llmtap_time_to_first_token_seconds_count"  # by route (the gen_ai.* one carries no route)

A = """# HELP req_total Finished requests.
# TYPE req_total counter
req_total{route="a"} 3
# HELP ttft_seconds TTFT.
# TYPE ttft_seconds histogram
ttft_seconds_bucket{route="a",le="0.1"} 1
ttft_seconds_bucket{route="a",le="+Inf"} 2
ttft_seconds_sum{route="a"} 0.25
ttft_seconds_count{route="a"} 2
# HELP active Open streams.
# TYPE active gauge
active{route="a"} 1
"""
B = """# HELP req_total Finished requests.
# TYPE req_total counter
req_total{route="a"} 4
req_total{route="b"} 1
# HELP ttft_seconds TTFT.
# TYPE ttft_seconds histogram
ttft_seconds_bucket{route="a",le="0.1"} 0
ttft_seconds_bucket{route="a",le="+Inf"} 5
ttft_seconds_sum{route="a"} 1.5
ttft_seconds_count{route="a"} 5
ttft_seconds_bucket{route="b",le="0.1"} 1
ttft_seconds_bucket{route="b",le="+Inf"} 1
ttft_seconds_sum{route="b"} 0.05
ttft_seconds_count{route="b"} 1
# HELP active Open streams.
# TYPE active gauge
active{route="a"} 2
"""


def test_merge_sums_each_series_once() -> None:
    merged = merge_metrics([A, B])
    lines = merged.splitlines()
    values = {line.rpartition(" ")[0]: line.rpartition(" ")[2] for line in lines if not line.startswith("#")}
    assert values == {
        'req_total{route="a"}': "7",
        'req_total{route="b"}': "1",
        'ttft_seconds_bucket{route="a",le="0.1"}': "1",
        'ttft_seconds_bucket{route="a",le="+Inf"}': "7",
        'ttft_seconds_sum{route="a"}': "1.75",
        'ttft_seconds_count{route="a"}': "7",
        'ttft_seconds_bucket{route="b",le="0.1"}': "1",
        'ttft_seconds_bucket{route="b",le="+Inf"}': "1",
        'ttft_seconds_sum{route="b"}': "0.05",
        'ttft_seconds_count{route="b"}': "1",
        'active{route="a"}': "3",
    }
    # Each family once, HELP then TYPE, and every sample inside its own family.
    assert [line for line in lines if line.startswith("# TYPE")] == [
        "# TYPE req_total counter",
        "# TYPE ttft_seconds histogram",
        "# TYPE active gauge",
    ]
    family = ""
    for line in lines:
        if line.startswith("# TYPE"):
            family = line.split()[2]
        elif not line.startswith("#"):
            assert line.startswith(family), line


def test_merge_of_one_is_the_same_and_of_none_is_a_comment() -> None:
    assert merge_metrics([A]) == A
    assert merge_metrics([]).startswith("#")


@pytest.fixture
def upstream() -> Iterator[Scripted]:
    up = Scripted(SCRIPT_TTFT="0.02", SCRIPT_GAP="0.005", SCRIPT_CHUNKS="5")
    yield up
    up.close()


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


def _serve(argv: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    """``python -m llmtap`` with ``argv``, no OTEL_ or LLMTAP_ variable of ours, its temporary files in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "llmtap", *argv, "--log-level", "warning"],
        cwd=ROOT,
        env={**env, "TMPDIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def two_routes(tmp_path: Path, sims: list[Background]) -> Path:
    """A config file of two routes, ``/a`` and ``/b``, one to each simulator."""
    config = tmp_path / "llmtap.yaml"
    config.write_text(
        "routes:\n"
        + "".join(
            f"  - {{prefix: /{name}, upstream: '{url}', provider: llmtap-sim, strip_prefix: true}}\n"
            for name, (url, _) in zip("ab", sims, strict=True)
        )
    )
    return config


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _merged_count(admin: str) -> float:
    text = httpx.get(admin + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(COUNT + "{"))


@pytest.mark.e2e
def test_two_relays_share_the_port_and_one_telemetry_process_counts_all(upstream: Scripted, tmp_path: Path) -> None:
    require_real(hasattr(socket, "SO_REUSEPORT"), "SO_REUSEPORT", "--workers needs Linux's SO_REUSEPORT")
    port, admin_port = free_port(), free_port()
    argv = ["serve", "--upstream", upstream.url, "--port", str(port), "--admin-port", str(admin_port), "--workers", "2"]
    proc = _serve(argv, tmp_path)
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        assert "2/2 relays" in wait_ready(proc, admin)
        children = _children(proc.pid)
        assert sorted(_comm(pid) for pid in children) == ["llmtap-relay", "llmtap-relay", "llmtap-telemetr"]

        # A new connection per request: the kernel spreads them over both relays, whose tapes all reach
        # the one telemetry process.
        requests = 16
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(requests):
            with httpx.Client(timeout=10) as client:
                r = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        deadline = time.monotonic() + PATIENCE
        while _merged_count(admin) < requests and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _merged_count(admin) == requests

        # A relay killed outright is started again, and the server stays whole.
        victim = next(pid for pid in children if _comm(pid) == "llmtap-relay")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + PATIENCE
        while True:
            children = _children(proc.pid)
            if victim not in children and len(children) == 3 and httpx.get(admin + "/readyz").status_code == 200:
                break
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            time.sleep(0.2)

        stop_clean(proc)
    finally:
        stop(proc, grace=0)


def test_workers_on_a_taken_port_fail_once_with_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--admin-port", str(free_port())]
        result = subprocess.run(
            [sys.executable, "-m", "llmtap", *argv, "--workers", "2"],
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 2
    assert f"proxy listener 127.0.0.1:{port}" in result.stderr


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary folder with a short path: llmtap's Unix sockets go under TMPDIR only when the path fits
    (107 bytes), else under /tmp, and a test that looks for them needs to know where."""
    with tempfile.TemporaryDirectory(prefix="lt-", dir="/tmp") as folder:
        yield Path(folder)


@dataclasses.dataclass
class TwoTelemetry:
    """``llmtap serve --telemetry-workers 2 --record`` in front of one simulator; its temporary files in ``tmp``."""

    proc: subprocess.Popen[str]
    tmp: Path
    records: Path
    url: str
    admin: str


@pytest.fixture
def two_telemetry(short_tmp: Path) -> Iterator[TwoTelemetry]:
    """One upstream, one relay, two telemetry processes, recording, ready; stopped after, with the simulator."""
    upstream, stop_sim = run_in_thread(get_profile("fast"))
    port, admin_port = free_port(), free_port()
    config = short_tmp / "llmtap.yaml"
    config.write_text(f"routes:\n  - {{prefix: /, upstream: '{upstream}', provider: llmtap-sim}}\n")
    records = short_tmp / "records"
    argv = ["serve", "--config", str(config), "--port", str(port), "--admin-port", str(admin_port)]
    proc = _serve([*argv, "--record", str(records), "--telemetry-workers", "2"], short_tmp)
    try:
        wait_ready(proc, f"http://127.0.0.1:{admin_port}")
        yield TwoTelemetry(proc, short_tmp, records, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
    finally:
        stop_sim()
        stop(proc, grace=0)


@pytest.mark.e2e
def test_two_telemetry_processes_share_one_upstream_and_see_every_prompt(two_telemetry: TwoTelemetry) -> None:
    """One upstream, two telemetry processes: its requests spread over both (by trace id), each process's cache
    diagnosis knows the prompts the other recorded (one cold request, then every one a hit with the whole system
    prompt expected), one scrape of the admin port adds both up, and its live view shows every request."""
    proc, records, admin = two_telemetry.proc, two_telemetry.records, two_telemetry.admin
    system = "You answer questions about the product's invoices, politely and briefly. " * 40
    sent = 24
    assert sorted(_comm(pid) for pid in _children(proc.pid)) == ["llmtap-telemetr", "llmtap-telemetr"]
    with httpx.Client(timeout=PATIENCE) as client:
        for i in range(sent):
            body = {
                "model": "llmtap-sim",
                "stream": True,
                "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}],
            }
            r = client.post(two_telemetry.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            # The next request goes once this one is recorded: what it taught has left for the other process.
            deadline = time.monotonic() + PATIENCE
            while _merged_count(admin) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.02)
    assert _merged_count(admin) == sent
    metrics = httpx.get(admin + "/metrics", timeout=5).text
    # The live view on the admin port: process 1's requests arrive as lessons a few ms after they are recorded.
    deadline = time.monotonic() + PATIENCE
    while len(live := _live(admin)["requests"]) < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(live) == sent and len({r["response_id"] for r in live}) == sent, len(live)
    assert [r["id"] for r in live] == list(range(1, sent + 1))
    (series,) = _live(admin)["snapshot"]["series"]
    assert series["requests"] == sent
    stop_clean(proc)
    got = sorted(read_records(records, ReadStats()), key=lambda r: r["time"])
    assert len(got) == sent
    writers = {r["instance_id"] for r in got}
    assert len(writers) == 2, writers  # 24 random trace ids, all on one process: a chance of 2 in 2**24
    classes = [r["cache"]["class"] for r in got]
    assert classes == ["cold"] + ["hit"] * (sent - 1), classes
    expected = {r["cache"]["expected_prefix_tokens"] for r in got[1:]}
    assert len(expected) == 1 and expected.pop() > 400, got[1]["cache"]
    # Nothing the processes told each other was lost.
    dropped = [line for line in metrics.splitlines() if line.startswith("llmtap_telemetry_facts_dropped_total{")]
    assert dropped and all(line.endswith(" 0") for line in dropped), dropped


@pytest.mark.e2e
def test_a_telemetry_process_started_again_learns_from_the_other_and_tells_it(two_telemetry: TwoTelemetry) -> None:
    """Telemetry process 1 killed outright: the server keeps serving, process 1 is started again, and the lessons
    flow both ways once more (its first request knows the prompt process 0 recorded since, and process 0's live
    view shows that request). The trace ids are the client's, chosen for the process that records each."""
    proc, records, admin = two_telemetry.proc, two_telemetry.records, two_telemetry.admin
    shipping = "You answer questions about the product's shipping, politely and briefly. " * 40
    returns = "You answer questions about the product's returns, politely and briefly. " * 40

    def chat(client: httpx.Client, process: int, system: str) -> dict[str, Any]:
        """One request in a trace process ``process`` records; its record, once written."""
        trace = secrets.token_hex(16)
        while shard_of(int(trace, 16), 0, 2) != process:
            trace = secrets.token_hex(16)
        body = {
            "model": "llmtap-sim",
            "stream": True,
            "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": trace}],
        }
        headers = {"traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"}
        r = client.post(two_telemetry.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            found = [x for x in read_records(records, ReadStats()) if x["trace_id"] == trace]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no record of {trace}")

    with httpx.Client(timeout=PATIENCE) as client:
        first, second = chat(client, 0, shipping), chat(client, 1, shipping)
        assert (first["cache"]["class"], second["cache"]["class"]) == ("cold", "hit")
        victim = second["pid"]
        assert victim != first["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + PATIENCE
        while victim in _children(proc.pid) or len(_children(proc.pid)) < 2:
            assert time.monotonic() < deadline, "the killed telemetry process was not started again"
            time.sleep(0.1)
        (peer,) = sorted(two_telemetry.tmp.glob("llmtap-*/telemetry.sock.admin.1"))
        while True:
            with contextlib.suppress(httpx.HTTPError):
                with httpx.Client(transport=httpx.HTTPTransport(uds=str(peer)), timeout=5) as private:
                    if private.get("http://telemetry/healthz").status_code == 200:
                        break
            assert time.monotonic() < deadline, "the telemetry process started again is not ready"
            time.sleep(0.1)
        # A prompt process 0 records now, then one of the process started again: it starts with nothing of its
        # own, so it knows the prompt only from process 0's lesson.
        known = chat(client, 0, returns)
        learned = chat(client, 1, returns)
    assert known["pid"] == first["pid"] and learned["pid"] not in (victim, first["pid"])
    # The system prompt changed (process 0 knew the old one); the server read the new one from its cache, and the
    # process started again expected it: it shares the prefix only process 0 had recorded.
    assert (known["cache"]["class"], learned["cache"]["class"]) == ("miss_changed", "hit"), (known, learned)
    assert learned["prompt"]["shared_prefix_tokens"] > 400 and learned["cache"]["expected_prefix_tokens"] > 400
    assert second["prompt"]["shared_prefix_tokens"] > 400  # before the kill too, from process 0's lesson
    # And process 0's live view has the new process's request: its lessons reach process 0 again.
    deadline = time.monotonic() + PATIENCE
    while learned["response_id"] not in {r["response_id"] for r in _live(admin)["requests"]}:
        assert time.monotonic() < deadline, "the live view never got the request of the process started again"
        time.sleep(0.05)
    stop_clean(proc)


def _live(admin: str) -> dict[str, Any]:
    """The first data the live view's page carries (``?window=all``): its kept requests and a snapshot."""
    page = httpx.get(admin + "/?window=all", timeout=5).text
    match = re.search(r'<script id="initial" type="application/json">(.*?)</script>', page, re.DOTALL)
    assert match is not None
    data: dict[str, Any] = json.loads(match.group(1))
    return data


def _requests_total(admin: str) -> float:
    text = httpx.get(admin + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("llmtap_requests_total{"))


@pytest.mark.e2e
def test_two_telemetry_processes_write_every_record_into_their_own_files(short_tmp: Path) -> None:
    """200 requests over two routes, spread over two telemetry processes, records rotating every few kB: every
    request's record on disk exactly once, none torn, each file written by one process only."""
    tmp_path = short_tmp
    sims = [run_in_thread(get_profile("fast")) for _ in range(2)]
    records = tmp_path / "records"
    port, admin_port = free_port(), free_port()
    config = two_routes(tmp_path, sims)
    argv = ["serve", "--config", str(config), "--port", str(port), "--admin-port", str(admin_port)]
    argv += ["--record", str(records), "--record-max-mb", "0.02", "--telemetry-workers", "2"]
    proc = _serve(argv, tmp_path)
    admin = f"http://127.0.0.1:{admin_port}"
    sent = 200
    try:
        wait_ready(proc, admin)
        telemetry = {pid for pid in _children(proc.pid) if _comm(pid) == "llmtap-telemetr"}
        assert len(telemetry) == 2
        body = {"model": "llmtap-sim", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

        def one(i: int) -> int:
            with httpx.Client(timeout=PATIENCE) as client:
                return client.post(f"http://127.0.0.1:{port}/{'ab'[i % 2]}/v1/chat/completions", json=body).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(sent))) == [200] * sent
        deadline = time.monotonic() + PATIENCE
        while _requests_total(admin) < sent and time.monotonic() < deadline:
            time.sleep(0.1)
        counted = _requests_total(admin)
        stop_clean(proc)
    finally:
        for _, stop_sim in sims:
            stop_sim()
        stop(proc, grace=0)
    stats = ReadStats()
    got = list(read_records(records, stats))
    assert counted == sent == len(got) == len({r["trace_id"] for r in got}), (counted, len(got))
    assert stats.skipped == 0, stats
    # Two writers, each its own pid and instance, each with requests of both routes (by trace id, not by upstream).
    by_instance: dict[str, set[tuple[int, str]]] = {}
    for r in got:
        by_instance.setdefault(r["instance_id"], set()).add((r["pid"], r["route"]))
    assert {pid for pairs in by_instance.values() for pid, _ in pairs} == telemetry
    assert [sorted(route for _, route in pairs) for pairs in by_instance.values()] == [["a", "b"], ["a", "b"]]
    # Every file is one writer's, named for it, within the size bound, and compressed once closed.
    files = record_files_at(records)
    assert len(files) > 4 and all(f.name.endswith(".jsonl.gz") for f in files), files
    for f in files:
        file_stats = ReadStats()
        writers = {r["instance_id"] for r in read_records(f, file_stats)}
        assert len(writers) == 1 and file_stats.skipped == 0, f
        assert f"-{writers.pop()}-" in f.name
        assert len(gzip.decompress(f.read_bytes())) <= 0.02 * (1 << 20)
    per = {i: sum(1 for r in got if r["instance_id"] == i) for i in by_instance}
    print(f"\n{sent} requests: {len(got)} records in {len(files)} files, by process {sorted(per.values())}")
