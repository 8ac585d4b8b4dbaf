"""What a new client connection costs the relay's listener before its first byte: ``python -m
bench.probes.connection_setup [--tree DIR ...]``.

A burst of new connections is served one after another on the relay's core: each connection's set-up (the
protocol object uvicorn makes for it, and its ``connection_made``) comes before the next one's request is read,
so what it costs adds up along the burst. For each llmtap source tree given (default: this one), a child
process on uvloop serves ``--connections`` connections, one at a time from a thread of its own, with llmtap's
``BoundedHeadProtocol`` (closed at once, nothing read), and times in CPU (``time.thread_time``) the protocol's
construction and its ``connection_made``. Trees run in turn, ``--rounds`` times; medians with the range.
Prints JSON lines and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


async def _serve(connections: int) -> dict[str, float]:
    import uvicorn
    from uvicorn.server import ServerState

    from llmtap.listener import BoundedHeadProtocol, ClientLimits

    async def app(scope: Any, receive: Any, send: Any) -> None:
        """Never called: no request is sent."""

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    state = ServerState()
    limits = ClientLimits(header_timeout=30, body_timeout=30, max_connections=1 << 20, per_client=1 << 20)
    spent = {"init_us": 0.0, "connection_made_us": 0.0}

    class Timed(BoundedHeadProtocol):
        def __init__(self, **kwargs: Any) -> None:
            t = time.thread_time()
            super().__init__(**kwargs)
            spent["init_us"] += time.thread_time() - t

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            t = time.thread_time()
            super().connection_made(transport)
            spent["connection_made_us"] += time.thread_time() - t
            transport.close()

    loop = asyncio.get_running_loop()

    def protocol() -> Timed:
        return Timed(config=config, server_state=state, app_state={}, _loop=loop, limits=limits)

    server = await loop.create_server(protocol, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]

    done = asyncio.Event()

    def clients() -> None:
        for _ in range(connections):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.recv(1)  # until the server closed it: one connection at a time
        loop.call_soon_threadsafe(done.set)

    threading.Thread(target=clients, daemon=True).start()
    await done.wait()
    server.close()
    return {k: 1e6 * v / connections for k, v in spent.items()}


def one(tree: Path, connections: int) -> dict[str, Any]:
    """One run of ``tree``'s listener in a fresh process."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'proxy'}{os.pathsep}{REPO}"}
    argv = [sys.executable, "-m", "bench.probes.connection_setup", "--child", str(connections)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return {"tree": str(tree), **json.loads(out.stdout.splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    """Print each tree's CPU per connection set-up (JSON lines, then a table of medians)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        import uvloop

        print(json.dumps(uvloop.run(_serve(int(args[1])))))
        return
    p = argparse.ArgumentParser(prog="python -m bench.probes.connection_setup", description=__doc__)
    p.add_argument("--tree", action="append", type=Path, help="an llmtap checkout (repeatable; default: this one)")
    p.add_argument("--connections", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    opts = p.parse_args(args)
    trees = [t.resolve() for t in (opts.tree or [REPO])]
    runs: dict[Path, list[dict[str, Any]]] = {t: [] for t in trees}
    for _ in range(opts.rounds):
        for tree in trees:
            result = one(tree, opts.connections)
            runs[tree].append(result)
            print(json.dumps(result), flush=True)
    print(f"\n{opts.connections} connections a run, {opts.rounds} rounds: CPU µs per connection (median, range)")
    print("\n| tree | protocol made | connection_made |")
    print("| --- | ---: | ---: |")
    for tree, results in runs.items():
        cells = []
        for key in ("init_us", "connection_made_us"):
            values = [r[key] for r in results]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f} to {max(values):.2f})")
        print(f"| {tree} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
