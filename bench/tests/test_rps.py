"""The requests-per-second part of the benchmark (``python -m bench --rps-only``) in smoke mode.

Not a performance test: it asserts that the part measured what it says (every path at every connection count and
rate, every scheduled request answered, the open-loop generator keeping its rate against the direct path), that
the figures hang together (p50 under p99, CPU per request charged to the trees that have one), and that the
profile of llmtap's two processes adds up. It runs the command as a user does and reads its ``results.json``
(about a minute: wrk, nginx and py-spy, all installed by ``.ci/install.d/50-bench.sh`` and the test extra).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bench.rps import FLOORS
from tests.conftest import require_real

ROOT = Path(__file__).parents[2]
PATHS = ("direct", "nginx", "floor", "floor:bytes", "llmtap", "llmtap:spare")
#: The smoke plan's connection counts and rates (bench/rps.py's SMOKE).
CONNECTIONS = (1, 4)
RATES = (300,)
#: The stages of a short request the profile must name in each process.
# The stages a short profile always samples (each at least a tenth of its process's time); the smaller ones, such
# as the tape, may get no sample in the smoke's two seconds.
RELAY_STAGES = {"upstream exchange"}
TELEMETRY_STAGES = {"metrics (emitter and SDK)"}


@pytest.fixture(scope="module")
def rps(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    absent = [tool for tool in ("wrk", "nginx", "py-spy") if shutil.which(tool) is None]
    require_real(not absent, ", ".join(absent) or "-", "bash .ci/install.d/50-bench.sh; pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("rps")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--rps-only", "--smoke", "--rps-profile", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return results, done.stdout


@pytest.mark.real
def test_closed_loop_measures_every_path_at_every_connection_count(rps: tuple[dict[str, Any], str]) -> None:
    part = rps[0]["rps"]
    assert {(r["path"], r["connections"]) for r in part["closed"]} == {(p, c) for p in PATHS for c in CONNECTIONS}
    for r in part["closed"]:
        assert r["requests"] > 0 and r["errors"] == 0, r
        assert 0 < r["p50_ms"] <= r["p99_ms"], r
        assert r["requests_per_s"] == pytest.approx(r["requests"] / r["seconds"]), r
        if r["path"] == "direct":
            assert "cpu_s" not in r, r
            continue
        # A tree's CPU per request is charged, by role: nginx has no telemetry process, llmtap has one.
        assert r["cpu_us_per_request"] > 0, r
        assert r["cpu_relay_us_per_request"] + r["cpu_telemetry_us_per_request"] == pytest.approx(
            r["cpu_us_per_request"]
        ), r
        if r["path"] == "nginx" or r["path"] in FLOORS:
            assert r["cpu_telemetry_us_per_request"] == 0, r
        else:
            # Read off llmtap's /metrics around the measurement: a count, never below zero.
            assert r["tapes_dropped"] is not None and r["tapes_dropped"] >= 0, r


@pytest.mark.real
def test_open_loop_answers_every_scheduled_request_and_reads_against_direct(rps: tuple[dict[str, Any], str]) -> None:
    part = rps[0]["rps"]
    assert {(r["path"], r["rate"]) for r in part["open"]} == {(p, rate) for p in PATHS for rate in RATES}
    seconds = part["plan"]["seconds"]
    for r in part["open"]:
        assert r["scheduled"] == r["issued"] == round(r["rate"] * seconds), r
        assert r["completed"] == r["scheduled"] and r["lost"] == 0 and r["errors"] == 0, r
        lat = r["latency_ms"]
        assert 0 < lat["p50"] <= lat["p99"] <= lat["max"], r
        # From the scheduled time: a send's own lateness is inside its latency, never outside it.
        assert r["late_ms"]["p50"] >= 0 and lat["max"] >= r["late_ms"]["max"], r
        if r["path"] == "direct":
            assert r["added_p50_ms"] == 0 and r["added_p99_ms"] == 0, r
        else:
            assert r["added_p50_ms"] == pytest.approx(lat["p50"] - _direct(part, r["rate"])["latency_ms"]["p50"]), r
    # The generator kept every rate against the direct path: it is not what a proxy's figures measure.
    assert part["generator_ok"] is True


def _direct(part: dict[str, Any], rate: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [r for r in part["open"] if r["path"] == "direct" and r["rate"] == rate]
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.real
def test_the_profile_of_both_processes_adds_up_to_their_cpu(rps: tuple[dict[str, Any], str]) -> None:
    profile = rps[0]["rps"]["profile"]
    assert profile["requests_per_s"] > 0 and profile["seconds"] > 1, profile
    for role, named in (("relay", RELAY_STAGES), ("telemetry", TELEMETRY_STAGES)):
        p = profile[role]
        assert p["samples"] > 0 and p["us_per_request"] > 0, (role, p)
        assert sum(s["share"] for s in p["stages"]) == pytest.approx(1.0), (role, p["stages"])
        assert sum(s["us_per_request"] for s in p["stages"]) == pytest.approx(p["us_per_request"]), role
        stages = {s["name"] for s in p["stages"]}
        assert named <= stages, (role, named - stages)
        assert p["top"] and all(0 < t["share"] <= 1 for t in p["top"]), (role, p["top"])
    # The telemetry's CPU over the tapes it recorded: never below its CPU over the requests relayed.
    assert profile["tapes_dropped"] >= 0
    assert profile["telemetry"]["us_per_tape"] >= profile["telemetry"]["us_per_request"] > 0


@pytest.mark.real
def test_the_run_says_its_tables_load_and_command(rps: tuple[dict[str, Any], str]) -> None:
    results, stdout = rps
    assert "| path | connections | requests/s |" in stdout and "added p50 / p99 ms over direct" in stdout
    assert "relay:" in stdout and "telemetry:" in stdout
    assert results["load_before"] and results["load_after"] and results["commit"]
    assert results["rps"]["command"] == "python -m bench --rps-only --smoke"


@pytest.mark.real
def test_the_fixed_upstream_answers_the_size_asked_on_one_connection() -> None:
    """Every request on a keep-alive connection gets the same JSON body of exactly the size asked."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fixed_upstream", "--bytes", "200"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        for _ in range(3):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=b'{"input":"x"}', method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
            assert len(body) == 200 and json.loads(body)["object"] == "list"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
