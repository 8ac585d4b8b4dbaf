"""The admission queue: FIFO order, the bound on the line, the wait limit, and giving up while waiting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.config.load import build
from llmtap.relay.admission import Admission, QueueFull
from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE, Running, Scripted, ServerThread, Telemetry
from tests.support.procs import Llmtap, Simulator, clients_of, metric_value


async def test_slots_then_first_come_first_served() -> None:
    adm = Admission(limit=2, queue_limit=10)
    await adm.acquire()
    await adm.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await adm.acquire()
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(4)]
    await asyncio.sleep(0)
    assert adm.waiting == 4 and adm.active == 2 and order == []
    for _ in range(4):
        adm.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3]
    # Each release handed its slot straight to the next in line: still two active, nobody waiting.
    assert adm.active == 2 and adm.waiting == 0


async def test_no_one_jumps_the_line() -> None:
    adm = Admission(limit=1, queue_limit=10)
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.release()  # the slot now belongs to the waiter, even before it runs
    late = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert waiter.done() and not late.done()
    adm.release()
    await late
    assert adm.active == 1


async def test_a_full_line_refuses() -> None:
    adm = Admission(limit=1, queue_limit=1)
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as caught:
        await adm.acquire()
    assert caught.value.reason == "queue_full"
    adm.release()
    await waiter


async def test_wait_limit_refuses_and_leaves_the_line() -> None:
    adm = Admission(limit=1, queue_limit=5, timeout=0.02)
    await adm.acquire()
    with pytest.raises(QueueFull) as caught:
        await adm.acquire()
    assert caught.value.reason == "queue_timeout"
    assert adm.waiting == 0 and adm.active == 1
    adm.release()
    assert adm.active == 0


async def test_cancelled_waiter_leaves_the_line_and_loses_no_slot() -> None:
    adm = Admission(limit=1, queue_limit=5)
    await adm.acquire()
    gone = asyncio.create_task(adm.acquire())
    stays = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert adm.waiting == 1
    adm.release()
    await stays
    adm.release()
    assert adm.active == 0 and adm.waiting == 0


async def test_slot_handed_over_as_the_waiter_is_cancelled_is_passed_on() -> None:
    adm = Admission(limit=1, queue_limit=5)
    await adm.acquire()
    first = asyncio.create_task(adm.acquire())
    second = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.release()  # hands the slot to ``first`` ...
    first.cancel()  # ... which is cancelled before it could run
    await asyncio.sleep(0)
    await asyncio.wait_for(second, 1)  # the slot went on to the next in line
    assert first.cancelled()
    adm.release()
    assert adm.active == 0


# --- through the proxy, on real sockets ------------------------------------------------------------

CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}


@pytest.mark.e2e
async def test_the_proxy_queues_measures_and_refuses(
    proxy_factory: Any, scripted: Scripted, telemetry: Telemetry
) -> None:
    settings = build({"upstream": scripted.url, "max_concurrency": 1, "queue_limit": 1, "retry_after": 7}, env={})
    proxy: Running = proxy_factory(settings, admin=True)

    async def stream(client: httpx.AsyncClient) -> tuple[int, float, float, httpx.Headers]:
        started = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            await r.aread()
        return r.status_code, started, time.monotonic(), r.headers

    async with httpx.AsyncClient(base_url=proxy.url, timeout=20) as client:
        first = asyncio.create_task(stream(client))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(stream(client))
        await asyncio.sleep(0.1)
        refused = await stream(client)  # the slot is taken and the line (one place) is full
        (s1, _, end1, _), (s2, start2, end2, _) = await asyncio.gather(first, second)
    assert (s1, s2) == (200, 200)
    status, _, refused_at, headers = refused
    # Refused at once: before the request holding the slot ended, where a place in the line would have waited.
    assert status == 503 and headers["retry-after"] == "7" and refused_at < end1
    assert end2 > end1 + 0.05  # the second waited for the first to finish
    proxy.flush()
    spans = telemetry.finished()
    roots = sorted((s for s in spans if sc.ROUTE in (s.attributes or {})), key=lambda s: s.start_time or 0)
    waited = [s for s in roots if float((s.attributes or {}).get(sc.QUEUE_PROXY_DURATION, 0)) > 0.1]  # type: ignore[arg-type]
    assert len(waited) == 1 and waited[0] is roots[1]
    queued = waited[0].attributes or {}
    wait = float(queued[sc.QUEUE_PROXY_DURATION])  # type: ignore[arg-type]
    assert queued[sc.QUEUE_SOURCE] == "proxy"
    # It waited from its arrival until the first one's end, on the proxy's one clock: its queue span (received to
    # admitted) holds the wait and ends no sooner than the first request's root; the slot is freed after that.
    (line,) = [
        s for s in spans if s.name == sc.SPAN_QUEUE and s.parent and s.parent.span_id == roots[1].context.span_id
    ]
    assert line.start_time and line.end_time and roots[0].start_time and roots[0].end_time
    assert roots[0].start_time < line.start_time < roots[0].end_time <= line.end_time + 1_000_000
    assert wait <= (line.end_time - line.start_time) / 1e9 + 1e-6
    # And on the client's clock, the wait is part of the second request's time, which also held the upstream's
    # whole script (0.3 s to the first chunk, then 39 more 20 ms apart) once the slot was free.
    assert wait <= end2 - start2 - (0.3 + 39 * 0.02)
    errors = [s.attributes or {} for s in roots if (s.attributes or {}).get(sc.ERROR_TYPE) == "queue_full"]
    assert len(errors) == 1 and errors[0][sc.HTTP_STATUS] == 503
    assert proxy.admin is not None
    async with httpx.AsyncClient() as client:
        text = (await client.get(proxy.admin.url + "/metrics")).text
    assert 'llmtap_queue_rejected_total{error_type="queue_full",llmtap_route="default"} 1' in text, text


async def _tgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A non-streamed TGI-style answer whose headers report the server's phases (milliseconds)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    answer = {
        "id": "x",
        "object": "chat.completion",
        "model": "tgi",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
    body = json.dumps(answer).encode()
    queue: bytes = scope["query_string"].partition(b"=")[2]
    headers = [(b"content-type", b"application/json"), (b"x-queue-time", queue), (b"x-total-time", b"40")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("queue_header", "expected"), [("7", 0.007), ("-3", None), ("9000000", None), ("2furlongs", None)]
)
def test_tgi_queue_header_is_used_or_rejected(
    proxy_factory: Any, telemetry: Telemetry, queue_header: str, expected: float | None
) -> None:
    with ServerThread(_tgi) as upstream:
        proxy: Running = proxy_factory(build({"upstream": upstream.url}, env={}), admin=True)
        body = {"model": "tgi", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(proxy.url + f"/v1/chat/completions?queue={queue_header}", json=body, timeout=10)
        assert r.status_code == 200
        proxy.flush()
    attrs = next(s.attributes or {} for s in telemetry.finished() if sc.ROUTE in (s.attributes or {}))
    assert proxy.admin is not None
    metrics = httpx.get(proxy.admin.url + "/metrics").text
    # Every route reads 0 from the start; a refused header adds to its own series.
    rejected = metric_value(metrics, "llmtap_server_timing_rejected_total")
    if expected is not None:
        assert attrs[sc.QUEUE_UPSTREAM_DURATION] == pytest.approx(expected)
        assert attrs[sc.QUEUE_UPSTREAM_SOURCE] == "server"
        assert rejected == 0, metrics
    else:
        assert attrs.get(sc.QUEUE_UPSTREAM_SOURCE) != "server"
        assert all(v >= 0 for k, v in attrs.items() if k.endswith(".duration"))  # type: ignore[operator]
        assert rejected >= 1, metrics


@pytest.mark.e2e
async def test_a_client_that_asks_again_at_once_finds_its_slot_free(proxy_factory: Any, scripted: Scripted) -> None:
    """One slot, no line: each request sent the moment the previous answer ended is admitted. The slot is freed
    when the upstream's answer is complete, before the relay's last send, not after it closes the connection."""
    settings = build({"upstream": scripted.url, "max_concurrency": 1, "queue_limit": 0}, env={})
    proxy: Running = proxy_factory(settings)
    statuses = []
    async with httpx.AsyncClient(base_url=proxy.url, timeout=20) as client:
        for i in range(40):
            body = {**CHAT, "stream": bool(i % 2)}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                await r.aread()
            statuses.append(r.status_code)
    assert statuses == [200] * 40, statuses


def _most_at_once(done: list[dict[str, Any]]) -> int:
    """The most of the simulator's requests ``done`` that ran at once, from arrival to last token."""
    edges = sorted([(r["arrival"], 1) for r in done] + [(r["last_token"], -1) for r in done])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.e2e
def test_the_limit_holds_for_the_server_over_two_relays(tmp_path: Path) -> None:
    """``llmtap serve --workers 2 --max-concurrency 2``: ten requests at once, each on a new connection, spread over
    both relays by the kernel; the upstream never runs more than two at once (each relay admitting two would let
    four in: the simulator runs four), every request is answered, and the ones that waited say so."""
    sim = Simulator("fast")
    args = ["--workers", "2", "--max-concurrency", "2", "--server-timing"]
    proxy = Llmtap(sim.url, tmp_path / "llmtap.log", *args)
    body = {"model": "llmtap-sim", "stream": True, "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}]}
    try:
        # Each client made first (making one, its TLS context included, takes tens of ms on a busy machine) and the
        # ten sent together: staggered by their clients' making, fewer of them would meet a full server.
        clients = [httpx.Client(timeout=30) for _ in range(10)]
        together = threading.Barrier(10)

        def one(client: httpx.Client) -> tuple[int, float]:
            """The status and the wait in line the relay reported (``Server-Timing``, ``llmtap-queue``)."""
            with client:
                together.wait(timeout=30)
                r = client.post(proxy.url + "/v1/chat/completions", json=body)
            timing = re.search(r"llmtap-queue;dur=([0-9.]+)", r.headers.get("server-timing", ""))
            return r.status_code, float(timing.group(1)) / 1000 if timing else -1.0

        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(one, clients))
        done = sim.client.get("/debug/requests").json()["requests"]
    finally:
        proxy.close()
        sim.close()
    assert [status for status, _ in answers] == [200] * 10 and len(done) == 10
    assert _most_at_once(done) == 2, done
    # Two slots for ten requests of about 0.1 s: most waited in one relay's line or the other's, and said so.
    waits = sorted(wait for _, wait in answers)
    assert min(waits) >= 0 and sum(wait > 0.02 for wait in waits) >= 6, waits


def _relays(pid: int) -> list[int]:
    """The relay processes among ``pid``'s children."""
    children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    relays = []
    for child in children:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == "llmtap-relay":
                relays.append(child)
    return relays


@pytest.mark.e2e
def test_a_relay_killed_while_it_holds_slots_leaves_none_held(tmp_path: Path) -> None:
    """Four long requests (more while one relay has none) through ``--workers 2 --max-concurrency 2``, then one relay
    SIGKILLed: the slots and places in line it held die with it (the supervisor clears its row), so the other relay's
    waiters are let in, and once the relay is started again the server admits two at a time, as before."""
    sim = Simulator("fast")
    proxy = Llmtap(sim.url, tmp_path / "llmtap.log", "--workers", "2", "--max-concurrency", "2")
    long = {"model": "llmtap-sim", "stream": True, "max_tokens": 300, "messages": [{"role": "user", "content": "hi"}]}
    short = {**long, "max_tokens": 30}

    def one(body: dict[str, Any]) -> int:
        try:
            with httpx.Client(timeout=30) as client:
                return client.post(proxy.url + "/v1/chat/completions", json=body).status_code
        except httpx.TransportError:
            return 0  # its relay was killed under it

    try:
        relays = _relays(proxy.proc.pid)
        assert len(relays) == 2
        with ThreadPoolExecutor(12) as pool:
            first = [pool.submit(one, long) for _ in range(4)]
            deadline = time.monotonic() + PATIENCE
            # Two admitted, the others waiting in a line, and each relay holding some: the kernel spreads new
            # connections over the relays (SO_REUSEPORT) by their addresses, so one more is sent, 12 in all at most,
            # until both relays have one (the killed relay's slots must have another relay's waiters to let in).
            while sim.state()["running"] < 2 or not all(clients_of(r, proxy.port) for r in relays):
                assert time.monotonic() < deadline, "nothing reached the upstream, or one relay got every request"
                if len(first) < 12 and sim.state()["running"] >= 2:
                    first.append(pool.submit(one, long))
                    time.sleep(0.2)
                time.sleep(0.01)
            os.kill(relays[0], signal.SIGKILL)
            statuses = [f.result() for f in first]
        # The killed relay's requests failed; every other one was answered, none stuck behind the dead one's slots.
        assert all(s in (0, 200) for s in statuses) and 200 in statuses, statuses
        deadline = time.monotonic() + PATIENCE
        while len(relays := _relays(proxy.proc.pid)) < 2 or relays[0] in relays[1:]:
            assert time.monotonic() < deadline, "the relay was not started again"
            time.sleep(0.1)
        proxy.wait_ready()
        since = max(r["seq"] for r in sim.client.get("/debug/requests").json()["requests"])
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, [short] * 8)) == [200] * 8
        done = sim.client.get(f"/debug/requests?since={since}").json()["requests"]
    finally:
        proxy.close()
        sim.close()
    assert len(done) == 8
    assert _most_at_once(done) == 2, done
