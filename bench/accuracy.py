"""Accuracy: what llmtap reports against what a client measures (aiperf), and its histograms against its exact figures.

A fresh llmtap (full telemetry) sits in front of an upstream whose TTFT is spread log-uniformly
(a single repeated TTFT would say little about percentiles); aiperf measures TTFT and ITL through it.
llmtap's figures are read two ways: exactly, from the root span of each request that reached the OTLP
sink, and from its Prometheus histograms through a real Prometheus's ``histogram_quantile``.

* aiperf against llmtap's exact figures: only the requests of aiperf's profiling phase (aiperf warms
  up first so that its own connection set-up is not in its TTFT), matched by start time;
* histogram against exact: every request the instance saw, so both sides read the same population.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import peers
from bench.stats import percentile_ms
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS
from tests.support.proctree import Service, pinned
from tests.support.prometheus import promql

TTFT_ATTR = "gen_ai.response.time_to_first_chunk"
TPOT_ATTR = "llmtap.time_per_output_token"
TTFT_METRIC = "llmtap_time_to_first_token_seconds"  # fine buckets, as the gen_ai.* one has by default
QUANTILES = (50, 95, 99)


@dataclass
class AccuracyPlan:
    """aiperf's load for the accuracy run."""

    concurrency: int
    requests: int
    warmup: int


def read_roots(path: Path, offset: int) -> list[dict[str, Any]]:
    """Root-span records the sink wrote after ``offset``."""
    out = []
    with path.open(encoding="utf-8") as f:
        f.seek(offset)
        for line in f:
            record = json.loads(line)
            if "trace" in record:
                out.append(record)
    return out


def _wait_roots(path: Path, offset: int, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    roots = read_roots(path, offset)
    while len(roots) < count and time.monotonic() < deadline:
        time.sleep(0.5)
        roots = read_roots(path, offset)
    return roots


def _aiperf(work: Path, cpu: str | None, url: str, plan: AccuracyPlan) -> Path:
    out = work / "aiperf"
    argv = [
        str(peers.AIPERF),
        "profile",
        "--model",
        "bench",
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        "builtin",
        "--concurrency",
        str(plan.concurrency),
        "--request-count",
        str(plan.requests),
        "--warmup-request-count",
        str(plan.warmup),
        "--isl",
        "64",
        "--osl",
        "50",
        "--use-server-token-count",
        "--no-server-metrics",
        "--ui",
        "none",
        "--workers-max",
        "2",
        "--record-processor-service-count",
        "1",
        "--artifact-dir",
        str(out),
    ]
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(peers.tiktoken_cache(work))}
    log = work / "aiperf.log"
    with log.open("wb") as f:
        import subprocess

        rc = subprocess.run(pinned(argv, cpu), stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    if rc != 0:
        raise RuntimeError(f"aiperf exited with {rc}; see {log}")
    return out


def _profile_window(out: Path) -> tuple[int, int]:
    """Wall-clock ns of the first profiling request's start and the last one's end, from aiperf's records."""
    starts, ends = [], []
    with (out / "profile_export.jsonl").open(encoding="utf-8") as f:
        for line in f:
            meta = json.loads(line)["metadata"]
            if meta.get("benchmark_phase", "profiling") == "profiling":
                starts.append(int(meta["request_start_ns"]))
                ends.append(int(meta["request_end_ns"]))
    return min(starts), max(ends)


def _wait_prometheus(port: int, count: int, timeout: float = 30.0) -> float | None:
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = promql(port, f"sum({TTFT_METRIC}_count)")
        if seen is not None and seen >= count:
            return seen
        time.sleep(0.5)
    return seen


def run(
    work: Path, *, proxy_cpu: str | None, client_cpu: str | None, sink_port: int, sink_file: Path, plan: AccuracyPlan
) -> dict[str, Any]:
    """The accuracy figures; every started process is stopped before returning."""
    started: list[Service] = []
    try:
        up, up_port = peers.upstream(work, client_cpu, ttft=0.02, gap=0.02, chunks=50, ttft_max=0.5)
        started.append(up)
        offset = sink_file.stat().st_size
        ep, admin = peers.llmtap(work, proxy_cpu, up_port, sink_port, name="llmtap-accuracy")
        assert ep.service is not None
        started.append(ep.service)
        prom, prom_port = peers.prometheus(work, client_cpu, admin)
        started.append(prom)
        out = _aiperf(work, client_cpu, ep.url.rsplit("/v1/", 1)[0], plan)
        total = plan.requests + plan.warmup
        roots = _wait_roots(sink_file, offset, total)
        prom_count = _wait_prometheus(prom_port, len(roots))
        start_ns, end_ns = _profile_window(out)
        profiled = [r for r in roots if start_ns <= r["start_ns"] <= end_ns]
        aiperf = json.loads((out / "profile_export_aiperf.json").read_text())
        return _figures(roots, profiled, aiperf, prom_port, prom_count, plan)
    finally:
        for svc in reversed(started):
            svc.stop()


def hist_bounds(samples: list[float], q: float) -> tuple[float, float]:
    """The bucket (seconds) in which ``histogram_quantile(q, ...)`` must answer for these samples in llmtap's fine
    buckets: the one holding the sample of rank ``q * n`` (Prometheus's rank), which it interpolates inside.

    The exact quantile (linear between the closest ranks) may lie outside it when few samples sit far apart, as
    p99 of a few dozen does: a histogram cannot know where inside a bucket its samples were."""
    ordered = sorted(samples)
    k = max(math.ceil(q * len(ordered)) - 1, 0)
    i = bisect.bisect_left(DURATION_BUCKETS, ordered[k])  # a value equal to a bound counts in that bound's bucket
    lo = DURATION_BUCKETS[i - 1] if i > 0 else 0.0
    hi = DURATION_BUCKETS[i] if i < len(DURATION_BUCKETS) else DURATION_BUCKETS[-1]
    return lo, hi


def _figures(
    roots: list[dict[str, Any]],
    profiled: list[dict[str, Any]],
    aiperf: dict[str, Any],
    prom_port: int,
    prom_count: float | None,
    plan: AccuracyPlan,
) -> dict[str, Any]:
    ms = 1000.0
    all_ttft = [r["attrs"][TTFT_ATTR] for r in roots if TTFT_ATTR in r["attrs"]]
    prof_ttft = [r["attrs"][TTFT_ATTR] for r in profiled if TTFT_ATTR in r["attrs"]]
    prof_tpot = [r["attrs"][TPOT_ATTR] for r in profiled if TPOT_ATTR in r["attrs"]]
    rows = []
    for q in QUANTILES:
        ref = float(aiperf["time_to_first_token"][f"p{q}"])
        exact = percentile_ms(prof_ttft, q)
        exact_all = percentile_ms(all_ttft, q)
        hist = promql(prom_port, f"histogram_quantile({q / 100}, sum by (le) ({TTFT_METRIC}_bucket))")
        hist_ms = hist * ms if hist is not None else None
        rows.append(
            {
                "quantile": q,
                "aiperf_ms": ref,
                "llmtap_exact_ms": exact,
                "diff_ms": exact - ref,
                "allowed_ms": 2.0 + 0.02 * ref,
                "ok_vs_aiperf": abs(exact - ref) <= 2.0 + 0.02 * ref,
                "llmtap_exact_all_ms": exact_all,
                "prometheus_ms": hist_ms,
                "hist_error_pct": None if hist_ms is None else 100.0 * (hist_ms - exact_all) / exact_all,
                "hist_bucket_ms": [bound * ms for bound in hist_bounds(all_ttft, q / 100)] if all_ttft else None,
                "ok_hist": hist_ms is not None and abs(hist_ms - exact_all) <= 0.05 * exact_all,
            }
        )
    itl = aiperf.get("inter_token_latency", {})
    return {
        "concurrency": plan.concurrency,
        "aiperf_requests": int(aiperf["request_count"]["avg"]),
        "llmtap_requests_all": len(roots),
        "llmtap_requests_profiled": len(prof_ttft),
        "prometheus_count": prom_count,
        "aiperf_version": aiperf.get("aiperf_version"),
        "ttft": rows,
        "itl_p50_ms": {"aiperf": itl.get("p50"), "llmtap_tpot": percentile_ms(prof_tpot, 50)},
        "itl_p99_ms": {"aiperf": itl.get("p99"), "llmtap_tpot": percentile_ms(prof_tpot, 99)},
    }
