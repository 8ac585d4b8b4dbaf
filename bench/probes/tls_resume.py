"""What resuming TLS sessions saves a new upstream connection: ``python -m bench.probes.tls_resume``.

The benchmark's scripted upstream listens with TLS (a private CA made for the run) on the client's core; on the
proxy's core, this process drives llmtap's own upstream client (``LeanTransport`` with the context
``llmtap.relay.tls`` builds, as the relay does) through ``--connections`` requests, each on a new connection
(the pool closed after each), in two ways taken in turn, ``--rounds`` times: ``resumed`` (the context offers the
last connection's session: the default) and ``full`` (its sessions forgotten before each connection, so every
handshake is a full one). Per connection: this process's CPU (user and system, the client's side of the handshake,
the request and the one-chunk answer) and the wall time from the request to its answer's end (both handshake
sides, the upstream's on the other core). Medians over the rounds, with the range. Prints JSON lines and a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench import peers, tlsca
from llmtap.relay import tls
from llmtap.relay.upstream import LeanTransport

WAYS = ("resumed", "full")


async def connections(url: str, context: tls.ResumingContext, n: int, *, resume: bool) -> dict[str, Any]:
    """``n`` requests, each on a new connection: CPU and wall time per connection, and how many resumed."""
    walls: list[float] = []
    resumed = 0
    cpu = time.process_time()
    for _ in range(n):
        if not resume:
            context.sessions.clear()
        transport = LeanTransport(ssl_context=context)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            start = time.perf_counter()
            r = await client.post(url, json={"model": "m", "stream": True, "max_tokens": 1})
            assert r.status_code == 200, r.status_code
            walls.append(time.perf_counter() - start)
            pool = next(iter(transport._pools.values()))
            conn = pool.idle[0] if pool.idle else None
            sslobj = conn._transport.get_extra_info("ssl_object") if conn is not None and conn._transport else None
            resumed += bool(sslobj is not None and sslobj.session_reused)
    spent = time.process_time() - cpu
    return {"cpu_us": 1e6 * spent / n, "wall_ms": 1e3 * statistics.median(walls), "resumed": resumed, "of": n}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes.tls_resume", description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=200, help="new connections per way and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--proxy-cpu", dest="proxy_cpu", default="0", help="this process's core")
    p.add_argument("--client-cpu", dest="client_cpu", default="1", help="the upstream's core")
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {int(args.proxy_cpu)})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        certs = tlsca.make(work / "tls")
        up, _, tls_port = peers.upstreams(work, args.client_cpu, ttft=0.0, gap=0.0, chunks=1, certs=certs)
        try:
            context = tls.context(tls.TLSOptions(ca=str(certs.ca)))
            assert isinstance(context, tls.ResumingContext)
            url = f"https://{tlsca.SERVER_NAME}:{tls_port}/v1/chat/completions"
            runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
            uvloop.run(connections(url, context, 20, resume=True))  # warm: imports, the first session
            for _ in range(args.rounds):
                for way in WAYS:
                    got = uvloop.run(connections(url, context, args.connections, resume=way == "resumed"))
                    runs[way].append(got)
                    print(json.dumps({"way": way, **{k: round(v, 3) for k, v in got.items()}}), flush=True)
        finally:
            up.stop()
    print("| handshake | client CPU per connection (µs) | wall time per request (ms) | resumed |")
    print("| --- | ---: | ---: | ---: |")
    for way in WAYS:
        cpu = [r["cpu_us"] for r in runs[way]]
        wall = [r["wall_ms"] for r in runs[way]]
        resumed = sum(r["resumed"] for r in runs[way])
        total = sum(r["of"] for r in runs[way])
        print(
            f"| {way} | {statistics.median(cpu):.0f} ({min(cpu):.0f} to {max(cpu):.0f}) |"
            f" {statistics.median(wall):.2f} ({min(wall):.2f} to {max(wall):.2f}) | {resumed} of {total} |"
        )


if __name__ == "__main__":
    main()
