"""The relay's CPU per chunk alone (issue 29): ``python -m bench.relay_cpu [--tree DIR ...]``.

For each llmtap source tree given (default: this one), starts the benchmark's scripted upstream and the OTLP
sink on the client's core, ``llmtap serve`` with its relay alone on the proxy's core (its telemetry process
moved to the client's core), and ``--streams`` staggered keep-alive streams of ``--chunks`` chunks each; it
reads the relay process's CPU (user and system, from ``/proc``) before and after and prints one JSON line:
CPU microseconds per content chunk, and per request. Trees run in turn, ``--rounds`` times, so an A/B on a
shared machine is interleaved; compare the lowest figures. Long streams (``--chunks 400``) show the cost per
chunk; the benchmark's own (50 chunks) adds each request's share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import peers
from bench.procs import Service, cpu_seconds, cpu_split, pinned


def run(argv: list[str], cpu: str) -> str:
    """A load client on the client's core; its standard output."""
    env = {**os.environ, "PYTHONPATH": str(peers.REPO)}
    done = subprocess.run(pinned(argv, cpu), capture_output=True, text=True, timeout=600, env=env, check=True)
    return done.stdout


def measure(tree: Path, work: Path, args: argparse.Namespace, up_port: int, sink_port: int) -> dict[str, object]:
    """One tree, one run: relay CPU per chunk and per request."""
    here = Path.cwd()
    # ``python -m llmtap`` looks in its working directory first: the tree's own, so its package is what runs.
    os.chdir(tree)
    try:
        ep, _ = peers.llmtap(
            work,
            args.proxy_cpu,
            up_port,
            sink_port,
            extra_env={"PYTHONPATH": f"{tree / 'proxy'}:{tree}"},
            telemetry_cpu=args.client_cpu,
        )
    finally:
        os.chdir(here)
    assert ep.service is not None
    svc: Service = ep.service
    try:
        relay = svc.roles()["relay"]
        period = args.ttft + args.chunks * args.gap
        argv = [
            sys.executable, "-m", "bench.client", "--url", ep.url, "--streams", "4", "--requests", "1",
            "--stagger", "0.1", "--max-tokens", str(args.chunks),
        ]  # fmt: skip
        run(argv, args.client_cpu)  # warm: lazy imports, the upstream pool
        time.sleep(1.0)
        before, system_before = cpu_seconds(relay), cpu_split(relay)[1]
        argv = [
            sys.executable, "-m", "bench.client", "--url", ep.url, "--streams", str(args.streams),
            "--requests", str(args.requests), "--stagger", str(period), "--max-tokens", str(args.chunks),
        ]  # fmt: skip
        records = json.loads(run(argv, args.client_cpu))["records"]
        spent = cpu_seconds(relay) - before
        system = cpu_split(relay)[1] - system_before
    finally:
        svc.stop()
    requests = len(records)
    chunks = requests * args.chunks
    return {
        "tree": str(tree),
        "streams": args.streams,
        "chunks_per_request": args.chunks,
        "requests": requests,
        "failed": sum(1 for r in records if r.get("error")),
        "relay_cpu_s": round(spent, 3),
        "relay_kernel_share": round(system / spent, 2) if spent > 0 else None,
        "relay_us_per_chunk": round(1e6 * spent / chunks, 1) if chunks else None,
        "relay_us_per_request": round(1e6 * spent / requests, 1) if requests else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", type=Path, help="an llmtap source tree (repeatable; default: this one)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--chunks", type=int, default=400)
    p.add_argument("--gap", type=float, default=0.010)
    p.add_argument("--ttft", type=float, default=0.020)
    p.add_argument("--requests", type=int, default=1, help="requests per stream")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--proxy-cpu", default="0")
    p.add_argument("--client-cpu", default="1")
    args = p.parse_args(argv)
    trees = args.tree or [peers.REPO]
    with tempfile.TemporaryDirectory(prefix="relay-cpu-") as folder:
        work = Path(folder)
        up, up_port = peers.upstream(work, args.client_cpu, ttft=args.ttft, gap=args.gap, chunks=args.chunks)
        sink, sink_port, _ = peers.sink(work, args.client_cpu)
        try:
            for _ in range(args.rounds):
                for tree in trees:
                    print(json.dumps(measure(tree, work, args, up_port, sink_port)), flush=True)
        finally:
            sink.stop()
            up.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
