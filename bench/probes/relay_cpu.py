"""The relay's CPU per chunk alone: ``python -m bench.probes.relay_cpu [--tree DIR ...] [--floor]``.

For each llmtap source tree given (default: this one), starts the benchmark's scripted upstream and the OTLP
sink on the client's core, ``llmtap serve`` with its relay alone on the proxy's core (its telemetry process
moved to the client's core), and ``--streams`` staggered keep-alive streams of ``--chunks`` chunks each; it
reads the relay process's CPU (user and system, from ``/proc``) before and after and prints one JSON line:
CPU microseconds per content chunk, and per request, and the telemetry process's per chunk apart (read once it
has finished the run's tapes). Trees run in turn, ``--rounds`` times, so an A/B on a
shared machine is interleaved; ``--summary`` ends with each tree's median and range. Long streams (``--chunks
400``) show the cost per chunk; the benchmark's own (50 chunks) adds each request's share.

Beside the CPU: ``wakes_per_chunk``, the relay's event-loop sleeps (voluntary context switches of its main
thread) per chunk, which says how many reads each wake-up served: a busy core batches reads, so a loaded
machine shows fewer wakes and less CPU per chunk, and figures are comparable only at similar wakes;
``rss_per_stream_kib``, the relay's resident memory at its peak while the streams were open, less before
them, per stream; and the machine's load average when the run started. ``--floor`` runs the thinnest relay
Python can be (``bench.probes.thin_relay``) in turn with the trees: what a chunk costs any relay on this machine at
this moment (the wake-up, the read, the write, the loopback), so llmtap's own share is the difference.
``--gather MS`` (repeatable) runs each tree once per value of ``telemetry_gather``, in turn: the relay gathering its
tapes for that long against not at all (0), side by side. ``--env LABEL:KEY=VALUE[,KEY=VALUE...]`` (repeatable)
does the same for any of llmtap's settings (its ``LLMTAP_*`` variables): e.g. the record journal on against off
(``--env on:LLMTAP_RECORD_JOURNAL_MB=256 --env off:LLMTAP_RECORD_JOURNAL=off --record``).

``--record`` has each tree write request records (``--record`` into a folder of its own, emptied before each run):
a tree with the record journal then journals every tape it reads, so its cost shows beside a tree without.

``--capture FILE`` (one tree, one round) keeps every byte the telemetry process reads from the relay in FILE, as it
reads it (``CAPTURE_SHIM``), for ``python -m bench.probes.telemetry --tapes FILE`` to play the same tapes again: what
the
work costs warm and paced, beside what this run measured of it in place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import peers
from bench.procs import Sampler
from tests.support.proctree import Service, cpu_seconds, cpu_split, pinned, rss_bytes


def wakes(pids: list[int]) -> int:
    """Voluntary context switches of the processes' main threads: each is one sleep of an event loop."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def run(argv: list[str], cpu: str) -> str:
    """A load client on the client's core; its standard output."""
    env = {**os.environ, "PYTHONPATH": str(peers.REPO)}
    done = subprocess.run(pinned(argv, cpu), capture_output=True, text=True, timeout=600, env=env, check=True)
    return done.stdout


#: Put first on ``llmtap serve``'s PYTHONPATH as ``sitecustomize`` by ``--capture``: once the telemetry process
#: imports its intake (``llmtap.telemetry.process``, which the relay never imports), every read of the relays'
#: channel is appended to ``BENCH_CAPTURE`` before the intake takes it.
CAPTURE_SHIM = """\
# Written by the benchmark (bench/probes/relay_cpu.py --capture): keep what the telemetry process reads from its relays.
import importlib.abc
import importlib.machinery
import os
import sys

_path = os.environ.get("BENCH_CAPTURE")


class _Capture(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "llmtap.telemetry.process":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            intake = module._Intake
            take = intake.data_received
            out = open(_path, "ab")

            def data_received(self, data):
                out.write(data)
                out.flush()
                take(self, data)

            intake.data_received = data_received

        spec.loader.exec_module = exec_module
        return spec


if _path:
    sys.meta_path.insert(0, _Capture())
"""


#: ``--floor``'s entry among the trees: the thinnest relay (``bench.probes.thin_relay``) in place of llmtap.
FLOOR = "floor"


def _records(work: Path) -> Path:
    """The records' folder of a run, empty (the last run's journal would be replayed into this one's figures)."""
    folder = work / "records"
    shutil.rmtree(folder, ignore_errors=True)
    return folder


@dataclass(frozen=True)
class Variant:
    """Settings a tree runs with besides the benchmark's own: a label, llmtap's environment, and the
    ``telemetry_gather`` they set (``--gather``), if any."""

    label: str = ""
    env: tuple[tuple[str, str], ...] = ()
    gather: int | None = None


def variants(args: argparse.Namespace) -> list[Variant]:
    """The variants ``--gather`` and ``--env`` ask for (none asked: the one of the defaults)."""
    out = [Variant(f"gather={ms}ms", (("LLMTAP_TELEMETRY_GATHER", str(ms)),), ms) for ms in args.gather or ()]
    for given in args.env or ():
        label, _, pairs = given.partition(":")
        env = tuple((k.strip(), v.strip()) for k, _, v in (pair.partition("=") for pair in pairs.split(",") if pair))
        if not label or not env or any(not k for k, _ in env):
            raise SystemExit(f"--env {given!r}: LABEL:KEY=VALUE[,KEY=VALUE...] expected")
        out.append(Variant(label, env))
    return out or [Variant()]


def start(
    tree: Path | str, work: Path, args: argparse.Namespace, up_port: int, sink_port: int, variant: Variant = Variant()
) -> tuple[str, Service]:
    """llmtap serve of ``tree`` (or the floor relay), its relay on the proxy's core: its URL and its service."""
    if tree == FLOOR:
        argv = [sys.executable, "-m", "bench.probes.thin_relay", "--upstream-port", str(up_port)]
        svc = Service(
            "thin-relay", argv, log=work / "thin-relay.log", cpu=args.proxy_cpu, env={"PYTHONPATH": str(peers.REPO)}
        )
        port = svc.ready(lambda: int(svc.read_line()))
        return f"http://127.0.0.1:{port}/v1/chat/completions", svc
    shim: list[str] = []
    if args.capture:
        (work / "capture-shim").mkdir(exist_ok=True)
        (work / "capture-shim" / "sitecustomize.py").write_text(CAPTURE_SHIM)
        shim.append(str(work / "capture-shim"))
    here = Path.cwd()
    # ``python -m llmtap`` looks in its working directory first: the tree's own, so its package is what runs.
    os.chdir(tree)
    try:
        ep, _ = peers.llmtap(
            work,
            args.proxy_cpu,
            up_port,
            sink_port,
            extra_env={
                "PYTHONPATH": ":".join([*shim, f"{Path(tree) / 'proxy'}", str(tree)]),
                **({"LLMTAP_RECORD": str(_records(work))} if args.record else {}),
                **dict(variant.env),
                **({"BENCH_CAPTURE": str(args.capture.resolve())} if args.capture else {}),
            },
            telemetry_cpu=args.telemetry_cpu or args.client_cpu,
        )
    finally:
        os.chdir(here)
    assert ep.service is not None
    return ep.url, ep.service


def settled(pids: list[int], quiet: float = 0.004, step: float = 0.5, limit: float = 20.0) -> float:
    """The processes' CPU seconds once they stopped working (under ``quiet`` s of CPU in ``step`` s): the
    telemetry side finishes the tapes after the streams ended."""
    last = cpu_seconds(pids)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(step)
        now = cpu_seconds(pids)
        if now - last < quiet:
            return now
        last = now
    return last


def measure(
    tree: Path | str, work: Path, args: argparse.Namespace, up_port: int, sink_port: int, variant: Variant = Variant()
) -> dict[str, object]:
    """One tree, one run with ``variant``'s settings: relay CPU per chunk and per request."""
    url, svc = start(tree, work, args, up_port, sink_port, variant)
    try:
        roles = svc.roles()
        relay, telemetry = roles["relay"], roles.get("telemetry", [])
        period = args.ttft + args.chunks * args.gap
        argv = [
            sys.executable, "-m", "bench.client", "--url", url, "--streams", "4", "--requests", "1",
            "--stagger", "0.1", "--max-tokens", str(args.chunks),
        ]  # fmt: skip
        run(argv, args.client_cpu)  # warm: lazy imports, the upstream pool
        time.sleep(1.0)
        load = os.getloadavg()[0]
        before, system_before, wakes_before = cpu_seconds(relay), cpu_split(relay)[1], wakes(relay)
        telemetry_before = cpu_seconds(telemetry) if telemetry else 0.0
        rss_before = rss_bytes(relay)
        argv = [
            sys.executable, "-m", "bench.client", "--url", url, "--streams", str(args.streams),
            "--requests", str(args.requests), "--stagger", str(period), "--max-tokens", str(args.chunks),
        ]  # fmt: skip
        with Sampler(svc) as sampler:
            records = json.loads(run(argv, args.client_cpu))["records"]
        spent = cpu_seconds(relay) - before
        telemetry_spent = settled(telemetry) - telemetry_before if telemetry else None
        system = cpu_split(relay)[1] - system_before
        slept = wakes(relay) - wakes_before
        rss_peak = max((rss for _, rss in sampler.samples), default=rss_before)
    finally:
        svc.stop()
    requests = len(records)
    chunks = requests * args.chunks
    return {
        "tree": str(tree),
        **({"gather_ms": variant.gather} if variant.gather is not None else {}),
        **({"variant": variant.label} if variant.label else {}),
        "streams": args.streams,
        "chunks_per_request": args.chunks,
        "requests": requests,
        "failed": sum(1 for r in records if r.get("error")),
        "relay_cpu_s": round(spent, 3),
        "relay_kernel_share": round(system / spent, 2) if spent > 0 else None,
        "relay_us_per_chunk": round(1e6 * spent / chunks, 1) if chunks else None,
        "relay_us_per_request": round(1e6 * spent / requests, 1) if requests else None,
        "telemetry_us_per_chunk": round(1e6 * telemetry_spent / chunks, 1) if chunks and telemetry_spent else None,
        "wakes_per_chunk": round(slept / chunks, 2) if chunks else None,
        "rss_per_stream_kib": round((rss_peak - rss_before) / 1024 / args.streams, 1),
        "rss_before_mib": round(rss_before / (1 << 20), 1),
        "rss_peak_mib": round(rss_peak / (1 << 20), 1),
        "load": round(load, 2),
    }


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.relay_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", type=Path, help="an llmtap source tree (repeatable; default: this one)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--chunks", type=int, default=400)
    p.add_argument("--gap", type=float, default=0.010)
    p.add_argument("--ttft", type=float, default=0.020)
    p.add_argument("--requests", type=int, default=1, help="requests per stream")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--proxy-cpu", default="0")
    p.add_argument("--client-cpu", default="1")
    p.add_argument(
        "--telemetry-cpu", help="core(s) of llmtap's telemetry process (default: the client's, beside the upstream)"
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="measure the thinnest relay too (bench.probes.thin_relay), in turn with the trees",
    )
    p.add_argument(
        "--gather",
        action="append",
        type=int,
        metavar="MS",
        help="run each tree with this telemetry_gather (repeatable: one run of each, in turn)",
    )
    p.add_argument(
        "--env",
        action="append",
        metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="run each tree with these llmtap variables too (repeatable: one run of each, in turn)",
    )
    p.add_argument("--summary", action="store_true", help="end with each tree's median and range per figure")
    p.add_argument(
        "--record", action="store_true", help="each tree writes request records (its journal, if it has one)"
    )
    p.add_argument(
        "--capture",
        type=Path,
        metavar="FILE",
        help="keep what the telemetry process reads from the relay in FILE (one tree, one round; for "
        "bench.probes.telemetry --tapes)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    trees: list[Path | str] = [*(args.tree or [peers.REPO]), *([FLOOR] if args.floor else [])]
    chosen = variants(args)
    if args.capture and (len(trees) != 1 or args.rounds != 1 or len(chosen) != 1):
        p.error("--capture takes one tree, one round and at most one --gather or --env")
    if args.capture:
        args.capture.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="relay-cpu-") as folder:
        work = Path(folder)
        up, up_port = peers.upstream(work, args.client_cpu, ttft=args.ttft, gap=args.gap, chunks=args.chunks)
        sink, sink_port, _ = peers.sink(work, args.client_cpu)
        entries = [(t, v) for t in trees for v in (chosen if t != FLOOR else [Variant()])]
        results: dict[str, list[dict[str, Any]]] = {_name(t, v): [] for t, v in entries}
        try:
            for _ in range(args.rounds):
                for tree, variant in entries:
                    result = measure(tree, work, args, up_port, sink_port, variant)
                    results[_name(tree, variant)].append(result)
                    print(json.dumps(result), flush=True)
        finally:
            sink.stop()
            up.stop()
        if args.summary:
            for tree, runs in results.items():
                print(json.dumps({"tree": tree, "runs": len(runs), **summary(runs)}), flush=True)
    return 0


def _name(tree: Path | str, variant: Variant) -> str:
    return f"{tree} {variant.label}" if variant.label else str(tree)


SUMMARIZED = (
    "relay_us_per_chunk",
    "telemetry_us_per_chunk",
    "relay_us_per_request",
    "wakes_per_chunk",
    "rss_per_stream_kib",
    "load",
)


def summary(runs: list[dict[str, Any]]) -> dict[str, object]:
    """Each figure's median over the runs and its range (lowest, highest)."""
    out: dict[str, object] = {}
    for key in SUMMARIZED:
        values = sorted(float(r[key]) for r in runs if r.get(key) is not None)
        if values:
            out[key] = {"median": round(statistics.median(values), 2), "range": [values[0], values[-1]]}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
