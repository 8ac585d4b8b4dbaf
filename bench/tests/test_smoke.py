"""The benchmark harness in smoke mode: it runs end to end and its figures hang together.

Not a performance test: nothing here asserts llmtap's targets. It asserts that the harness measured what
it says (every path, every concurrency, every request matched to the upstream's own record), that the
load client was not the bottleneck on the direct path, and that the accuracy part read aiperf, llmtap's
spans and a real Prometheus (all peers: about a minute and a half). The burst part (direct, llmtap and
nginx when installed; bursts of 1 and 8 over plain and HTTPS upstreams, the paths in turn; about 2 minutes) needs
no other peer.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import peers, report
from bench.run import PATHS, SMOKE, parser, path_specs
from bench.stats import analyse
from tests.conftest import require_real
from tests.support.proctree import TELEMETRY_COMM, Service, pin_threads

ROOT = Path(__file__).resolve().parents[2]
#: What a run measures by default: every path, and llmtap a second time with its whole tree on one core.
RUN_PATHS = (*PATHS[: PATHS.index("llmtap") + 1], "llmtap:one-core", *PATHS[PATHS.index("llmtap") + 1 :])


def test_the_one_core_budget_runs_beside_the_dedicated_cores_and_is_reported_against_nginx() -> None:
    """``python -m bench`` runs llmtap twice (relay alone on its core; the whole tree on one core) unless
    told not to, and reports each against nginx's row of the same scenario, relay and telemetry CPU apart."""
    assert path_specs(parser().parse_args([])) == list(RUN_PATHS)
    assert path_specs(parser().parse_args(["--no-one-core"])) == list(PATHS)
    assert path_specs(parser().parse_args(["--paths", "direct,nginx"])) == ["direct", "nginx"]
    row = {"upstream": "http", "streams": 64, "merged": 0, "added_gap_ms_p99": 1.0, "added_ttft_ms_p99": 4.0}
    results: dict[str, Any] = {
        "phases": [
            {**row, "path": "nginx", "added_ttft_ms_p50": 1.0},
            {**row, "path": "llmtap:one-core", "added_ttft_ms_p50": 3.5, "added_gap_ms_p99": 2.5, "merged": 2,
             "cpu_relay_s_per_1000_chunks": 0.024, "cpu_telemetry_s_per_1000_chunks": 0.031, "tapes_dropped": 0.0},
        ],
        "bursts": [],
    }  # fmt: skip
    (line,) = [x for x in report._one_core_table(results) if x.startswith("| llmtap")]
    assert line == "| llmtap:one-core | http | 64 staggered | 2.50 / 0.00 | 1.50 | 2 (0) | 24 | 31 | 0 |"
    # No nginx row to compare with: no table.
    assert report._one_core_table({"phases": results["phases"][1:], "bursts": []}) == []


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def results(out: Path) -> dict[str, Any]:
    absent = peers.missing()
    require_real(not absent, ", ".join(sorted(absent)) or "-", "; ".join(sorted(set(absent.values()))) or "-")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--tls", "off", "--no-bursts", "--no-rps", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### Paths side by side" in done.stdout
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


def _phase(results: dict[str, Any], path: str, streams: int) -> dict[str, Any]:
    found: list[dict[str, Any]] = [p for p in results["phases"] if p["path"] == path and p["streams"] == streams]
    assert len(found) == 1, (path, streams)
    return found[0]


@pytest.mark.real
def test_every_path_measured_at_every_concurrency(results: dict[str, Any]) -> None:
    assert {(p["path"], p["streams"]) for p in results["phases"]} == {(p, s) for p in RUN_PATHS for s in SMOKE.streams}
    for p in results["phases"]:
        expected = p["streams"] * SMOKE.requests[p["streams"]]
        assert p["requests"] == expected and p["failed"] == 0 and p["unmatched"] == 0, p
        # Every content chunk the upstream wrote reached the client as an event of its own or merged.
        assert p["chunks"] + p["merged"] >= expected * SMOKE.chunks, p
        # A path cannot deliver before the upstream sent: only clock-read jitter below zero.
        assert p["added_ttft_ms_p50"] > -1.0, p


@pytest.mark.real
def test_direct_path_checks_that_the_client_kept_up(results: dict[str, Any], out: Path) -> None:
    """The run says whether its load client kept up, from the direct path's own records.

    Whether it did is the machine's business (a busy one makes the client late, and the run must then say
    so); that the run's verdict matches its records, and is printed, is the harness's.
    """
    for streams in SMOKE.streams:
        direct = _phase(results, "direct", streams)
        # Every chunk the upstream wrote reached the client as an event of its own (nothing in between could
        # join two), though a late client may have read several in one go: those count as merged as well.
        assert direct["chunks"] == direct["requests"] * SMOKE.chunks, direct
        assert 0 <= direct["merged"] < direct["chunks"], direct
        assert direct["cpu_s"] is None and direct["client_cpu_s"] > 0
    client: list[dict[str, Any]] = []
    upstream: list[dict[str, Any]] = []
    for streams in SMOKE.streams:
        raw = json.loads((out / f"records-direct-{streams}.json").read_text())
        client += raw["client"]
        upstream += raw["upstream"]
    pooled = analyse("direct", 0, client, upstream, gap=SMOKE.gap)
    assert pooled.unmatched == 0 and pooled.failed == 0
    check = results["client_check"]
    assert check["requests"] == pooled.requests == sum(_phase(results, "direct", s)["requests"] for s in SMOKE.streams)
    assert check["added_ttft_ms_p50"] == pytest.approx(pooled.added_ttft_ms_p50)
    assert check["added_gap_ms_p50"] == pytest.approx(pooled.added_gap_ms_p50)
    assert check["merged"] == pooled.merged
    kept_up = pooled.added_ttft_ms_p50 <= 2.0 and abs(pooled.added_gap_ms_p50) <= 2.0 and pooled.merged == 0
    assert check["ok"] is kept_up
    text = report.markdown(results)
    assert ("Load client kept up (" in text) is kept_up and ("**Load client lagged** (" in text) is not kept_up


@pytest.mark.real
def test_proxies_charged_cpu_and_memory(results: dict[str, Any]) -> None:
    for path in ("nginx", "llmtap", "litellm"):
        for streams in SMOKE.streams:
            p = _phase(results, path, streams)
            # nginx's CPU time over a short phase can be under one clock tick (10 ms): read, not necessarily > 0.
            assert p["cpu_s_per_1000_chunks"] is not None and p["cpu_s_per_1000_chunks"] >= 0, p
            assert path == "nginx" or p["cpu_s_per_1000_chunks"] > 0, p
            assert p["rss_peak_mib"] is not None and p["rss_peak_mib"] >= p["rss_idle_mib"] > 0, p
    # The Python proxies hold far more memory than nginx: the process tree was really measured.
    assert _phase(results, "llmtap", 1)["rss_idle_mib"] > 5 * _phase(results, "nginx", 1)["rss_idle_mib"]


@pytest.mark.real
def test_ramp_ran(results: dict[str, Any]) -> None:
    ramp = results["ramp"]
    assert [r["streams"] for r in ramp] == list(SMOKE.ramp[: len(ramp)]) and ramp
    assert all(r["path"] == "llmtap" and r["failed"] == 0 and r["chunks_per_s"] > 0 for r in ramp)


@pytest.mark.real
def test_accuracy_read_aiperf_spans_and_prometheus(results: dict[str, Any]) -> None:
    acc = results["accuracy"]
    plan = SMOKE.accuracy
    assert acc["aiperf_requests"] == plan.requests
    assert acc["llmtap_requests_all"] == plan.requests + plan.warmup
    assert acc["llmtap_requests_profiled"] == plan.requests
    assert acc["prometheus_count"] == plan.requests + plan.warmup
    for row in acc["ttft"]:
        # llmtap's TTFT is a part of the client's: never longer (beyond 2 ms of clock reads), never tiny.
        assert row["llmtap_exact_ms"] <= row["aiperf_ms"] + 2.0, row
        assert row["llmtap_exact_ms"] >= 0.5 * row["aiperf_ms"], row
        # Prometheus answers inside the fine bucket (9% wide) that holds the sample of its rank. How far that is
        # from the exact figure depends on how far apart the samples are (p99 of 20 is nearly the largest, which
        # the histogram interpolates inside its bucket): the benchmark's 352 requests hold it to 5%.
        assert row["prometheus_ms"] is not None
        lo, hi = row["hist_bucket_ms"]
        assert hi / lo == pytest.approx(2 ** (1 / 8), rel=1e-3), row
        assert lo * (1 - 1e-6) <= row["prometheus_ms"] <= hi * (1 + 1e-6), row


@pytest.mark.real
def test_run_was_isolated_in_a_network_namespace(results: dict[str, Any]) -> None:
    can = os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None
    require_real(can, "a network namespace for the benchmark", "run as root with unshare and ip (util-linux, iproute2)")
    assert results["netns"] is True


@pytest.mark.real
def test_run_was_described(results: dict[str, Any]) -> None:
    m = results["machine"]
    assert m["cores"] and m["python"] and "nginx" in m["nginx"] and m["litellm"] and m["aiperf"]
    assert "load average" in results["load_before"] and "load average" in results["load_after"]


# --- bursts over plain and HTTPS upstreams ----------------------------------------------------------------

BURST_SIZES = (1, 8)
BURST_PATHS = ("direct", "llmtap", *(("nginx",) if shutil.which("nginx") else ()))
#: The rows a burst run gives: llmtap's second, one-core placement too.
BURST_ROWS = (*BURST_PATHS, "llmtap:one-core")


@pytest.fixture(scope="module")
def burst_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-bursts")


@pytest.fixture(scope="module")
def bursts(burst_out: Path) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "bench", "--smoke", "--paths", ",".join(BURST_PATHS), "--tls", "both",
        "--bursts", ",".join(map(str, BURST_SIZES)), "--no-staggered", "--no-ramp", "--no-accuracy",
        "--no-workers", "--no-rps", "--out", str(burst_out),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### Burst arrivals" in done.stdout and "### CPU per 1,000 chunks by process" in done.stdout
    assert ("### The one-core budget" in done.stdout) is ("nginx" in BURST_PATHS)
    data: dict[str, Any] = json.loads((burst_out / "results.json").read_text())
    return data


@pytest.mark.real
def test_bursts_every_request_complete_over_plain_and_https(bursts: dict[str, Any]) -> None:
    rows = bursts["bursts"]
    expected = {(p, u, n) for p in BURST_ROWS for u in ("http", "https") for n in BURST_SIZES}
    assert {(r["path"], r["upstream"], r["size"]) for r in rows} == expected
    count = SMOKE.burst_count()
    for r in rows:
        assert r["bursts"] == count and len(r["per_burst"]) == count, r
        # Every request of every burst completed, each with every chunk the upstream wrote, on its own connection.
        assert r["requests"] == r["complete"] == r["size"] * count and r["errors"] == 0, r
        assert r["chunks"] + r["merged"] >= r["requests"] * SMOKE.chunks, r
        for b in r["per_burst"]:
            assert b["requests"] == b["complete"] == r["size"] and b["errors"] == 0, b
            assert b["added_ttft_ms_p50"] is not None and math.isfinite(b["added_ttft_ms_p50"]), b
        for key in ("added_ttft_ms_p50", "added_ttft_ms_p99", "added_gap_ms_p99", "connect_ms_p50"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
        # Nothing arrives before the upstream sent it: only clock-read jitter below zero.
        assert r["added_ttft_ms_p50"] > -1.0, r
        assert r["command"].startswith("python -m bench ") and f"--bursts {r['size']}" in r["command"], r
        if r["path"] != "direct":
            assert r["over_direct_ttft_ms_p50"] is not None and math.isfinite(r["over_direct_ttft_ms_p50"]), r


@pytest.mark.real
def test_bursts_reached_the_upstream_over_the_scheme_asked(bursts: dict[str, Any], burst_out: Path) -> None:
    assert bursts["plan"]["tls"] == ["http", "https"]
    for path in BURST_PATHS:
        for scheme in ("http", "https"):
            raw = json.loads((burst_out / f"records-burst-{path}-{scheme}-8.json").read_text())
            # The upstream marks each request with its listener: https rows really came in over TLS.
            assert raw["upstream"] and all(u["tls"] is (scheme == "https") for u in raw["upstream"]), (path, scheme)
            # One new client connection per request: every request's clock started before its own connect.
            assert all(c["start"] <= c["sent"] for c in raw["client"])
    assert bursts["upstream_ca"] in ("--upstream-ca", "SSL_CERT_FILE+certifi")


@pytest.mark.real
def test_the_paths_take_their_bursts_in_turn(bursts: dict[str, Any], burst_out: Path) -> None:
    """Each path's k-th burst of a size before any path's next one, and each burst alone: the paths compared on
    one core are measured over the same minutes, never one path's bursts all before another's."""
    assert bursts["plan"]["bursts_in_turn"] is True
    count = SMOKE.burst_count()
    for scheme in ("http", "https"):
        for size in BURST_SIZES:
            taken = []  # (release, end of the burst's last request, path, burst)
            for path in BURST_ROWS:
                name = f"records-burst-{path.replace(':', '_')}-{scheme}-{size}.json"
                raw = json.loads((burst_out / name).read_text())
                for k in range(count):
                    mine = [c for c in raw["client"] if c["burst"] == k]
                    assert len(mine) == size, (path, scheme, size, k)
                    taken.append((min(c["release"] for c in mine), max(c["end"] for c in mine), path, k))
            taken.sort()
            assert [k for *_, k in taken] == sorted(k for *_, k in taken), taken
            assert [path for *_, path, k in taken if k == 0] == [path for *_, path, k in taken if k == 1], taken
            # No burst is released before the one before it (another path's) has ended.
            for before, after in itertools.pairwise(taken):
                assert after[0] > before[1], (before, after)


@pytest.mark.real
def test_bursts_charge_cpu_by_process_role(bursts: dict[str, Any]) -> None:
    relay_cpu: dict[str, float] = {}
    for r in bursts["bursts"]:
        if r["path"] == "direct":
            assert r["cpu_s"] is None and r["cpu_relay_s_per_1000_chunks"] is None, r
            continue
        # /proc counts CPU in clock ticks (10 ms): nginx relaying a burst of one can read 0.
        assert r["cpu_relay_s_per_1000_chunks"] is not None and r["cpu_relay_s_per_1000_chunks"] >= 0, r
        relay_cpu[r["path"]] = relay_cpu.get(r["path"], 0.0) + r["cpu_relay_s"]
        assert r["cpu_telemetry_s_per_1000_chunks"] is not None and r["cpu_telemetry_s_per_1000_chunks"] >= 0, r
        assert r["procs"]["relay"] >= 1, r
        # The roles split the tree's CPU: together they are the whole (one reading of /proc at each end).
        assert r["cpu_relay_s"] + r["cpu_telemetry_s"] == pytest.approx(r["cpu_s"], abs=1e-6), r
        assert r["rss_relay_kib_per_stream"] is not None and math.isfinite(r["rss_relay_kib_per_stream"]), r
        if r["path"] == "nginx":
            assert r["procs"]["telemetry"] == 0, r
    # llmtap's relay spends about 0.1 ms a chunk: over every burst of the run, many ticks.
    assert relay_cpu["llmtap"] > 0, relay_cpu


@pytest.mark.real
def test_tapes_dropped_absent_is_not_zero(bursts: dict[str, Any]) -> None:
    for r in bursts["bursts"]:
        if r["path"] != "llmtap":
            continue
        # Either llmtap exports the counter (a count, never negative) or the figure is absent (n/a), not 0.
        assert r["tapes_dropped"] is None or r["tapes_dropped"] >= 0, r


# --- the parts of the harness that need no peer -----------------------------------------------------------


def test_process_roles_by_comm(tmp_path: Path) -> None:
    """A tree whose child names itself llmtap-telemetry: its CPU is the telemetry role's, the rest relay's."""
    script = (
        "import subprocess, sys, time\n"
        "child = ('open(\\'/proc/self/comm\\', \\'w\\').write(\\'llmtap-telemetry\\')\\n'\n"
        "         'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\n'\n"
        "         'print(1, flush=True)\\ntime.sleep(30)')\n"
        "p = subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.PIPE)\n"
        "p.stdout.readline()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    svc = Service("roles", [sys.executable, "-c", script], log=tmp_path / "roles.log", cpu=None)
    try:
        child = int(svc.read_line())
        assert Path(f"/proc/{child}/comm").read_text().strip() == TELEMETRY_COMM
        roles = svc.roles()
        assert roles["telemetry"] == [child] and roles["relay"] == [svc.proc.pid]
        cpu = svc.cpu_roles()
        assert cpu["telemetry"] >= 0.2, cpu
        assert svc.rss_relay() > 0
    finally:
        svc.stop()


def test_pinning_a_process_moves_every_thread_it_runs(tmp_path: Path) -> None:
    """The benchmark moves llmtap's telemetry process to a core of its own once it runs: its threads started
    already (the recorder, the exporters) go with it, not only its main thread."""
    script = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print(threading.active_count(), flush=True)\n"
        "time.sleep(30)\n"
    )
    svc = Service("threads", [sys.executable, "-c", script], log=tmp_path / "threads.log", cpu=None)
    try:
        assert int(svc.read_line()) == 4
        pid = svc.proc.pid
        core = {min(os.sched_getaffinity(0))}
        pin_threads(pid, core)
        tasks = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        assert len(tasks) >= 4
        assert all(os.sched_getaffinity(tid) == core for tid in tasks), [os.sched_getaffinity(t) for t in tasks]
    finally:
        svc.stop()


def test_tapes_dropped_summed_over_labels_and_absent_as_none() -> None:
    text = (
        "# TYPE llmtap_telemetry_tapes_dropped_total counter\n"
        'llmtap_telemetry_tapes_dropped_total{reason="queue_full"} 3.0\n'
        'llmtap_telemetry_tapes_dropped_total{reason="encode"} 2\n'
        "llmtap_telemetry_tapes_dropped_created 1.7e9\n"
        "llmtap_other_total 9\n"
    )
    assert peers.exposition_sum(text, peers.TAPES_DROPPED) == 5.0
    assert peers.exposition_sum("llmtap_telemetry_tapes_dropped_total 0\n", peers.TAPES_DROPPED) == 0.0
    assert peers.exposition_sum("llmtap_other_total 9\n", peers.TAPES_DROPPED) is None


def test_burst_command_line_and_ablations() -> None:
    from bench.run import parser, path_specs

    args = parser().parse_args(["--bursts", "1,32,64", "--tls", "on", "--paths", "direct,nginx,llmtap",
                                "--ablation", "otel-off", "--ablation", "chunk-spans-off"])  # fmt: skip
    assert args.bursts == (1, 32, 64) and args.tls == "on"
    # llmtap:one-core (the whole tree on the proxy's one core) runs by default, beside the dedicated cores.
    assert path_specs(args) == [
        "direct",
        "nginx",
        "llmtap",
        "llmtap:one-core",
        "llmtap:otel-off",
        "llmtap:chunk-spans-off",
    ]
    assert peers.ablation_names("otel-off+chunk-spans-off") == ["otel-off", "chunk-spans-off"]
    with pytest.raises(ValueError):
        peers.ablation_names("no-such-switch")
    with pytest.raises(SystemExit):
        path_specs(parser().parse_args(["--paths", "nginx:otel-off"]))
    # Bounded: at least two bursts per size, never more than the plan's count or its time budget allows.
    assert 2 <= SMOKE.burst_count() <= SMOKE.bursts_per_size


@pytest.mark.e2e
def test_telemetry_scale_spreads_one_upstream_over_two_processes_and_loses_no_lesson() -> None:
    """``bench.probes.telemetry_scale`` at a small load: every tape recorded, both processes recording, no lesson
    lost."""
    from bench.probes import telemetry_scale

    out = io.StringIO()
    # It pins its own process to core 0, as the command it is: this test worker's, for this test only (every
    # later test of the worker, and every process it starts, would run on that one core).
    cores = os.sched_getaffinity(0)
    try:
        with contextlib.redirect_stdout(out):
            assert telemetry_scale.main(["--workers", "2", "--rounds", "1", "--seconds", "1", "--rate", "200"]) == 0
    finally:
        os.sched_setaffinity(0, cores)
    (line,) = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
    assert line["telemetry_processes"] == 2 and line["recorded"] == line["sent"] == 200, line
    assert sum(line["recorded_by_process"]) == 200 and min(line["recorded_by_process"]) > 50, line
    assert line["dropped"] == 0 and line["facts_dropped"] == 0, line


def test_captured_tapes_play_again_through_the_recorders_worker(tmp_path: Path) -> None:
    """``bench.probes.telemetry --tapes``: the frames of a capture played through the queue and the worker, per chunk
    the
    content chunks the timelines counted (the first stream a warm-up, not counted)."""
    from bench.probes.telemetry import measure_tapes, tape
    from llmtap.wire.framing import encode_frame
    from tests.support.tapes import chat_tape

    capture = tmp_path / "tapes.bin"
    frames = [b"".join(encode_frame(tape(key, 12))) for key in range(5)]
    # A stream in segments too: a 40 KiB read fills the tape, which leaves as a segment before the end.
    _, long = chat_tape(9, [b"data: " + b'{"choices":[{"index":0,"delta":{"content":"x"}}]}' + b" " * 40_000 + b"\n\n"])
    assert len(long) == 2
    frames += [b"".join(encode_frame(m)) for m in long]
    capture.write_bytes(b"".join(frames))
    got = measure_tapes(capture)
    assert got["requests"] == 5 and got["chunks_per_request"] == round((4 * 12 + 1) / 5, 1), got
    assert got["spans_per_request"] > 0 and got["us_per_chunk_total"] > 0, got
    capture.write_bytes(b"".join(frames)[:-1])
    with pytest.raises(SystemExit, match="ends inside a message"):
        measure_tapes(capture)


def test_the_capture_shim_keeps_what_the_telemetry_intake_reads(tmp_path: Path) -> None:
    """``bench.probes.relay_cpu --capture``: the shim appends every read of the intake to the file, before the intake
    takes
    it, and the process that never imports the intake (the relay) is left alone."""
    from bench.probes.relay_cpu import CAPTURE_SHIM

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(CAPTURE_SHIM)
    out = tmp_path / "capture.bin"
    script = """
import sys
from llmtap.telemetry import process

taken = []

class Recorder:
    spool = None

    def submit(self, message, source):
        taken.append(message)

    def submit_all(self, messages, source):
        taken.extend(messages)

    def relay_ready(self, source, ready):
        pass

intake = process._Intake(Recorder(), 0, set())
from llmtap.wire.framing import encode_frame
data = b"".join(encode_frame((3, 1))) + b"".join(encode_frame((3, 2)))
intake.data_received(data[:5])
intake.data_received(data[5:])
assert taken == [(3, 1), (3, 2)], taken
"""
    env = {
        **os.environ,
        "BENCH_CAPTURE": str(out),
        "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT / "proxy"), str(ROOT)]),
    }
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    from llmtap.wire.framing import frames

    assert frames(bytearray(out.read_bytes())) == [(3, 1), (3, 2)]
    # The relay's process never imports the intake: nothing is written for it.
    out.unlink()
    subprocess.run([sys.executable, "-c", "import llmtap.relay.app"], check=True, env=env, timeout=120)
    assert not out.exists()
