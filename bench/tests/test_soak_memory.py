"""The memory soak (``python -m bench.probes.soak --memory``): its arithmetic, and a short run of the whole thing.

The full run (40 minutes, ``bench/RESULTS.md``) is too long for the suite; the short one checks that every process
is sampled, that the probe finds each bounded structure inside llmtap with its bound, and that none of them
is past its bound after overload phases with the telemetry process stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.probes.soak_memory import MB, last_half, metric_sum, slope_mb_per_min, smaps

ROOT = Path(__file__).resolve().parents[2]
#: What the probe must find in the telemetry process, each with its bound.
BOUNDED = (
    "open_streams",
    "gone_streams",
    "prefix_index",
    "token_counts",
    "join_held",
    "join_early",
    "join_recent",
    "trace_ids_known",
    "spans_waiting",
    "estimator_completions",
    "live_samples",
    "live_requests",
    "sdk_attribute_sets",
    "labels_model",
    "labels_dimension_tenant",
)


def test_growth_is_a_least_squares_slope_in_mb_a_minute() -> None:
    rising = [(t, 100 * MB + t / 60 * MB + (MB if t % 20 == 0 else 0)) for t in range(0, 600, 5)]
    slope = slope_mb_per_min(rising)
    assert slope is not None and slope == pytest.approx(1.0, abs=0.02)
    assert slope_mb_per_min([(t, 100 * MB) for t in range(0, 600, 5)]) == 0.0
    assert slope_mb_per_min([(0, MB), (5, MB)]) is None


def test_the_last_half_is_whole_periods_where_there_are_overload_phases() -> None:
    assert last_half(2700, 300, 45) == (1500, 2700)  # four periods, each ending in its overload phase
    assert last_half(2400, 300, 30) == (1200, 2400)
    assert last_half(100, 300, 30) == (50, 100)  # not one whole period in it: the plain second half
    assert last_half(600, 300, 0) == (300, 600)


def test_smaps_reads_this_process_and_none_for_one_gone() -> None:
    mem = smaps(os.getpid())
    assert mem is not None and mem["rss"] >= mem["pss"] >= mem["uss"] > 0
    assert smaps(2**22 + 12345) is None


def test_metric_sum_adds_a_metrics_lines_with_the_label() -> None:
    page = (
        'llmtap_telemetry_tapes_dropped_total{reason="queue_full"} 3.0\n'
        'llmtap_telemetry_tapes_dropped_total{reason="evicted"} 2\n'
        "llmtap_telemetry_tapes_dropped_created 1.7e9\n"
        "llmtap_requests_total 9\n"
    )
    assert metric_sum(page, "llmtap_telemetry_tapes_dropped_total") == 5.0
    assert metric_sum(page, "llmtap_telemetry_tapes_dropped_total", '="evicted"') == 2.0
    assert metric_sum(page, "llmtap_requests_total") == 9.0


@pytest.mark.e2e
def test_a_short_memory_soak_samples_both_processes_and_finds_every_bound(tmp_path: Path) -> None:
    argv = ["--memory", "--duration", "45", "--rate", "40", "--overload-rate", "80", "--period", "25",
            "--burst", "10", "--stall", "4", "--sample", "2", "--json", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "bench.probes.soak", *argv], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert done.returncode == (0 if result["flat"] else 1)
    assert set(result["processes"]) == {"relay", "telemetry"}
    for p in result["processes"].values():
        assert p["rss_plateau_mb"] > 0 and p["rss_growth_last_half_mb_per_min"] is not None
    assert result["load"].get("status_200", 0) > 1000, result["load"]
    assert result["overload"]["stalls"] >= 1
    fills = result["fills"]["telemetry"]
    for name in BOUNDED:
        assert name in fills and fills[name]["bound"], name
    # The last reading within each bound (one taken mid-update, from the probe's thread, may show an entry more).
    assert all(f["last"] <= f["bound"] for f in fills.values() if f["bound"] is not None), fills
    assert fills["prefix_index"]["max"] > 0 and fills["live_samples"]["max"] > 0
    assert "targets" in result["fills"]["relay"]


def test_the_memory_soak_runs_the_load_with_the_shape_it_was_given() -> None:
    """The load's shape options are one set (``soak_load.add_shape``): what the memory soak parsed reaches the load
    as it was, and a shape option the memory soak does not name keeps the load's default."""
    from bench.probes import soak_load, soak_memory

    given = soak_memory.parser().parse_args(["--rate", "50", "--burst", "0", "--tenants", "7"])
    argv = ["--url", "http://127.0.0.1:1/v1/chat/completions", "--duration", "3", *soak_load.shape_argv(given)]
    load = soak_load.parser().parse_args(argv)
    assert {name: getattr(load, name) for name in soak_load.SHAPE} == {
        "rate": 50.0,
        "overload_rate": 400.0,
        "period": 300.0,
        "burst": 0.0,
        "tenants": 7,
    }
