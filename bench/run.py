"""The benchmark harness: ``python -m bench`` (full run) or ``python -m bench --smoke`` (about a minute).

One run, one upstream, four paths: direct, nginx, LiteLLM and llmtap with full telemetry. The proxy under
test is pinned to one core and everything else (client, upstream, OTLP sink, Prometheus, aiperf) to the
other; llmtap runs twice: with its relay alone on that core (its telemetry process moved to the other), and
as ``llmtap:one-core``, its whole tree on the one core nginx has (the one-core budget). Each path's
staggered phases run with it alone; the bursts run with every path up, taken in turn burst by burst
(``Bench.run_bursts``), so paths compared on one core are measured over the same minutes. As root,
the run re-executes itself inside ``unshare -n`` (loopback only), so nothing can leave
the machine. Results go to ``bench/out/<time>/results.json``; a full run with ``--write`` also rewrites
the figures block of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import accuracy, peers, report, rps, tlsca
from bench.peers import Endpoint
from bench.procs import Sampler, quiesce
from bench.stats import PathFigures, analyse, crossing, median, open_streams
from llmtap.analysis.stats import quantile
from tests.support.proctree import Service, pinned

PATHS = ("direct", "nginx", "llmtap", "litellm")
IN_NETNS = "BENCH_IN_NETNS"
#: The direct path within this of the upstream's script (added TTFT and gap, p50): the load client kept up.
CLIENT_LIMIT_MS = 2.0


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
    #: Burst sizes (requests released at once, each on a new connection).
    bursts: tuple[int, ...] = ()
    #: Bursts per size at most, and at most this many seconds of bursts per size (at least two bursts).
    bursts_per_size: int = 5
    burst_budget: float = 9.0
    #: With ``burst_budget``, how many bursts a size gets: one burst's share of the budget beyond its script.
    burst_slack: float = 0.4
    #: Seconds between starting the load clients and their first request (their start-up must fit in it).
    client_lead: float = 1.0
    #: Requests per stream of the 4-stream warm-up.
    warm_requests: int = 2
    #: Seconds a path's CPU time must stay still to count as quiet (telemetry drained).
    settle: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def period(self) -> float:
        """One request's scripted length."""
        return self.ttft + self.chunks * self.gap

    def requests_for(self, streams: int) -> int:
        """Requests per stream of a staggered phase at that concurrency."""
        return self.requests.get(streams) or max(2, min(self.requests.values()))

    def burst_count(self) -> int:
        """Bursts per size: ``bursts_per_size``, fewer when they would take longer than ``burst_budget``."""
        return max(2, min(self.bursts_per_size, int(self.burst_budget // (self.period + self.burst_slack))))


FULL = Plan(
    streams=(1, 64, 256),
    requests={1: 30, 64: 6, 256: 4},
    ramp=(4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512),
    ramp_requests=3,
    accuracy=accuracy.AccuracyPlan(concurrency=16, requests=320, warmup=32),
    workers_streams=64,
    bursts=(1, 8, 32, 64, 128),
)
SMOKE = Plan(
    streams=(1, 8),
    requests={1: 3, 8: 2},
    ramp=(16,),
    ramp_requests=1,
    idle_probe=1.0,
    accuracy=accuracy.AccuracyPlan(concurrency=4, requests=16, warmup=4),
    bursts=(1, 8),
    bursts_per_size=2,
    burst_budget=3.0,
    client_lead=0.6,
    warm_requests=1,
    settle=0.5,
)


@dataclass
class Measure:
    """What a path's process tree did over one measured part: CPU by role, memory samples, tapes dropped."""

    cpu_s: float
    cpu_system_s: float
    cpu_roles: dict[str, float]
    peak: int
    samples: list[tuple[float, int]]
    procs: dict[str, int]
    tapes_dropped: float | None

    @classmethod
    def joined(cls, parts: list[Measure | None]) -> Measure | None:
        """Several parts of one tree as one: CPU and tapes summed, the highest peak, every sample."""
        mine = [m for m in parts if m is not None]
        if not mine:
            return None
        roles: dict[str, float] = {}
        procs: dict[str, int] = {}
        for m in mine:
            for role, cpu in m.cpu_roles.items():
                roles[role] = roles.get(role, 0.0) + cpu
            for role, n in m.procs.items():
                procs[role] = max(procs.get(role, 0), n)
        tapes = [m.tapes_dropped for m in mine]
        return cls(
            cpu_s=sum(m.cpu_s for m in mine),
            cpu_system_s=sum(m.cpu_system_s for m in mine),
            cpu_roles=roles,
            peak=max(m.peak for m in mine),
            samples=[s for m in mine for s in m.samples],
            procs=procs,
            tapes_dropped=None if None in tapes else sum(t for t in tapes if t is not None),
        )


@dataclass
class _Burst:
    """One burst of one path: the client's and the upstream's records, the client's CPU, the tree's measure."""

    records: list[dict[str, Any]]
    upstream: list[dict[str, Any]]
    client_cpu: float
    measure: Measure | None


def scheme(tls: bool) -> str:
    """``https`` or ``http``."""
    return "https" if tls else "http"


def base_path(spec: str) -> str:
    """The path of a path spec (``llmtap:otel-off`` is llmtap with the otel-off switch)."""
    return spec.split(":", 1)[0]


class Bench:
    """One run: the shared upstream and sink, the cores, and the figures gathered so far."""

    def __init__(
        self,
        work: Path,
        plan: Plan,
        proxy_cpu: str | None,
        client_cpu: str | None,
        *,
        tls: bool = False,
        smoke: bool = False,
    ) -> None:
        self.work = work
        self.plan = plan
        self.proxy_cpu = proxy_cpu
        self.client_cpu = client_cpu
        self.want_tls = tls
        self.smoke = smoke
        self.services: list[Service] = []
        self.results: dict[str, Any] = {"phases": [], "ramp": [], "bursts": [], "skipped": []}
        self.idle_cpu: dict[str, float] = {}
        self.idle_relay_rss: dict[str, float] = {}
        self.certs: tlsca.Certs | None = None
        self.tls_port: int | None = None
        #: Trees that have been quiet since their last measured part ended (its telemetry drained): each
        #: service -> its dropped-tape count then. Such a tree's next part starts from a reading at once.
        self._settled: dict[Service, float | None] = {}

    def start_shared(self) -> None:
        """The upstream (plain, and TLS when a part of the run needs it) and the OTLP sink, on the client's core."""
        p = self.plan
        if self.want_tls:
            self.certs = tlsca.make(self.work / "tls")
        up, self.up_port, self.tls_port = peers.upstreams(
            self.work, self.client_cpu, ttft=p.ttft, gap=p.gap, chunks=p.chunks, certs=self.certs
        )
        sink, self.sink_port, self.sink_file = peers.sink(self.work, self.client_cpu)
        self.services += [up, sink]

    def stop_all(self) -> None:
        """Stop everything still running, newest first."""
        for svc in reversed(self.services):
            svc.stop()
        self.services.clear()

    def endpoint(self, spec: str, tls: bool = False) -> Endpoint:
        """Start one path (``direct``, ``nginx``, ``litellm``, ``llmtap`` or ``llmtap:<ablation>``) against the
        plain or the TLS upstream."""
        name, _, ablation = spec.partition(":")
        certs = self.certs if tls else None
        if tls and (certs is None or self.tls_port is None):
            raise RuntimeError("no TLS upstream in this run")
        port = self.tls_port if tls else self.up_port
        assert port is not None
        if name == "direct":
            return Endpoint("direct", f"{scheme(tls)}://127.0.0.1:{port}/v1/chat/completions", None)
        if name == "nginx":
            ep = peers.nginx(self.work, self.proxy_cpu, port, certs=certs)
        elif name == "litellm":
            ep = peers.litellm(self.work, self.proxy_cpu, port)
        else:
            ep, self.admin_port = peers.llmtap(
                self.work,
                self.proxy_cpu,
                port,
                self.sink_port,
                certs=certs,
                ablation=ablation,
                # One core: the telemetry process stays on the relay's core (the tree is pinned there).
                telemetry_cpu=None if peers.ONE_CORE in peers.ablation_names(ablation) else self.client_cpu,
            )
            ep.name = spec
        assert ep.service is not None
        self.services.append(ep.service)
        return ep

    def stop(self, ep: Endpoint) -> None:
        """Stop a path's tree, if it has one, and forget it."""
        if ep.service is not None:
            ep.service.stop()
            self.services.remove(ep.service)
            self._settled.pop(ep.service, None)

    def clients(
        self, ep: Endpoint, streams: int, requests: int, tag: str, *, burst: bool = False
    ) -> tuple[list[dict[str, Any]], float]:
        """Run the load client processes; return their records and CPU seconds.

        With ``burst``, every stream sends one request on a new connection, all released at once (``requests`` is
        then ignored).
        """
        p = self.plan
        procs = max(1, math.ceil(streams / p.streams_per_client))
        start_at = time.perf_counter() + p.client_lead + 0.3 * procs
        per = [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]
        running = []
        offset = 0
        for n in per:
            argv = [
                sys.executable, "-m", "bench.client", "--url", ep.url, "--streams", str(n),
                "--offset", str(offset), "--total-streams", str(streams), "--requests", str(requests),
                "--stagger", str(p.period), "--start-at", str(start_at),
                "--tag", tag, "--max-tokens", str(p.chunks),
            ]  # fmt: skip
            if burst:
                argv += ["--bursts", "1"]
            if ep.auth:
                argv += ["--auth", ep.auth]
            if ep.url.startswith("https:") and self.certs is not None:
                argv += ["--ca", str(self.certs.ca)]
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

    @staticmethod
    def key(ep: Endpoint, tls: bool) -> str:
        return f"{ep.name}/{scheme(tls)}"

    def warm(self, ep: Endpoint, tls: bool = False) -> float:
        """A few requests first (lazy imports, pools); returns the path's resident bytes when idle after them."""
        self.clients(ep, 4, self.plan.warm_requests, f"{ep.name}-{scheme(tls)}-warm")
        peers.records(self.up_port)
        if ep.service is None:
            return 0.0
        before = quiesce(ep.service, settle=self.plan.settle)
        # What the path burns doing nothing (timers, exporters): charged to every phase's CPU too.
        time.sleep(self.plan.idle_probe)
        self.idle_cpu[self.key(ep, tls)] = 1000 * (ep.service.cpu() - before) / self.plan.idle_probe
        self.idle_relay_rss[self.key(ep, tls)] = float(ep.service.rss_relay())
        return float(ep.service.rss())

    def measured(
        self, ep: Endpoint, run: Callable[[], tuple[list[dict[str, Any]], float]]
    ) -> tuple[list[dict[str, Any]], float, Measure | None]:
        """Run the clients, measuring the path's tree from before until its telemetry stopped moving."""
        if ep.service is None:
            records, client_cpu = run()
            return records, client_cpu, None
        svc = ep.service
        if svc in self._settled:
            # Quiet since the end of its part before: read now. What it spent idle while other paths' parts ran
            # (bursts go path by path in turn) is no part's.
            tapes0 = self._settled.pop(svc)
        else:
            tapes0 = peers.scrape_sum(ep.admin) if ep.admin else None
            quiesce(svc, settle=self.plan.settle)
        roles0, sys0 = svc.cpu_roles(), svc.cpu_system()
        cpu0 = sum(roles0.values())  # the whole from the same reading as its parts
        with Sampler(svc) as sampler:
            records, client_cpu = run()
        quiesce(svc, settle=self.plan.settle)
        roles1 = svc.cpu_roles()
        sys1 = svc.cpu_system()
        cpu1 = sum(roles1.values())
        tapes1 = peers.scrape_sum(ep.admin) if ep.admin else None
        # The scrape's own CPU (a render of /metrics, a few ms, or part of one that failed) is no part's: the next
        # part reads the tree afresh.
        self._settled[svc] = tapes1
        # A process that left the tree took its CPU with it: a role's figure never goes below zero.
        roles = {r: max(0.0, roles1.get(r, 0.0) - roles0.get(r, 0.0)) for r in set(roles0) | set(roles1)}
        m = Measure(
            cpu_s=cpu1 - cpu0,
            cpu_system_s=sys1 - sys0,
            cpu_roles=roles,
            peak=sampler.peak,
            samples=sampler.samples,
            procs={r: len(pids) for r, pids in sampler.roles.items()},
            tapes_dropped=None if tapes1 is None else tapes1 - (tapes0 or 0.0),
        )
        return records, client_cpu, m

    def charge(
        self,
        fig: PathFigures,
        ep: Endpoint,
        tls: bool,
        m: Measure | None,
        idle_rss: float,
        records: list[dict[str, Any]],
    ) -> None:
        """The path's CPU (whole tree and by role), memory and dropped tapes, onto its figures."""
        if m is None:
            return
        k = 1000 / fig.chunks if fig.chunks else None
        fig.cpu_s = m.cpu_s
        fig.cpu_system_share = m.cpu_system_s / m.cpu_s if m.cpu_s > 0 else None
        fig.idle_cpu_ms_per_s = self.idle_cpu.get(self.key(ep, tls))
        fig.cpu_s_per_1000_chunks = m.cpu_s * k if k else None
        fig.cpu_relay_s = m.cpu_roles.get("relay", 0.0)
        fig.cpu_telemetry_s = m.cpu_roles.get("telemetry", 0.0)
        fig.cpu_relay_s_per_1000_chunks = fig.cpu_relay_s * k if k else None
        fig.cpu_telemetry_s_per_1000_chunks = fig.cpu_telemetry_s * k if k else None
        fig.procs = m.procs
        fig.rss_idle_mib = idle_rss / 2**20
        fig.rss_peak_mib = m.peak / 2**20
        fig.rss_kib_per_stream = (m.peak - idle_rss) / 1024 / fig.streams
        # The plateau: the samples taken while every stream of the phase (or of a burst) was open.
        plateau = median(rss for t, rss in m.samples if open_streams(records, t) >= fig.streams)
        idle_relay = self.idle_relay_rss.get(self.key(ep, tls))
        if plateau is not None and idle_relay is not None:
            fig.rss_relay_kib_per_stream = (plateau - idle_relay) / 1024 / fig.streams
        fig.tapes_dropped = m.tapes_dropped

    def phase(
        self, ep: Endpoint, streams: int, requests: int, idle_rss: float, tag: str, tls: bool = False
    ) -> PathFigures:
        """One measured phase of one path at one concurrency (staggered keep-alive streams)."""
        records, client_cpu, m = self.measured(ep, lambda: self.clients(ep, streams, requests, tag))
        upstream = peers.records(self.up_port)
        raw = {"client": records, "upstream": upstream}
        (self.work / f"records-{tag}.json").write_text(json.dumps(raw))
        fig = analyse(ep.name, streams, records, upstream, gap=self.plan.gap)
        fig.upstream = scheme(tls)
        fig.client_cpu_s = client_cpu
        self.charge(fig, ep, tls, m, idle_rss, records)
        print(report.phase_line(fig), flush=True)
        return fig

    def run_bursts(self, specs: list[str], tls: bool) -> None:
        """Every path's bursts over one upstream, taken in turn: the first burst of each path, then the second of
        each, and so on, size by size.

        The paths share the proxy's core, and a machine that others share drifts over minutes: taken one path
        after another, a few seconds of other work can land on all the bursts of one path's size and none of the
        path it is compared with. Taken in turn, each path's bursts of a size spread over the same minute and the
        per-burst medians compare like with like. Each burst waits until the path before it has drained its
        telemetry, so no path's work runs in another's burst.
        """
        eps: list[Endpoint] = []
        try:
            for spec in specs:
                eps.append(self.endpoint(spec, tls))
            idle = [self.warm(ep, tls) for ep in eps]
            for size in self.plan.bursts:
                taken: list[list[_Burst]] = [[] for _ in eps]
                for k in range(self.plan.burst_count()):
                    for ep, parts in zip(eps, taken, strict=True):
                        parts.append(self.one_burst(ep, size, k, tls))
                for ep, parts, idle_rss in zip(eps, taken, idle, strict=True):
                    row = self.burst_row(ep, size, tls, parts, idle_rss)
                    row["command"] = self.command(ep.name, tls, burst=size)
                    self.results["bursts"].append(row)
        finally:
            for ep in eps:
                self.stop(ep)

    def one_burst(self, ep: Endpoint, size: int, k: int, tls: bool) -> _Burst:
        """The ``k``-th burst of ``size`` requests to one path, each on a new connection, measured alone."""
        tag = f"{self.burst_tag(ep, tls, size)}-{k}"
        records, client_cpu, m = self.measured(ep, lambda: self.clients(ep, size, 0, tag, burst=True))
        for r in records:
            r["burst"] = k
        return _Burst(records, peers.records(self.up_port), client_cpu, m)

    @staticmethod
    def burst_tag(ep: Endpoint, tls: bool, size: int) -> str:
        return f"burst-{ep.name.replace(':', '_')}-{scheme(tls)}-{size}"

    def burst_row(self, ep: Endpoint, size: int, tls: bool, parts: list[_Burst], idle_rss: float) -> dict[str, Any]:
        """One path's bursts of one size: figures per burst, their medians, the tree's CPU over its bursts."""
        records = [r for part in parts for r in part.records]
        upstream = [u for part in parts for u in part.upstream]
        tag = self.burst_tag(ep, tls, size)
        (self.work / f"records-{tag}.json").write_text(json.dumps({"client": records, "upstream": upstream}))
        pooled = analyse(ep.name, size, records, upstream, gap=self.plan.gap)
        pooled.upstream, pooled.scenario = scheme(tls), "burst"
        pooled.client_cpu_s = sum(part.client_cpu for part in parts)
        self.charge(pooled, ep, tls, Measure.joined([part.measure for part in parts]), idle_rss, records)
        per = []
        for k, part in enumerate(parts):
            mine = part.records
            f = analyse(ep.name, size, mine, upstream, gap=self.plan.gap)
            releases = [r["start"] - r["release"] for r in mine if "start" in r]
            connects = [1000 * (r["sent"] - r["start"]) for r in mine if "start" in r and not r.get("error")]
            per.append({
                "burst": k, "requests": f.requests, "complete": f.complete,
                "errors": f.failed + f.unmatched, "merged": f.merged,
                "added_ttft_ms_p50": _num(f.added_ttft_ms_p50), "added_ttft_ms_p99": _num(f.added_ttft_ms_p99),
                "added_gap_ms_p99": _num(f.added_gap_ms_p99),
                "late_start_ms_max": 1000 * max(releases) if releases else None,
                "connect_ms_p50": quantile(connects, 0.5), "connect_ms_p99": quantile(connects, 0.99),
            })  # fmt: skip
        row = {
            **pooled.as_dict(),
            "size": size,
            "bursts": len(per),
            "bursts_planned": len(parts),
            # Connections the upstream saw for these requests (a proxy's pool reused, or one per request).
            "upstream_connections": len({u.get("conn") for u in upstream}),
            "errors": pooled.failed + pooled.unmatched,
            # Medians across the bursts of each burst's own percentile.
            "added_ttft_ms_p50": median(b["added_ttft_ms_p50"] for b in per),
            "added_ttft_ms_p99": median(b["added_ttft_ms_p99"] for b in per),
            "added_gap_ms_p99": median(b["added_gap_ms_p99"] for b in per),
            # The client's connect (and TLS handshake) to the first hop: a part of the added TTFT above.
            "connect_ms_p50": median(b["connect_ms_p50"] for b in per),
            "connect_ms_p99": median(b["connect_ms_p99"] for b in per),
            "pooled": {k: _num(getattr(pooled, k)) for k in ("added_ttft_ms_p50", "added_ttft_ms_p99",
                                                              "added_gap_ms_p50", "added_gap_ms_p99")},
            "per_burst": per,
        }  # fmt: skip
        print(report.burst_line(row), flush=True)
        return row

    def run_path(self, spec: str, *, tls: bool = False, ramp: bool = False, phases: bool = True) -> None:
        """The staggered phases of one path over one upstream (and llmtap's ramp), then stop it."""
        ep = self.endpoint(spec, tls)
        try:
            idle = self.warm(ep, tls)
            for streams in self.plan.streams if phases else ():
                tag = f"{spec.replace(':', '_')}-{streams}" + ("-https" if tls else "")
                fig = self.phase(ep, streams, self.plan.requests_for(streams), idle, tag, tls)
                fig.command = self.command(spec, tls, streams=streams)
                self.results["phases"].append(fig.as_dict())
            if ramp:
                self.ramp(ep, idle)
        finally:
            self.stop(ep)

    def client_check(self) -> None:
        """Whether the load client kept up: the direct path's staggered requests, pooled, within
        ``CLIENT_LIMIT_MS`` of the upstream's script and with no chunk merged. A busy machine can fail it; the
        run then says that its added figures include the client's own delay (``results["client_check"]``)."""
        client: list[dict[str, Any]] = []
        upstream: list[dict[str, Any]] = []
        for streams in self.plan.streams:
            path = self.work / f"records-direct-{streams}.json"
            if path.exists():
                raw = json.loads(path.read_text())
                client += raw["client"]
                upstream += raw["upstream"]
        if not client:
            return
        pooled = analyse("direct", 0, client, upstream, gap=self.plan.gap)
        ttft, gap = _num(pooled.added_ttft_ms_p50), _num(pooled.added_gap_ms_p50)
        self.results["client_check"] = {
            "requests": pooled.requests,
            "added_ttft_ms_p50": ttft,
            "added_gap_ms_p50": gap,
            "merged": pooled.merged,
            "limit_ms": CLIENT_LIMIT_MS,
            "ok": ttft is not None
            and gap is not None
            and ttft <= CLIENT_LIMIT_MS
            and abs(gap) <= CLIENT_LIMIT_MS
            and pooled.merged == 0,
        }

    def command(self, spec: str, tls: bool, *, streams: int | None = None, burst: int | None = None) -> str:
        """The command that measures this one figure again, beside the direct path it is judged against."""
        paths = "direct" if spec == "direct" else f"direct,{spec}"
        argv = ["python", "-m", "bench"] + (["--smoke"] if self.smoke else [])
        argv += ["--paths", paths, "--tls", "on" if tls else "off"]
        if streams is not None:
            argv += ["--streams", str(streams), "--no-bursts"]
        if burst is not None:
            argv += ["--bursts", str(burst), "--no-staggered"]
        argv += ["--no-ramp", "--no-accuracy", "--no-workers"]
        return shlex.join(argv)

    def ramp(self, ep: Endpoint, idle: float) -> None:
        """More streams at 50 chunks/s each, past the point where llmtap's added gap p99 passes 5 ms, until it
        falls behind (the phase takes a quarter longer than the script) or its gap p99 passes 50 ms."""
        points = []
        p = self.plan
        for streams in p.ramp:
            fig = self.phase(ep, streams, p.ramp_requests, idle, f"ramp-{streams}")
            fig.command = "python -m bench --paths llmtap --tls off --ramp-only --no-accuracy --no-workers"
            self.results["ramp"].append(fig.as_dict())
            points.append((fig.chunks_per_s, fig.added_gap_ms_p99))
            scripted = p.period * (1 + p.ramp_requests)  # the starts are staggered over one period
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
                fig = self.phase(ep, streams, self.plan.requests_for(streams), idle, f"workers-{n}")
                scrapes = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
                        size = len(r.read())
                    scrapes.append(1000 * (time.perf_counter() - t0))
                rows.append({**fig.as_dict(), "workers": n, "scrape_ms_p50": quantile(scrapes, 0.5),
                             "scrape_bytes": size,
                             "command": "python -m bench --paths llmtap --tls off --no-staggered --no-bursts "
                                        "--no-ramp --no-accuracy"})  # fmt: skip
            finally:
                self.stop(ep)

    def over_direct(self) -> None:
        """Each burst row's added TTFT less the direct path's, same size and upstream, same run."""
        direct = {(r["size"], r["upstream"]): r for r in self.results["bursts"] if r["path"] == "direct"}
        for r in self.results["bursts"]:
            d = direct.get((r["size"], r["upstream"])) if r["path"] != "direct" else None
            for q in ("p50", "p99"):
                mine, floor = r[f"added_ttft_ms_{q}"], d[f"added_ttft_ms_{q}"] if d else None
                r[f"over_direct_ttft_ms_{q}"] = mine - floor if mine is not None and floor is not None else None


def _num(value: float) -> float | None:
    """NaN as None (JSON)."""
    return None if math.isnan(value) else value


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


def _sizes(text: str) -> tuple[int, ...]:
    """``1,32,64`` as sizes; ``none`` (or nothing) as none."""
    if text.strip().lower() in ("", "none", "off"):
        return ()
    sizes = tuple(int(x) for x in text.split(",") if x.strip())
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError("sizes are positive integers")
    return sizes


def parser() -> argparse.ArgumentParser:
    """The harness's command line."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small counts (about a minute); what CI runs")
    p.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma list of {', '.join(PATHS)}; llmtap:ABLATION (e.g. llmtap:otel-off) for an ablated llmtap",
    )
    p.add_argument(
        "--ablation",
        action="append",
        default=[],
        metavar="NAME",
        help=f"also run llmtap with a switch beside llmtap (repeatable; NAME+NAME combines): "
        f"{', '.join(peers.ABLATIONS)}",
    )
    p.add_argument(
        "--tls",
        choices=("off", "on", "both"),
        default="both",
        help="upstream over plain HTTP, HTTPS (private CA), or each in turn (default); ramp, workers and "
        "accuracy always plain",
    )
    p.add_argument("--streams", type=_sizes, help="concurrencies of the staggered keep-alive phases (e.g. 1,64)")
    p.add_argument("--bursts", type=_sizes, help="burst sizes, new connections released at once (e.g. 1,32,64)")
    p.add_argument("--no-bursts", dest="no_bursts", action="store_true", help="skip the bursts")
    p.add_argument("--no-staggered", dest="staggered", action="store_false", help="skip the staggered phases")
    p.add_argument("--no-ramp", dest="ramp", action="store_false", help="skip llmtap's ramp")
    p.add_argument(
        "--ramp-only", dest="ramp_only", action="store_true", help="with --paths llmtap: the ramp alone (no phases)"
    )
    p.add_argument("--no-accuracy", dest="accuracy", action="store_false", help="skip the aiperf/Prometheus part")
    p.add_argument("--no-workers", dest="workers", action="store_false", help="skip the --workers 1 and 2 comparison")
    p.add_argument(
        "--no-one-core",
        dest="one_core",
        action="store_false",
        help="skip llmtap:one-core (llmtap's whole tree on the proxy's core, beside llmtap with its telemetry "
        "on the client's core)",
    )
    p.add_argument(
        "--no-rps", dest="rps", action="store_false", help="skip requests per second beside nginx (bench.rps)"
    )
    p.add_argument(
        "--rps-only", dest="rps_only", action="store_true", help="requests per second beside nginx alone (bench.rps)"
    )
    p.add_argument(
        "--rps-profile",
        dest="rps_profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with the rps part: also profile llmtap's two processes under it (bench.rps_profile, needs py-spy)",
    )
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


def rps_part(work: Path, args: argparse.Namespace, proxy_cpu: str | None, client_cpu: str | None) -> dict[str, Any]:
    """The requests-per-second part (``bench.rps``), with its profile when asked, and the command that runs it alone."""
    plan = rps.SMOKE if args.smoke else rps.FULL
    part = rps.run(work, plan, proxy_cpu, client_cpu)
    if args.rps_profile > 0:
        from bench import rps_profile

        part["profile"] = rps_profile.run(work, plan, proxy_cpu, client_cpu, args.rps_profile)
    part["command"] = shlex.join(["python", "-m", "bench", "--rps-only"] + (["--smoke"] if args.smoke else []))
    return part


def rps_markdown(part: dict[str, Any]) -> str:
    """The rps part's tables, and its profile's when it has one."""
    text = rps.markdown(part)
    if "profile" in part:
        from bench import rps_profile

        text += "\n\n" + rps_profile.markdown(part["profile"])
    return text


def rps_alone(args: argparse.Namespace, argv: list[str]) -> int:
    """``python -m bench --rps-only``: the rps part and nothing else, into ``results.json`` as a full run's."""
    absent = rps.missing()
    if absent:
        print("missing: " + "; ".join(f"{k} ({v})" for k, v in absent.items()), file=sys.stderr)
        return 3
    nice = args.nice if args.nice is not None else (0 if args.smoke or os.geteuid() != 0 else -10)
    if nice:
        os.nice(nice)
    work = Path(args.out).resolve() if args.out else peers.REPO / "bench" / "out" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    single_core = (os.cpu_count() or 1) < 2
    proxy_cpu, client_cpu = (None, None) if single_core else (args.proxy_cpu, args.client_cpu)
    results: dict[str, Any] = {
        "mode": "smoke" if args.smoke else "full",
        "command": shlex.join(["python", "-m", "bench", *argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "netns": bool(os.environ.get(IN_NETNS)),
        "nice": os.nice(0),
        "commit": _out(["git", "-C", str(peers.REPO), "rev-parse", "--short", "HEAD"]),
        "load_before": load(),
    }
    try:
        results["rps"] = rps_part(work, args, proxy_cpu, client_cpu)
    finally:
        results["load_after"] = load()
        (work / "results.json").write_text(json.dumps(results, indent=1))
    print(rps_markdown(results["rps"]))
    print(f"results: {work / 'results.json'}")
    return 0


def path_specs(args: argparse.Namespace) -> list[str]:
    """The paths of a run, each checked; ``--ablation`` adds ``llmtap:NAME`` after llmtap."""
    specs = [p for p in args.paths.split(",") if p]
    one_core = f"llmtap:{peers.ONE_CORE}"
    if getattr(args, "one_core", False) and "llmtap" in specs and one_core not in specs:
        # The one-core budget beside the dedicated-core one: every run measures both.
        specs.insert(specs.index("llmtap") + 1, one_core)
    for name in args.ablation:
        spec = f"llmtap:{name}"
        if spec not in specs:
            specs.append(spec)
    for spec in specs:
        name, _, ablation = spec.partition(":")
        if name not in PATHS or (ablation and name != "llmtap"):
            raise SystemExit(f"unknown path {spec!r} (paths: {', '.join(PATHS)}, llmtap:ABLATION)")
        try:
            peers.ablation_names(ablation)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    return specs


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print where the results are."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.netns:
        _netns(argv)
    if args.rps_only:
        return rps_alone(args, argv)
    paths = path_specs(args)
    bases = {base_path(p) for p in paths}
    absent = {
        k: v for k, v in peers.missing().items() if k in bases or (args.accuracy and k in ("aiperf", "prometheus"))
    }
    if args.rps:
        absent.update(rps.missing())
    if absent:
        print("missing: " + "; ".join(f"{k} ({v})" for k, v in absent.items()), file=sys.stderr)
        return 3
    plan = dataclasses.replace(SMOKE if args.smoke else FULL)
    if args.streams is not None:
        plan.streams = args.streams
    if args.bursts is not None:
        plan.bursts = args.bursts
    if args.no_bursts:
        plan.bursts = ()
    staggered = args.staggered and not args.ramp_only
    if args.ramp_only:
        plan.bursts = ()
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.tls]
    nice = args.nice if args.nice is not None else (0 if args.smoke or os.geteuid() != 0 else -10)
    if nice:
        os.nice(nice)
    # Absolute: nginx takes its prefix from it, and a relative one would be read from that prefix again.
    work = Path(args.out).resolve() if args.out else peers.REPO / "bench" / "out" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    single_core = (os.cpu_count() or 1) < 2
    bench = Bench(
        work,
        plan,
        None if single_core else args.proxy_cpu,
        None if single_core else args.client_cpu,
        tls=True in modes,
        smoke=args.smoke,
    )
    results = bench.results
    results.update(
        mode="smoke" if args.smoke else "full",
        command=shlex.join(["python", "-m", "bench", *argv]),
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        netns=bool(os.environ.get(IN_NETNS)),
        nice=os.nice(0),
        machine=machine(),
        load_before=load(),
        plan={"streams": plan.streams if staggered else (), "requests": plan.requests, "ramp": plan.ramp,
              "chunks": plan.chunks, "gap_ms": plan.gap * 1000, "ttft_ms": plan.ttft * 1000,
              "bursts": plan.bursts, "bursts_per_size": plan.burst_count(), "bursts_in_turn": True,
              "tls": [scheme(t) for t in modes],
              "paths": paths},
        upstream_ca=None,
    )  # fmt: skip
    try:
        bench.start_shared()
        if "llmtap" in bases and True in modes:
            # How llmtap is told to trust the run's CA (the flag, or the environment until the flag exists).
            results["upstream_ca"] = "--upstream-ca" if peers.llmtap_has_upstream_ca() else "SSL_CERT_FILE+certifi"
        for tls in modes:
            for spec in paths:
                if tls and base_path(spec) == "litellm":
                    why = "LiteLLM is not pointed at a private CA by this harness (plain upstream only)"
                    results["skipped"].append({"path": spec, "upstream": "https", "why": why})
                    print(f"skipped: {spec} over https: {why}", flush=True)
                    continue
                ramp = args.ramp and spec == "llmtap" and not tls
                if staggered or ramp:
                    bench.run_path(spec, tls=tls, ramp=ramp, phases=staggered)
            if plan.bursts:
                bench.run_bursts([s for s in paths if not (tls and base_path(s) == "litellm")], tls)
        bench.over_direct()
        bench.client_check()
        if args.workers and plan.workers_streams and "llmtap" in paths:
            bench.workers()
        if args.rps:
            results["rps"] = rps_part(work, args, bench.proxy_cpu, bench.client_cpu)
        if args.accuracy:
            results["accuracy"] = accuracy.run(
                work,
                proxy_cpu=bench.proxy_cpu,
                client_cpu=bench.client_cpu,
                sink_port=bench.sink_port,
                sink_file=bench.sink_file,
                plan=plan.accuracy,
            )
            results["accuracy"]["command"] = (
                "python -m bench --paths llmtap --tls off --no-staggered --no-bursts --no-ramp --no-workers"
            )
    finally:
        bench.stop_all()
        results["load_after"] = load()
        (work / "results.json").write_text(json.dumps(results, indent=1))
    print(report.markdown(results))
    if "rps" in results:
        print("\n### Requests per second beside nginx\n\n" + rps_markdown(results["rps"]))
    if args.write and not args.smoke:
        report.write_results(results, peers.REPO / "bench" / "RESULTS.md")
    print(f"results: {work / 'results.json'}")
    return 0
