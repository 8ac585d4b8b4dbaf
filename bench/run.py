"""The benchmark harness: ``python -m bench`` (full run) or ``python -m bench --smoke`` (about a minute).

One run, one upstream, four paths: direct, nginx, LiteLLM and llmtap with full telemetry. The proxy under
test is pinned to one core and everything else (client, upstream, OTLP sink, Prometheus, aiperf) to the
other. As root, the run re-executes itself inside ``unshare -n`` (loopback only), so nothing can leave
the machine. Results go to ``bench/out/<time>/results.json``; a full run with ``--write`` also rewrites
the figures block of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import accuracy, peers, report
from bench.peers import Endpoint
from bench.procs import Sampler, Service, pinned, quiesce
from bench.stats import PathFigures, analyse, crossing
from proxy.stats import quantile

PATHS = ("direct", "nginx", "llmtap", "litellm")
IN_NETNS = "BENCH_IN_NETNS"


@dataclass
class Plan:
    """How much load each part of a run gets."""

    streams: tuple[int, ...]
    requests: dict[int, int]
    ramp: tuple[int, ...]
    ramp_requests: int
    accuracy: accuracy.AccuracyPlan
    chunks: int = 50
    gap: float = 0.020
    ttft: float = 0.020
    streams_per_client: int = 64
    #: Streams for the --workers comparison (None: skipped).
    workers_streams: int | None = None
    idle_probe: float = 3.0
    extra: dict[str, Any] = field(default_factory=dict)


FULL = Plan(
    streams=(1, 64, 256),
    requests={1: 30, 64: 6, 256: 4},
    ramp=(4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512),
    ramp_requests=3,
    accuracy=accuracy.AccuracyPlan(concurrency=16, requests=320, warmup=32),
    workers_streams=64,
)
SMOKE = Plan(
    streams=(1, 8),
    requests={1: 3, 8: 2},
    ramp=(16,),
    ramp_requests=1,
    idle_probe=1.0,
    accuracy=accuracy.AccuracyPlan(concurrency=4, requests=16, warmup=4),
)


class Bench:
    """One run: the shared upstream and sink, the cores, and the figures gathered so far."""

    def __init__(self, work: Path, plan: Plan, proxy_cpu: str | None, client_cpu: str | None) -> None:
        self.work = work
        self.plan = plan
        self.proxy_cpu = proxy_cpu
        self.client_cpu = client_cpu
        self.services: list[Service] = []
        self.results: dict[str, Any] = {"phases": [], "ramp": []}
        self.idle_cpu: dict[str, float] = {}

    def start_shared(self) -> None:
        """The upstream and the OTLP sink, on the client's core."""
        p = self.plan
        up, self.up_port = peers.upstream(self.work, self.client_cpu, ttft=p.ttft, gap=p.gap, chunks=p.chunks)
        sink, self.sink_port, self.sink_file = peers.sink(self.work, self.client_cpu)
        self.services += [up, sink]

    def stop_all(self) -> None:
        """Stop everything still running, newest first."""
        for svc in reversed(self.services):
            svc.stop()
        self.services.clear()

    def endpoint(self, name: str) -> Endpoint:
        """Start one path."""
        url = f"http://127.0.0.1:{self.up_port}/v1/chat/completions"
        if name == "direct":
            return Endpoint("direct", url, None)
        if name == "nginx":
            ep = peers.nginx(self.work, self.proxy_cpu, self.up_port)
        elif name == "litellm":
            ep = peers.litellm(self.work, self.proxy_cpu, self.up_port)
        else:
            ep, self.admin_port = peers.llmtap(self.work, self.proxy_cpu, self.up_port, self.sink_port)
        assert ep.service is not None
        self.services.append(ep.service)
        return ep

    def clients(self, ep: Endpoint, streams: int, requests: int, tag: str) -> tuple[list[dict[str, Any]], float]:
        """Run the load client processes; return their records and CPU seconds."""
        procs = max(1, math.ceil(streams / self.plan.streams_per_client))
        start_at = time.perf_counter() + 1.0 + 0.3 * procs
        per = [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]
        running = []
        offset = 0
        for n in per:
            argv = [
                sys.executable, "-m", "bench.client", "--url", ep.url, "--streams", str(n),
                "--offset", str(offset), "--total-streams", str(streams), "--requests", str(requests),
                "--stagger", str(self.plan.ttft + self.plan.chunks * self.plan.gap), "--start-at", str(start_at),
                "--tag", tag, "--max-tokens", str(self.plan.chunks),
            ]  # fmt: skip
            if ep.auth:
                argv += ["--auth", ep.auth]
            env = {**os.environ, "PYTHONPATH": str(peers.REPO)}
            running.append(subprocess.Popen(pinned(argv, self.client_cpu), stdout=subprocess.PIPE, env=env))
            offset += n
        records: list[dict[str, Any]] = []
        cpu = 0.0
        for proc in running:
            out, _ = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"load client exited with {proc.returncode}")
            doc = json.loads(out)
            records += doc["records"]
            cpu += doc["cpu"]
        return records, cpu

    def warm(self, ep: Endpoint) -> float:
        """A few requests first (lazy imports, pools); returns the path's resident bytes when idle after them."""
        self.clients(ep, 4, 2, f"{ep.name}-warm")
        peers.records(self.up_port)
        if ep.service is None:
            return 0.0
        before = quiesce(ep.service)
        # What the path burns doing nothing (timers, exporters): charged to every phase's CPU too.
        time.sleep(self.plan.idle_probe)
        self.idle_cpu[ep.name] = 1000 * (ep.service.cpu() - before) / self.plan.idle_probe
        return float(ep.service.rss())

    def phase(self, ep: Endpoint, streams: int, requests: int, idle_rss: float, tag: str) -> PathFigures:
        """One measured phase of one path at one concurrency."""
        cpu0 = quiesce(ep.service) if ep.service is not None else 0.0
        if ep.service is not None:
            sys0 = ep.service.cpu_system()
            with Sampler(ep.service) as sampler:
                records, client_cpu = self.clients(ep, streams, requests, tag)
            cpu1 = quiesce(ep.service)
            sys1 = ep.service.cpu_system()
        else:
            records, client_cpu = self.clients(ep, streams, requests, tag)
        upstream = peers.records(self.up_port)
        raw = {"client": records, "upstream": upstream}
        (self.work / f"records-{tag}.json").write_text(json.dumps(raw))
        fig = analyse(ep.name, streams, records, upstream, gap=self.plan.gap)
        fig.client_cpu_s = client_cpu
        if ep.service is not None:
            fig.cpu_s = cpu1 - cpu0
            fig.cpu_system_share = (sys1 - sys0) / fig.cpu_s if fig.cpu_s > 0 else None
            fig.idle_cpu_ms_per_s = self.idle_cpu.get(ep.name)
            fig.cpu_s_per_1000_chunks = fig.cpu_s / (fig.chunks / 1000) if fig.chunks else None
            fig.rss_idle_mib = idle_rss / 2**20
            fig.rss_peak_mib = sampler.peak / 2**20
            fig.rss_kib_per_stream = (sampler.peak - idle_rss) / 1024 / streams
        print(report.phase_line(fig), flush=True)
        return fig

    def run_path(self, name: str, *, ramp: bool, phases: bool = True) -> None:
        """All concurrencies of one path (and llmtap's ramp), then stop it."""
        ep = self.endpoint(name)
        try:
            idle = self.warm(ep)
            for streams in self.plan.streams if phases else ():
                fig = self.phase(ep, streams, self.plan.requests[streams], idle, f"{name}-{streams}")
                self.results["phases"].append(fig.as_dict())
            if ramp:
                self.ramp(ep, idle)
        finally:
            if ep.service is not None:
                ep.service.stop()
                self.services.remove(ep.service)

    def ramp(self, ep: Endpoint, idle: float) -> None:
        """More streams at 50 chunks/s each, past the point where llmtap's added gap p99 passes 5 ms, until it
        falls behind (the phase takes a quarter longer than the script) or its gap p99 passes 50 ms."""
        points = []
        p = self.plan
        for streams in p.ramp:
            fig = self.phase(ep, streams, p.ramp_requests, idle, f"ramp-{streams}")
            self.results["ramp"].append(fig.as_dict())
            points.append((fig.chunks_per_s, fig.added_gap_ms_p99))
            period = p.ttft + p.chunks * p.gap
            scripted = period * (1 + p.ramp_requests)  # the starts are staggered over one period
            if fig.seconds > 1.25 * scripted or fig.added_gap_ms_p99 > 50.0:
                break
        self.results["ramp_crossing_chunks_per_s"] = crossing(points, 5.0)

    def workers(self) -> None:
        """llmtap with one and with two workers, free on both cores: added figures, memory, scrape time."""
        streams = self.plan.workers_streams
        assert streams is not None
        rows = self.results.setdefault("workers", [])
        for n in (1, 2):
            ep, admin = peers.llmtap(self.work, None, self.up_port, self.sink_port, name=f"llmtap-w{n}", workers=n)
            assert ep.service is not None
            self.services.append(ep.service)
            try:
                idle = self.warm(ep)
                fig = self.phase(ep, streams, self.plan.requests[streams], idle, f"workers-{n}")
                scrapes = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
                        size = len(r.read())
                    scrapes.append(1000 * (time.perf_counter() - t0))
                rows.append({**fig.as_dict(), "workers": n, "scrape_ms_p50": quantile(scrapes, 0.5),
                             "scrape_bytes": size})  # fmt: skip
            finally:
                ep.service.stop()
                self.services.remove(ep.service)


def machine() -> dict[str, Any]:
    """What the run ran on, and how busy the machine was."""
    model = ""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for dist in ("uvicorn", "uvloop", "httptools", "httpx", "opentelemetry-sdk"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "nginx": _out(["nginx", "-v"]),
        "litellm": _version(peers.TOOLS / "litellm/bin/python", "litellm"),
        "aiperf": _version(peers.TOOLS / "aiperf/bin/python", "aiperf"),
        "prometheus": _out(["prometheus", "--version"]).split("\n")[0],
    }


def load() -> str:
    """``uptime``'s load averages."""
    return _out(["uptime"])


def _out(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).strip()


def _version(python: Path, dist: str) -> str:
    """The version of a distribution installed in another virtual environment."""
    return _out([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"])


def _netns(argv: list[str]) -> None:
    """Re-execute inside a network namespace with only loopback (root only); return when that is not possible."""
    if os.environ.get(IN_NETNS) or os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        return
    os.environ[IN_NETNS] = "1"
    script = 'ip link set lo up && exec "$@"'
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, "-m", "bench", *argv])


def parser() -> argparse.ArgumentParser:
    """The harness's command line."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small counts (about a minute); what CI runs")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--no-ramp", dest="ramp", action="store_false", help="skip llmtap's ramp")
    p.add_argument("--ramp-only", dest="ramp_only", action="store_true", help="with --paths llmtap: the ramp alone")
    p.add_argument("--no-accuracy", dest="accuracy", action="store_false", help="skip the aiperf/Prometheus part")
    p.add_argument("--no-workers", dest="workers", action="store_false", help="skip the --workers 1 and 2 comparison")
    p.add_argument("--no-netns", dest="netns", action="store_false", help="do not re-run inside unshare -n")
    p.add_argument("--out", help="results folder (default bench/out/<time>)")
    p.add_argument("--proxy-cpu", default="0", help="core of the proxy under test")
    p.add_argument("--client-cpu", default="1", help="core(s) of client, upstream, sink, Prometheus, aiperf")
    p.add_argument("--write", action="store_true", help="rewrite the figures block of bench/RESULTS.md")
    p.add_argument(
        "--nice",
        type=int,
        help="niceness of the whole run (default -10 for a full run as root, so other work on a shared machine "
        "disturbs it less; 0 in smoke mode)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print where the results are."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.netns:
        _netns(argv)
    paths = [p for p in args.paths.split(",") if p]
    absent = {
        k: v for k, v in peers.missing().items() if k in paths or (args.accuracy and k in ("aiperf", "prometheus"))
    }
    if absent:
        print("missing: " + "; ".join(f"{k} ({v})" for k, v in absent.items()), file=sys.stderr)
        return 3
    plan = SMOKE if args.smoke else FULL
    nice = args.nice if args.nice is not None else (0 if args.smoke or os.geteuid() != 0 else -10)
    if nice:
        os.nice(nice)
    work = Path(args.out or peers.REPO / "bench" / "out" / time.strftime("%Y%m%d-%H%M%S"))
    work.mkdir(parents=True, exist_ok=True)
    single_core = (os.cpu_count() or 1) < 2
    bench = Bench(work, plan, None if single_core else args.proxy_cpu, None if single_core else args.client_cpu)
    results = bench.results
    results.update(
        mode="smoke" if args.smoke else "full",
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        netns=bool(os.environ.get(IN_NETNS)),
        nice=os.nice(0),
        machine=machine(),
        load_before=load(),
        plan={"streams": plan.streams, "requests": plan.requests, "ramp": plan.ramp, "chunks": plan.chunks,
              "gap_ms": plan.gap * 1000, "ttft_ms": plan.ttft * 1000},
    )  # fmt: skip
    try:
        bench.start_shared()
        for name in paths:
            bench.run_path(name, ramp=args.ramp and name == "llmtap", phases=not args.ramp_only)
        if args.workers and plan.workers_streams and "llmtap" in paths:
            bench.workers()
        if args.accuracy:
            results["accuracy"] = accuracy.run(
                work,
                proxy_cpu=bench.proxy_cpu,
                client_cpu=bench.client_cpu,
                sink_port=bench.sink_port,
                sink_file=bench.sink_file,
                plan=plan.accuracy,
            )
    finally:
        bench.stop_all()
        results["load_after"] = load()
        (work / "results.json").write_text(json.dumps(results, indent=1))
    print(report.markdown(results))
    if args.write and not args.smoke:
        report.write_results(results, peers.REPO / "bench" / "RESULTS.md")
    print(f"results: {work / 'results.json'}")
    return 0
