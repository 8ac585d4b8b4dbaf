"""Other clients' latency while one client floods the relay with large chat bodies.

``python -m bench.probes.body_flood`` starts two ``tests/support/fault_upstream.py`` and one ``llmtap serve`` of
whatever code
``PYTHONPATH`` selects, then alternates two phases ``--rounds`` times: probes alone, and probes while
``--clients`` flooding clients (one process of their own, raw sockets, one keep-alive connection each) send
chat bodies of ``--mib`` MiB back to back, or ``--rate`` a second each (``"stream": true``, so the relay asks for
usage and splices the body). The flood goes to a route of its own (``/flood``) with an upstream of its own, which
answers unread (``x-ignore-body``): what the probes share with the flood is the relay (and the machine), not the
upstream's event loop. A probe is a small chat stream of ``--chunks`` chunks ``--gap-ms`` apart: its first byte
and its whole time, as its client saw them. It prints the p50 and max of both per phase, how many bodies the flood
got through a second, and the relay's and the telemetry process's CPU per flooding body (beside the flood less
alone, over as long): what the flood took of the loop every other client shares, and of the machine.

The body's shape (``--shape``): ``one`` message holding the whole text (one long JSON string, what a long
document pasted into a prompt is), ``many`` messages of 8 KiB each, or ``code`` (one message of source text,
a quote or backslash every few bytes: what the JSON escapes cost).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import FaultUpstream, Llmtap
from tests.support.proctree import by_role, cpu_seconds, descendants

#: Words the bodies are made of (fixed seed: every run sends the same bytes).
_WORDS = tuple("".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=2 + i % 8)) for i in range(4096))


def chat_body(size: int, shape: str) -> bytes:
    """A streamed chat request of ``size`` bytes at most (a little under it), of the given shape."""
    rnd = random.Random(44)

    def text(n: int) -> str:
        if shape == "code":
            line = 'print("x\\ty", data["key"])  # a \\"quoted\\" path: C:\\\\tmp\n'
            return (line * (n // len(line) + 1))[:n]
        return " ".join(rnd.choices(_WORDS, k=n // 5 + 1))[:n]

    def build(n: int) -> bytes:
        if shape == "many":
            messages = [{"role": "user", "content": text((8 << 10) - 64)} for _ in range(max(1, n // (8 << 10)))]
        else:
            messages = [{"role": "user", "content": text(n)}]
        return json.dumps({"model": "flood", "stream": True, "messages": messages}).encode()

    room = size - 256
    body = build(room)
    # JSON escapes make some text longer than its characters: shrink it to fit.
    return body if len(body) <= size else build(room * room // len(body))


def _request(port: int, body: bytes) -> bytes:
    head = (
        f"POST /flood/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"x-ignore-body: 1\r\nx-chunks: 2\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _flood_one(port: int, request: bytes, until: float, counts: list[int], rate: float) -> None:
    """Send ``request`` again and again on one keep-alive connection, reading each chunked answer to its end;
    ``rate`` bodies a second at most (0: as fast as the relay takes them)."""
    sock = socket.create_connection(("127.0.0.1", port))
    due = time.monotonic()
    try:
        while time.monotonic() < until:
            if rate:
                time.sleep(max(due - time.monotonic(), 0.0))
                due += 1 / rate
            sock.sendall(request)
            got = b""
            while not got.endswith(b"0\r\n\r\n"):
                part = sock.recv(1 << 16)
                if not part:
                    return
                got = got[-8:] + part
            counts.append(1)
    finally:
        sock.close()


def flood(port: int, mib: float, shape: str, clients: int, seconds: float, rate: float = 0.0) -> int:
    """Flood for ``seconds`` (the ``--flood`` child's work); returns the bodies sent."""
    request = _request(port, chat_body(int(mib * (1 << 20)), shape))
    until = time.monotonic() + seconds
    counts: list[int] = []
    job = (port, request, until, counts, rate)
    threads = [threading.Thread(target=_flood_one, args=job) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(counts)


def probe(url: str, chunks: int, gap_ms: int) -> tuple[float, float]:
    """One small stream: seconds to its first body byte, and to its end."""
    body = {"model": "probe", "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
    headers = {"x-chunks": str(chunks), "x-gap-ms": str(gap_ms)}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        for _ in r.iter_raw():
            first = first if first is not None else time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


def _summary(samples: list[tuple[float, float]]) -> dict[str, Any]:
    firsts, ends = [s[0] * 1000 for s in samples], [s[1] * 1000 for s in samples]
    return {
        "probes": len(samples),
        "first_byte_ms_p50": round(statistics.median(firsts), 1),
        "first_byte_ms_max": round(max(firsts), 1),
        "e2e_ms_p50": round(statistics.median(ends), 1),
        "e2e_ms_max": round(max(ends), 1),
    }


def _cpu(proxy: Llmtap) -> tuple[float, float]:
    """CPU seconds the relay process and the telemetry process have used so far (their threads together)."""
    roles = by_role(descendants(proxy.proc.pid))
    return cpu_seconds(roles["relay"]), cpu_seconds(roles["telemetry"])


def _phase(
    proxy: Llmtap, args: argparse.Namespace, *, flood: bool
) -> tuple[list[tuple[float, float]], tuple[float, float], int]:
    """One phase: the probes' samples, the relay's and the telemetry's CPU seconds over it, and the bodies the flood
    sent."""
    child = None
    before = _cpu(proxy)
    if flood:
        argv = [sys.executable, "-m", "bench.probes.body_flood", "--flood", str(proxy.port), "--mib", str(args.mib)]
        argv += ["--shape", args.shape, "--clients", str(args.clients), "--seconds", str(args.seconds + 1)]
        argv += ["--rate", str(args.rate)]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the flood under way (and as long a pause alone)
    samples = []
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        samples.append(probe(proxy.url, args.chunks, args.gap_ms))
    sent = 0
    if child is not None:
        out, _ = child.communicate(timeout=args.seconds + 120)
        sent = int(out.strip() or 0)
    after = _cpu(proxy)
    return samples, (after[0] - before[0], after[1] - before[1]), sent


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the upstreams and llmtap, alternate the phases, and summarize each."""
    upstream, flooded = FaultUpstream(), FaultUpstream()
    home = Path(tempfile.mkdtemp(prefix="llmtap-flood-"))
    config = home / "llmtap.yaml"
    config.write_text(f"routes:\n  - prefix: /flood\n    strip_prefix: true\n    upstream: {flooded.url}\n")
    proxy = Llmtap(upstream.url, home / "llmtap.log", "--log-level", "warning", "--config", str(config))
    alone: list[tuple[float, float]] = []
    beside: list[tuple[float, float]] = []
    cpu = [0.0, 0.0]  # the relay's and the telemetry's, beside the flood less alone
    sent = 0
    try:
        for _ in range(args.rounds):
            samples, quiet, _ = _phase(proxy, args, flood=False)
            alone += samples
            samples, busy, bodies = _phase(proxy, args, flood=True)
            beside += samples
            cpu = [cpu[0] + busy[0] - quiet[0], cpu[1] + busy[1] - quiet[1]]
            sent += bodies
    finally:
        proxy.close()
        upstream.close()
        flooded.close()
    return {
        "body_bytes": len(chat_body(int(args.mib * (1 << 20)), args.shape)),
        "shape": args.shape,
        "clients": args.clients,
        "bodies_per_s": round(sent / (args.rounds * (args.seconds + 1)), 1),
        # The relay's CPU per flooding body: what the flood took of the loop every other client shares.
        "relay_cpu_ms_per_body": round(cpu[0] * 1000 / max(sent, 1), 1),
        "telemetry_cpu_ms_per_body": round(cpu[1] * 1000 / max(sent, 1), 1),
        "alone": _summary(alone),
        "beside_the_flood": _summary(beside),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the bench (or, with ``--flood PORT``, be its flooding child) and print one JSON object."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.body_flood", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=8.0, help="size of each flooding body, MiB (8)")
    p.add_argument("--shape", choices=("one", "many", "code"), default="one", help="the bodies' shape (one)")
    p.add_argument("--clients", type=int, default=1, help="flooding clients, one connection each (1)")
    p.add_argument("--rate", type=float, default=0.0, help="bodies a second per client at most (0: no limit)")
    p.add_argument("--rounds", type=int, default=3, help="alone / beside phases, alternated (3)")
    p.add_argument("--seconds", type=float, default=8.0, help="probing time per phase (8)")
    p.add_argument("--chunks", type=int, default=5, help="chunks of a probe's stream (5)")
    p.add_argument("--gap-ms", type=int, default=10, help="ms between a probe's chunks (10)")
    p.add_argument("--flood", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flood is not None:
        print(flood(args.flood, args.mib, args.shape, args.clients, args.seconds, args.rate), flush=True)
        return
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
