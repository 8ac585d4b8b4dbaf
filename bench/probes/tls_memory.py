"""What one upstream connection holds in the relay's memory, plain and TLS: ``python -m bench.probes.tls_memory``.

A server in a child process (TLS with a private CA made for the run, or plain TCP) answers 200 bytes to every
read. A client child process opens ``--connections`` connections to it, over TLS with the context the relay
builds for an upstream (``llmtap.relay.tls``), on uvloop (the relay's event loop) or on asyncio's own, and
reads its resident memory (``/proc/self/statm``) before them, once they are connected, and after
``--exchanges`` request/answer turns on each of them: KiB per connection, less one connection made before
(warm-up). ``--together`` opens them all at once, as a burst of new streams makes the relay open its upstream
connections (every handshake in flight together), where by default each waits for the one before. Each kind runs
in a fresh process, ``--rounds`` times in turn; medians with the range. Prints JSON lines and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import tlsca

#: (transport, event loop) of each kind measured.
KINDS = (("plain", "uvloop"), ("tls", "uvloop"), ("tls", "asyncio"))
ANSWER = b"x" * 200


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Answer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(ANSWER)


class _Ask(asyncio.Protocol):
    def __init__(self) -> None:
        self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        if not self.answered.done():
            self.answered.set_result(None)


async def _serve(port_file: Path, folder: Path, tls: bool) -> None:
    ctx = tlsca.server_context(folder / "server.pem", folder / "server.key") if tls else None
    server = await asyncio.get_running_loop().create_server(_Answer, "127.0.0.1", 0, ssl=ctx, backlog=4096)
    # Written once, before anything is served: the parent waits for it.
    port_file.write_text(str(server.sockets[0].getsockname()[1]))  # noqa: ASYNC240
    await asyncio.sleep(3600)


async def _measure(
    port: int, folder: Path, tls: bool, connections: int, exchanges: int, together: bool = False
) -> dict[str, float]:
    from llmtap.relay import tls as relay_tls

    loop = asyncio.get_running_loop()
    ctx = relay_tls.context(relay_tls.TLSOptions(ca=str(folder / "ca.pem"))) if tls else None
    name = "127.0.0.1" if tls else None

    async def connect() -> _Ask:
        _, protocol = await loop.create_connection(_Ask, "127.0.0.1", port, ssl=ctx, server_hostname=name)
        return protocol

    async def turn(protocols: list[_Ask]) -> None:
        for p in protocols:
            p.answered = loop.create_future()
            p.transport.write(b"ask")
        await asyncio.gather(*(p.answered for p in protocols))

    await turn([await connect()])  # warm-up: the context, the loop's first buffers
    before = _rss()
    if together:
        protocols = list(await asyncio.gather(*(connect() for _ in range(connections))))
    else:
        protocols = [await connect() for _ in range(connections)]
    connected = _rss()
    for _ in range(exchanges):
        await turn(protocols)
    used = _rss()
    for p in protocols:
        p.transport.close()
    kib = 1024 * connections
    return {"connected_kib": (connected - before) / kib, "used_kib": (used - before) / kib}


def _child(argv: list[str]) -> None:
    role, loop_name, transport, folder = argv[0], argv[1], argv[2], Path(argv[3])
    if loop_name == "uvloop":
        import uvloop

        uvloop.install()
    if role == "serve":
        asyncio.run(_serve(Path(argv[4]), folder, transport == "tls"))
        return
    together = argv[7:8] == ["together"]
    result = asyncio.run(_measure(int(argv[4]), folder, transport == "tls", int(argv[5]), int(argv[6]), together))
    print(json.dumps(result))


def one(
    folder: Path, transport: str, loop_name: str, connections: int, exchanges: int, *, together: bool = False
) -> dict[str, Any]:
    """One kind in fresh processes: its server (on uvloop) and the measuring client (``together``: its connections
    opened at once)."""
    port_file = folder / f"port-{transport}-{loop_name}-{time.monotonic_ns()}"
    me = [sys.executable, "-m", "bench.probes.tls_memory", "--child"]
    server = subprocess.Popen([*me, "serve", "uvloop", transport, str(folder), str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        argv = [*me, "measure", loop_name, transport, str(folder), port_file.read_text()]
        argv += [str(connections), str(exchanges), "together" if together else "one-by-one"]
        out = subprocess.run(argv, check=True, capture_output=True, text=True)
    finally:
        server.terminate()
        server.wait(10)
    return {"transport": transport, "loop": loop_name, **json.loads(out.stdout.splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    """Print each kind's memory per connection (JSON lines, then a table of medians)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        _child(args[1:])
        return
    p = argparse.ArgumentParser(prog="python -m bench.probes.tls_memory", description=__doc__)
    p.add_argument("--connections", type=int, default=256)
    p.add_argument("--exchanges", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--together", action="store_true", help="open the connections at once (a burst's handshakes)")
    opts = p.parse_args(args)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tlsca.make(folder)
        for _ in range(opts.rounds):
            for transport, loop_name in KINDS:
                result = one(folder, transport, loop_name, opts.connections, opts.exchanges, together=opts.together)
                runs[(transport, loop_name)].append(result)
                print(json.dumps(result), flush=True)
    opened = "opened at once" if opts.together else "opened one by one"
    head = f"{opts.connections} connections {opened}, {opts.exchanges} exchanges each, {opts.rounds} rounds"
    print(f"\n{head}: KiB per connection")
    print("\n| connection | event loop | connected (median, range) | after the exchanges (median, range) |")
    print("| --- | --- | ---: | ---: |")
    for (transport, loop_name), results in runs.items():
        cells = []
        for key in ("connected_kib", "used_kib"):
            values = [r[key] for r in results]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f} to {max(values):.1f})")
        print(f"| {transport} | {loop_name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
