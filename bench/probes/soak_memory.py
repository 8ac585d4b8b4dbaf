"""The memory soak: ``llmtap serve`` under fast, ever-new traffic until every cache is full, its memory sampled.

``python -m bench.probes.soak --memory`` (or ``python -m bench.probes.soak_memory``). llmtap serves as users run it
(one relay,
one telemetry process, records into a folder, spans and metrics over OTLP/gRPC to ``bench.sink``, tenants as a
metric dimension) in front of ``llmtap simulate --profile fast``, and ``bench.probes.soak_load`` sends short streamed
chats at ``--rate``, each with a prompt never seen before and one of thousands of tenants. llmtap's caches fill by
count, not by time, so a fast rate reaches their bounds within minutes. In the last ``--burst`` seconds of every
``--period`` the rate rises and some answers are long, and the telemetry process is stopped (SIGSTOP) for
``--stall`` seconds: the relay's channel fills and, once it runs again, the backlog overflows its queue, so tapes
are dropped in whole and in part (ends and segments turned away), the overload the bounds must hold under.

Every ``--sample`` seconds each process's resident memory (RSS, and PSS and USS from ``/proc/PID/smaps_rollup``);
inside each process the probe (``bench.probes.soak_probe``) writes the fill of every bounded structure. The report:
per process the plateau (median and largest RSS over the last half of the run: whole periods from the first one
starting at or after the middle, so the overload's saw-tooth weighs the same at both ends), the growth over it (a
least-squares slope, MB a minute; the target is under ``TARGET_MB_PER_MIN``), each cache's fill against its bound
and its growth, what the allocators hold (Python's live blocks, C's in use and free), and the tapes dropped.
``--out DIR`` keeps every sample (``samples.jsonl``), the probes' lines, the logs and ``result.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.probes.soak_load import add_shape, shape_argv
from tests.support.net import free_port, wait_http
from tests.support.proctree import Service, by_role, descendants

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "soak_site"
#: Growth over the last half of a run that counts as flat.
TARGET_MB_PER_MIN = 0.05
MB = 1 << 20


def smaps(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS (private clean + dirty) of ``pid`` in bytes, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        kb[name] = int(rest.split()[0])
    return {
        "rss": kb.get("Rss", 0) * 1024,
        "pss": kb.get("Pss", 0) * 1024,
        "uss": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024,
    }


def slope_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, value) in value a minute; None for fewer than three points."""
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60


def slope_mb_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, bytes) in MB a minute; None for fewer than three points."""
    slope = slope_per_min(points)
    return None if slope is None else slope / MB


def last_half(duration: float, period: float, burst: float) -> tuple[float, float]:
    """The seconds the growth is measured over: the second half of the run, as whole periods where there are
    overload phases (from the first period's start at or after the middle to the last one's end), so that their
    saw-tooth weighs the same at both ends."""
    if burst > 0 and period > 0:
        first = math.ceil(duration / 2 / period) * period
        last = math.floor(duration / period) * period
        if last - first >= period:
            return first, last
    return duration / 2, duration


def scrape(admin: int) -> str:
    """The telemetry's ``/metrics`` page ('' when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples whose line holds ``label``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line:
            total += float(line.rpartition(" ")[2])
    return total


class Soak:
    """One run: the processes, the load, the samples."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.dir = workdir
        self.services: list[Service] = []
        self.samples = (workdir / "samples.jsonl").open("a", encoding="utf-8")
        self.stalls = 0
        #: When the load started, on the monotonic clock (the samples' and the probes' times count from it).
        self.started = 0.0

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        svc = Service(name, argv, log=self.dir / f"{name}.log", env=env, cpu=None)
        self.services.append(svc)
        return svc

    def launch(self) -> tuple[Service, int, int]:
        """The simulator, the OTLP sink and llmtap; returns llmtap, its port and its admin port."""
        sim_port, port, admin = free_port(), free_port(), free_port()
        sim = self.start("simulator", [sys.executable, "-m", "llmtap", "simulate", "--profile", "fast",
                                       "--port", str(sim_port)])  # fmt: skip
        wait_http(f"http://127.0.0.1:{sim_port}/metrics", 60, alive=lambda: sim.proc.poll() is None)
        sink = self.start("sink", [sys.executable, "-m", "bench.sink", "--out", os.devnull])
        sink_port = int(sink.read_line())
        path = os.pathsep.join([str(SITE), str(ROOT), str(ROOT / "proxy"), os.environ.get("PYTHONPATH", "")])
        env = {
            "PYTHONPATH": path,
            "SOAK_PROBE_DIR": str(self.dir),
            "SOAK_PROBE_EVERY": str(self.args.sample),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        }
        argv = [sys.executable, "-m", "llmtap", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
                "--port", str(port), "--admin-port", str(admin), "--record", str(self.dir / "records"),
                "--record-keep-mb", "256", "--metric-dimensions", "tenant", "--log-level", "warning",
                "--telemetry-scheduling", self.args.scheduling]  # fmt: skip
        llmtap = self.start("llmtap", argv, env)
        wait_http(f"http://127.0.0.1:{admin}/readyz", 60, alive=lambda: llmtap.proc.poll() is None)
        return llmtap, port, admin

    def sample(self, llmtap: Service, t: float) -> None:
        for pid in descendants(llmtap.proc.pid):
            mem = smaps(pid)
            if mem is not None:
                roles = by_role([pid])
                role = "telemetry" if roles["telemetry"] else "relay"
                self.samples.write(json.dumps({"t": t, "pid": pid, "role": role, **mem}) + "\n")
        self.samples.flush()

    def stall(self, llmtap: Service, on: bool) -> None:
        """Stop (or continue) the telemetry process: the overload's stalled consumer."""
        for pid in by_role(descendants(llmtap.proc.pid))["telemetry"]:
            try:
                os.kill(pid, signal.SIGSTOP if on else signal.SIGCONT)
            except ProcessLookupError:
                continue
        self.stalls += on

    def run(self) -> dict[str, Any]:
        a = self.args
        try:
            llmtap, port, admin = self.launch()
            start = self.started = time.monotonic() + 2.0
            load = self.start("load", [sys.executable, "-m", "bench.probes.soak_load", "--url",
                f"http://127.0.0.1:{port}/v1/chat/completions", "--duration", str(a.duration), *shape_argv(a),
                "--start-at", str(start)])  # fmt: skip
            scrapes = self.watch(llmtap, admin, load, start)
            counts = json.loads(load.read_line(timeout=180))
            time.sleep(a.sample)
            self.sample(llmtap, time.monotonic() - start)
            final = scrape(admin)
        finally:
            for svc in reversed(self.services):
                if svc.name == "llmtap":
                    self.stall(svc, False)
                svc.stop()
            self.samples.close()
        return self.report(counts, final, scrapes)

    def watch(self, llmtap: Service, admin: int, load: Service, start: float) -> list[dict[str, float]]:
        """Sample until the load ends; stall the telemetry at the start of each overload phase."""
        a = self.args
        scrapes: list[dict[str, float]] = []
        next_sample = next_scrape = start
        stalled_until, phase = 0.0, -1
        while load.proc.poll() is None and time.monotonic() < start + a.duration + 300:
            now = time.monotonic()
            t = now - start
            period = int(t // a.period) if t >= 0 else -1
            if a.burst and a.stall and t % a.period >= a.period - a.burst and period != phase:
                phase, stalled_until = period, now + a.stall
                self.stall(llmtap, True)
            if stalled_until and now >= stalled_until:
                stalled_until = 0.0
                self.stall(llmtap, False)
            if now >= next_sample:
                next_sample += a.sample
                self.sample(llmtap, t)
            if now >= next_scrape and not stalled_until:
                next_scrape += 60.0
                text = scrape(admin)
                scrapes.append({"t": t, **self.drops(text)})
            time.sleep(0.2)
        if stalled_until:
            self.stall(llmtap, False)
        return scrapes

    @staticmethod
    def drops(text: str) -> dict[str, float]:
        out = {"requests": metric_sum(text, "llmtap_requests_total")}
        for reason in ("channel_full", "queue_full", "evicted", "partial"):
            out[reason] = metric_sum(text, "llmtap_telemetry_tapes_dropped_total", f'="{reason}"')
        return out

    def report(self, counts: dict[str, Any], final: str, scrapes: list[dict[str, float]]) -> dict[str, Any]:
        a = self.args
        lines = [json.loads(x) for x in (self.dir / "samples.jsonl").read_text().splitlines() if x.strip()]
        processes: dict[str, Any] = {}
        first, last = last_half(a.duration, a.period, a.burst)
        for role in ("relay", "telemetry"):
            mine = [x for x in lines if x["role"] == role and x["t"] >= 0]
            if not mine:
                continue
            half = [x for x in mine if first <= x["t"] < last]
            processes[role] = {
                "pids": sorted({x["pid"] for x in mine}),
                **{f"{k}_first_mb": round(mine[0][k] / MB, 1) for k in ("rss", "pss", "uss")},
                **{f"{k}_plateau_mb": round(statistics.median(x[k] for x in half) / MB, 1) for k in ("rss", "uss")},
                "rss_max_mb": round(max(x["rss"] for x in mine) / MB, 1),
                "rss_last_half_max_mb": round(max(x["rss"] for x in half) / MB, 1),
                "rss_growth_last_half_mb_per_min": _round(slope_mb_per_min([(x["t"], x["rss"]) for x in half])),
                "uss_growth_last_half_mb_per_min": _round(slope_mb_per_min([(x["t"], x["uss"]) for x in half])),
            }
        fills = self.fills(first, last)
        flat = all(
            p["rss_growth_last_half_mb_per_min"] is not None
            and p["rss_growth_last_half_mb_per_min"] < TARGET_MB_PER_MIN
            for p in processes.values()
        )
        return {
            "duration_s": a.duration,
            "last_half_s": [first, last],
            "rate": a.rate,
            "overload": {
                "rate": a.overload_rate,
                "period_s": a.period,
                "burst_s": a.burst,
                "stall_s": a.stall,
                "stalls": self.stalls,
            },
            "load": counts,
            "requests_recorded": metric_sum(final, "llmtap_requests_total"),
            "drops": self.drops(final),
            "drops_over_time": scrapes,
            "processes": processes,
            "fills": fills,
            "flat": flat,
        }

    def fills(self, first: float, last: float) -> dict[str, Any]:
        """Each probed size: its last value, its largest, its bound where it has one, and its growth a minute over
        the last half (``first`` to ``last`` seconds into the load)."""
        out: dict[str, Any] = {}
        for path in sorted(self.dir.glob("probe-*.jsonl")):
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            if not lines:
                continue
            role = lines[-1]["role"]
            names = {k for line in lines for k in line} - {"t", "pid", "role", "error"}
            for key in sorted(k for k in names if not k.endswith("_bound")):
                values = [line[key] for line in lines if isinstance(line.get(key), int)]
                if values:
                    bound = lines[-1].get(f"{key}_bound")
                    half = [
                        (line["t"] - self.started, line[key])
                        for line in lines
                        if isinstance(line.get(key), int) and first <= line["t"] - self.started < last
                    ]
                    growth = _round(slope_per_min(half))
                    entry = {"last": values[-1], "max": max(values), "bound": bound, "growth_per_min": growth}
                    out.setdefault(role, {})[key] = entry
        return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def table(r: dict[str, Any]) -> str:
    """The result as text."""
    rows = [
        f"run: {r['duration_s']:.0f} s at {r['rate']:g} requests/s, overload {r['overload']}",
        f"load: {r['load']}",
        f"recorded {r['requests_recorded']:.0f}; dropped {r['drops']}",
    ]
    for role, p in r["processes"].items():
        rows.append(
            f"{role}: RSS {p['rss_first_mb']} -> plateau {p['rss_plateau_mb']} MB (max {p['rss_max_mb']}), "
            f"USS plateau {p['uss_plateau_mb']} MB, last-half growth {p['rss_growth_last_half_mb_per_min']} MB/min "
            f"(USS {p['uss_growth_last_half_mb_per_min']})"
        )
    for role, fills in r["fills"].items():
        rows.append(f"{role} fills (last / max / bound; growth a minute over the last half):")
        rows += [f"  {k}: {v['last']} / {v['max']} / {v['bound']}; {v['growth_per_min']}" for k, v in fills.items()]
    first, last = r["last_half_s"]
    rows.append(f"flat (every process under {TARGET_MB_PER_MIN} MB/min from {first:.0f} to {last:.0f} s): {r['flat']}")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.probes.soak --memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=2400.0, help="seconds of load (2400)")
    add_shape(p)
    p.add_argument("--stall", type=float, default=8.0, help="seconds the telemetry is stopped in each period (8)")
    p.add_argument("--scheduling", default="normal", help="the telemetry's --telemetry-scheduling (normal)")
    p.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples (5)")
    p.add_argument("--out", type=Path, help="keep samples, probes, logs and result.json here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.probes.soak --memory``."""
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmtap-memsoak-") as tmp:
        workdir = args.out or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = Soak(args, workdir).run()
        (workdir / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
