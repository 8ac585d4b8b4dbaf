"""One upstream's telemetry in one process and spread over two: ``python -m bench.probes.telemetry_scale``.

Starts the telemetry processes exactly as ``llmtap serve --telemetry-workers M`` does (``TelemetryProcess``),
each pinned to a core of its own (every thread), default telemetry with a span per chunk, spans and metrics
exported over OTLP/HTTP to a sink that takes each body and answers at once. This process plays the relays: it
connects to their channels and hands over, at ``--rate`` requests a second for ``--seconds``, the tapes of
streamed chat requests to one upstream (``--chunks`` content chunks each, usage at the end, a prompt with a
shared system part, random trace ids, numbered and overlapping as the relay numbers requests to an upstream),
each to the process its trace id names (``shard_of``, as the relay chooses). Offered above what one process
takes, a full queue drops tapes (counted): what each configuration records a second is its capacity.

Prints one JSON line per configuration and round: requests recorded and dropped, recorded per second, each
telemetry process's CPU per recorded request, and the lessons they could not pass to each other. ``--summary``
ends with each configuration's medians. ``--records`` writes each request's record and sets what several
processes gave each request (its queue/prefill split against the route's ``server_slots``, and its cache class:
each prompt starts with one of eight system prompts, and the server reads nothing from its cache, so the class
says whether the process knew the prompt was sent before) against what one process gave the same request in
the same round: ``same_as_one_process`` of ``compared``. Offer a rate one process keeps up with for that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from llmtap.config.load import build
from llmtap.serve.telemetry import TelemetryProcess
from llmtap.store.files import ReadStats, read_records
from llmtap.wire.framing import encode_frame
from llmtap.wire.tape import shard_of
from tests.support.proctree import cpu_seconds, pin_threads
from tests.support.tapes import chat_tape, content_event

#: The prompts' system parts: each request takes one of these (their prefixes are what the cache index keeps whole).
SYSTEMS = [f"You answer questions about the product's invoices (v{v}), briefly. " * 20 for v in range(8)]
#: The slots the route says the upstream runs (the slot replay's count).
SLOTS = 32


class _Sink(BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export and answers 200 with an empty response (what a collector says), keeping the
    connection."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


def sink() -> tuple[ThreadingHTTPServer, int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def tapes(count: int, chunks: int, rate: float, seed: int) -> list[tuple[int, bytes]]:
    """``count`` end messages, framed, with the trace id each is sent by: requests ``1 / rate`` s apart, each
    ``ttft + chunks * gap`` long, numbered in order with the requests in flight ahead of each."""
    rng = random.Random(seed)
    # The server reads nothing from its cache: each request's class says whether its prompt was sent before.
    details = {"cached_tokens": 0}
    usage = {"prompt_tokens": 300, "completion_tokens": 2 * chunks, "prompt_tokens_details": details}
    last = {"model": "m", "choices": [], "usage": usage}
    reads = [content_event(" word word")] * chunks + [b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"]
    gap, length = 0.02, 0.1 + 0.02 * chunks
    ends: list[float] = []
    out: list[tuple[int, bytes]] = []
    for key in range(count):
        received = 1000.0 + key / rate
        ahead = sum(1 for e in ends[-4096:] if e > received)
        ends.append(received + length)
        system = rng.choice(SYSTEMS)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {key}"}]
        body = json.dumps({"model": "m", "stream": True, "messages": messages}).encode()
        trace_id = rng.getrandbits(128)
        _, sent = chat_tape(
            key,
            reads,
            received=received,
            body=body,
            gap=gap,
            trace_id=trace_id,
            span_id=rng.getrandbits(64) or 1,
            upstream=(key + 1, ahead),
        )
        prefix, data = encode_frame(sent[-1])
        out.append((trace_id, prefix + data))
    return out


#: What is read from ``/metrics``: requests recorded, tapes dropped, lessons lost, each summed over its labels.
DROPPED = "llmtap_telemetry_tapes_dropped_total"
COUNTED = ("llmtap_requests_total", DROPPED, "llmtap_telemetry_facts_dropped_total")


def scrape(port: int) -> dict[str, float]:
    """The admin listener's ``/metrics`` (every process's, added up): ``COUNTED``."""
    return _sums(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)


def scrape_own(path: str) -> dict[str, float]:
    """One telemetry process's own ``/metrics``, on its private admin socket (processes 1 and up)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=30) as client:
        return _sums(client.get("http://telemetry/metrics").text)


def _sums(text: str) -> dict[str, float]:
    """``COUNTED`` summed over their labels; tapes dropped also by reason (``..._total:partial`` and so on)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTED:
            value = float(line.rsplit(" ", 1)[1])
            sums[name] = sums.get(name, 0.0) + value
            if name == DROPPED and 'llmtap_telemetry_reason="' in line:
                reason = line.split('llmtap_telemetry_reason="', 1)[1].split('"', 1)[0]
                sums[f"{name}:{reason}"] = sums.get(f"{name}:{reason}", 0.0) + value
    return sums


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (the telemetry processes inherit it), as it was afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(workers: int, args: argparse.Namespace, sink_port: int, seed: int) -> dict[str, Any]:
    """One configuration, one round."""
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "500",
    }
    with environment(otel):
        return _measure(workers, args, seed)


def _measure(workers: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    count = int(args.rate * args.seconds)
    frames = tapes(count + 64, args.chunks, args.rate, seed)
    warm, frames = frames[:64], frames[64:]
    with tempfile.TemporaryDirectory(prefix="lt-scale-", dir="/tmp") as folder:
        config = Path(folder) / "llmtap.yaml"
        route = f"{{prefix: /, upstream: 'http://127.0.0.1:9', server_slots: {SLOTS}, cache_min_tokens: 16}}"
        config.write_text(f"routes:\n  - {route}\n")
        records = Path(folder) / "records"
        flags: dict[str, Any] = {
            "config": str(config),
            "telemetry_workers": workers,
            "admin_port": 0,
            "chunk_spans": "spans",
            "prometheus": True,
        }
        if args.records:
            flags["record"] = str(records)
        settings = build(flags)
        channel = os.path.join(folder, "telemetry.sock")
        with TelemetryProcess(settings, channel, relays=1) as telemetry:
            pids = [p.pid for p in telemetry.procs]
            # Each process a core of its own (process 0 beside this one's feeding); ``--one-core``: all on core 1,
            # where what the processes tell each other costs what it costs without a second core's help.
            cores = [1] * workers if workers == 1 or args.one_core else list(range(workers))
            for pid, core in zip(pids, cores, strict=True):
                pin_threads(pid, {core})
            paths = [channel] if workers == 1 else [f"{channel}.{i}" for i in range(workers)]
            socks = []
            for path in paths:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                socks.append(s)
            for trace_id, frame in warm:
                socks[shard_of(trace_id, 0, workers)].sendall(frame)
            deadline = time.monotonic() + 60
            while scrape(telemetry.admin_port).get("llmtap_requests_total", 0) < len(warm):
                assert time.monotonic() < deadline, "the telemetry processes did not take the warm-up tapes"
                time.sleep(0.1)
            for pid, core in zip(pids, cores, strict=True):  # threads started since (the exporters') move too
                pin_threads(pid, {core})
            before = [cpu_seconds([pid]) for pid in pids]
            feeder_before = cpu_seconds([os.getpid()])
            done_before = scrape(telemetry.admin_port)
            tick = 0.01
            per_tick = max(1, int(args.rate * tick))
            started = time.monotonic()
            for i in range(0, len(frames), per_tick):
                batch: list[list[bytes]] = [[] for _ in range(workers)]
                for trace_id, frame in frames[i : i + per_tick]:
                    batch[shard_of(trace_id, 0, workers)].append(frame)
                for s, frames_of in zip(socks, batch, strict=True):
                    if frames_of:
                        s.sendall(b"".join(frames_of))
                wait = started + (i // per_tick + 1) * tick - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            fed = time.monotonic() - started
            # Done when the processes' CPU goes quiet (read from /proc: scraping /metrics meanwhile would cost the
            # first process a merge of every page each time); then every tape is counted once, below.
            step, last, busy_until = 0.1, cpu_seconds(pids), time.monotonic()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(step)
                cpu = cpu_seconds(pids)
                if cpu - last > 0.1 * step * workers:
                    busy_until = time.monotonic()
                elif time.monotonic() - busy_until > 1.0:
                    break
                last = cpu
            elapsed = busy_until - started
            now = scrape(telemetry.admin_port)
            taken = now.get("llmtap_requests_total", 0) - done_before.get("llmtap_requests_total", 0)
            # Whole tapes lost (the queue full); a tape whose bytes the queue's byte bound left out is recorded, from
            # its timing, and counted apart (``partial``).
            lost = [f"{DROPPED}:{r}" for r in ("queue_full", "channel_full", "evicted")]
            dropped = sum(now.get(k, 0) - done_before.get(k, 0) for k in lost)
            partial = now.get(f"{DROPPED}:partial", 0) - done_before.get(f"{DROPPED}:partial", 0)
            spent = [cpu_seconds([pid]) - b for pid, b in zip(pids, before, strict=True)]
            feeder = cpu_seconds([os.getpid()]) - feeder_before
            # Requests each process recorded: process 0's is the whole less the others'.
            others = [scrape_own(path).get("llmtap_requests_total", 0.0) for path in telemetry.peer_paths]
            own = [now.get("llmtap_requests_total", 0.0) - sum(others), *others]
            warmed = [sum(1 for t, _ in warm if shard_of(t, 0, workers) == i) for i in range(workers)]
            by_process = [int(o - w) for o, w in zip(own, warmed, strict=True)]
            for s in socks:
                s.close()
        # Each measured request's estimate and cache class, to set against another configuration's (``--records``).
        measured = {format(trace_id, "032x") for trace_id, _ in frames}
        estimates = {
            r["trace_id"]: (r["queue"], r["prefill"], r["queue_source"], r["cache"]["class"])
            for r in (read_records(records, ReadStats()) if args.records else ())
            if r["trace_id"] in measured
        }
    return {
        "estimates": estimates,
        "telemetry_processes": workers,
        "chunks_per_request": args.chunks,
        "offered_per_s": args.rate,
        "sent": len(frames),
        "fed_s": round(fed, 2),
        "recorded": int(taken),
        "dropped": int(dropped),
        "partial": int(partial),
        "recorded_per_s": round(taken / elapsed, 1),
        "recorded_by_process": by_process,
        "us_per_request_by_process": [round(1e6 * c / max(n, 1), 1) for c, n in zip(spent, by_process, strict=True)],
        "cpu_s_by_process": [round(c, 2) for c in spent],
        "feeder_and_sink_cpu_s": round(feeder, 2),
        "facts_dropped": int(now.get("llmtap_telemetry_facts_dropped_total", 0)),
        "load": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.telemetry_scale", description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="telemetry processes to compare")
    parser.add_argument("--chunks", type=int, default=1, help="content chunks per request")
    parser.add_argument("--rate", type=float, default=3000.0, help="requests offered a second")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long they are offered")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one-core", action="store_true", help="every telemetry process on core 1")
    parser.add_argument("--summary", action="store_true", help="end with each configuration's medians")
    parser.add_argument(
        "--records",
        action="store_true",
        help="write records and report how many requests got the queue/prefill split and cache class one process gave",
    )
    args = parser.parse_args(argv)
    # This process (the relays' part and the sink) on core 0, its threads too: beside telemetry process 0 when
    # there are two, alone when there is one.
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {0})
    server, port = sink()
    runs: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            alone: dict[str, Any] | None = None
            for workers in args.workers:
                result = measure(workers, args, port, seed=r)
                estimates = result.pop("estimates")
                if workers == 1:
                    alone = estimates
                elif alone is not None and args.records:
                    both = set(alone) & set(estimates)
                    result["compared"] = len(both)
                    result["same_as_one_process"] = sum(1 for t in both if alone[t] == estimates[t])
                    result["differ"] = [(alone[t], estimates[t]) for t in sorted(both) if alone[t] != estimates[t]][:3]
                    result["cache_classes"] = dict(Counter(e[3] for e in estimates.values()))
                runs.append(result)
                print(json.dumps(result), flush=True)
    finally:
        server.shutdown()
        server.server_close()
    if args.summary:
        for workers in args.workers:
            mine = [r for r in runs if r["telemetry_processes"] == workers]
            print(
                json.dumps(
                    {
                        "summary": workers,
                        "recorded_per_s": statistics.median(r["recorded_per_s"] for r in mine),
                        "us_per_request": statistics.median(
                            statistics.mean(r["us_per_request_by_process"]) for r in mine
                        ),
                        "facts_dropped": sum(r["facts_dropped"] for r in mine),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
