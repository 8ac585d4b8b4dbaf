"""The floor: the thinnest relay Python can be, to measure llmtap's relay against in the same run.

``python -m bench.probes.thin_relay --upstream-port N`` prints its port, then relays each client connection to a
keep-alive connection of its own to the upstream: the client's bytes go up as they are, and each upstream
read goes to the client's transport in the read callback with one timestamp and one list append, nothing
else (no HTTP parsing, no routing, no telemetry, no flow control). A response ends at the chunked body's last
chunk (``0\\r\\n\\r\\n`` at the end of a read), which is all the benchmark's upstream sends. Not part of llmtap
and not a proxy anyone should run: what is left of a relayed chunk's CPU here is the event loop's wake-up,
the socket read and write, and the kernel's loopback, which llmtap's relay pays too.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import uvloop

__all__ = ["Down", "serve"]

_LAST_CHUNK = b"0\r\n\r\n"


class _Up(asyncio.Protocol):
    """The upstream side of one client connection: each read goes straight to the client."""

    def __init__(self, down: Down) -> None:
        self.down = down
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        down = self.down
        down.reads.append(time.perf_counter())
        if down.transport is not None:
            down.transport.write(data)
        if data.endswith(_LAST_CHUNK):
            down.reads.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.down.transport is not None:
            self.down.transport.close()


class Down(asyncio.Protocol):
    """One client connection; its bytes go upstream as they arrive (the first ones once the upstream is open).
    ``bench.probes.thin_http`` keeps the connections and changes what goes up (``upstream``, ``data_received``)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.up: Any = None
        self.pending: list[bytes] = []
        self.reads: list[float] = []

    def upstream(self) -> asyncio.Protocol:
        """The protocol of this connection's upstream side."""
        return _Up(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        transport, self.up = await loop.create_connection(self.upstream, "127.0.0.1", self.port)
        for data in self.pending:
            transport.write(data)
        self.pending.clear()

    def send_up(self, data: bytes) -> None:
        """``data`` to the upstream, or kept until its connection is open."""
        up = self.up
        if up is None or up.transport is None:
            self.pending.append(data)
        else:
            up.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.send_up(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()


async def serve(upstream_port: int) -> None:
    """Listen on a free port of 127.0.0.1, print it, relay until killed."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Down(upstream_port), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes.thin_relay", description=__doc__.splitlines()[0])
    p.add_argument("--upstream-port", type=int, required=True)
    uvloop.run(serve(p.parse_args().upstream_port))


if __name__ == "__main__":
    main()
