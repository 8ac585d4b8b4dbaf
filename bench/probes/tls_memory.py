"""What one upstream connection holds in the relay's memory, plain and TLS: ``python -m bench.probes.tls_memory``.

A server in a child process (TLS with a private CA made for the run, or plain TCP) answers 200 bytes to every
read. A client child process opens ``--connections`` connections to it, over TLS with the context the relay
builds for an upstream (``llmtap.relay.tls``), on uvloop (the relay's event loop) or on asyncio's own, and
reads its resident memory (``/proc/self/statm``) before them, once they are connected, and after
``--exchanges`` request/answer turns on each of them: KiB per connection, less one connection made before
(warm-up). ``--together`` opens them all at once, as a burst of new streams makes the relay open its upstream
connections (every handshake in flight together), where by default each waits for the one before. Each kind runs
in a fresh process, ``--rounds`` times in turn; medians with the range. Prints JSON lines and a Markdown table.

``--relay-reads`` reads as the relay's upstream connections do (``llmtap.relay.upstream.connection``: into the
process's one shared buffer, under the relay's malloc setting, ``llmtap.serve.heap``), where by default each read
is a new ``bytes`` made by the loop's TLS transport. ``--breakdown`` says, per connection, what holds the memory
after the exchanges: malloc's blocks in use (``mallinfo2``), of them the Python objects (``tracemalloc``, which
sees the loop's raw allocations too) and the loop's TLS read buffer (256 KiB, mostly never touched: address space,
not resident), the rest OpenSSL's; resident memory with and without what ``malloc_trim`` gives back.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench import tlsca
from llmtap.relay.upstream.connection import BUFFER

#: (transport, event loop) of each kind measured.
KINDS = (("plain", "uvloop"), ("tls", "uvloop"), ("tls", "asyncio"))
ANSWER = b"x" * 200


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _malloc() -> dict[str, int]:
    """glibc's counts: blocks in use (heap and mappings), and in mappings alone."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "mapped": info.hblkhd}


def _trim() -> None:
    ctypes.CDLL(None).malloc_trim(0)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Answer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(ANSWER)


class _SharedAsk(asyncio.BufferedProtocol):
    """Reads as the relay's upstream connections do: into the process's one buffer, each read copied out."""

    def __init__(self) -> None:
        self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return BUFFER.get(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        bytes(BUFFER.view[:nbytes])
        if not self.answered.done():
            self.answered.set_result(None)


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
    port: int, folder: Path, tls: bool, connections: int, exchanges: int, flags: list[str]
) -> dict[str, float]:
    from llmtap.relay import tls as relay_tls

    loop = asyncio.get_running_loop()
    ctx = relay_tls.context(relay_tls.TLSOptions(ca=str(folder / "ca.pem"))) if tls else None
    name = "127.0.0.1" if tls else None
    kind: Any = _SharedAsk if "relay-reads" in flags else _Ask

    async def connect() -> _Ask:
        _, protocol = await loop.create_connection(kind, "127.0.0.1", port, ssl=ctx, server_hostname=name)
        return protocol  # type: ignore[no-any-return]

    async def turn(protocols: list[_Ask]) -> None:
        for p in protocols:
            p.answered = loop.create_future()
            p.transport.write(b"ask")
        await asyncio.gather(*(p.answered for p in protocols))

    await turn([await connect()])  # warm-up: the context, the loop's first buffers
    if "breakdown" in flags:
        tracemalloc.start()
    before, heap_before = _rss(), _malloc()
    if "together" in flags:
        protocols = list(await asyncio.gather(*(connect() for _ in range(connections))))
    else:
        protocols = [await connect() for _ in range(connections)]
    connected = _rss()
    for _ in range(exchanges):
        await turn(protocols)
    used = _rss()
    kib = 1024 * connections
    out = {"connected_kib": (connected - before) / kib, "used_kib": (used - before) / kib}
    if "breakdown" in flags:
        out.update(_breakdown(heap_before, before, kib, tls))
    for p in protocols:
        p.transport.close()
    return out


def _breakdown(heap_before: dict[str, int], rss_before: int, kib: int, tls: bool) -> dict[str, float]:
    """What holds the connections' memory (KiB each), read while they are open."""
    heap = _malloc()
    python = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    in_use = heap["in_use"] - heap_before["in_use"]
    # Each TLS transport's read buffer, 256 KiB (uvloop's and asyncio's), which tracemalloc sees too.
    loop_buffer = 256 * kib if tls else 0
    _trim()
    return {
        "malloc_in_use_kib": in_use / kib,
        "of_it_mapped_kib": (heap["mapped"] - heap_before["mapped"]) / kib,
        "loop_read_buffer_kib": loop_buffer / kib,
        "python_objects_kib": (python - loop_buffer) / kib,
        "openssl_kib": (in_use - python) / kib,
        "rss_after_trim_kib": (_rss() - rss_before) / kib,
    }


def _child(argv: list[str]) -> None:
    role, loop_name, transport, folder = argv[0], argv[1], argv[2], Path(argv[3])
    if loop_name == "uvloop":
        import uvloop

        uvloop.install()
    if role == "serve":
        asyncio.run(_serve(Path(argv[4]), folder, transport == "tls"))
        return
    flags = argv[7:]
    if "relay-reads" in flags:
        from llmtap.serve.heap import fix_mmap_threshold

        fix_mmap_threshold()
    result = asyncio.run(_measure(int(argv[4]), folder, transport == "tls", int(argv[5]), int(argv[6]), flags))
    print(json.dumps(result))


def one(
    folder: Path, transport: str, loop_name: str, connections: int, exchanges: int, *, flags: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One kind in fresh processes: its server (on uvloop) and the measuring client (``flags``: ``together``, its
    connections opened at once; ``relay-reads``, read as the relay does; ``breakdown``)."""
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
        argv += [str(connections), str(exchanges), *flags]
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
    p.add_argument("--relay-reads", action="store_true", help="read as the relay does (one shared buffer)")
    p.add_argument("--breakdown", action="store_true", help="what holds each connection's memory")
    opts = p.parse_args(args)
    flags = tuple(
        name
        for name, on in (("together", opts.together), ("relay-reads", opts.relay_reads), ("breakdown", opts.breakdown))
        if on
    )
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tlsca.make(folder)
        for _ in range(opts.rounds):
            for transport, loop_name in KINDS:
                result = one(folder, transport, loop_name, opts.connections, opts.exchanges, flags=flags)
                runs[(transport, loop_name)].append(result)
                print(json.dumps(result), flush=True)
    opened = "opened at once" if opts.together else "opened one by one"
    head = f"{opts.connections} connections {opened}, {opts.exchanges} exchanges each, {opts.rounds} rounds"
    if opts.relay_reads:
        head += ", read as the relay reads"
    print(f"\n{head}: KiB per connection")
    print("\n| connection | event loop | connected (median, range) | after the exchanges (median, range) |")
    print("| --- | --- | ---: | ---: |")
    for (transport, loop_name), results in runs.items():
        cells = []
        for key in ("connected_kib", "used_kib"):
            values = [r[key] for r in results]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f} to {max(values):.1f})")
        print(f"| {transport} | {loop_name} | {cells[0]} | {cells[1]} |")
    if opts.breakdown:
        _print_breakdown(runs)


def _print_breakdown(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    keys = [k for k in runs[KINDS[0]][0] if k.endswith("_kib") and k not in ("connected_kib", "used_kib")]
    print("\nWhat holds it, after the exchanges (KiB per connection, medians):\n")
    print("| connection | event loop | " + " | ".join(k.removesuffix("_kib").replace("_", " ") for k in keys) + " |")
    print("| --- | --- |" + " ---: |" * len(keys))
    for (transport, loop_name), results in runs.items():
        cells = [f"{statistics.median(r[k] for r in results):.1f}" for k in keys]
        print(f"| {transport} | {loop_name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
