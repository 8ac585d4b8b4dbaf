"""A short request's relay CPU by layer, in one process: ``python -m bench.probes.layers``.

``bench.probes.short_exchange`` gives the relay's CPU per short request whole; a profile of it spreads that over a
hundred functions, a few per cent each. This probe measures it a layer at a time instead, each layer a server of
its own in the same harness (one process, uvloop, one keep-alive client, the raw upstream answering each request
with the same 160-byte JSON body), its CPU per request less the direct path's:

* ``floor``: the HTTP floor (``bench.probes.thin_http``): both heads parsed and written again, in the read
  callbacks, nothing else;
* ``server``: llmtap's listener under uvicorn and an ASGI application that answers each request at once with a
  fixed answer in one write (``llmtap.relay.oneshot``), no upstream: what the server's parse, request cycle and
  task cost;
* ``hop``: ``server``, and each request sent upstream on one kept connection by a minimal client (the head
  written, the answer parsed by httptools, the task woken at its end) and its answer relayed whole: what going
  upstream at all costs;
* ``client``: ``hop`` with llmtap's upstream client (``Upstreams.send``: the pool, the idle connection's check,
  the request's head built from the client's, the answer parsed, the connection parked) in place of the minimal one;
* ``relay``: llmtap's relay (``create_app``, default settings, its tapes dropped at the hand-over as in
  ``short_exchange``).

So ``server - direct`` is the server's share, ``hop - server`` the upstream hop's, ``client - hop`` the upstream
client's above the least one, and ``relay - client`` the exchange's: routing, checks, the tape, the trace, the
answer's head read and written, the hand-over. Each layer runs in a process of its own, in turn, ``--rounds``
times; prints one JSON line per run and each layer's median and range. Pin it (``taskset -c 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from bench import peers
from bench.probes import short_exchange, thin_http

LAYERS = ("floor", "server", "hop", "client", "relay")
#: The fixed answer's head fields, as the upstream sends them.
_FIELDS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(short_exchange.ANSWER))]
_TIMEOUTS: dict[str, float | None] = {"connect": 5.0, "read": 60.0, "write": 60.0, "pool": 5.0}

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
Close = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


class _Minimal(asyncio.Protocol):
    """The least upstream client: one kept connection, the head written, the answer parsed, the waiter woken."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.waiter: asyncio.Future[None] | None = None
        self.fields: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.fields, self.body = [], []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def _app(layer: str, up_port: int, settings: Any) -> tuple[App, Close]:
    """The ASGI application of ``layer`` (``server``, ``hop``, ``client``), and what closes its upstream side."""
    from llmtap.listener import CYCLE
    from llmtap.relay.forward import Upstreams
    from llmtap.relay.oneshot import head_of, write_whole

    def answer(cycle: Any, fields: list[tuple[bytes, bytes]], body: bytes) -> None:
        whole = head_of(cycle, 200, fields, len(body), writable=True)
        assert whole is not None
        write_whole(cycle, whole, 200, body)

    if layer == "server":

        async def server(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                cycle = scope["extensions"].pop(CYCLE)
                await receive()
                answer(cycle, _FIELDS, short_exchange.ANSWER)

        return server, _nothing
    if layer == "hop":
        loop = asyncio.get_running_loop()
        _, up = await loop.create_connection(_Minimal, "127.0.0.1", up_port)

        async def hop(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                cycle = scope["extensions"].pop(CYCLE)
                body = (await receive())["body"]
                up.waiter = loop.create_future()
                up.transport.write(
                    b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (up_port, len(body), body)
                )
                await up.waiter
                answer(cycle, up.fields, b"".join(up.body))

        async def close() -> None:
            up.transport.close()

        return hop, close
    upstreams = Upstreams(settings)
    route = settings.routes[0]

    def leaving() -> None:
        return None

    async def client(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            cycle = scope["extensions"].pop(CYCLE)
            body = (await receive())["body"]
            got = await upstreams.send(
                route, scope, list(scope["headers"]), body, _TIMEOUTS, leaving, trace=None, body_changed=False,
                plain=False,
            )  # fmt: skip
            whole = got.connection.take_whole()
            answer(cycle, got.headers, whole)
            got.close()

    return client, upstreams.aclose


async def _one(layer: str, count: int) -> dict[str, Any]:
    """One layer's run, in this process: its CPU per request, less the direct path's."""
    from llmtap.cli import parser
    from llmtap.config.load import build
    from llmtap.relay.app import create_app

    loop = asyncio.get_running_loop()
    upstream = await loop.create_server(short_exchange._Upstream, "127.0.0.1", 0)
    up_port = upstream.sockets[0].getsockname()[1]
    settings = build(vars(parser().parse_args(["serve", "--upstream", f"http://127.0.0.1:{up_port}"])))
    close: Close = _nothing
    stop: Close
    if layer == "floor":
        floor = await loop.create_server(lambda: thin_http._Client(up_port, False), "127.0.0.1", 0)
        port = floor.sockets[0].getsockname()[1]

        async def stop_floor() -> None:
            floor.close()

        stop = stop_floor

    else:
        if layer == "relay":
            app: Any = create_app(settings, channel=short_exchange._Drop())
        else:
            app, close = await _app(layer, up_port, settings)
        port, stop = await short_exchange.serve(app, settings)
    layered, base = await short_exchange.through_and_direct(port, up_port, count)
    await close()
    await stop()
    upstream.close()
    return {
        "layer": layer,
        "requests": count,
        "us_per_request": (layered - base) / count * 1e6,
        "direct_us_per_request": base / count * 1e6,
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    """Run each layer in turn, ``--rounds`` times; print each run, each layer's median, and each step's."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.layers", description=__doc__.splitlines()[0])
    p.add_argument("--layer", choices=LAYERS, action="append", default=[], help="a layer to run (repeatable; all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--one", choices=LAYERS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        import uvloop

        print(json.dumps(uvloop.run(_one(args.one, args.requests))), flush=True)
        return 0
    layers = args.layer or list(LAYERS)
    runs: dict[str, list[float]] = {layer: [] for layer in layers}
    for k in range(args.rounds):
        for layer in layers:
            argv = [sys.executable, "-m", "bench.probes.layers", "--one", layer, "--requests", str(args.requests)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=peers.REPO)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["round"] = k
            runs[layer].append(row["us_per_request"])
            print(json.dumps(row), flush=True)
    medians = {layer: statistics.median(values) for layer, values in runs.items()}
    for layer, values in runs.items():
        print(json.dumps({"layer": layer, "median": medians[layer], "min": min(values), "max": max(values)}))
    steps = [("server", None), ("hop", "server"), ("client", "hop"), ("relay", "client")]
    shares = {
        f"{upper} - {lower or 'direct'}": medians[upper] - (medians[lower] if lower else 0.0)
        for upper, lower in steps
        if upper in medians and (lower is None or lower in medians)
    }
    print(json.dumps({"steps_us_per_request": shares}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
