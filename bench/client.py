"""The benchmark's load client: raw asyncio protocols (no HTTP library), one keep-alive connection per stream.

Each stream sends one chat request at a time, with ``bench-id:<id>`` in the prompt so the upstream's
record of the same request can be found, and reads the response with its own incremental HTTP/1.1 and
SSE parsing. The time of every socket read is taken on ``time.perf_counter()`` the moment the loop hands
the bytes over; each content event gets the time and the index of the read that completed it, so two
events that came in one read (merged chunks) are visible. Streams start staggered over one request's
length, so chunks arrive spread out, as from independent users.

Several processes can share the streams (``--offset``, ``--total-streams``, a common ``--start-at`` on the
monotonic clock). Each prints one JSON document: its records and the CPU seconds it used.

Burst arrivals (``--bursts K --burst-period P``): every stream of every process sends its k-th request at
``start_at + k * P`` (or when its previous one ended, if later), each on a new connection that is closed
after the response (``connection: close``); the request's clock (``start``) starts before the connect, so
connection set-up (and a TLS handshake) is part of its TTFT. ``https://`` URLs are read over TLS, trusting
``--ca``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import ssl
import sys
import time
from typing import Any, cast
from urllib.parse import urlsplit

#: A chat delta with non-empty content; role-only deltas carry ``"content":""``.
CONTENT = re.compile(rb'"content":\s*"(?!")')


class _Exchange(asyncio.Protocol):
    """One connection; ``request`` sends a request and resolves when its response has fully arrived."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._reset()

    def _reset(self) -> None:
        self.buf = b""
        self.head = True
        self.status = 0
        self.chunked = False
        self.remaining = -1
        self.sse = b""
        self.reads = 0
        self.first_byte: float | None = None
        self.times: list[float] = []
        self.read_index: list[int] = []
        self.body_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection closed mid-response"))
        if not self.closed.done():
            self.closed.set_result(None)

    def request(self, data: bytes) -> asyncio.Future[None]:
        """Send one request; the future resolves when the response is complete."""
        assert self.transport is not None
        self._reset()
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.done

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        self.reads += 1
        if self.first_byte is None:
            self.first_byte = t
        self.buf += data
        if self.head:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"content-length":
                    self.remaining = int(value)
            self.buf = self.buf[end + 4 :]
            self.head = False
        if self.chunked:
            self._dechunk(t)
        elif self.remaining >= 0:
            take = self.buf[: self.remaining]
            self.remaining -= len(take)
            self.buf = self.buf[len(take) :]
            self._payload(take, t)
            if self.remaining == 0:
                self._complete()

    def _dechunk(self, t: float) -> None:
        buf = self.buf
        pos = 0
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                break
            size = int(buf[pos:line_end].split(b";", 1)[0], 16)
            if size == 0:
                if buf.find(b"\r\n", line_end + 2) < 0:
                    break
                self.buf = b""
                self._complete()
                return
            if len(buf) < line_end + 2 + size + 2:
                break
            self._payload(buf[line_end + 2 : line_end + 2 + size], t)
            pos = line_end + 2 + size + 2
        self.buf = buf[pos:]

    def _payload(self, data: bytes, t: float) -> None:
        self.body_bytes += len(data)
        self.sse += data.replace(b"\r\n", b"\n")
        while True:
            end = self.sse.find(b"\n\n")
            if end < 0:
                return
            event, self.sse = self.sse[:end], self.sse[end + 2 :]
            if CONTENT.search(event):
                self.times.append(t)
                self.read_index.append(self.reads)

    def _complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


def _request_bytes(url: str, body: bytes, auth: str | None, *, close: bool = False) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    headers = [
        f"POST {parts.path} HTTP/1.1",
        f"host: {host}:{port}",
        "content-type: application/json",
        "accept: text/event-stream",
        f"content-length: {len(body)}",
    ]
    if auth:
        headers.append(f"authorization: Bearer {auth}")
    if close:
        headers.append("connection: close")
    return host, port, ("\r\n".join(headers) + "\r\n\r\n").encode() + body


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client's TLS context for an ``https://`` URL: trusting ``--ca`` (else the system's store)."""
    if urlsplit(args.url).scheme != "https":
        return None
    return ssl.create_default_context(cafile=args.ca)


async def _connect(args: argparse.Namespace, tls: ssl.SSLContext | None) -> _Exchange:
    loop = asyncio.get_running_loop()
    parts = urlsplit(args.url)
    port = parts.port or (443 if tls is not None else 80)
    _, conn = await loop.create_connection(_Exchange, parts.hostname, port, ssl=tls)
    return conn


async def _stream(args: argparse.Namespace, slot: int, records: list[dict[str, Any]]) -> None:
    tls = _tls(args)
    conn: _Exchange | None = None
    bursts = args.bursts > 0
    start = args.start_at + (0.0 if bursts else slot * args.stagger / args.total_streams)
    for n in range(args.bursts if bursts else args.requests):
        release = start + n * args.burst_period if bursts else start
        if bursts:
            # A burst: released together, each request on its own new connection.
            await asyncio.sleep(max(0.0, release - time.perf_counter()))
        elif conn is None or conn.transport is None:
            conn = await _connect(args, tls)
        if n == 0 and not bursts:
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
        rid = f"{args.tag}.{slot}.{n}"
        body = json.dumps(
            {
                "model": args.model,
                "messages": [{"role": "user", "content": f"bench-id:{rid} Write fifty words."}],
                "stream": True,
                "max_tokens": args.max_tokens,
            }
        ).encode()
        data = _request_bytes(args.url, body, args.auth, close=bursts)[2]
        begun = time.perf_counter()
        error = None
        sent = begun
        try:
            if bursts:
                conn = await asyncio.wait_for(_connect(args, tls), args.timeout)
                sent = time.perf_counter()
            assert conn is not None
            await asyncio.wait_for(conn.request(data), args.timeout)
        except (TimeoutError, ConnectionError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        record: dict[str, Any] = {
            "id": rid,
            "slot": slot,
            "sent": sent,
            "end": time.perf_counter(),
            "status": conn.status if conn is not None else 0,
            "first_byte": conn.first_byte if conn is not None else None,
            "times": conn.times if conn is not None else [],
            "reads": conn.read_index if conn is not None else [],
            "bytes": conn.body_bytes if conn is not None else 0,
            "error": error,
        }
        if bursts:
            record.update(start=begun, release=release, burst=n)
        records.append(record)
        if (bursts or error is not None) and conn is not None and conn.transport is not None:
            conn.transport.close()
            conn = None
    if conn is not None and conn.transport is not None:
        conn.transport.close()
        await conn.closed


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run this process's streams; return their records."""
    records: list[dict[str, Any]] = []
    slots = range(args.offset, args.offset + args.streams)
    await asyncio.gather(*(_stream(args, slot, records) for slot in slots))
    return records


def parser() -> argparse.ArgumentParser:
    """The client's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the chat completions URL")
    p.add_argument("--streams", type=int, default=1, help="streams in this process")
    p.add_argument("--offset", type=int, default=0, help="index of this process's first stream")
    p.add_argument("--total-streams", dest="total_streams", type=int, default=0, help="streams in all processes")
    p.add_argument("--requests", type=int, default=1, help="requests per stream, one after another")
    p.add_argument("--stagger", type=float, default=1.0, help="spread the streams' starts over this many seconds")
    p.add_argument("--start-at", dest="start_at", type=float, default=0.0, help="perf_counter() time to start")
    p.add_argument("--tag", default="r", help="prefix of the request ids")
    p.add_argument("--model", default="bench")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=50)
    p.add_argument("--auth", help="bearer token")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--bursts", type=int, default=0, help="burst mode: this many bursts, a new connection each")
    p.add_argument("--burst-period", dest="burst_period", type=float, default=1.5, help="seconds between bursts")
    p.add_argument("--ca", help="CA certificate (PEM) to trust for https:// URLs")
    return p


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.client``: print one JSON document with the records and this process's CPU time."""
    args = parser().parse_args(argv)
    args.total_streams = args.total_streams or args.streams
    args.start_at = args.start_at or time.perf_counter()
    import uvloop

    records = uvloop.run(run(args))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    json.dump({"records": records, "cpu": usage.ru_utime + usage.ru_stime}, sys.stdout)


if __name__ == "__main__":
    main()
