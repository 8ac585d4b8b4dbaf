"""The benchmark harness in smoke mode (about a minute): it runs end to end and its figures hang together.

Not a performance test: nothing here asserts llmtap's targets. It asserts that the harness measured what
it says (every path, every concurrency, every request matched to the upstream's own record), that the
load client was not the bottleneck on the direct path, and that the accuracy part read aiperf, llmtap's
spans and a real Prometheus.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import peers
from bench.run import PATHS, SMOKE
from bench.stats import analyse
from tests.conftest import require_real

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def results(out: Path) -> dict[str, Any]:
    absent = peers.missing()
    require_real(not absent, ", ".join(sorted(absent)) or "-", "; ".join(sorted(set(absent.values()))) or "-")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
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
    assert {(p["path"], p["streams"]) for p in results["phases"]} == {(p, s) for p in PATHS for s in SMOKE.streams}
    for p in results["phases"]:
        expected = p["streams"] * SMOKE.requests[p["streams"]]
        assert p["requests"] == expected and p["failed"] == 0 and p["unmatched"] == 0, p
        # Every content chunk the upstream wrote reached the client as an event of its own or merged.
        assert p["chunks"] + p["merged"] >= expected * SMOKE.chunks, p
        assert p["added_ttft_ms_p50"] <= p["added_ttft_ms_p99"]
        assert p["added_gap_ms_p50"] <= p["added_gap_ms_p99"]
        # A path cannot deliver before the upstream sent: only clock-read jitter below zero.
        assert p["added_ttft_ms_p50"] > -1.0, p


@pytest.mark.real
def test_direct_path_shows_the_client_is_not_the_bottleneck(results: dict[str, Any], out: Path) -> None:
    for streams in SMOKE.streams:
        direct = _phase(results, "direct", streams)
        assert direct["merged"] == 0, direct
        assert direct["chunks"] == direct["requests"] * SMOKE.chunks
        assert direct["cpu_s"] is None and direct["client_cpu_s"] > 0
    # Within 2 ms of the script, over every direct request of the run (a smoke phase has few requests;
    # one late wake-up on a shared machine must not decide).
    client: list[dict[str, Any]] = []
    upstream: list[dict[str, Any]] = []
    for streams in SMOKE.streams:
        raw = json.loads((out / f"records-direct-{streams}.json").read_text())
        client += raw["client"]
        upstream += raw["upstream"]
    pooled = analyse("direct", 0, client, upstream, gap=SMOKE.gap)
    assert pooled.unmatched == 0 and pooled.failed == 0
    assert pooled.added_ttft_ms_p50 <= 2.0, pooled
    assert abs(pooled.added_gap_ms_p50) <= 2.0, pooled


@pytest.mark.real
def test_proxies_charged_cpu_and_memory(results: dict[str, Any]) -> None:
    for path in ("nginx", "llmtap", "litellm"):
        for streams in SMOKE.streams:
            p = _phase(results, path, streams)
            assert p["cpu_s_per_1000_chunks"] is not None and p["cpu_s_per_1000_chunks"] > 0, p
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
        # Histogram buckets are 9% apart: a wrong unit or metric would be far outside this.
        assert row["prometheus_ms"] is not None
        assert abs(row["hist_error_pct"]) <= 20.0, row


@pytest.mark.real
def test_run_was_isolated_and_described(results: dict[str, Any]) -> None:
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        assert results["netns"] is True
    m = results["machine"]
    assert m["cores"] and m["python"] and "nginx" in m["nginx"] and m["litellm"] and m["aiperf"]
    assert "load average" in results["load_before"] and "load average" in results["load_after"]
