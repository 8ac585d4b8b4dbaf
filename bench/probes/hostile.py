"""Hostile responses through ``llmtap serve``: the telemetry process's memory and a normal stream's latency.

``python -m bench.probes.hostile`` relays, one after the other, a gzip bomb (an SSE body of ``--bomb-mib`` MiB of
one-letter content events, gzip'd to about a thousandth of that) and a plain stream of ``--stream-mib`` MiB
of content of one letter, from ``tests/support/fault_upstream.py`` (``gzip-bomb`` and ``one-letter``). While each
plays, normal streams (20 chunks 10 ms apart) run back to back beside it, and once more after it. For each
phase it reports the hostile stream's time, the telemetry process's resident memory before and at its
peak, the relay's peak, the normal streams' first byte and duration (p50 and max), and how long their request
records took to appear in the ``--record`` file after their responses ended (``--wait`` at most: a record
that never comes is reported as the wait). A baseline phase runs the normal streams alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from llmtap.store.files import ReadStats, read_records
from tests.support.net import free_port, wait_http
from tests.support.proctree import Service, by_role, rss_bytes

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = [sys.executable, "-m", "tests.support.fault_upstream"]
HOSTILE = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Go."}]}
COLUMNS = (
    "hostile_s",
    "telemetry_rss_mib",
    "telemetry_peak_growth_mib",
    "relay_peak_mib",
    "normal_streams",
    "first_byte_ms_p50",
    "first_byte_ms_max",
    "e2e_ms_p50",
    "e2e_ms_max",
    "record_ms_p50",
    "record_ms_max",
)


class Memory(threading.Thread):
    """Peak resident bytes of the telemetry process and of the relay, sampled every 20 ms."""

    def __init__(self, llmtap: Service) -> None:
        super().__init__(daemon=True)
        roles = by_role(llmtap.pids())
        self.telemetry, self.relay = roles["telemetry"], roles["relay"]
        self.before = rss_bytes(self.telemetry)
        self.peak = self.before
        self.relay_peak = rss_bytes(self.relay)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.telemetry))
            self.relay_peak = max(self.relay_peak, rss_bytes(self.relay))


class Bench:
    """One ``llmtap serve`` with a record file, in front of the fault upstream."""

    def __init__(self, home: Path, wait: float) -> None:
        self.wait = wait
        self.upstream = Service("upstream", UPSTREAM, log=home / "upstream.log", cpu=None)
        self.upstream_url = f"http://127.0.0.1:{self.upstream.read_line()}"
        self.records = home / "records"
        port, admin = free_port(), free_port()
        argv = [sys.executable, "-m", "llmtap", "serve", "--upstream", self.upstream_url, "--port", str(port)]
        argv += ["--admin-port", str(admin), "--record", str(self.records), "--log-level", "warning"]
        self.llmtap = Service("llmtap", argv, log=home / "llmtap.log", env={"OTEL_TRACES_EXPORTER": "none"}, cpu=None)
        self.url, self.admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        wait_http(self.admin + "/readyz", 30, alive=lambda: self.llmtap.proc.poll() is None)
        self._seen: set[str] = set()

    def close(self) -> None:
        self.llmtap.stop()
        self.upstream.stop()

    def recorded(self, model: str) -> bool:
        """Whether a record of ``model`` is in the record folder (read whole each look: the files stay small here)."""
        if model not in self._seen:
            self._seen.update(r.get("model") or "" for r in read_records(self.records, ReadStats()))
        return model in self._seen

    def normal(self) -> dict[str, float]:
        """One normal stream: its first byte and duration, and how long after its end its record appeared."""
        model = f"normal-{uuid.uuid4().hex[:12]}"
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
        headers = {"x-chunks": "20", "x-gap-ms": "10"}
        started = time.perf_counter()
        first = None
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
            for _ in r.iter_raw():
                first = first if first is not None else time.perf_counter() - started
        ended = time.perf_counter()
        while not self.recorded(model) and time.perf_counter() - ended < self.wait:
            time.sleep(0.01)
        return {"first_byte": first or 0.0, "e2e": ended - started, "record": time.perf_counter() - ended}

    def hostile(self, fault: str, size: int) -> dict[str, Any]:
        """The hostile stream in a thread, normal streams beside it and one after."""
        took: list[float] = []

        def run() -> None:
            started = time.perf_counter()
            headers = {"x-fault": fault, "x-fault-arg": str(size)}
            with httpx.stream(
                "POST", self.url + "/v1/chat/completions", json=HOSTILE, headers=headers, timeout=600
            ) as r:
                for _ in r.iter_raw():
                    pass
            took.append(time.perf_counter() - started)

        if fault == "gzip-bomb":
            # The upstream compresses a bomb once per size: asked for it straight, so that is not measured.
            headers = {"x-fault": fault, "x-fault-arg": str(size)}
            with httpx.stream("POST", self.upstream_url + "/v1/chat/completions", json=HOSTILE, headers=headers) as r:
                for _ in r.iter_raw():  # as it came: never inflated here
                    pass
        memory = Memory(self.llmtap)
        memory.start()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        normals = []
        while thread.is_alive():
            normals.append(self.normal())
        thread.join()
        normals.append(self.normal())
        memory.done.set()
        memory.join()
        return {
            "hostile_s": round(took[0], 2) if took else None,
            "telemetry_rss_mib": round(memory.before / 2**20, 1),
            "telemetry_peak_growth_mib": round((memory.peak - memory.before) / 2**20, 1),
            "relay_peak_mib": round(memory.relay_peak / 2**20, 1),
            **summary(normals),
        }

    def baseline(self, count: int = 20) -> dict[str, Any]:
        """Normal streams alone."""
        return summary([self.normal() for _ in range(count)])


def summary(normals: list[dict[str, float]]) -> dict[str, Any]:
    """p50 and max of the normal streams' figures, in ms."""
    out: dict[str, Any] = {"normal_streams": len(normals)}
    for key in ("first_byte", "e2e", "record"):
        values = [n[key] * 1000 for n in normals]
        out[f"{key}_ms_p50"] = round(statistics.median(values), 1)
        out[f"{key}_ms_max"] = round(max(values), 1)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the phases and print a table (or ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.hostile", description=__doc__)
    p.add_argument("--bomb-mib", type=int, default=256, help="what the gzip bomb inflates to (256)")
    p.add_argument("--stream-mib", type=int, default=1024, help="content of the long stream (1024)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a record at most (120)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmtap-hostile-") as home:
        bench = Bench(Path(home), args.wait)
        try:
            results = {
                "baseline": bench.baseline(),
                f"gzip bomb, {args.bomb_mib} MiB": bench.hostile("gzip-bomb", args.bomb_mib << 20),
                f"one letter, {args.stream_mib} MiB": bench.hostile("one-letter", args.stream_mib << 20),
            }
        finally:
            bench.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| phase | " + " | ".join(COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(COLUMNS))
    for phase, figures in results.items():
        print(f"| {phase} | " + " | ".join(str(figures.get(k, "–")) for k in COLUMNS) + " |")


if __name__ == "__main__":
    main()
