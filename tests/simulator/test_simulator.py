"""The simulated upstream, through real sockets: uvicorn on 127.0.0.1 and httpx clients.

Shapes are compared with the vLLM 0.32 recordings by skeleton (keys in order, value types), timings
with the profile and with the server's own truth at ``/debug/requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from llmtap.analysis import tokens
from llmtap.simulator import PROFILES, Profile, get_profile, run_in_thread
from llmtap.simulator.cache import PrefixCache
from llmtap.simulator.text import Vocabulary, block_hashes
from tests.conftest import PATIENCE

# Recorded from vLLM 0.32 (/work/shared/data/transcripts/vllm-0.32-cpu/README.md); the copy beside the
# tests wins over the shared one.
TRANSCRIPTS = next(
    (
        p
        for p in (Path(__file__).parents[1] / "transcripts", Path("/work/shared/data/transcripts/vllm-0.32-cpu"))
        if (p / "chat-stream.body").is_file()
    ),
    None,
)
FIXED_CLOCK = 1795985942.0
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"

pytestmark = pytest.mark.e2e


# ---------------------------------------------------------------- helpers


def fast(**overrides: Any) -> Profile:
    """The test profile with some fields changed."""
    return get_profile("fast", **overrides)


class Sim:
    """A simulator in a thread, stopped on exit."""

    def __init__(self, profile: Profile, seed: int | None = 7) -> None:
        self.profile = profile
        self.url, self.stop = run_in_thread(profile, seed=seed, clock=lambda: FIXED_CLOCK)

    def __enter__(self) -> Sim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with Sim(fast()) as s:
        yield s


def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) for every event of an SSE body."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        out.append((name, "\n".join(data)))
    return out


def skeleton(value: Any) -> Any:
    """Keys in order and leaf types: what the shape of a JSON value is, without its content."""
    if isinstance(value, dict):
        return [(k, skeleton(v)) for k, v in value.items()]
    if isinstance(value, list):
        return ["list", *(skeleton(v) for v in value[:1])]
    return type(value).__name__


def event_skeletons(raw: bytes) -> list[Any]:
    """Skeletons of a stream's events, with runs of equal skeletons collapsed to one."""
    out: list[Any] = []
    for name, data in parse_sse(raw):
        sk = (name, "[DONE]" if data == "[DONE]" else skeleton(json.loads(data)))
        if not out or out[-1] != sk:
            out.append(sk)
    return out


def chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a stream, without [DONE]."""
    return [json.loads(data) for _, data in parse_sse(raw) if data != "[DONE]"]


def transcript(name: str) -> bytes:
    """A recorded vLLM body."""
    if TRANSCRIPTS is None:
        pytest.skip("vLLM transcripts not found")
    return (TRANSCRIPTS / f"{name}.body").read_bytes()


def chat_body(text: str = "Where is my parcel?", **extra: Any) -> dict[str, Any]:
    """A chat request with one user message."""
    return {"model": "llmtap-sim", "messages": [{"role": "user", "content": text}], **extra}


def body_for(path: str, text: str, **extra: Any) -> dict[str, Any]:
    """The same prompt for any of the three generation routes."""
    if path == COMPLETIONS:
        return {"model": "llmtap-sim", "prompt": text, **extra}
    if path == MESSAGES:
        return {"max_tokens": 16, **chat_body(text), **extra}
    return chat_body(text, **extra)


def text_of(path: str, raw: bytes, stream: bool) -> str:
    """The generated text of a response."""
    if not stream:
        obj = json.loads(raw)
        if path == CHAT:
            return str(obj["choices"][0]["message"]["content"])
        if path == COMPLETIONS:
            return str(obj["choices"][0]["text"])
        return str(obj["content"][0]["text"])
    parts = []
    for c in chunks(raw):
        if path == MESSAGES:
            parts.append(c["delta"]["text"] if c["type"] == "content_block_delta" else "")
        else:
            for choice in c["choices"]:
                parts.append(choice["delta"].get("content", "") if path == CHAT else choice["text"])
    return "".join(parts)


def usage_of(path: str, raw: bytes, stream: bool) -> dict[str, Any]:
    """The final usage object of a response."""
    if not stream:
        return dict(json.loads(raw)["usage"])
    final = [c for c in chunks(raw) if c.get("type") == "message_delta" or c.get("choices") == []]
    return dict(final[-1]["usage"])


def truth(client: httpx.Client, **params: int) -> list[dict[str, Any]]:
    """The simulator's per-request records."""
    return list(client.get("/debug/requests", params=params).json()["requests"])


def sample_sum(text: str, name: str) -> float:
    """Sum of the samples of one metric (``name`` may carry its labels) in Prometheus text."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def metric(client: httpx.Client, name: str) -> float:
    """A metric read from /metrics."""
    return sample_sum(client.get("/metrics").text, name)


async def ametric(client: httpx.AsyncClient, name: str) -> float:
    """``metric`` for an async client."""
    return sample_sum((await client.get("/metrics")).text, name)


async def seconds_until_zero(client: httpx.AsyncClient, name: str, limit_s: float = 2.0) -> float:
    """Poll a gauge until it reads 0; the seconds that took."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if not await ametric(client, name):
            return time.monotonic() - start
        await asyncio.sleep(0.002)
    raise AssertionError(f"{name} stayed above 0 for {limit_s} s")


def lateness(record: dict[str, Any]) -> float:
    """The most that any chunk of a request was written after its deadline (the machine's doing)."""
    return float(max(t - d for t, d in zip(record["chunk_offsets_s"], record["chunk_due_offsets_s"], strict=True)))


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No garbage collection inside: this process's own collections (3 to 10 ms in the client's
    thread, which shares the GIL with the server's) would otherwise be charged to the simulator."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def has_content(event: bytes) -> bool:
    """True for an SSE event that carries generated text (not a role chunk, usage or [DONE])."""
    data = event.partition(b"data: ")[2]
    if not data or data == b"[DONE]":
        return False
    obj = json.loads(data)
    if "choices" not in obj:
        return bool(obj.get("delta", {}).get("text"))
    return any(c.get("text") or c.get("delta", {}).get("content") for c in obj["choices"])


async def timed_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[float, list[float], bytes]:
    """Send a streamed request; (send time, arrival time of each content event, raw body)."""
    start = time.monotonic()
    stamps: list[float] = []
    raw, pending = b"", b""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for piece in response.aiter_raw():
            now = time.monotonic()
            raw += piece
            pending += piece
            *done, pending = pending.split(b"\n\n")
            stamps += [now for ev in done if has_content(ev)]
    return start, stamps, raw


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("name", "path", "extra"),
    [
        ("chat-stream", CHAT, {}),
        ("chat-stream-usage", CHAT, {"stream_options": {"include_usage": True}}),
        (
            "chat-stream-continuous-usage",
            CHAT,
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ),
        ("completions-stream-usage", COMPLETIONS, {"stream_options": {"include_usage": True}}),
        ("messages-stream", MESSAGES, {}),
    ],
)
def test_streams_have_the_vllm_shapes(sim: Sim, name: str, path: str, extra: dict[str, Any]) -> None:
    with httpx.Client(base_url=sim.url) as client:
        r = client.post(path, json=body_for(path, "Hello there", stream=True, max_tokens=6, **extra))
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = parse_sse(r.content)
    if path == MESSAGES:
        # Anthropic's ping right after content_block_start, then exactly vLLM's sequence.
        assert [n for n, _ in events[:3]] == ["message_start", "content_block_start", "ping"]
        r_raw = b"".join(f"event: {n}\ndata: {d}\n\n".encode() for n, d in events if n != "ping")
    else:
        assert events[-1] == (None, "[DONE]")
        r_raw = r.content
    assert event_skeletons(r_raw) == event_skeletons(transcript(name))
    if path == CHAT:
        body = chunks(r.content)
        assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        finishes = [c["choices"][0]["finish_reason"] for c in body if c["choices"]]
        assert finishes == [None] * 6 + ["length"]  # role chunk, five deltas, the last delta
        assert ("usage" in body[-1] and body[-1]["choices"] == []) == bool(extra)


def test_without_include_usage_there_is_no_usage_chunk(sim: Sim) -> None:
    with httpx.Client(base_url=sim.url) as client:
        r = client.post(CHAT, json=chat_body(stream=True, max_tokens=3, stream_options={"include_usage": False}))
    assert all("usage" not in c and c["choices"] for c in chunks(r.content))


@pytest.mark.parametrize(("name", "path"), [("chat-nonstream", CHAT), ("messages-nonstream", MESSAGES)])
def test_whole_bodies_have_the_vllm_shapes(sim: Sim, name: str, path: str) -> None:
    with httpx.Client(base_url=sim.url) as client:
        r = client.post(path, json=body_for(path, "Hello there", max_tokens=5))
    assert r.headers["content-type"] == "application/json"
    assert skeleton(r.json()) == skeleton(json.loads(transcript(name)))


def test_completions_whole_body(sim: Sim) -> None:
    with httpx.Client(base_url=sim.url) as client:
        obj = client.post(COMPLETIONS, json={"prompt": "Once upon", "max_tokens": 4}).json()
    assert obj["object"] == "text_completion" and obj["id"].startswith("cmpl-")
    assert obj["choices"][0]["finish_reason"] == "length"
    assert obj["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 6,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


# ---------------------------------------------------------------- tokens


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES])
@pytest.mark.parametrize("stream", [False, True])
def test_usage_equals_tiktoken_count(sim: Sim, path: str, stream: bool) -> None:
    prompt = "Please check order 1234 — it's late, and the 'express' label was wrong!"
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream and path != MESSAGES else {}
    with httpx.Client(base_url=sim.url) as client:
        r = client.post(path, json=body_for(path, prompt, stream=stream, max_tokens=23, **extra))
    text, usage = text_of(path, r.content, stream), usage_of(path, r.content, stream)
    assert tokens.count(text) == 23
    if path == MESSAGES:
        # Earlier tests sent this prompt too: Anthropic counts cache reads outside input_tokens.
        assert usage["output_tokens"] == 23
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == tokens.count(prompt)
    else:
        assert usage["completion_tokens"] == 23 and usage["prompt_tokens"] == tokens.count(prompt)


def test_prompt_joining_rule(sim: Sim) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "Second part."}]},
    ]
    joined = "You are a helpful agent.\nFirst part.\nSecond part."
    with httpx.Client(base_url=sim.url) as client:
        chat = client.post(CHAT, json={"messages": messages, "max_tokens": 1}).json()
        anthropic = client.post(
            MESSAGES, json={"system": "You are a helpful agent.", "messages": messages[1:], "max_tokens": 1}
        ).json()
    assert chat["usage"]["prompt_tokens"] == tokens.count(joined)
    assert anthropic["usage"]["input_tokens"] == tokens.count(joined)


def test_output_length_rules(sim: Sim) -> None:
    with httpx.Client(base_url=sim.url) as client:
        default = client.post(CHAT, json=chat_body()).json()
        both = client.post(CHAT, json=chat_body(max_tokens=9, max_completion_tokens=4, ignore_eos=True)).json()
    assert default["usage"]["completion_tokens"] == sim.profile.default_max_tokens
    assert both["usage"]["completion_tokens"] == 4  # max_completion_tokens wins, as in OpenAI's API


def test_vocabulary_words_are_single_tokens() -> None:
    for encoding in tokens.ENCODINGS:
        vocab = Vocabulary(encoding)
        assert all(len(tokens.get_encoding(encoding).encode_ordinary(w)) == 1 for w in vocab.words)
        text = vocab.generate("seed", 500)
        assert tokens.count("".join(text), encoding) == 500
        assert vocab.generate("seed", 500) == text != vocab.generate("other seed", 500)


def test_identical_requests_give_identical_bytes_but_ids() -> None:
    bodies = []
    for _ in range(2):
        with Sim(fast(), seed=42) as s, httpx.Client(base_url=s.url) as client:
            bodies.append(client.post(CHAT, json=chat_body(stream=True, max_tokens=8)).content)
            bodies.append(client.post(CHAT, json=chat_body(stream=True, max_tokens=8)).content)
    assert bodies[0] == bodies[2] and bodies[1] == bodies[3]  # same seed, same clock: same bytes
    ids = [chunks(b)[0]["id"] for b in bodies[:2]]
    assert ids[0] != ids[1] and all(re.fullmatch(r"chatcmpl-[0-9a-f]{16}", i) for i in ids)
    assert bodies[0].replace(ids[0].encode(), b"ID") == bodies[1].replace(ids[1].encode(), b"ID")


# ---------------------------------------------------------------- errors


def test_errors_have_vllm_shapes_and_statuses(sim: Sim) -> None:
    big = " word" * (sim.profile.max_model_len + 5)
    with httpx.Client(base_url=sim.url) as client:
        unknown = client.post(CHAT, json=chat_body(model="nope"))
        bad_json = client.post(CHAT, content=b'{"model": "llmtap-sim", messages}')
        too_long = client.post(CHAT, json=chat_body(big))
        over_budget = client.post(CHAT, json=chat_body(max_tokens=sim.profile.max_model_len))
        missing = client.post(CHAT, json={"model": "llmtap-sim"})
        no_stream = client.post(CHAT, json=chat_body(stream_options={"include_usage": True}))
        no_prompt = client.post(COMPLETIONS, json={"model": "llmtap-sim"})
        records = truth(client, limit=7)
    assert unknown.status_code == 404
    assert skeleton(unknown.json()) == skeleton(json.loads(transcript("error-unknown-model")))
    assert unknown.json()["error"]["message"] == "The model `nope` does not exist. Valid aliases: llmtap-sim."
    assert bad_json.status_code == 400
    assert skeleton(bad_json.json()) == skeleton(json.loads(transcript("error-bad-json")))
    assert "'loc': 'body.24'" in bad_json.json()["error"]["message"]
    assert too_long.status_code == 400
    assert skeleton(too_long.json()) == skeleton(json.loads(transcript("error-too-long")))
    assert f"maximum context length is {sim.profile.max_model_len} tokens" in too_long.json()["error"]["message"]
    for r in (over_budget, missing, no_stream, no_prompt):
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert "'messages'" in missing.json()["error"]["message"]
    assert [r["outcome"] for r in records] == ["error"] * 7
    assert [r["status"] for r in records] == [404, 400, 400, 400, 400, 400, 400]


def test_anthropic_errors(sim: Sim) -> None:
    with httpx.Client(base_url=sim.url) as client:
        unknown = client.post(MESSAGES, json=body_for(MESSAGES, "hi", model="nope"))
        bad_json = client.post(MESSAGES, content=b"{")
        no_max = client.post(MESSAGES, json=chat_body())
    assert unknown.status_code == 404
    assert unknown.json()["type"] == "error" and unknown.json()["error"]["type"] == "not_found_error"
    for r in (bad_json, no_max):
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_models_health_and_unknown_path(sim: Sim) -> None:
    with Sim(fast(served_models=["a-model", "b-alias"])) as s, httpx.Client(base_url=s.url) as client:
        models = client.get("/v1/models").json()
        health = client.get("/health")
        alias = client.post(CHAT, json=chat_body(model="b-alias", max_tokens=1)).json()
        missing = client.get("/v2/nothing")
    assert [m["id"] for m in models["data"]] == ["a-model", "b-alias"]
    assert models["data"][0]["max_model_len"] == 8192
    assert health.status_code == 200
    assert alias["model"] == "b-alias"
    assert missing.status_code == 404


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_hits_only_a_shared_prefix() -> None:
    fixed = " ".join(f"Rule {i}: answer politely and cite the order number." for i in range(60))
    with Sim(fast(prefill_base_s=0.005, prefill_tokens_per_s=20000.0)) as s, httpx.Client(base_url=s.url) as client:

        def ask(system: str, user: str) -> dict[str, Any]:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return dict(client.post(CHAT, json={"messages": messages, "max_tokens": 2}).json())

        first = ask(fixed, "Where is order 1?")
        second = ask(fixed, "Where is order 2, please?")
        variable_first = [ask("Order 3 was late.", fixed), ask("Order 4 is broken.", fixed)]
        anthropic_body = {"system": fixed, "messages": [{"role": "user", "content": "5"}], "max_tokens": 2}
        anthropic = client.post(MESSAGES, json=anthropic_body).json()
        records = truth(client)
        cached_total = metric(client, "llmtap_sim_cached_tokens_total")
    fixed_tokens = tokens.count(fixed + "\n")
    expected = fixed_tokens // 16 * 16  # full blocks wholly inside the shared part
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected > 400
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in variable_first] == [0, 0]
    assert anthropic["usage"]["cache_read_input_tokens"] == expected
    assert anthropic["usage"]["input_tokens"] == tokens.count(fixed + "\n5") - expected
    # The cached read is planned cheaper by exactly the cached tokens' prefill (what the simulator planned:
    # its measured prefill also holds how late a busy machine woke it), and it was not served early.
    planned = {r["id"]: r["prefill_plan_s"] for r in records}
    saved = planned[first["id"]] - planned[second["id"]]
    delta_tokens = first["usage"]["prompt_tokens"] - second["usage"]["prompt_tokens"]
    assert saved == pytest.approx((expected + delta_tokens) / 20000.0, abs=1e-9)
    assert all(r["chunk_offsets_s"][0] >= r["chunk_due_offsets_s"][0] for r in records)
    assert cached_total == 2 * expected


def test_cache_evicts_least_recently_used_blocks() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=6)
    a, b, c = (block_hashes(list(range(base, base + 13)), 4) for base in (0, 100, 200))  # 3 blocks each
    cache.insert(a)
    cache.insert(b)
    assert cache.lookup(a, 13).cached_tokens == 12  # touching A makes B the least recently used
    cache.insert(c)
    assert len(cache) == 6
    assert cache.lookup(b, 13).cached_tokens == 0
    assert cache.lookup(a, 13).cached_tokens == 12 and cache.lookup(c, 13).cached_tokens == 12
    # A full hit still computes the last token, as vLLM does: 12 tokens give at most 8 cached.
    assert cache.lookup(a[:3], 12).cached_tokens == 8


def test_lru_eviction_through_the_server() -> None:
    prompts = [" ".join(f"{name} line {i} of the policy." for i in range(20)) for name in ("Alpha", "Beta", "Gamma")]
    counts = [tokens.count(p) for p in prompts]
    blocks = [n // 16 for n in counts]
    capacity = blocks[0] + blocks[1] + 1
    with Sim(fast(cache_blocks=capacity)) as s, httpx.Client(base_url=s.url) as client:

        def cached(prompt: str) -> int:
            r = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1}).json()
            return int(r["usage"]["prompt_tokens_details"]["cached_tokens"])

        alpha, beta, gamma = prompts
        full_alpha = (counts[0] - 1) // 16 * 16  # the last prompt token is always computed
        assert [cached(alpha), cached(beta), cached(alpha), cached(gamma)] == [0, 0, full_alpha, 0]
        # Alpha was touched after beta, so gamma's blocks pushed beta out, tail first: beta keeps its head.
        kept = capacity - blocks[0] - blocks[2]
        assert 0 < kept < blocks[1]
        assert cached(alpha) == full_alpha
        assert cached(beta) == kept * 16


# ---------------------------------------------------------------- scheduler and timing


async def test_queueing_appears_beyond_max_num_seqs_and_prefill_does_not_grow() -> None:
    profile = fast(max_num_seqs=2, prefill_base_s=0.01, decode_s_per_token=0.01, default_max_tokens=8)
    with Sim(profile) as s:
        async with httpx.AsyncClient(base_url=s.url) as client:
            waiting_seen: list[float] = []

            async def watch() -> None:
                while True:
                    waiting_seen.append(await ametric(client, "llmtap_sim_num_requests_waiting"))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            requests = []
            with paused_gc():
                for i in range(6):  # 4 ms apart, so the arrival order is unambiguous
                    requests.append(asyncio.create_task(client.post(CHAT, json=chat_body(f"question {i}"))))
                    await asyncio.sleep(0.004)
                await asyncio.gather(*requests)
            watcher.cancel()
            records = (await client.get("/debug/requests")).json()["requests"]
    assert max(waiting_seen) >= 2
    # First come, first served: in the order requests joined the line, after reading and tokenizing them
    # (two arrivals 2 ms apart swapped places before the line once, on a loaded machine).
    by_joining = sorted(records, key=lambda r: r["joined"])
    assert by_joining == sorted(records, key=lambda r: r["admitted"])
    assert all(r["arrival"] <= r["joined"] <= r["admitted"] for r in records)
    # The first two took a slot the moment they joined the line, before anything finished; each later one
    # waited for a slot and took it the moment one freed: within 3 ms of a request's last token, plus how
    # late this machine woke the simulator (its own record: actual against due).
    finishes = sorted(r["last_token"] for r in records)
    assert all(r["admitted"] < finishes[0] for r in by_joining[:2])
    late = max(lateness(r) for r in records)
    for k, r in enumerate(by_joining[2:]):
        assert r["admitted"] >= finishes[k]
        assert min(r["admitted"] - f for f in finishes if f <= r["admitted"]) < 0.003 + late, (r, late)
    # The last one waited for the two rounds ahead of it: admitted at the fourth finish (above), its queue from its
    # arrival to then (an arrival a loaded machine made late shortens the queue, not the rounds it waited for).
    last = by_joining[-1]
    assert last["queue_s"] == pytest.approx(last["admitted"] - last["arrival"], abs=1e-6)
    assert last["admitted"] >= finishes[3] > last["arrival"]
    # No growth under load: every prefill was planned at the profile's figure, waiting or not.
    assert all(r["cached_tokens"] == 0 for r in records)
    assert [r["prefill_plan_s"] for r in records] == [profile.prefill_s(r["prompt_tokens"]) for r in records]


async def test_timing_follows_the_profile_and_the_client_sees_the_truth() -> None:
    profile = fast(prefill_base_s=0.03, prefill_tokens_per_s=100000.0, decode_s_per_token=0.012)
    step = profile.decode_s_per_token
    with Sim(profile) as s:
        async with httpx.AsyncClient(base_url=s.url) as client:
            await timed_stream(client, CHAT, chat_body("warm-up", stream=True, max_tokens=2))  # connect, warm paths
            runs = []
            with paused_gc():
                for i in range(4):
                    body = chat_body(f"timing {i}", stream=True, max_tokens=15)
                    runs.append(await timed_stream(client, CHAT, body))
            records = {r["id"]: r for r in (await client.get("/debug/requests")).json()["requests"]}
    late: list[float] = []  # each chunk: written against due
    client_ttft: list[float] = []  # what the client measured against the truth
    for start, stamps, raw in runs:
        record = records[chunks(raw)[0]["id"]]
        offsets, due = record["chunk_offsets_s"], record["chunk_due_offsets_s"]
        assert len(stamps) == 15 == len(offsets) == len(due)
        # The plan is the profile's, exactly: the first token a prefill after arrival, then one step per
        # token from the first token's deadline (never from a late wake-up: no drift accumulates).
        assert due[0] == pytest.approx(profile.prefill_s(record["prompt_tokens"]), abs=2e-6)
        assert [d - due[0] for d in due] == pytest.approx([k * step for k in range(15)], abs=2e-6)
        late += [o - d for o, d in zip(offsets, due, strict=True)]
        # Nothing is early: not the server against its plan, not the client against the server's write.
        assert all(t >= record["arrival"] + o for t, o in zip(stamps, offsets, strict=True))
        client_ttft.append(stamps[0] - start - offsets[0])
    assert min(late) >= 0 and min(client_ttft) >= 0, (late, client_ttft)
    # How late is the machine's doing (1 to 2.5 ms at worst on a quiet 2-core one); a simulator that slept a step
    # too long, or a client that read a chunk late, would be a whole step out in the median.
    assert statistics.median(late) < step and statistics.median(client_ttft) < step, (late, client_ttft)


async def test_stream_interval_and_batch_slowdown() -> None:
    # A prefill long enough that both of the pair are admitted before either starts decoding.
    profile = fast(stream_interval=4, decode_s_per_token=0.005, batch_slowdown=1.0, prefill_base_s=0.1)
    with Sim(profile) as s:
        async with httpx.AsyncClient(base_url=s.url) as client:
            alone = await client.post(CHAT, json=chat_body("alone", stream=True, max_tokens=10))
            record = (await client.get("/debug/requests")).json()["requests"][-1]
            pair = [client.post(CHAT, json=chat_body(f"pair {i}", max_tokens=10)) for i in range(2)]
            await asyncio.gather(*pair)
            both = (await client.get("/debug/requests", params={"limit": 2})).json()["requests"]
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks(alone.content)[1:]]
    assert [tokens.count(d) for d in deltas] == [1, 4, 4, 1]  # the first token alone, then 4 per chunk
    assert record["chunk_tokens"] == [1, 4, 4, 1]

    def planned_decode(r: dict[str, Any]) -> float:
        return float(r["chunk_due_offsets_s"][-1] - r["chunk_due_offsets_s"][0])

    # The plan (what a busy machine cannot move: it only wakes the simulator late, never early).
    assert planned_decode(record) == pytest.approx(9 * 0.005, abs=2e-6)
    assert all(o >= d for o, d in zip(record["chunk_offsets_s"], record["chunk_due_offsets_s"], strict=True))
    # Two running sequences: each step takes decode * (1 + 1.0 * (2 - 1)), twice as long. The pair's second
    # arrived within the first's 100 ms prefill, so it ran beside the first for all of the first's decode.
    first = min(both, key=lambda r: r["admitted"])
    assert planned_decode(first) == pytest.approx(9 * 0.010, abs=2e-6)


PRELUDE_PREFILL = 0.2


async def test_prelude_goes_out_at_admission_or_with_the_first_token() -> None:
    arrivals = []
    for early in (True, False):
        with Sim(fast(prefill_base_s=PRELUDE_PREFILL, prelude_on_admit=early)) as s:
            async with httpx.AsyncClient(base_url=s.url) as client:
                await client.get("/health")  # connect first
                start = time.monotonic()
                stamps: list[float] = []
                async with client.stream("POST", MESSAGES, json=body_for(MESSAGES, "hi", stream=True)) as r:
                    pending = b""
                    async for piece in r.aiter_raw():
                        pending += piece
                        *done, pending = pending.split(b"\n\n")
                        stamps += [time.monotonic() - start for ev in done if ev.startswith(b"event: message_start")]
                        stamps += [time.monotonic() - start for ev in done if has_content(ev)][:1]
                arrivals.append(stamps[:2])
    (early_start, early_first), (late_start, late_first) = arrivals
    # message_start a whole prefill before the first token, or with it as vLLM sends them: each within half a
    # prefill of that (a client thread that a busy machine holds up between two reads sees them apart).
    assert early_first - early_start > PRELUDE_PREFILL / 2, arrivals
    assert late_first - late_start < PRELUDE_PREFILL / 2, arrivals


def test_serve_runs_in_its_own_process() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import asyncio; from llmtap.simulator import get_profile, serve; "
        f"asyncio.run(serve('127.0.0.1', {port}, get_profile('fast', served_models=['own-process'])))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + PATIENCE
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None, "the simulator did not start"
                    time.sleep(0.05)
            models = client.get("/v1/models").json()
            reply = client.post(CHAT, json=chat_body(model="own-process", max_tokens=3)).json()
    finally:
        proc.terminate()
        returncode = proc.wait(timeout=PATIENCE)
    assert models["data"][0]["id"] == "own-process"
    assert reply["usage"]["completion_tokens"] == 3
    assert returncode == -signal.SIGTERM  # uvicorn shuts down, then re-raises the signal it caught


async def test_disconnect_frees_the_slot_at_once() -> None:
    profile = fast(max_num_seqs=1, decode_s_per_token=0.005, default_max_tokens=2000)
    running, waiting = "llmtap_sim_num_requests_running", "llmtap_sim_num_requests_waiting"
    with Sim(profile) as s:
        async with httpx.AsyncClient(base_url=s.url) as client, httpx.AsyncClient(base_url=s.url) as probe:
            async with client.stream("POST", CHAT, json=chat_body("long", stream=True)) as first:
                # Hold the iterator: a dropped one is finalized, which would close the connection early.
                pieces = cast(AsyncGenerator[bytes, None], first.aiter_raw())
                async for piece in pieces:
                    if b'"content":" ' in piece:
                        break
                # A second request waits for the only slot, then leaves from the line.
                async with client.stream("POST", CHAT, json=chat_body("queued", stream=True)):
                    await asyncio.sleep(0.05)
                    assert (await ametric(probe, running), await ametric(probe, waiting)) == (1, 1)
                unqueued_after = await seconds_until_zero(probe, waiting)
                assert await ametric(probe, running) == 1
                await pieces.aclose()
            freed_after = await seconds_until_zero(probe, running)
            queued, long = (await probe.get("/debug/requests")).json()["requests"]
            # The slot is free: the next request is admitted without queueing.
            after_id = (await probe.post(CHAT, json=chat_body("after", max_tokens=2))).json()["id"]
            after = (await probe.get("/debug/requests", params={"limit": 1})).json()["requests"][0]
            cancelled = await ametric(probe, 'llmtap_sim_requests_total{model_name="llmtap-sim",outcome="cancelled"}')
    # "At once" against what holding on would cost: the long stream had 2,000 tokens at 5 ms to go (10 s, less
    # what it sent), so a slot or a place in line kept until then is seen here; the quiet figures (a few ms) are
    # not a bound, a busy machine stretches the polls.
    assert unqueued_after < 1.0 and freed_after < 1.0, (unqueued_after, freed_after)
    assert (queued["outcome"], queued["admitted"], queued["output_tokens"]) == ("cancelled", None, 0)
    assert long["outcome"] == "cancelled" and 0 < long["output_tokens"] < 2000
    assert (after["id"], after["outcome"]) == (after_id, "ok")
    assert after["admitted"] - after["joined"] < 1.0, after  # joined the line and got a slot, no wait
    assert cancelled == 2


async def test_long_prompt_is_counted_off_the_event_loop() -> None:
    profile = fast(decode_s_per_token=0.01, max_model_len=1000)
    # One long "word": slow to encode for its size, so what the test sees is the counting itself rather than
    # Python's unavoidable GIL-holding work (JSON decoding, the id list). 400 kB took 0.15 s on an AVX2 EPYC and
    # 0.05 s on a newer Xeon; doubled until it takes a tenth of a second here.
    rng = random.Random(1)
    huge = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=400_000))
    while True:
        counted = time.monotonic()
        huge_tokens = tokens.count(huge)
        count_s = time.monotonic() - counted
        if count_s > 0.1 or len(huge) >= 3_200_000:
            break
        huge += "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=len(huge)))
    # Encoded up front: the client shares this process's GIL, and encoding mid-stream would stall the server.
    payload = json.dumps({"prompt": huge, "max_tokens": 1}).encode()
    with Sim(profile) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
            stream = asyncio.create_task(client.post(CHAT, json=chat_body("steady", stream=True, max_tokens=40)))
            await asyncio.sleep(0.05)
            rejected = await client.post(COMPLETIONS, content=payload)
            steady = (await stream).content
            records = (await client.get("/debug/requests")).json()["requests"]
    # The control timed once more, now: a machine that got busier during the stream counts slower too.
    counted = time.monotonic()
    tokens.count(huge)
    count_s = max(count_s, time.monotonic() - counted)
    assert rejected.status_code == 400 and f"{huge_tokens} input tokens" in rejected.json()["error"]["message"]
    assert count_s > 0.05  # long enough that counting on the loop would stretch a gap far past its 10 ms
    (record,) = (r for r in records if r["id"] == chunks(steady)[0]["id"])
    assert record["output_tokens"] == 40
    # Counting on the event loop would have held one of the stream's chunks back by the whole count (the
    # control: the same count, timed before and after, on the same busy machine); off the loop, no chunk is held
    # back by most of it (the JSON decoding of the prompt still holds the GIL for part of that time).
    assert lateness(record) < count_s * 0.75, (lateness(record), count_s)


# ---------------------------------------------------------------- truth, metrics, profiles


def test_debug_requests_is_bounded_and_pages_by_seq() -> None:
    with Sim(fast(history=5)) as s, httpx.Client(base_url=s.url) as client:
        ids = [client.post(CHAT, json=chat_body(f"q{i}", max_tokens=1)).json()["id"] for i in range(8)]
        page = client.get("/debug/requests").json()
        since = client.get("/debug/requests", params={"since": page["last_seq"] - 2}).json()["requests"]
        latest = truth(client, limit=1)
        counted = metric(client, "llmtap_sim_requests_total")
    assert [r["id"] for r in page["requests"]] == ids[3:]
    assert [r["seq"] for r in since] == [7, 8]
    assert [r["id"] for r in latest] == ids[-1:]
    assert counted == 8
    record = page["requests"][-1]
    assert record["outcome"] == "ok" and record["output_tokens"] == 1
    assert record["queue_s"] >= 0 and record["prefill_s"] > 0 and record["decode_s"] == 0


def test_profiles_carry_the_course_numbers() -> None:
    support, code = PROFILES["support"], PROFILES["code"]
    assert support.prefill_s(6200) == pytest.approx(0.78, abs=0.005)
    assert support.prefill_s(6200 - 5248) == pytest.approx(0.12, abs=0.005)
    assert support.default_max_tokens * support.decode_s_per_token == pytest.approx(6.6)
    assert 1 / support.decode_s_per_token == pytest.approx(45, abs=1)
    assert code.prefill_s(200) == pytest.approx(0.025)
    assert code.decode_s_per_token < support.decode_s_per_token and code.default_max_tokens == 64
    changed = get_profile("support", max_num_seqs=2, served_models=["x", "y"])
    assert (changed.max_num_seqs, changed.served_models, changed.model) == (2, ("x", "y"), "x")
    assert PROFILES["support"].max_num_seqs == 8
    with pytest.raises(ValueError, match="max_num_seqs"):
        get_profile("fast", max_num_seqs=0)
    with pytest.raises(KeyError, match="unknown profile"):
        get_profile("nope")
