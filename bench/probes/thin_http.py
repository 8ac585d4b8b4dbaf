"""The HTTP floor: the thinnest HTTP/1.1 relay Python can be, to measure llmtap's per-request cost against.

``python -m bench.probes.thin_http --upstream-port N`` prints its port, then relays each client connection over a
keep-alive connection of its own to the upstream, as an HTTP proxy must at the least: each request's line and
headers parsed (httptools, the parser llmtap's listener runs), its head written again without the hop-by-hop
fields, its body after it; each answer's status line and headers parsed and written again the same way, its body
relayed as it arrives (a chunked body framed again as chunks). One timestamp a request and one an answer; every
byte read from one side goes to the other in the read's own callback, at most one write a read. Nothing else: no
task per request, no routing, no admission, no upstream pool, no timeouts or bounds on what a client may send, no
telemetry. ``bench.probes.thin_relay`` is the floor below it, bytes passed with no parsing at all. Request bodies
are relayed as counted (Content-Length): a chunked request body is not framed again.

Not part of llmtap and not a proxy anyone should run (it trusts both sides): what a request costs here is what the
event loop, the sockets, the kernel's loopback and one HTTP parse and write each way cost, which any Python
proxy pays; the rest of llmtap's cost a request is its own (``python -m bench --rps-only``, the ``floor`` path).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httptools
import uvloop

from bench.probes.thin_relay import Down

#: Fields that describe one hop's connection (RFC 9110 section 7.6.1), not the message: never relayed.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)
#: Timestamps a side keeps before it lets go of them (one a message: a bounded list, as a tape would be).
_KEEP = 1024


def _fields(fields: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The end-to-end fields, each ``name: value`` line, and the blank line that ends a head."""
    out: list[bytes] = []
    for name, value in fields:
        if name.lower() not in HOP_BY_HOP:
            out += (name, b": ", value, b"\r\n")
    out.append(b"\r\n")
    return out


class _Upstream(asyncio.Protocol):
    """The upstream side of one client connection: each answer's head written again, its body relayed."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reason = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.chunked = False
        self.out: list[bytes] = []
        self.answered: list[float] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        out = self.out
        if out and not self.client.tasks:
            transport = self.client.transport
            if transport is not None:
                transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client.transport is not None:
            self.client.transport.close()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.reason = b""
        self.fields = []
        if len(self.answered) >= _KEEP:
            self.answered.clear()
        self.answered.append(time.perf_counter())

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.chunked = any(
            name.lower() == b"transfer-encoding" and b"chunked" in value.lower() for name, value in self.fields
        )
        line = b"HTTP/1.1 %d %s\r\n" % (self.parser.get_status_code(), self.reason)
        fields = _fields(self.fields)
        if self.chunked:
            fields.insert(-1, b"transfer-encoding: chunked\r\n")
        self.out.append(line + b"".join(fields))

    def on_body(self, body: bytes) -> None:
        if self.chunked:
            self.out += (b"%x\r\n" % len(body), body, b"\r\n")
        else:
            self.out.append(body)

    def on_message_complete(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        waiter = self.client.waiter
        if waiter is not None:
            self.client.waiter = None
            answer = b"".join(self.out)
            self.out.clear()
            waiter.set_result(answer)


class _Client(Down):
    """One client connection: each request's head written again for the upstream, its body after it (the first
    requests once the upstream connection is open, as ``thin_relay``'s)."""

    def __init__(self, port: int, tasks: bool) -> None:
        super().__init__(port)
        self.tasks = tasks
        #: In ``--tasks``: the running request's wait for its whole answer.
        self.waiter: asyncio.Future[bytes] | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.out: list[bytes] = []
        self.received: list[float] = []

    def upstream(self) -> asyncio.Protocol:
        return _Upstream(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()
            return
        out = self.out
        if out:
            self.send_up(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.fields = []
        if len(self.received) >= _KEEP:
            self.received.clear()
        self.received.append(time.perf_counter())

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        line = self.parser.get_method() + b" " + self.url + b" HTTP/1.1\r\n"
        self.out.append(line + b"".join(_fields(self.fields)))

    def on_body(self, body: bytes) -> None:
        self.out.append(body)

    def on_message_complete(self) -> None:
        if self.tasks:
            self.waiter = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._answer(self.waiter))

    async def _answer(self, waiter: asyncio.Future[bytes]) -> None:
        """``--tasks``: the answer, once whole, goes to the client from the request's own task."""
        answer = await waiter
        if self.transport is not None:
            self.transport.write(answer)


async def serve(upstream_port: int, tasks: bool) -> None:
    """Listen on a free port of 127.0.0.1, print it, relay until killed."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream_port, tasks), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes.thin_http", description=__doc__.splitlines()[0])
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument(
        "--tasks",
        action="store_true",
        help="each request waits for its whole answer in a task of its own, as an async handler's does, and writes it",
    )
    args = p.parse_args()
    uvloop.run(serve(args.upstream_port, args.tasks))


if __name__ == "__main__":
    main()
