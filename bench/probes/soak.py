"""The soak: mixed traffic with faults through llmtap, every response checked, leaks and memory watched.

``python -m bench.probes.soak`` runs ten minutes at 64 concurrent streams; ``--duration 60`` is the CI smoke
(``tests/e2e/test_soak_smoke.py``). The upstream is ``tests/support/fault_upstream.py``: normal streams and bodies,
upstream faults (resets, hang-ups, stalls cut by the idle timeout, bodies shorter or longer than their
Content-Length, 500s, repeated usage), clients that leave mid-stream and clients that read slowly, and an
OTLP collector that refuses a third of the exports (half of those with 503, which the exporter retries, half
with 400, which it does not: those spans are lost and must be counted). It reports and checks:

* every response's bytes against the sha256 of what the upstream wrote (a prefix of it when the upstream
  reset the connection, since the kernel drops what was not yet read): ``bytes_lost`` must be 0;
* no leaked tasks, threads, file descriptors or connections: the proxy's own counts (it runs here under a
  monitor that writes them every second, on the event loop ``llmtap serve`` runs) come back, once the load
  ends, to what they were when idle after the warm-up; they are given up to ``SETTLE_S`` to do so (streams
  cut by the idle timeout, records handed over), and a count still above it then is a leak;
* resident memory flat: the median of the last tenth of the run within 10% of the first tenth's.

The result is one JSON object (``--json``) or a short table, and the exit code is 0 only when all hold.

``python -m bench.probes.soak --memory`` is the memory soak (``bench.probes.soak_memory``): fast, ever-new traffic
with overload
phases until every cache of llmtap is full, each process's memory sampled, its growth over the last half of the run
held under 0.05 MB a minute (``docs/memory.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx

from tests.support.net import LoopbackHTTPServer, free_port, wait_http
from tests.support.proctree import cpu_seconds

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = [sys.executable, "-m", "tests.support.fault_upstream"]
CHAT = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Soak."}]}
IDLE_TIMEOUT = 1.0
#: How long the proxy's counts get to come back to their idle level after the load.
SETTLE_S = 30.0
#: What each request does, and how often. Faults are a fifth of the traffic.
SCENARIOS: dict[str, int] = {
    "stream": 50,
    "stream-usage": 10,
    "unary": 8,
    "slow-client": 5,
    "client-leaves": 7,
    "close-mid-stream": 3,
    "reset-mid-stream": 3,
    "stall-body": 2,
    "cl-long": 2,
    "cl-short": 2,
    "reset-before-headers": 2,
    "status-500": 2,
    "dup-usage": 2,
    "cumulative-usage": 2,
}
#: The client status each scenario must end with (None: the body is cut, the client sees a protocol error).
EXPECTED_STATUS: dict[str, int | None] = {"reset-before-headers": 502, "status-500": 500}
CUT = frozenset({"close-mid-stream", "reset-mid-stream", "stall-body", "cl-long"})
_COUNTS = ("tasks", "threads", "fds", "sockets")


# --- the proxy, under a monitor ---------------------------------------------------------------------


async def _monitor(path: Path) -> None:
    """Every second, one JSON line of what the process holds: tasks, threads, descriptors, memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    with path.open("a", encoding="utf-8") as out:
        while True:
            fds = os.listdir("/proc/self/fd")
            sockets = sum(1 for fd in fds if _link(f"/proc/self/fd/{fd}").startswith("socket:"))
            with open("/proc/self/statm", encoding="ascii") as statm:  # noqa: ASYNC230 (procfs: no disk I/O)
                rss = int(statm.read().split()[1]) * page
            line = {
                "t": time.monotonic(),
                "tasks": len(asyncio.all_tasks()),
                "threads": threading.active_count(),
                "fds": len(fds),
                "sockets": sockets,
                "rss": rss,
            }
            out.write(json.dumps(line) + "\n")
            out.flush()
            await asyncio.sleep(1.0)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def serve_monitored(status: Path, serve_args: Sequence[str]) -> int:
    """``llmtap serve`` with the monitor beside the relay in the same event loop (the ``--serve`` entry).

    The telemetry process runs as under ``llmtap serve``; the monitor reads the relay's own process.
    """
    from llmtap import logs
    from llmtap.cli import parser
    from llmtap.config.load import build
    from llmtap.serve.relay import serve
    from llmtap.serve.server import run_loop
    from llmtap.serve.sockets import bind
    from llmtap.serve.telemetry import TelemetryProcess

    settings = build(vars(parser().parse_args(["serve", *serve_args])))
    logs.setup(settings.log_level)

    async def run(proxy_sock: socket.socket, channel_path: str, telemetry: TelemetryProcess) -> None:
        monitor = asyncio.create_task(_monitor(status))
        try:
            await serve(settings, proxy_sock, channel_path, telemetry=telemetry)
        finally:
            monitor.cancel()

    with tempfile.TemporaryDirectory(prefix="llmtap-soak-") as folder:
        channel_path = os.path.join(folder, "telemetry.sock")
        proxy_sock = bind(settings.host, settings.port, "proxy listener")
        with TelemetryProcess(settings, channel_path, relays=1) as telemetry:
            run_loop(run(proxy_sock, channel_path, telemetry))
    return 0


# --- a collector that fails a third of the time -----------------------------------------------------


class _Flaky(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        server: FlakyCollector = self.server  # type: ignore[assignment]
        server.exports += 1
        # Every third export refused: 503 (retried, so usually delivered) and 400 (final: the spans are lost)
        self.send_response({3: 503, 0: 400}.get(server.exports % 6, 200))
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class FlakyCollector(LoopbackHTTPServer):
    """OTLP/HTTP that refuses every third export, with 503 and 400 in turn."""

    def __init__(self) -> None:
        self.exports = 0
        super().__init__(_Flaky, poll=0.1)


# --- the load -------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the workers saw."""

    requests: Counter[str] = field(default_factory=Counter)
    checked: int = 0
    bytes_relayed: int = 0
    mismatched: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    cancel_seconds: list[float] = field(default_factory=list)


class Load:
    """``concurrency`` workers sending a seeded mix of scenarios until the deadline."""

    def __init__(self, proxy: str, upstream: str, concurrency: int, seed: int) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.tally = Tally()
        self._names = list(SCENARIOS)
        self._weights = list(SCENARIOS.values())

    async def run(self, seconds: float) -> Tally:
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency)
        timeout = httpx.Timeout(30.0)
        async with (
            httpx.AsyncClient(base_url=self.proxy, limits=limits, timeout=timeout) as client,
            httpx.AsyncClient(base_url=self.upstream, limits=limits, timeout=timeout) as truth,
        ):
            deadline = time.monotonic() + seconds
            await asyncio.gather(*(self._worker(client, truth, deadline) for _ in range(self.concurrency)))
        return self.tally

    async def _worker(self, client: httpx.AsyncClient, truth: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            scenario = self.rng.choices(self._names, self._weights)[0]
            chunks, gap = self.rng.randint(10, 60), self.rng.choice((0, 5, 10, 20))
            try:
                await self._one(client, truth, scenario, chunks, gap)
            except Exception as exc:  # a failure of the harness itself is a finding too
                self.tally.unexpected.append(f"{scenario}: {type(exc).__name__}: {exc}")

    async def _one(
        self, client: httpx.AsyncClient, truth: httpx.AsyncClient, scenario: str, chunks: int, gap: int
    ) -> None:
        rid = uuid.uuid4().hex
        headers = {"x-request-id": rid, "x-chunks": str(chunks), "x-gap-ms": str(gap), "x-keep": "1"}
        fault = scenario if scenario not in ("stream", "stream-usage", "unary", "slow-client", "client-leaves") else ""
        headers |= {"x-fault": fault, "x-fault-arg": str(self.rng.randint(1, 8))}
        body: dict[str, Any] = {**CHAT, "stream": scenario != "unary" and scenario != "cl-short"}
        usage = scenario == "stream-usage" or self.rng.random() < 0.3
        if usage:
            body["stream_options"] = {"include_usage": True}
        self.tally.requests[scenario] += 1
        received = b""
        status: int | None = None
        error: Exception | None = None
        left = None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                status = r.status_code
                async for part in r.aiter_raw():
                    received += part
                    if scenario == "slow-client":
                        await asyncio.sleep(0.02)
                    if scenario == "client-leaves" and received.count(b"data: ") >= 4:
                        break
            if scenario == "client-leaves":
                left = time.monotonic()  # leaving the block closed the connection mid-stream
        except httpx.HTTPError as exc:
            error = exc
        self.tally.bytes_relayed += len(received)
        await self._check(truth, scenario, rid, status, error, received, usage, left)

    async def _check(
        self,
        truth: httpx.AsyncClient,
        scenario: str,
        rid: str,
        status: int | None,
        error: Exception | None,
        received: bytes,
        usage: bool,
        left: float | None,
    ) -> None:
        where = f"{scenario} {rid}"
        expected = EXPECTED_STATUS.get(scenario, 200)
        if status != expected:
            self.tally.unexpected.append(f"{where}: status {status}, expected {expected} ({error!r})")
            return
        cut = scenario in CUT
        if cut != isinstance(error, httpx.RemoteProtocolError):
            self.tally.unexpected.append(f"{where}: ended with {error!r}")
        if scenario in ("reset-before-headers", "status-500"):
            return
        sent = (await truth.get(f"/sent/{rid}", params={"prefix": len(received)})).json()
        if scenario == "client-leaves":
            # The proxy must have cancelled the upstream request: it saw the connection end.
            for _ in range(100):
                if sent.get("gone_at") is not None or sent.get("done"):
                    break
                await asyncio.sleep(0.01)
                sent = (await truth.get(f"/sent/{rid}", params={"prefix": len(received)})).json()
            if sent.get("gone_at") is not None and left is not None:
                self.tally.cancel_seconds.append(sent["gone_at"] - left)
            want = sent["prefix_sha256"]
        elif scenario == "reset-mid-stream":
            want = sent["prefix_sha256"]
        elif usage or scenario not in ("stream", "slow-client", "dup-usage", "cumulative-usage"):
            want = sent["sha256"]
        else:
            # The proxy asked for usage on the client's behalf and removed that one event again.
            want = sent["sha256_without_usage"]
        self.tally.checked += 1
        if hashlib.sha256(received).hexdigest() != want:
            self.tally.mismatched.append(where)


# --- one run --------------------------------------------------------------------------------------------


def _idle(status: Path, since: float) -> dict[str, int]:
    """The monitor's last line at least ``since`` (monotonic)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in status.read_text().splitlines() if x.strip()]
        fresh = [x for x in lines if x["t"] >= since]
        if fresh:
            last: dict[str, int] = fresh[-1]
            return last
        time.sleep(0.2)
    raise RuntimeError("the proxy's monitor stopped writing")


def _leaks(before: dict[str, int], after: dict[str, int], pooled: int) -> dict[str, int]:
    """What the proxy holds now beyond its idle level; keep-alive connections to the upstream are the pool's
    working set, not a leak (at most one per stream)."""
    return {key: after[key] - before[key] - (pooled if key in ("fds", "sockets") else 0) for key in _COUNTS}


def _settled(
    status: Path, since: float, before: dict[str, int], upstream_port: int, pool_before: int
) -> tuple[dict[str, int], int]:
    """The monitor's first line after ``since`` that holds nothing beyond ``before``, or its last one once
    ``SETTLE_S`` have passed; with the upstream pool's size then."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        after, pool_after = _idle(status, since), _connections_to(upstream_port)
        settled = all(v <= 0 for v in _leaks(before, after, pool_after - pool_before).values())
        if settled or time.monotonic() > deadline:
            return after, pool_after
        since = after["t"] + 0.001  # the next line: the monitor writes one a second
        time.sleep(0.5)


def _connections_to(port: int) -> int:
    """Open TCP connections (any state but LISTEN and TIME_WAIT) whose far end is ``port``."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] not in ("0A", "06") and int(fields[2].rsplit(":", 1)[1], 16) == port:
            count += 1
    return count


def run(duration: float, concurrency: int, seed: int, workdir: Path) -> dict[str, Any]:
    """One soak; returns the figures and the verdict."""
    status = workdir / "monitor.jsonl"
    upstream = subprocess.Popen(UPSTREAM, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    collector = FlakyCollector()
    proxy: subprocess.Popen[bytes] | None = None
    try:
        assert upstream.stdout is not None
        upstream_port = int(upstream.stdout.readline())
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        port, admin = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
        env |= {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
        }
        serve_args = ["--upstream", upstream_url, "--port", str(port), "--admin-port", str(admin)]
        serve_args += ["--idle-timeout", str(IDLE_TIMEOUT), "--read-timeout", "5", "--log-level", "error"]
        serve_args += ["--record", str(workdir / "records"), "--slo-ttft-ms", "1000"]
        with (workdir / "llmtap.log").open("wb") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "bench.probes.soak", "--serve", str(status), "--", *serve_args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        wait_http(f"http://127.0.0.1:{admin}/readyz", 30, alive=lambda: proxy is not None and proxy.poll() is None)
        proxy_url = f"http://127.0.0.1:{port}"
        # Warm-up at full concurrency, so pools and caches reach their working size, then idle.
        warm = asyncio.run(Load(proxy_url, upstream_url, concurrency, seed + 1).run(min(15.0, duration / 4)))
        time.sleep(2.5)
        before = _idle(status, time.monotonic() - 0.1)
        pool_before = _connections_to(upstream_port)
        started, cpu_before = time.monotonic(), cpu_seconds([proxy.pid])
        tally = asyncio.run(Load(proxy_url, upstream_url, concurrency, seed).run(duration))
        ended, cpu_after, load = time.monotonic(), cpu_seconds([proxy.pid]), os.getloadavg()[0]
        after, pool_after = _settled(status, ended, before, upstream_port, pool_before)
        lines = [json.loads(x) for x in status.read_text().splitlines() if x.strip()]
        during = [x["rss"] for x in lines if started <= x["t"] <= ended]
        tenth = max(len(during) // 10, 1)
        first, last = statistics.median(during[:tenth]), statistics.median(during[-tenth:])
        connections = _connections_to(port)
        metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=10).text
    finally:
        if proxy is not None:
            proxy.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proxy.wait(30)
            if proxy.poll() is None:
                proxy.kill()
                proxy.wait(5)
        upstream.terminate()
        upstream.wait(10)
        if upstream.stdout is not None:
            upstream.stdout.close()
        collector.close()
    leaks = _leaks(before, after, pool_after - pool_before)
    growth = (last - first) / first
    cancels = sorted(tally.cancel_seconds)
    result: dict[str, Any] = {
        "duration_s": round(ended - started, 1),
        "concurrency": concurrency,
        "requests": sum(tally.requests.values()),
        "by_scenario": dict(sorted(tally.requests.items())),
        "warmup_requests": sum(warm.requests.values()),
        "bytes_relayed": tally.bytes_relayed,
        "responses_checked": tally.checked,
        "bytes_lost": len(tally.mismatched),
        "mismatched": tally.mismatched[:20],
        "unexpected": tally.unexpected[:20],
        "unexpected_count": len(tally.unexpected),
        "idle_before": before,
        "idle_after": after,
        "leaked": leaks,
        "client_connections_left": connections,
        "upstream_pool": [pool_before, pool_after],
        "rss_first_mib": round(first / 2**20, 1),
        "rss_last_mib": round(last / 2**20, 1),
        "rss_growth_pct": round(100 * growth, 1),
        "cancel_ms_p50": round(1000 * cancels[len(cancels) // 2], 1) if cancels else None,
        "cancel_ms_max": round(1000 * cancels[-1], 1) if cancels else None,
        "proxy_cpu_pct": round(100 * (cpu_after - cpu_before) / (ended - started), 1),
        "load_average": round(load, 2),
        "collector_exports": collector.exports,
        "spans_dropped": _metric(metrics, "llmtap_telemetry_spans_dropped_total"),
        "proxy_exit_code": proxy.returncode if proxy is not None else None,
    }
    result["pass"] = (
        not tally.mismatched
        and not tally.unexpected
        and all(v <= 0 for v in leaks.values())
        and connections == 0
        and pool_after <= concurrency
        and abs(growth) <= 0.10
        and result["proxy_exit_code"] == 0
    )
    return result


def _metric(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + "{"))


def _table(r: dict[str, Any]) -> str:
    rows = [
        ("verdict", "PASS" if r["pass"] else "FAIL"),
        ("duration, concurrency", f"{r['duration_s']} s, {r['concurrency']} streams"),
        ("requests (checked)", f"{r['requests']} ({r['responses_checked']} by sha256)"),
        ("bytes relayed, lost", f"{r['bytes_relayed'] / 2**20:.1f} MiB, {r['bytes_lost']} responses differ"),
        ("unexpected outcomes", str(r["unexpected_count"])),
        ("leaked tasks/threads/fds/sockets", "/".join(str(v) for v in r["leaked"].values())),
        ("client connections left", str(r["client_connections_left"])),
        ("upstream pool idle before, after", "{}, {}".format(*r["upstream_pool"])),
        ("RSS first -> last tenth", f"{r['rss_first_mib']} -> {r['rss_last_mib']} MiB ({r['rss_growth_pct']:+}%)"),
        ("upstream cancel after client left", f"p50 {r['cancel_ms_p50']} ms, max {r['cancel_ms_max']} ms"),
        ("proxy CPU, machine load", f"{r['proxy_cpu_pct']}% of a core, load average {r['load_average']}"),
        ("spans dropped (flaky collector)", f"{r['spans_dropped']:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.probes.soak``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return serve_monitored(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:])
    if argv[:1] == ["--memory"]:
        from bench.probes.soak_memory import main as memory

        return memory(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.probes.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of measured load (600)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streams (64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix (0)")
    p.add_argument("--out", type=Path, help="keep the proxy's log, monitor samples and records here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmtap-soak-") as tmp:
        workdir = args.out or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run(args.duration, args.concurrency, args.seed, workdir)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
