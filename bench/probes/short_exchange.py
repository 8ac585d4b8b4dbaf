"""A short request's relay CPU in one process, tree against tree: ``python -m bench.probes.short_exchange``.

The requests-per-second rig (``bench.probes.rps_ab``) measures whole processes side by side, and on a shared
machine its rounds move by more than a cut of a few microseconds buys. Here one process holds everything, on one
event loop (uvloop) and one core: a raw-asyncio upstream answering every POST with the same 160-byte JSON body,
llmtap's relay (``create_app`` under llmtap's listener, default settings, its tapes handed to a channel that
takes and drops them: no telemetry, no encoding of the tape's frame), and one keep-alive client sending the
benchmark's embeddings request and reading each answer whole before the next. The process's CPU time (user and
system) over ``--requests`` requests through the relay, less the same client's CPU over as many requests sent
straight to the upstream, is the relay's CPU per request: its parse, exchange, upstream client, the writes and
the loop's turns, with the kernel's loopback in both.

With ``--split`` the upstream writes each answer's head, then its body a millisecond later (as an upstream
under uvicorn writes them apart): the relay reads them in two reads.

Each ``--tree`` (a checkout with ``proxy/``) runs in a process of its own, the trees in turn, ``--rounds``
times; prints one JSON line per run and each tree's median and range. Pin it (``taskset -c 1``).
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
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import peers

BODY = b'{"model":"bench","input":"the quick brown fox"}'
ANSWER = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2,0.3,0.4]}],"model":"bench"' + (
    b"," + b" " * 40 + b'"usage":{"prompt_tokens":4,"total_tokens":4}}'
)


def _request(port: int) -> bytes:
    return (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (port, len(BODY), BODY)
    )


#: With ``--split``, how long after its head an answer's body is written (a millisecond: the relay has read the
#: head by then, so the body is a read of its own).
SPLIT_DELAY = 0.001


class _Upstream(asyncio.Protocol):
    """Answers each request (a head and its 47-byte body, in one read) with the fixed answer; in one write, or
    (``split``) its head and then its body."""

    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(ANSWER),
        ANSWER,
    )

    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)
    #: Whether the head and the body go in two writes (``--split``).
    split = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0 or len(self.buffer) < end + 4 + len(BODY):
                return
            self.buffer = self.buffer[end + 4 + len(BODY) :]
            if self.split:
                # The head now, the body on a later turn of the loop: two reads at the relay, as from an upstream
                # that writes its head and its body apart (uvicorn does).
                self.transport.write(self.head)
                asyncio.get_running_loop().call_later(SPLIT_DELAY, self._body)
            else:
                self.transport.write(self.answer)

    def _body(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(ANSWER)


class _Client(asyncio.Protocol):
    """One keep-alive connection: a request, its answer read whole (by its Content-Length), the next request."""

    def __init__(self, request: bytes, count: int, done: asyncio.Future[None]) -> None:
        self.request = request
        self.left = count
        self.done = done
        self.buffer = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower()
        at = head.find(b"content-length:")
        size = int(head[at + 15 :].split(b"\r\n", 1)[0])
        if len(self.buffer) < end + 4 + size:
            return
        if not head.startswith(b"http/1.1 200"):
            self.done.set_exception(RuntimeError(head.decode("latin-1")))
            return
        self.buffer = self.buffer[end + 4 + size :]
        self.left -= 1
        if self.left:
            self.transport.write(self.request)
        else:
            self.done.set_result(None)


class _Drop:
    """A channel that takes every tape and drops it: the relay's side of the hand-over, nothing past it."""

    dropped = 0
    shards = 1

    def send(self, message: Any, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        return True

    async def aclose(self) -> None:
        return None


async def _cpu_of(port: int, count: int) -> float:
    """CPU seconds of this process over ``count`` requests to ``port`` on one connection."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    began = time.process_time()
    transport, _ = await loop.create_connection(lambda: _Client(_request(port), count, done), "127.0.0.1", port)
    await done
    spent = time.process_time() - began
    transport.close()
    return spent


async def serve(app: Any, settings: Any) -> tuple[int, Callable[[], Awaitable[None]]]:
    """``app`` served by uvicorn under llmtap's listener (``uvicorn_config``) on a free loopback port, once started:
    the port, and what stops the server."""
    import uvicorn

    from llmtap.serve.server import uvicorn_config

    server = uvicorn.Server(uvicorn_config(app, settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn's flag, no event to wait on
        await asyncio.sleep(0.01)

    async def stop() -> None:
        server.should_exit = True
        await serving

    return port, stop


async def through_and_direct(port: int, up_port: int, count: int) -> tuple[float, float]:
    """CPU seconds of ``count`` requests through ``port``, and of as many straight to the upstream (the mean of a run
    before and one after), each path warmed first."""
    warm = max(count // 10, 200)
    await _cpu_of(port, warm)
    await _cpu_of(up_port, warm)
    direct = await _cpu_of(up_port, count)
    through = await _cpu_of(port, count)
    direct_after = await _cpu_of(up_port, count)
    return through, (direct + direct_after) / 2


async def _one(count: int) -> dict[str, Any]:
    """One tree's run, in this process: the relay's CPU per request, less the direct path's."""
    from llmtap.cli import parser
    from llmtap.config.load import build
    from llmtap.relay.app import create_app

    loop = asyncio.get_running_loop()
    upstream = await loop.create_server(_Upstream, "127.0.0.1", 0)
    up_port = upstream.sockets[0].getsockname()[1]
    settings = build(vars(parser().parse_args(["serve", "--upstream", f"http://127.0.0.1:{up_port}"])))
    relay_port, stop = await serve(create_app(settings, channel=_Drop()), settings)
    relayed, base = await through_and_direct(relay_port, up_port, count)
    await stop()
    upstream.close()
    return {
        "requests": count,
        "relay_us_per_request": (relayed - base) / count * 1e6,
        "relayed_us_per_request": relayed / count * 1e6,
        "direct_us_per_request": base / count * 1e6,
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    """Run each tree in turn, ``--rounds`` times; print each run and the medians."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.short_exchange", description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, action="append", default=[], help="a checkout with proxy/ (repeatable)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument(
        "--split", action="store_true", help="the upstream writes each answer's head, then its body 1 ms later"
    )
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _Upstream.split = args.split
    if args.one:
        import uvloop

        print(json.dumps(uvloop.run(_one(args.requests))), flush=True)
        return 0
    trees = args.tree or [peers.REPO]
    runs: dict[Path, list[float]] = {tree: [] for tree in trees}
    for k in range(args.rounds):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": f"{tree.resolve() / 'proxy'}{os.pathsep}{peers.REPO}"}
            argv = [sys.executable, "-m", "bench.probes.short_exchange", "--one", "--requests", str(args.requests)]
            argv += ["--split"] if args.split else []
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=peers.REPO)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row.update(tree=str(tree), round=k)
            runs[tree].append(row["relay_us_per_request"])
            print(json.dumps(row), flush=True)
    for tree, values in runs.items():
        summary = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(json.dumps({"tree": str(tree), "relay_us_per_request": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
