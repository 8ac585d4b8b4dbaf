"""An open-loop load generator: requests sent at fixed times, whatever the answers do.

``python -m bench.openloop --url URL --rate 3000 --seconds 5`` sends request ``i`` at ``start + i / rate`` over a
pool of keep-alive connections opened before the start, and prints one JSON line. A closed-loop client (``wrk``)
waits for an answer before it asks again, so a slow answer delays the requests behind it and is measured once
(coordinated omission); here a request's latency runs from the time it was *scheduled*, so a request that waited
for a free connection, or for the generator itself, carries that wait. The event loop's timers fire on a 1 ms
grain, so the schedule's clock is a thread that sleeps until each request's time and wakes the loop: ``late_ms``
says how late each send still was (a send waiting for a free connection is late too), and the direct path's
figures, that a proxy's are read against, carry the same lateness. ``service_ms`` is the latency from the
moment the request was written, for comparison.

The answers must be HTTP/1.1 with ``content-length`` or chunked bodies. Every request is the same ``POST``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any, cast

from llmtap.analysis.stats import quantile


class Pool:
    """The schedule, the connections and what each request measured."""

    def __init__(self, request: bytes, rate: float, total: int) -> None:
        self.request = request
        self.rate = rate
        self.total = total
        self.idle: deque[Conn] = deque()
        self.waiting: deque[float] = deque()
        self.start = 0.0
        self.issued = 0
        self.latency: list[float] = []
        self.service: list[float] = []
        self.late: list[float] = []
        #: Each answered request's scheduled, sent and answered times (``perf_counter``: the monotonic clock).
        self.times: list[tuple[float, float, float]] = []
        self.errors = 0
        self.done = asyncio.get_running_loop().create_future()

    def issue(self, due: int) -> None:
        """Issue every request up to number ``due`` not issued yet, each with its own scheduled time."""
        while self.issued < min(due, self.total):
            self.dispatch(self.start + self.issued / self.rate)
            self.issued += 1

    def clock(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """The schedule's clock, in a thread of its own: sleep until the next request's time, then have the loop
        issue what is due.

        The loop's own timers fire on a 1 ms grain (or spin when asked for less); a thread's ``sleep`` wakes within
        tens of microseconds of its time and costs nothing while it waits.
        """
        due = 0
        while due < self.total and not stop.is_set():
            wait = self.start + due / self.rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            due = min(self.total, int((time.perf_counter() - self.start) * self.rate) + 1)
            loop.call_soon_threadsafe(self.issue, due)

    def dispatch(self, scheduled: float) -> None:
        """Send on an idle connection, or keep the request (and its time) until one is free."""
        if self.idle:
            self.idle.popleft().send(scheduled)
        else:
            self.waiting.append(scheduled)

    def finished(self, conn: Conn, scheduled: float, sent: float, ok: bool) -> None:
        """One answer in: its figures, then the connection takes the oldest waiting request or rests."""
        now = time.perf_counter()
        if ok:
            self.latency.append(now - scheduled)
            self.service.append(now - sent)
            self.late.append(sent - scheduled)
            self.times.append((scheduled, sent, now))
        else:
            self.errors += 1
        if len(self.latency) + self.errors >= self.total and not self.done.done():
            self.done.set_result(None)
        if not ok:
            return
        if self.waiting:
            conn.send(self.waiting.popleft())
        else:
            self.idle.append(conn)


class Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.scheduled = 0.0
        self.sent = 0.0
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, scheduled: float) -> None:
        """Write the request now; it was due at ``scheduled``."""
        assert self.transport is not None
        self.scheduled, self.busy = scheduled, True
        self.sent = time.perf_counter()
        self.transport.write(self.pool.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = answer_end(self.buf)
        if end is None or not self.busy:
            return
        ok = self.buf.startswith(b"HTTP/1.1 200")
        del self.buf[:end]
        self.busy = False
        self.pool.finished(self, self.scheduled, self.sent, ok)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self.busy = False
            self.pool.finished(self, self.scheduled, self.sent, False)


def answer_end(buf: bytearray) -> int | None:
    """Where the first whole HTTP/1.1 answer in ``buf`` ends, or None while it is incomplete."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = bytes(buf[:head_end]).lower()
    at = head.find(b"\r\ncontent-length:")
    if at >= 0:
        line_end = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : line_end if line_end >= 0 else len(head)])
        end = head_end + 4 + length
        return end if len(buf) >= end else None
    if b"\r\ntransfer-encoding: chunked" not in head:
        return head_end + 4
    pos = head_end + 4
    while True:
        size_end = buf.find(b"\r\n", pos)
        if size_end < 0:
            return None
        size = int(bytes(buf[pos:size_end]).split(b";")[0], 16)
        pos = size_end + 2 + size + 2
        if len(buf) < pos:
            return None
        if size == 0:
            return pos


def build_request(url: str, body: bytes) -> tuple[str, int, bytes]:
    """Host, port and the bytes of the ``POST``."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return host, port, head.encode() + body


async def run(
    url: str, body: bytes, rate: float, seconds: float, connections: int, trace: bool = False
) -> dict[str, Any]:
    """Open the pool, send ``rate * seconds`` requests on schedule, wait for every answer (or a deadline);
    ``trace``: with each answered request's times (``times``, for ``--trace``)."""
    host, port, request = build_request(url, body)
    total = max(1, round(rate * seconds))
    pool = Pool(request, rate, total)
    loop = asyncio.get_running_loop()
    for _ in range(connections):
        _, conn = await loop.create_connection(lambda: Conn(pool), host, port)
        pool.idle.append(conn)
    cpu0 = time.process_time()
    pool.start = time.perf_counter() + 0.05
    stop = threading.Event()
    clock = threading.Thread(target=pool.clock, args=(loop, stop), daemon=True)
    clock.start()
    try:
        await asyncio.wait_for(pool.done, timeout=seconds + 30.0)
    except TimeoutError:
        pass
    finally:
        stop.set()
        clock.join()
    elapsed = time.perf_counter() - pool.start
    cpu = time.process_time() - cpu0
    for conn in list(pool.idle):
        if conn.transport is not None:
            conn.transport.close()
    result = summary(pool, elapsed, cpu)
    if trace:
        result["times"] = pool.times
    return result


def summary(pool: Pool, elapsed: float, cpu: float) -> dict[str, Any]:
    """What the run measured, in ms."""

    def ms(values: list[float], q: float) -> float:
        got = quantile(values, q) if values else None
        return float("nan") if got is None else 1000 * got

    return {
        "rate": pool.rate,
        "scheduled": pool.total,
        "issued": pool.issued,
        "completed": len(pool.latency),
        "errors": pool.errors,
        "lost": pool.total - len(pool.latency) - pool.errors,
        "seconds": elapsed,
        "achieved_rate": len(pool.latency) / elapsed if elapsed > 0 else 0.0,
        "latency_ms": {"p50": ms(pool.latency, 0.5), "p99": ms(pool.latency, 0.99), "max": ms(pool.latency, 1.0)},
        "service_ms": {"p50": ms(pool.service, 0.5), "p99": ms(pool.service, 0.99)},
        "late_ms": {"p50": ms(pool.late, 0.5), "p99": ms(pool.late, 0.99), "max": ms(pool.late, 1.0)},
        "client_cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.openloop``."""
    p = argparse.ArgumentParser(prog="python -m bench.openloop", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--connections", type=int, default=64, help="keep-alive connections opened before the start")
    p.add_argument("--body", default='{"model":"bench","input":"the quick brown fox"}')
    p.add_argument(
        "--trace",
        help="write each answered request's scheduled, sent and answered times (the "
        "monotonic clock, s) to this file as JSON",
    )
    args = p.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.connections < 1:
        p.error("--rate, --seconds and --connections must be positive")
    import uvloop

    result = uvloop.run(run(args.url, args.body.encode(), args.rate, args.seconds, args.connections, bool(args.trace)))
    result["pid"] = os.getpid()
    if args.trace:
        Path(args.trace).write_text(json.dumps(result.pop("times")))
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
