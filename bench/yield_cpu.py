"""The telemetry process's scheduling class on a shared core, measured: ``python -m bench.yield_cpu``.

llmtap's whole process tree is pinned to one core (a sidecar with a one-core limit), the upstream, the OTLP
sink and the client to another. For each ``--telemetry-scheduling`` (``nice``: niced by 5, the old
default; ``idle``: SCHED_IDLE, the new one) the same bursts of streams are sent, each request on a new
connection (``bench.client``'s burst mode): added TTFT as the client sees it (its TTFT less the upstream's
own), merged chunks (two content events in one client read), tapes dropped (every reason, from
``/metrics``), and how long the telemetry process took to record the last request after the bursts ended
(the price of yielding: telemetry waits for the relay's idle time). Prints JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import peers
from bench.procs import pinned

REPO = Path(__file__).resolve().parent.parent
RECORDED = "llmtap_requests_total"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def burst(url: str, cpu: str, streams: int, bursts: int, period: float, chunks: int) -> list[dict[str, Any]]:
    """``bursts`` bursts of ``streams`` requests ``period`` seconds apart; the client's records."""
    argv = [sys.executable, "-m", "bench.client", "--url", url, "--streams", str(streams), "--bursts", str(bursts)]
    argv += ["--burst-period", str(period), "--max-tokens", str(chunks), "--timeout", "60"]
    argv += ["--start-at", str(time.perf_counter() + 1.0)]
    done = subprocess.run(pinned(argv, cpu), capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    records: list[dict[str, Any]] = json.loads(done.stdout)["records"]
    return records


def measure(how: str, args: argparse.Namespace, work: Path, up_port: int, sink_port: int) -> dict[str, Any]:
    """One scheduling class: the bursts, and what they cost."""
    extra = {"LLMTAP_TELEMETRY_SCHEDULING": how}
    ep, admin = peers.llmtap(work, args.proxy_cpu, up_port, sink_port, name=f"llmtap-{how}", extra_env=extra)
    assert ep.service is not None
    try:
        recorded_before = peers.scrape_sum(admin, RECORDED) or 0.0
        peers.records(up_port)  # forget the upstream's records so far
        records = burst(ep.url, args.client_cpu, args.streams, args.bursts, args.period, args.chunks)
        ended = time.perf_counter()
        upstream: dict[Any, Any] = {r["id"]: r for r in peers.records(up_port)}
        want = recorded_before + len(records)
        deadline = ended + 120
        recorded = recorded_before
        while time.perf_counter() < deadline:
            recorded = peers.scrape_sum(admin, RECORDED) or 0.0
            if recorded >= want:
                break
            time.sleep(0.05)
        drained = time.perf_counter() - ended
        added: list[float] = []
        merged = 0
        for r in records:
            if r["error"] or not r["times"]:
                continue
            sent: dict[str, Any] | None = upstream.get(r["id"])
            if sent is None:
                continue
            first_upstream = sent["sent"][0] - sent["arrived"]
            added.append(r["times"][0] - r["start"] - first_upstream)
            merged += len(r["reads"]) - len(set(r["reads"]))
        return {
            "scheduling": how,
            "requests": len(records),
            "errors": sum(1 for r in records if r["error"]),
            "added_ttft_ms_p50": round(1000 * statistics.median(added), 2) if added else None,
            "added_ttft_ms_p99": round(1000 * _percentile(added, 0.99), 2) if added else None,
            "merged_chunks": merged,
            "tapes_dropped": peers.scrape_sum(admin, peers.TAPES_DROPPED),
            "recorded": int(recorded - recorded_before),
            "telemetry_drained_s": round(drained, 2),
        }
    finally:
        ep.service.stop()


def main(argv: list[str] | None = None) -> None:
    """Run both classes, side by side."""
    p = argparse.ArgumentParser(prog="python -m bench.yield_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64, help="requests per burst")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--period", type=float, default=2.0, help="seconds between bursts")
    p.add_argument("--chunks", type=int, default=50)
    p.add_argument("--proxy-cpu", dest="proxy_cpu", default="0", help="the core llmtap's whole tree shares")
    p.add_argument("--client-cpu", dest="client_cpu", default="1", help="core of the client, upstream and sink")
    p.add_argument("--classes", default="nice,idle", help="scheduling classes to compare, in order")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        up, up_port = peers.upstream(work, args.client_cpu, ttft=0.05, gap=0.02, chunks=args.chunks)
        sink, sink_port, _ = peers.sink(work, args.client_cpu)
        try:
            runs = [measure(how, args, work, up_port, sink_port) for how in args.classes.split(",")]
        finally:
            up.stop()
            sink.stop()
    print(json.dumps(runs))
    keys = [k for k in runs[0] if k != "scheduling"]
    print("| telemetry scheduling | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for run in runs:
        print(f"| {run['scheduling']} | " + " | ".join(str(run[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
