"""The telemetry process's scheduling on a shared core, measured: ``python -m bench.probes.yield_cpu``.

llmtap's whole process tree is pinned to one core (a sidecar with a one-core limit), the upstream, the OTLP
sink and the client to another. For each entry of ``--classes`` (``CLASS`` or ``CLASS/US``: the
``--telemetry-scheduling``, ``nice`` or ``idle``, and the ``--telemetry-yield`` in microseconds, 0 for none, its
default when not given) the same load is sent: bursts of streams, each request on a new connection
(``bench.client``'s burst mode), or with ``--staggered`` keep-alive streams started evenly over one request's
length, one request after another.
Reported: added TTFT as the client sees it (its TTFT less the upstream's own), merged chunks (two content
events in one client read), the relay's wait for the core (``/proc/PID/schedstat``: time runnable but not
running, per time it got the core), relay and telemetry CPU per chunk (telemetry's read once it recorded the
last request), tapes dropped (every reason, from ``/metrics``), and how long the
telemetry process took to record the last request after the load ended (the price of yielding: telemetry
waits for the relay's idle time). ``--hog N`` keeps N busy processes on llmtap's core meanwhile (a core not its
own: telemetry must still keep up, yielding to the relays only). Entries run in turn, ``--rounds`` times. Prints
JSON and a Markdown table.
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
from tests.support.proctree import cpu_seconds, pinned

REPO = Path(__file__).resolve().parents[2]
RECORDED = "llmtap_requests_total"
#: ``--hog``: a process that keeps its core busy (another tenant of the sidecar's core, a busy test machine).
HOG = "while True: pass"
#: The upstream's script: its first chunk this long after the request, the next ones this far apart.
TTFT = 0.05
GAP = 0.02


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


def staggered(url: str, cpu: str, streams: int, requests: int, period: float, chunks: int) -> list[dict[str, Any]]:
    """``streams`` keep-alive streams started evenly over ``period`` s, ``requests`` each; the client's records."""
    argv = [sys.executable, "-m", "bench.client", "--url", url, "--streams", str(streams), "--requests", str(requests)]
    argv += ["--stagger", str(period), "--max-tokens", str(chunks), "--timeout", "60"]
    done = subprocess.run(pinned(argv, cpu), capture_output=True, text=True, timeout=600, check=True)
    records: list[dict[str, Any]] = json.loads(done.stdout)["records"]
    return records


def waits(pids: list[int]) -> tuple[int, int]:
    """Nanoseconds the processes were runnable but not running, and how many times they got the core."""
    waited = slices = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/schedstat").read_text().split()
        except OSError:
            continue
        waited += int(fields[1])
        slices += int(fields[2])
    return waited, slices


def measure(spec: str, args: argparse.Namespace, work: Path, up_port: int, sink_port: int) -> dict[str, Any]:
    """One scheduling entry (``CLASS`` or ``CLASS/US``): the load, and what it cost."""
    how, _, every = spec.partition("/")
    extra = {"LLMTAP_TELEMETRY_SCHEDULING": how}
    if every:
        extra["LLMTAP_TELEMETRY_YIELD"] = every
    name = f"llmtap-{how}-{every or 'default'}"
    ep, admin = peers.llmtap(work, args.proxy_cpu, up_port, sink_port, name=name, extra_env=extra)
    assert ep.service is not None
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        recorded_before = peers.scrape_sum(admin, RECORDED) or 0.0
        peers.records(up_port)  # forget the upstream's records so far
        roles = ep.service.roles()
        relays, telemetry = roles["relay"], roles.get("telemetry", [])
        waited, slices = waits(relays)
        relay_cpu, telemetry_cpu = cpu_seconds(relays), cpu_seconds(telemetry)
        hogs += [subprocess.Popen(pinned([sys.executable, "-c", HOG], args.proxy_cpu)) for _ in range(args.hog)]
        if args.staggered:
            period = TTFT + args.chunks * GAP  # one request's length
            records = staggered(ep.url, args.client_cpu, args.streams, args.requests, period, args.chunks)
        else:
            records = burst(ep.url, args.client_cpu, args.streams, args.bursts, args.period, args.chunks)
        ended = time.perf_counter()
        waited_after, slices_after = waits(relays)
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
        _stop(hogs)
        relay_cpu = cpu_seconds(relays) - relay_cpu
        telemetry_cpu = cpu_seconds(telemetry) - telemetry_cpu
        chunks = args.chunks * len(records)
        added: list[float] = []
        merged = 0
        for r in records:
            if r["error"] or not r["times"]:
                continue
            sent: dict[str, Any] | None = upstream.get(r["id"])
            if sent is None:
                continue
            first_upstream = sent["sent"][0] - sent["arrived"]
            # A burst request's clock starts before its connect; a keep-alive one's when it was sent.
            added.append(r["times"][0] - r.get("start", r.get("sent")) - first_upstream)
            merged += len(r["reads"]) - len(set(r["reads"]))
        got = slices_after - slices
        return {
            "scheduling": spec,
            "requests": len(records),
            "errors": sum(1 for r in records if r["error"]),
            "added_ttft_ms_p50": round(1000 * statistics.median(added), 2) if added else None,
            "added_ttft_ms_p99": round(1000 * _percentile(added, 0.99), 2) if added else None,
            "merged_chunks": merged,
            "relay_wait_ms_per_run": round((waited_after - waited) / 1e6 / got, 3) if got else None,
            "relay_us_per_chunk": round(1e6 * relay_cpu / chunks, 1) if chunks else None,
            "telemetry_us_per_chunk": round(1e6 * telemetry_cpu / chunks, 1) if chunks else None,
            "tapes_dropped": peers.scrape_sum(admin, peers.TAPES_DROPPED),
            "recorded": int(recorded - recorded_before),
            "telemetry_drained_s": round(drained, 2),
        }
    finally:
        _stop(hogs)
        ep.service.stop()


def _stop(hogs: list[subprocess.Popen[bytes]]) -> None:
    """The busy processes gone (at the load's end, or on the way out of a failed entry)."""
    while hogs:
        hog = hogs.pop()
        hog.kill()
        hog.wait()


def main(argv: list[str] | None = None) -> None:
    """Run both classes, side by side."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.yield_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64, help="requests per burst")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--period", type=float, default=2.0, help="seconds between bursts")
    p.add_argument("--chunks", type=int, default=50)
    p.add_argument("--proxy-cpu", dest="proxy_cpu", default="0", help="the core llmtap's whole tree shares")
    p.add_argument("--client-cpu", dest="client_cpu", default="1", help="core of the client, upstream and sink")
    p.add_argument(
        "--classes", default="nice,nice/100,idle,idle/100", help="CLASS or CLASS/YIELD_US entries to compare, in order"
    )
    p.add_argument("--staggered", action="store_true", help="keep-alive streams one request after another, not bursts")
    p.add_argument("--requests", type=int, default=8, help="requests per stream (--staggered)")
    p.add_argument("--rounds", type=int, default=1, help="times each entry runs, in turn")
    p.add_argument(
        "--hog", type=int, default=0, help="busy processes on llmtap's core while each entry runs (a core not its own)"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        up, up_port = peers.upstream(work, args.client_cpu, ttft=TTFT, gap=GAP, chunks=args.chunks)
        sink, sink_port, _ = peers.sink(work, args.client_cpu)
        try:
            specs = args.classes.split(",")
            runs = [measure(spec, args, work, up_port, sink_port) for _ in range(args.rounds) for spec in specs]
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
