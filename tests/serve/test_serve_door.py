"""What a client meets at ``llmtap serve``'s door, through the real command on real sockets.

The admission line's two refusals with the status a route asks for (``--queue-full-status 429``): a full
line at once, and a wait past ``--queue-timeout``; and an idle keep-alive connection kept longer than the
clients that reuse it keep it themselves.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import PATIENCE, Scripted
from tests.support.procs import FaultUpstream, Llmtap, metric_value, upstream as upstream  # the fixture

pytestmark = pytest.mark.e2e

CHAT = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
#: A stream long enough to hold the only slot for as long as the test needs (it leaves it early).
LONG = {"x-chunks": "200", "x-gap-ms": "50"}
QUEUE_TIMEOUT = 0.5


def response(conn: socket.socket) -> bytes:
    """One whole response with a Content-Length from ``conn``: its head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536) or b"<closed>"
        assert not data.endswith(b"<closed>"), data
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += conn.recv(65536)
    return head


async def test_a_full_line_and_a_long_wait_are_refused_with_429(upstream: FaultUpstream, tmp_path: Path) -> None:
    args = ("--max-concurrency", "1", "--queue-limit", "1", "--queue-timeout", str(QUEUE_TIMEOUT))
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", *args, "--queue-full-status", "429", "--retry-after", "3")
    try:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=20) as client:

            async def refused() -> tuple[httpx.Response, float]:
                started = time.monotonic()
                r = await client.post("/v1/chat/completions", json=CHAT)
                return r, time.monotonic() - started

            async with client.stream("POST", "/v1/chat/completions", json=CHAT, headers=LONG) as holding:
                assert holding.status_code == 200  # its headers are in: it holds the only slot
                # Two more: one takes the line's only place and waits in it; the other finds the line full.
                # Which is which is up to the order they reach the proxy in.
                waiting = asyncio.create_task(refused())
                await asyncio.sleep(0.1)
                other = await refused()
                answers = [other, await waiting]
                assert not holding.is_closed  # the slot was held all along: nothing was let in
            # The counts reach /metrics through the telemetry process: wait for them, with a deadline.
            deadline = time.monotonic() + PATIENCE
            while True:
                metrics = (await client.get(proxy.admin_url + "/metrics")).text
                if metric_value(metrics, "llmtap_queue_rejected_total") >= 2 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
    finally:
        proxy.close()
    by_reason = {r.json()["error"]["type"]: (r, took) for r, took in answers}
    assert set(by_reason) == {"queue_full", "queue_timeout"}, [r.text for r, _ in answers]
    for reason, (r, _) in by_reason.items():
        assert r.status_code == 429 and r.headers["retry-after"] == "3", r.text
        assert metric_value(metrics, "llmtap_queue_rejected_total", error_type=reason) == 1, metrics
    # The wait ended at its limit, while the slot was still taken; the full line answered without one.
    assert by_reason["queue_timeout"][1] >= QUEUE_TIMEOUT
    assert by_reason["queue_full"][1] < by_reason["queue_timeout"][1]


def test_an_idle_connection_outlives_the_clients_keep_alive(scripted: Scripted, tmp_path: Path) -> None:
    """httpx (and so the openai and anthropic SDKs) reuses an idle connection for 5 s, counted from when it
    read the end of the last response. A proxy that closed at 5 s from when it wrote that end would close
    connections the client is about to reuse; a request sent on one meets a reset (``ReadError``), as the
    soak saw at 64 streams on a busy machine. So the proxy keeps an idle connection well past 5 s."""
    proxy = Llmtap(scripted.url, tmp_path / "llmtap.log")
    request = b"GET /echo-headers HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn:
            for wait in (0.0, 5.5):
                time.sleep(wait)
                conn.sendall(request)
                assert response(conn).startswith(b"HTTP/1.1 200 "), wait
    finally:
        proxy.close()
