"""Requests per second beside nginx: short non-streamed answers, the cost each request carries on its own.

``python -m bench --rps-only`` (or a part of ``python -m bench``): a fixed 160-byte JSON answer (an embeddings call,
``bench.fixed_upstream``) from an upstream that answers at once; nginx (one worker) on the proxy's core, llmtap's
whole process tree (relay and telemetry, default settings: no OTLP endpoint, no records) on the same core, the
upstream and the load generators on the other core; ``llmtap:spare`` is the same llmtap with a core to spare, its
telemetry process moved to the other core (beside the client), as a deployment without a one-core limit runs it.
The floors, on the proxy's core as well, are what any Python relay pays a request on this machine, measured in the
same run: ``floor`` the thinnest HTTP/1.1 relay (``bench.probes.thin_http``: each head parsed and written again,
nothing else), ``floor:bytes`` bytes passed with no parsing at all (``bench.probes.thin_relay``). The paths take
each measurement in turn (direct, nginx, the floors, llmtap, llmtap:spare, then the next measurement), so a shared
machine's drift lands on all of them alike.

- Closed loop (``wrk``, one thread, keep-alive): 1 and 16 connections, each for ``seconds``: requests/s, and
  ``wrk``'s latency p50 and p99. Beside each path's figures, its tree's CPU per request (from ``/proc``, read until
  the telemetry has drained), the relay's and the telemetry's apart.
- Open loop (``bench.openloop``): 1,000 and 3,000 requests/s on a fixed schedule over 64 keep-alive connections,
  latency from each request's scheduled time (no coordinated omission); each path's p50 and p99 less the direct
  path's at the same rate. The direct path is also the generator's own check: it must keep the rate (all answered,
  at the rate asked, within 2%).

Everything is bounded: a fixed number of measurements of ``seconds`` each, a 30 s deadline per measurement beyond
it. ``python -m bench.rps`` is ``python -m bench --rps-only``: the part on its own (``--rps-profile SECONDS`` adds
``bench.rps_profile``'s sampled profile of both of llmtap's processes under the 16-connection load).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import peers
from bench.procs import quiesce
from tests.support.net import free_port, wait_http
from tests.support.proctree import Service, pin_threads, pinned

#: The request every path gets: an embeddings call, as short as the answer.
BODY = '{"model":"bench","input":"the quick brown fox"}'
PATH = "/v1/embeddings"
RPS_PATHS = ("direct", "nginx", "floor", "floor:bytes", "llmtap", "llmtap:spare")
#: The floors' modules: the thinnest HTTP/1.1 relay Python can be, and bytes passed with no parsing at all.
FLOORS = {"floor": "bench.probes.thin_http", "floor:bytes": "bench.probes.thin_relay"}
#: The direct path's open loop must answer every request, at the rate asked within this share.
RATE_SLACK = 0.02

#: ``wrk``'s script: the POST, and one JSON line at the end (requests, duration, errors, latency percentiles in µs).
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["content-type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('RESULT {"requests":%%d,"duration_us":%%d,"errors":%%d,"p50_us":%%d,"p99_us":%%d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class RpsPlan:
    """How much load the part gets."""

    connections: tuple[int, ...] = (1, 16)
    rates: tuple[int, ...] = (1000, 3000)
    seconds: float = 5.0
    warm: float = 1.0
    open_connections: int = 64
    answer_bytes: int = 160
    settle: float = 0.5
    paths: tuple[str, ...] = RPS_PATHS
    extra: dict[str, Any] = field(default_factory=dict)


FULL = RpsPlan()
SMOKE = RpsPlan(connections=(1, 4), rates=(300,), seconds=1.0, warm=0.5, open_connections=8)


def missing() -> dict[str, str]:
    """What this part needs that is absent, and how to install it."""
    out: dict[str, str] = {}
    if shutil.which("wrk") is None:
        out["wrk"] = peers.INSTALL
    if shutil.which("nginx") is None:
        out["nginx"] = peers.INSTALL
    return out


class Rig:
    """The upstream and the paths in front of it, on their cores."""

    def __init__(self, work: Path, plan: RpsPlan, proxy_cpu: str | None, client_cpu: str | None) -> None:
        self.work = work
        self.plan = plan
        self.proxy_cpu = proxy_cpu
        self.client_cpu = client_cpu
        self.services: list[Service] = []
        self.urls: dict[str, str] = {}
        self.trees: dict[str, Service] = {}
        #: Each llmtap tree's admin port (``/metrics``: the tapes its telemetry dropped).
        self.admins: dict[str, int] = {}
        (work / "rps.lua").write_text(WRK_SCRIPT % BODY)

    def start(self) -> None:
        """The upstream on the client's core, then each path of the plan."""
        port = self.upstream()
        for path in self.plan.paths:
            if path == "direct":
                self.urls[path] = f"http://127.0.0.1:{port}{PATH}"
            elif path == "nginx":
                ep = peers.nginx(self.work, self.proxy_cpu, port)
                assert ep.service is not None
                self.keep(path, ep.service, ep.url.replace("/v1/chat/completions", PATH))
            elif path in FLOORS:
                self.keep(path, *self.floor(FLOORS[path], port))
            elif path == "llmtap":
                self.keep(path, *self.llmtap(port))
            elif path == "llmtap:spare":
                svc, url = self.llmtap(port, name="llmtap-rps-spare")
                if self.client_cpu is not None:  # the telemetry process on the other core: a core to spare
                    for pid in svc.roles()["telemetry"]:
                        pin_threads(pid, {int(c) for c in self.client_cpu.split(",")})
                self.keep(path, svc, url)
            else:
                raise ValueError(f"unknown path {path!r} (paths: {', '.join(RPS_PATHS)})")

    def upstream(self) -> int:
        """Start the fixed upstream on the client's core; its port."""
        argv = [sys.executable, "-m", "bench.fixed_upstream", "--bytes", str(self.plan.answer_bytes)]
        up = Service("rps-upstream", argv, log=self.work / "rps-upstream.log", cpu=self.client_cpu, env=_env())
        self.services.append(up)
        self.upstream_port: int = up.ready(lambda: int(up.read_line()))
        return self.upstream_port

    def keep(self, path: str, svc: Service, url: str) -> None:
        """Measure ``svc``'s tree as ``path``, reached at ``url``."""
        if svc.name in self.admins:
            self.admins[path] = self.admins.pop(svc.name)
        self.services.append(svc)
        self.trees[path] = svc
        self.urls[path] = url

    def llmtap(self, upstream_port: int, tree: Path | None = None, name: str = "llmtap-rps") -> tuple[Service, str]:
        """``llmtap serve`` (from ``tree``'s ``proxy/``, else this checkout's) with default settings (no OTLP
        endpoint, no records), its whole tree on the proxy's core."""
        port, admin = free_port(), free_port()
        argv = [
            sys.executable, "-m", "llmtap", "serve", "--upstream", f"http://127.0.0.1:{upstream_port}",
            "--provider", "vllm", "--port", str(port), "--admin-port", str(admin), "--log-level", "warning",
        ]  # fmt: skip
        env = _env() if tree is None else {"PYTHONPATH": f"{tree / 'proxy'}{os.pathsep}{peers.REPO}"}
        svc = Service(name, argv, log=self.work / f"{name}.log", cpu=self.proxy_cpu, env=env)
        svc.ready(lambda: wait_http(f"http://127.0.0.1:{admin}/readyz", 60, alive=lambda: svc.proc.poll() is None))
        self.admins[name] = admin
        return svc, f"http://127.0.0.1:{port}{PATH}"

    def floor(self, module: str, upstream_port: int) -> tuple[Service, str]:
        """A floor relay (``module``) on the proxy's core: what any Python relay pays a request on this machine."""
        argv = [sys.executable, "-m", module, "--upstream-port", str(upstream_port)]
        name = module.rsplit(".", 1)[-1].replace("_", "-")
        svc = Service(name, argv, log=self.work / f"{name}.log", cpu=self.proxy_cpu, env=_env())
        port = svc.ready(lambda: int(svc.read_line()))
        return svc, f"http://127.0.0.1:{port}{PATH}"

    def stop(self) -> None:
        """Stop everything, newest first."""
        for svc in reversed(self.services):
            svc.stop()
        self.services.clear()

    def wrk(self, url: str, connections: int, seconds: float) -> dict[str, Any]:
        """One closed-loop run of ``wrk`` on the client's core: its figures."""
        argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s"]
        argv += ["-s", str(self.work / "rps.lua"), url]
        done = subprocess.run(
            pinned(argv, self.client_cpu), capture_output=True, text=True, timeout=seconds + 60, check=True
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {done.stdout[-500:]} {done.stderr[-500:]}")
        got: dict[str, Any] = json.loads(line[len("RESULT ") :])
        seconds_run = got["duration_us"] / 1e6
        return {
            "requests": got["requests"],
            "errors": got["errors"],
            "seconds": seconds_run,
            "requests_per_s": got["requests"] / seconds_run if seconds_run > 0 else 0.0,
            "p50_ms": got["p50_us"] / 1000,
            "p99_ms": got["p99_us"] / 1000,
        }

    def openloop(self, url: str, rate: int, seconds: float) -> dict[str, Any]:
        """One open-loop run of ``bench.openloop`` on the client's core: its figures."""
        argv = [
            sys.executable, "-m", "bench.openloop", "--url", url, "--rate", str(rate), "--seconds", str(seconds),
            "--connections", str(self.plan.open_connections), "--body", BODY,
        ]  # fmt: skip
        done = subprocess.run(
            pinned(argv, self.client_cpu), capture_output=True, text=True, timeout=seconds + 90, env=_env(), check=True
        )
        got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return got

    def measured(self, path: str, run: Any) -> dict[str, Any]:
        """``run()``'s figures, with the path's tree CPU over it (until its telemetry drained), per request."""
        svc = self.trees.get(path)
        if svc is None:
            return dict(run())
        admin = self.admins.get(path)
        quiesce(svc, settle=self.plan.settle)
        tapes0 = peers.scrape_sum(admin) if admin else None
        roles0 = svc.cpu_roles()
        got = dict(run())
        quiesce(svc, settle=self.plan.settle)
        roles1 = svc.cpu_roles()
        if admin:
            # Tapes the telemetry turned away (its queue full): requests relayed whole but not measured.
            tapes1 = peers.scrape_sum(admin)
            got["tapes_dropped"] = None if tapes1 is None else tapes1 - (tapes0 or 0.0)
        roles = {r: max(0.0, roles1.get(r, 0.0) - roles0.get(r, 0.0)) for r in set(roles0) | set(roles1)}
        done = got.get("requests", got.get("completed", 0)) or 0
        got["cpu_s"] = sum(roles.values())
        got["cpu_us_per_request"] = 1e6 * got["cpu_s"] / done if done else None
        for role in ("relay", "telemetry"):
            got[f"cpu_{role}_us_per_request"] = 1e6 * roles.get(role, 0.0) / done if done else None
        return got


def _env() -> dict[str, str]:
    """The benchmark's modules and this tree's llmtap importable in a child."""
    here = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(peers.REPO), str(peers.REPO / "proxy"), here) if p)}


def run(work: Path, plan: RpsPlan, proxy_cpu: str | None, client_cpu: str | None) -> dict[str, Any]:
    """The whole part: start, warm, closed loop, open loop, stop. Its results, ready for JSON."""
    rig = Rig(work, plan, proxy_cpu, client_cpu)
    out: dict[str, Any] = {"plan": asdict(plan), "closed": [], "open": [], "load_before": _load()}
    try:
        rig.start()
        for path in plan.paths:
            rig.wrk(rig.urls[path], 16, plan.warm)
        for connections in plan.connections:
            for path in plan.paths:
                row = rig.measured(path, functools.partial(rig.wrk, rig.urls[path], connections, plan.seconds))
                row.update(path=path, connections=connections)
                out["closed"].append(row)
                print(closed_line(row), flush=True)
        for rate in plan.rates:
            for path in plan.paths:
                row = rig.measured(path, functools.partial(rig.openloop, rig.urls[path], rate, plan.seconds))
                row.update(path=path, rate=rate)
                out["open"].append(row)
                print(open_line(row), flush=True)
        over_direct(out["open"])
        out["generator_ok"] = generator_ok(out["open"])
    finally:
        rig.stop()
        out["load_after"] = _load()
    return out


def over_direct(rows: list[dict[str, Any]]) -> None:
    """Each open-loop row's p50 and p99 less the direct path's at the same rate."""
    direct = {r["rate"]: r for r in rows if r["path"] == "direct"}
    for r in rows:
        d = direct.get(r["rate"])
        for q in ("p50", "p99"):
            r[f"added_{q}_ms"] = r["latency_ms"][q] - d["latency_ms"][q] if d is not None else None


def generator_ok(rows: list[dict[str, Any]]) -> bool | None:
    """Whether the generator kept every rate against the direct path (None: no direct row)."""
    direct = [r for r in rows if r["path"] == "direct"]
    if not direct:
        return None
    return all(
        r["lost"] == 0 and r["errors"] == 0 and r["achieved_rate"] >= (1 - RATE_SLACK) * r["rate"] for r in direct
    )


def _load() -> str:
    return os.getloadavg().__repr__()


def _f(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def closed_line(row: dict[str, Any]) -> str:
    """A one-line progress report of a closed-loop measurement."""
    return (
        f"rps {row['path']:>12} x{row['connections']:<3} {row['requests_per_s']:>9,.0f} req/s "
        f"p50 {row['p50_ms']:.3f} p99 {row['p99_ms']:.3f} ms errors {row['errors']} "
        f"cpu/req {_f(row.get('cpu_us_per_request'), 0)} µs"
    )


def open_line(row: dict[str, Any]) -> str:
    """A one-line progress report of an open-loop measurement."""
    lat = row["latency_ms"]
    return (
        f"rps {row['path']:>12} @{row['rate']:<5} {row['achieved_rate']:>7,.0f} req/s "
        f"p50 {lat['p50']:.3f} p99 {lat['p99']:.3f} ms late p99 {row['late_ms']['p99']:.3f} ms "
        f"lost {row['lost']} errors {row['errors']} cpu/req {_f(row.get('cpu_us_per_request'), 0)} µs"
    )


def markdown(result: dict[str, Any]) -> str:
    """The part's tables."""
    lines = [
        "| path | connections | requests/s | p50 / p99 ms | tree CPU per request µs (relay / telemetry) | errors "
        "| tapes dropped |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["closed"]:
        cpu = (
            f"{_f(r.get('cpu_us_per_request'), 0)} ({_f(r.get('cpu_relay_us_per_request'), 0)} / "
            f"{_f(r.get('cpu_telemetry_us_per_request'), 0)})"
            if "cpu_s" in r
            else "–"
        )
        lines.append(
            f"| {r['path']} | {r['connections']} | {r['requests_per_s']:,.0f} | {r['p50_ms']:.3f} / {r['p99_ms']:.3f}"
            f" | {cpu} | {r['errors']} | {_f(r.get('tapes_dropped'), 0)} |"
        )
    lines += [
        "",
        "| path | rate/s | answered/s | p50 / p99 ms | added p50 / p99 ms over direct | sends late p99 ms | lost "
        "| tapes dropped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["open"]:
        lat = r["latency_ms"]
        lines.append(
            f"| {r['path']} | {r['rate']:,} | {r['achieved_rate']:,.0f} | {lat['p50']:.3f} / {lat['p99']:.3f} | "
            f"{_f(r.get('added_p50_ms'), 3)} / {_f(r.get('added_p99_ms'), 3)} | {r['late_ms']['p99']:.3f} | "
            f"{r['lost'] + r['errors']} | {_f(r.get('tapes_dropped'), 0)} |"
        )
    lines.append("")
    lines.append(f"Generator kept every rate against direct: {result.get('generator_ok')}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.rps [ARGS]``: ``python -m bench --rps-only [ARGS]`` (inside ``unshare -n`` as root)."""
    from bench import run as harness

    return harness.main(["--rps-only", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
