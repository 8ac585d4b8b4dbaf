"""The queue/prefill split from outside, checked per request against the simulator's exact truth.

A burst larger than the server's slots, with varied prompt lengths and repeated prefixes, goes through
the proxy; the simulator says when it admitted each request and when its first token left. The bar
(issue "Where the time goes"): each estimated queue and prefill within 10% or 20 ms of the truth, plus
whatever the machine itself put between the two in this very run. That is measured, not guessed: how
late the simulator wrote a chunk against the deadline it planned (its record has both), and how much
longer the proxy saw a request's upstream TTFT than the simulator's own arrival-to-first-token. On a quiet
machine both are a few milliseconds; a busy one stretches them, and the estimate may not be blamed for it.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.config.load import build
from llmtap.simulator import get_profile
from llmtap.store.files import ReadStats, read_records
from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE, Running, Telemetry, free_port
from tests.support.procs import Llmtap, stop

pytestmark = pytest.mark.e2e

# Two slots, a prefill that grows visibly with length (5 ms + 1 ms per 8 tokens), 4 ms per token.
PROFILE = get_profile(
    "fast", max_num_seqs=2, prefill_base_s=0.005, prefill_tokens_per_s=20_000.0, decode_s_per_token=0.004
)
WORDS = [f"w{i}" for i in range(997)]  # random words: unrelated prompts share no prefix


def prompt(rng: random.Random, shared: str, words: int) -> str:
    return shared + " ".join(rng.choice(WORDS) for _ in range(words))


# In its own process: tokenizing a 4,000-token prompt under a GIL shared with the proxy and the client
# would stall the simulator's clock and spoil the very truth the test compares with.
SERVE = (
    "import asyncio, sys; from llmtap.simulator import get_profile; from llmtap.simulator.server import serve; "
    "asyncio.run(serve('127.0.0.1', int(sys.argv[1]), get_profile('fast', max_num_seqs=2, prefill_base_s=0.005, "
    "prefill_tokens_per_s=8000.0, decode_s_per_token=0.004)))"
)


@pytest.fixture(scope="module")
def simulator() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PATIENCE
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the simulator did not start"
            time.sleep(0.05)
        yield url
    finally:
        stop(proc)


async def chat(client: httpx.AsyncClient, text: str, max_tokens: int) -> str:
    """One streamed chat through the proxy; returns the response id (the simulator's truth key)."""
    body = {
        "model": PROFILE.model,
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }
    raw = b""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for piece in r.aiter_raw():
            raw += piece
    first = raw.split(b"\n\n", 1)[0].removeprefix(b"data: ")
    return str(json.loads(first)["id"])


def within(estimate: float, truth: float, rel: float = 0.10, floor: float = 0.020) -> bool:
    return abs(estimate - truth) <= max(rel * truth, floor)


def check(rows: list[dict[str, Any]], noise: tuple[float, float]) -> None:
    """Every request within 10% or 20 ms of the truth, the floor widened by what the run measured (``compare``):
    twice the most either side was late on one request, plus the simulator's latest admission.

    Twice: the replay puts a request's wait between its own send and an earlier request's end, as the proxy saw
    them, so its error can hold one request's hop in and another's hop out, each up to the noise; and the truth's
    queue holds the simulator's own lateness in letting the request in, which no replay can see."""
    late, admission = noise
    for r in rows:
        assert r["source"] == ("estimated", "estimated"), r
    for phase in ("queue", "prefill"):
        misses = [r for r in rows if not within(r[phase][0], r[phase][1], floor=0.020 + 2 * late + admission)]
        assert not misses, (phase, noise, misses)


async def run_burst(url: str, seed: int) -> tuple[list[str], list[str]]:
    """Five requests alone, then a burst of eight; new prompts per seed (the simulator's cache persists).

    Returns the ids of the five (which the envelope learns from) and of the burst."""
    rng = random.Random(seed)
    shared = prompt(rng, "", 300) + " "  # a long common first part: prefix-cache hits after the first
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        # Alone, one after another: the envelope learns the unloaded line from these.
        alone = [await chat(client, prompt(rng, "", words), 2) for words in (30, 150, 300, 450, 600)]
        texts = [prompt(rng, shared if i % 2 else "", rng.choice((50, 150, 300, 500))) for i in range(8)]
        burst = []
        for text in texts:  # 5 ms apart: a burst, in an order the server cannot mistake
            burst.append(asyncio.create_task(chat(client, text, rng.choice((6, 12, 20)))))
            await asyncio.sleep(0.005)
        return alone, list(await asyncio.gather(*burst))


def from_spans(telemetry: Telemetry) -> list[dict[str, Any]]:
    """What the proxy said of each request, from its request spans: the truth's key and the figures ``compare``
    reads (the upstream TTFT, the upstream's time from the request's send to its end, queue and prefill)."""
    seen = []
    for span in telemetry.finished():
        attrs: Any = span.attributes or {}
        if sc.RESPONSE_ID not in attrs or sc.PREFILL_DURATION not in attrs:
            continue
        seen.append(
            {
                "id": attrs[sc.RESPONSE_ID],
                "upstream_ttft": float(attrs[sc.UPSTREAM_TTFT]),
                "upstream_end": float(attrs[sc.E2E]) - float(attrs[sc.QUEUE_PROXY_DURATION]),
                "queue": attrs.get(sc.QUEUE_UPSTREAM_DURATION),
                "prefill": attrs[sc.PREFILL_DURATION],
                "source": (attrs.get(sc.QUEUE_UPSTREAM_SOURCE), attrs[sc.PREFILL_SOURCE]),
            }
        )
    return seen


def from_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same from records (``llmtap serve --record``): their queue is the proxy's and the upstream's, and the
    proxy's is none here (no admission line). Their TTFT counts from the request's arrival at the proxy to its first
    content chunk's write to the client, so the time to the end from the send is short of the truth by the relay's
    delay of that chunk: read as at least none (``early``)."""
    return [
        {
            "id": r["response_id"],
            "upstream_ttft": r["upstream_ttft"],
            "upstream_end": r["e2e"] - (r["ttft"] - r["upstream_ttft"]),
            "early": True,
            "queue": r["queue"],
            "prefill": r["prefill"],
            "source": (r["queue_source"], r["prefill_source"]),
        }
        for r in records
        if r["response_id"] is not None
    ]


def machine_noise(seen: dict[str, Any], t: dict[str, Any]) -> float:
    """What the machine added to one request, from both sides' own records: the simulator's latest chunk
    against its deadline, plus the larger of the proxy's two views beyond the simulator's: its upstream TTFT
    beyond the simulator's arrival to first token, and its upstream time to the end beyond the simulator's
    arrival to last token (the ends the replay frees slots at; a stalled proxy sees them late)."""
    late = max(o - d for o, d in zip(t["chunk_offsets_s"], t["chunk_due_offsets_s"], strict=True))
    first = seen["upstream_ttft"] - t["chunk_offsets_s"][0]
    end = seen["upstream_end"] - t["chunk_offsets_s"][-1]
    if seen.get("early"):
        end = max(end, 0.0)
    # Neither side is ever early (records round to the microsecond: a microsecond either way is the rounding).
    assert late >= 0 and first >= -2e-6 and end >= -2e-6, (late, first, end)
    return float(late + max(first, end))


def admission_lateness(records: list[dict[str, Any]]) -> float:
    """How late the simulator itself admitted a request of the run, at most: from the last moment that could
    have let it in (its own arrival, or the latest end of another request before its admission) to its
    admission. Its truth's queue holds this time (reading and tokenizing the body, waking the waiter a freed
    slot was handed to), which no replay of ends and sends can see; quiet, it is a millisecond or two."""
    ends = [r["last_token"] for r in records]
    return float(max(r["admitted"] - max([r["arrival"], *(e for e in ends if e <= r["admitted"])]) for r in records))


def compare(
    seen: list[dict[str, Any]], truth_url: str, ids: tuple[list[str], list[str]]
) -> tuple[list[dict[str, Any]], tuple[float, float]]:
    """One row per burst request (estimate, truth), and the most the machine added to any request of the run:
    the most either side was late on one request (``machine_noise``), and the simulator's latest admission."""
    truth = {r["id"]: r for r in httpx.get(truth_url + "/debug/requests").json()["requests"]}
    alone, burst = ids
    rows, noise = [], []
    for s in seen:
        if s["id"] not in alone + burst:
            continue
        t = truth[s["id"]]
        noise.append(machine_noise(s, t))
        if t["id"] not in burst:
            continue
        rows.append(
            {
                "prompt": t["prompt_tokens"],
                "cached": t["cached_tokens"],
                "queue": (s["queue"], t["queue_s"]),
                "prefill": (s["prefill"], t["prefill_s"]),
                "source": s["source"],
                "arrival": t["arrival"],
                "joined": t["joined"],
                "admitted": t["admitted"],
                "ended": t["last_token"],
            }
        )
    rows.sort(key=lambda r: r["arrival"])
    assert len(rows) == len(burst) and len(noise) == len(alone) + len(burst)
    admission = admission_lateness([truth[i] for i in burst])
    for r in rows:
        print(r)
    print("machine noise", max(noise), "admission lateness", admission)
    return rows, (max(noise), admission)


def test_slot_replay_matches_the_truth(simulator: str, proxy_factory: Any, telemetry: Telemetry) -> None:
    proxy: Running = proxy_factory(build({"upstream": simulator, "server_slots": 2}, env={}))
    ids = asyncio.run(run_burst(proxy.url, seed=11))
    proxy.flush()
    rows, noise = compare(from_spans(telemetry), simulator, ids)
    assert sum(r["queue"][1] > 0.05 for r in rows) >= 4  # the burst really queued
    assert sum(r["cached"] > 0 for r in rows) >= 2  # and the repeated prefix really hit the cache
    check(rows, noise)


def test_learned_envelope_matches_the_truth(simulator: str, proxy_factory: Any, telemetry: Telemetry) -> None:
    proxy: Running = proxy_factory(build({"upstream": simulator}, env={}))
    ids = asyncio.run(run_burst(proxy.url, seed=12))
    proxy.flush()
    rows, noise = compare(from_spans(telemetry), simulator, ids)
    assert sum(r["queue"][1] > 0.05 for r in rows) >= 4
    check(rows, noise)


def test_slot_replay_matches_the_truth_over_two_relays(simulator: str, tmp_path: Path) -> None:
    """``llmtap serve --workers 2``: the burst's connections spread over two relay processes, each of which sends
    requests on its own, yet the replay must count every request in flight to the upstream, whichever relay sent
    it, and order them by when they were sent."""
    records = tmp_path / "records"
    args = ["--workers", "2", "--server-slots", "2", "--record", str(records)]
    proxy = Llmtap(simulator, tmp_path / "llmtap.log", *args)
    try:
        ids = asyncio.run(run_burst(proxy.url, seed=13))
        deadline = time.monotonic() + PATIENCE
        while len(got := list(read_records(records, ReadStats()))) < sum(map(len, ids)):
            assert time.monotonic() < deadline, f"{len(got)} records"
            time.sleep(0.05)
    finally:
        proxy.close()
    rows, noise = compare(from_records(got), simulator, ids)
    assert sum(r["queue"][1] > 0.05 for r in rows) >= 4
    check(rows, noise)
