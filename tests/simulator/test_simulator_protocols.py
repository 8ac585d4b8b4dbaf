"""The simulator speaks every protocol llmtap reads, and llmtap's telemetry of each is right.

Shapes are compared with the transcripts beside the tests by skeleton (keys in order, value types): vLLM
0.32's recordings for the Responses API, Ollama's and Gemini's documented wire formats for theirs, and
the bytes are read back with llmtap's own decoders and providers. Then ``llmtap serve`` runs in front
of ``llmtap simulate``, each in its own process as users run them, and every protocol's request records
must carry the simulator's own truth: prompt, output and cached tokens, and a TTFT no shorter than the
server's and showing the prefix cache's gain.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.providers import Gemini, Ollama, OpenAIResponses, provider_for
from llmtap.providers.sse import decoder_for
from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.text import Vocabulary
from llmtap.store.files import ReadStats, read_records
from llmtap.types import Facts
from tests.conftest import PATIENCE, free_port
from tests.support.procs import ROOT, Llmtap, stop

TRANSCRIPTS = Path(__file__).parents[1] / "transcripts"
FIXED_CLOCK = 1795985942.0
RESPONSES, OLLAMA_CHAT, OLLAMA_GENERATE = "/v1/responses", "/api/chat", "/api/generate"
GEMINI = "/v1beta/models/llmtap-sim"

pytestmark = pytest.mark.e2e


# ---------------------------------------------------------------- helpers


def skeleton(value: Any, optional: frozenset[str] = frozenset()) -> Any:
    """Keys in order and leaf types, without the keys in ``optional`` (fields the simulator has no use for)."""
    if isinstance(value, dict):
        return [(k, skeleton(v, optional)) for k, v in value.items() if k not in optional]
    if isinstance(value, list):
        return ["list", *(skeleton(v, optional) for v in value[:1])]
    return type(value).__name__


def collapsed(items: list[Any]) -> list[Any]:
    """Runs of equal items folded to one: a stream of 3 deltas and one of 5 have the same shape."""
    return [x for i, x in enumerate(items) if i == 0 or items[i - 1] != x]


def transcript(name: str) -> bytes:
    return (TRANSCRIPTS / f"{name}.body").read_bytes()


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of every event, through llmtap's own SSE decoder."""
    decoder = decoder_for("sse")
    return [(e.event, json.loads(e.data)) for e in [*decoder.feed(raw), *decoder.flush()]]


def sse_skeletons(raw: bytes, optional: frozenset[str] = frozenset()) -> list[Any]:
    return collapsed([(name, skeleton(data, optional)) for name, data in sse_events(raw)])


def ndjson_lines(raw: bytes) -> list[Any]:
    return [json.loads(line) for line in raw.splitlines() if line]


def stream_facts(provider_path: str, framing: str, raw: bytes) -> list[Facts]:
    """What llmtap's provider reads from a stream, event by event."""
    provider = provider_for("POST", provider_path)
    assert provider is not None
    parser, decoder = provider.stream_parser(), decoder_for(framing)
    return [f for e in [*decoder.feed(raw), *decoder.flush()] if (f := parser.feed(e)) is not None]


@dataclass
class Sim:
    url: str
    client: httpx.Client


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    url, stop_sim = run_in_thread(get_profile("fast"), seed=7, clock=lambda: FIXED_CLOCK)
    with httpx.Client(base_url=url, timeout=10) as client:
        yield Sim(url, client)
    stop_sim()


def long_prompt(name: str, tokens: int = 200) -> str:
    """A prompt of its own (no cache hit from another test) long enough to fill many cache blocks."""
    return name + "".join(Vocabulary("o200k_base").generate(name, tokens))


# ---------------------------------------------------------------- shapes: Responses


def test_responses_stream_has_the_vllm_shape(sim: Sim) -> None:
    body = {"model": "llmtap-sim", "input": "Hello", "max_output_tokens": 5, "stream": True}
    r = sim.client.post(RESPONSES, json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert sse_skeletons(r.content) == sse_skeletons(transcript("responses-stream"))
    events = sse_events(r.content)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    done = next(data for name, data in events if name == "response.output_text.done")
    final = events[-1][1]["response"]
    assert done["text"] == deltas == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == 5 and final["usage"]["input_tokens"] == 1
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    # llmtap's own reading: five content deltas, then the usage at the end.
    facts = stream_facts(RESPONSES, "sse", r.content)
    assert sum(f.has_content for f in facts) == 5
    assert facts[-1].done and facts[-1].usage is not None and facts[-1].usage.output_tokens == 5


def test_responses_body_has_the_vllm_shape_and_the_same_usage_as_the_stream(sim: Sim) -> None:
    prompt = long_prompt("responses-body")
    body = {"model": "llmtap-sim", "instructions": "Be brief.", "input": prompt, "max_output_tokens": 4}
    whole = sim.client.post(RESPONSES, json=body)
    assert whole.headers["content-type"] == "application/json"
    assert skeleton(whole.json()) == skeleton(json.loads(transcript("responses-nonstream")))
    streamed = sim.client.post(RESPONSES, json=body | {"stream": True})
    a = OpenAIResponses().parse_body(whole.content).usage
    b = stream_facts(RESPONSES, "sse", streamed.content)[-1].usage
    assert a is not None and b is not None
    assert (a.input_tokens, a.output_tokens, a.cache_read_tokens) == (b.input_tokens, 4, 0)
    # The second request reads the first's prompt from the prefix cache, and says so.
    assert b.cache_read_tokens is not None and b.cache_read_tokens >= 192


def test_responses_input_messages_and_errors(sim: Sim) -> None:
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    obj = sim.client.post(RESPONSES, json={"input": parts, "max_output_tokens": 2}).json()
    assert obj["usage"]["input_tokens"] == 2 and obj["model"] == "llmtap-sim"
    missing = sim.client.post(RESPONSES, json={"model": "llmtap-sim"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.input"
    unknown = sim.client.post(RESPONSES, json={"model": "nope", "input": "hi"})
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]


# ---------------------------------------------------------------- shapes: Ollama


@pytest.mark.parametrize(("path", "name"), [(OLLAMA_CHAT, "chat"), (OLLAMA_GENERATE, "generate")])
def test_ollama_streams_are_ndjson_in_ollamas_shape(sim: Sim, path: str, name: str) -> None:
    prompt = long_prompt(f"ollama-{name}")
    body: dict[str, Any] = {"model": "llmtap-sim", "options": {"num_predict": 4}}
    body |= {"messages": [{"role": "user", "content": prompt}]} if name == "chat" else {"prompt": prompt}
    first, second = (sim.client.post(path, json=body) for _ in range(2))
    assert first.headers["content-type"] == "application/x-ndjson"
    # A thinking model's fields and the deprecated token context are Ollama's, not the simulator's.
    optional = frozenset({"thinking", "context"})
    recorded = ndjson_lines(transcript(f"ollama/{name}-stream"))
    ours = ndjson_lines(first.content)
    assert collapsed([skeleton(x, optional) for x in ours]) == collapsed([skeleton(x, optional) for x in recorded])
    assert [x["done"] for x in ours] == [False] * 4 + [True] and ours[-1]["done_reason"] == "length"
    assert "prompt_eval_cached_count" not in ours[-1]  # zero metrics are left out, as Ollama's omitempty does
    if name == "chat":
        cached = ndjson_lines(second.content)
        assert skeleton(cached[-1]) == skeleton(ndjson_lines(transcript("ollama/chat-stream-cached"))[-1])
    facts = stream_facts(path, "ndjson", second.content)
    usage, timing = facts[-1].usage, facts[-1].server_timing
    assert usage is not None and usage.output_tokens == 4 and usage.input_tokens == ours[-1]["prompt_eval_count"]
    assert usage.cache_read_tokens is not None and usage.cache_read_tokens >= 192
    # Durations in nanoseconds: the server's own phases, which llmtap takes as reported.
    assert timing is not None and timing.prefill is not None and 0 < timing.prefill < 1.0
    # Read in the right unit (nanoseconds), not the planned 3 x 3 ms: a simulator behind its schedule after a
    # stall sends the late tokens at once, so on a busy machine its real decode can be shorter (seen: 3.4 ms).
    assert timing.decode is not None and 1e-4 < timing.decode < 1.0


def test_ollama_whole_bodies_and_errors(sim: Sim) -> None:
    body = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "stream": False}
    whole = sim.client.post(OLLAMA_CHAT, json=body | {"options": {"num_predict": 3}})
    assert whole.headers["content-type"] == "application/json"
    assert skeleton(whole.json()) == skeleton(json.loads(transcript("ollama/chat-nonstream")))
    facts = Ollama(generate=False).parse_body(whole.content)
    assert facts.usage is not None and facts.usage.output_tokens == 3 and facts.finish_reasons == ["length"]
    generate = {"model": "llmtap-sim:latest", "prompt": "2 + 2?", "stream": False}
    generated = sim.client.post(OLLAMA_GENERATE, json=generate)
    optional = frozenset({"thinking", "context"})
    assert skeleton(generated.json()) == skeleton(json.loads(transcript("ollama/generate-nonstream")), optional)
    assert generated.json()["eval_count"] == get_profile("fast").default_max_tokens
    missing = sim.client.post(OLLAMA_CHAT, json={"model": "llama9", "messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 404
    assert skeleton(missing.json()) == skeleton(json.loads(transcript("ollama/error-not-found")))
    assert sim.client.post(OLLAMA_CHAT, json={"messages": []}).json() == {"error": "model is required"}


# ---------------------------------------------------------------- shapes: Gemini


def gemini_body(prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "systemInstruction": {"parts": [{"text": "Answer briefly."}]},
        "contents": [{"role": "user", "parts": [{"text": prompt}]}],
        "generationConfig": {"maxOutputTokens": max_tokens},
    }


def test_gemini_sse_stream_has_geminis_shape(sim: Sim) -> None:
    body = gemini_body(long_prompt("gemini-sse"))
    path = f"{GEMINI}:streamGenerateContent?alt=sse"
    first, second = (sim.client.post(path, json=body) for _ in range(2))
    assert first.headers["content-type"] == "text/event-stream"
    assert second.content.count(b"\r\n\r\n") == 4 and b"\n\n" not in second.content.replace(b"\r\n", b"")
    # Thinking tokens are the model's, not the simulator's; a cache hit has all the transcript's fields.
    optional = frozenset({"thoughtsTokenCount"})
    assert sse_skeletons(second.content) == sse_skeletons(transcript("gemini/stream-sse"), optional)
    usages = [data["usageMetadata"] for _, data in sse_events(second.content)]
    assert [u["candidatesTokenCount"] for u in usages] == [1, 2, 3, 4]  # cumulative, not per chunk
    assert "cachedContentTokenCount" not in sse_events(first.content)[-1][1]["usageMetadata"]
    facts = stream_facts(path, "sse", second.content)
    assert facts[-1].done and facts[-1].finish_reasons == ["MAX_TOKENS"]
    usage = facts[-1].usage
    assert usage is not None and usage.output_tokens == 4 and usage.input_tokens == usages[-1]["promptTokenCount"]
    assert usage.cache_read_tokens == usages[-1]["cachedContentTokenCount"] >= 192


def test_gemini_array_stream_and_whole_body(sim: Sim) -> None:
    body = gemini_body("Why is the sky blue?", 3)
    streamed = sim.client.post(f"{GEMINI}:streamGenerateContent", json=body)
    assert streamed.headers["content-type"] == "application/json; charset=UTF-8"
    chunks = json.loads(streamed.content)
    optional = frozenset({"thoughtsTokenCount", "cachedContentTokenCount", "cacheTokensDetails"})
    recorded = json.loads(transcript("gemini/stream-array"))
    assert collapsed([skeleton(c, optional) for c in chunks[:-1]]) == [skeleton(recorded[0], optional)]
    assert skeleton(chunks[-1], optional) == skeleton(recorded[-1], optional)
    assert streamed.content.startswith(b"[{\n  ") and streamed.content.count(b"},\n{") == 2
    facts = stream_facts(f"{GEMINI}:streamGenerateContent", "json-array", streamed.content)
    assert sum(f.has_content for f in facts) == 3 and facts[-1].done
    whole = sim.client.post(f"{GEMINI}:generateContent", json=body)
    assert skeleton(whole.json(), optional) == skeleton(json.loads(transcript("gemini/nonstream")), optional)
    usage = Gemini(vertex=False).parse_body(whole.content).usage
    assert usage is not None and usage.output_tokens == 3 and facts[-1].usage == usage
    assert (
        "".join(c["candidates"][0]["content"]["parts"][0]["text"] for c in chunks)
        == (whole.json()["candidates"][0]["content"]["parts"][0]["text"])
    )


def test_gemini_errors_have_googles_shape(sim: Sim) -> None:
    recorded = skeleton(json.loads(transcript("gemini/error-invalid-argument")))
    empty = sim.client.post(f"{GEMINI}:generateContent", json={"contents": []})
    assert empty.status_code == 400 and skeleton(empty.json()) == recorded
    assert empty.json()["error"]["status"] == "INVALID_ARGUMENT"
    unknown = sim.client.post("/v1beta/models/gemini-9:generateContent", json=gemini_body("hi"))
    assert unknown.status_code == 404 and unknown.json()["error"]["status"] == "NOT_FOUND"


# ---------------------------------------------------------------- through llmtap


@dataclass(frozen=True)
class Protocol:
    """One protocol as a client speaks it: where to send, and the body for a prompt."""

    name: str  # llmtap's provider name, as the record's ``protocol`` says it
    route: str  # the simulator's route, as its truth says it
    path: str
    stream_path: str

    def body(self, prompt: str, stream: bool) -> dict[str, Any]:
        model: dict[str, Any] = {"model": "llmtap-sim"}
        message = [{"role": "user", "content": prompt}]
        if self.route == "chat":
            return model | {"messages": message, "max_tokens": 4, "stream": stream}
        if self.route == "completions":
            return model | {"prompt": prompt, "max_tokens": 4, "stream": stream}
        if self.route == "responses":
            return model | {"input": prompt, "max_output_tokens": 4, "stream": stream}
        if self.route == "messages":
            return model | {"messages": message, "max_tokens": 4, "stream": stream}
        if self.route == "ollama_chat":
            return model | {"messages": message, "options": {"num_predict": 4}, "stream": stream}
        if self.route == "ollama_generate":
            return model | {"prompt": prompt, "options": {"num_predict": 4}, "stream": stream}
        return gemini_body(prompt)


PROTOCOLS = [
    Protocol("openai_chat", "chat", "/v1/chat/completions", "/v1/chat/completions"),
    Protocol("openai_completions", "completions", "/v1/completions", "/v1/completions"),
    Protocol("openai_responses", "responses", RESPONSES, RESPONSES),
    Protocol("anthropic", "messages", "/v1/messages", "/v1/messages"),
    Protocol("ollama_chat", "ollama_chat", OLLAMA_CHAT, OLLAMA_CHAT),
    Protocol("ollama_generate", "ollama_generate", OLLAMA_GENERATE, OLLAMA_GENERATE),
    Protocol("gemini", "gemini", f"{GEMINI}:generateContent", f"{GEMINI}:streamGenerateContent?alt=sse"),
]
# The support profile reads 7,950 tokens/s: 2,000 uncached tokens take about 250 ms, cached ones ~3 ms.
PROMPT_TOKENS = 2000


@dataclass
class Traffic:
    """For each protocol: (record, simulator truth) of a cold stream, a warm stream and a whole body."""

    pairs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    tmp = tmp_path_factory.mktemp("protocols")
    port = free_port()
    sim_log = (tmp / "sim.log").open("w")
    # The command users run, with the course's support profile (so prefill takes visible time).
    cmd = [sys.executable, "-m", "llmtap", "simulate", "--profile", "support", "--port", str(port)]
    sim = subprocess.Popen(cmd, cwd=ROOT, stdout=sim_log, stderr=subprocess.STDOUT)
    sim_url = f"http://127.0.0.1:{port}"
    proxy: Llmtap | None = None
    try:
        deadline = time.monotonic() + PATIENCE
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(sim_url + "/health", timeout=1).status_code == 200:
                    break
            assert sim.poll() is None and time.monotonic() < deadline, (tmp / "sim.log").read_text()
            time.sleep(0.05)
        records = tmp / "records"
        proxy = Llmtap(sim_url, tmp / "llmtap.log", "--record", str(records))
        sent, took = 0, []
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for p in PROTOCOLS:
                prompt = f"{p.name}:" + "".join(Vocabulary("o200k_base").generate(p.name, PROMPT_TOKENS))
                for stream in (True, True, False):
                    began = time.monotonic()
                    r = client.post(p.stream_path if stream else p.path, json=p.body(prompt, stream))
                    took.append(time.monotonic() - began)  # sent to the whole answer read, on the client
                    assert r.status_code == 200, (p.name, r.text[:500])
                    sent += 1
        deadline = time.monotonic() + PATIENCE
        while True:
            lines = list(read_records(records, ReadStats()))
            if len(lines) >= sent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(lines) == sent, proxy.logs()[-3000:]
        truth = httpx.get(sim_url + "/debug/requests").json()["requests"]
        assert len(truth) == sent
        recorded = [{**line, "client_s": t} for line, t in zip(lines, took, strict=True)]
        rows = list(zip(recorded, truth, strict=True))
        yield Traffic({p.name: rows[i * 3 : i * 3 + 3] for i, p in enumerate(PROTOCOLS)})
    finally:
        if proxy is not None:
            proxy.close()
        stop(sim)
        sim_log.close()


def test_every_protocol_is_read_by_its_own_provider(traffic: Traffic) -> None:
    for p in PROTOCOLS:
        rows = traffic.pairs[p.name]
        # Gemini's stream is a method of its own (``:streamGenerateContent``), so a route of its own.
        stream_route = "gemini_stream" if p.route == "gemini" else p.route
        routes = [(p.name, stream_route)] * 2 + [(p.name, p.route)]
        assert [(rec["protocol"], sim["route"]) for rec, sim in rows] == routes
        assert [rec["stream"] for rec, _ in rows] == [True, True, False], p.name
        assert all(rec["outcome"] == "ok" and sim["outcome"] == "ok" for rec, sim in rows), p.name


def test_usage_of_every_protocol_is_the_simulators_truth(traffic: Traffic) -> None:
    for p in PROTOCOLS:
        for rec, sim in traffic.pairs[p.name]:
            tokens = rec["tokens"]
            assert tokens["input"] == sim["prompt_tokens"] >= PROMPT_TOKENS, (p.name, tokens)
            assert tokens["output"] == sim["output_tokens"] == 4, (p.name, tokens)
            # A miss may say 0 or leave the count out (Ollama and Gemini omit zero counts).
            assert (tokens["cache_read"] or 0) == sim["cached_tokens"], (p.name, tokens)
            assert tokens["input_source"] == tokens["output_source"] == "usage", (p.name, tokens)


def test_prefix_cache_hits_show_as_cached_tokens_and_a_shorter_ttft(traffic: Traffic) -> None:
    for p in PROTOCOLS:
        (cold, cold_sim), (warm, warm_sim), _ = traffic.pairs[p.name]
        assert cold_sim["cached_tokens"] == 0 and cold["tokens"]["cache_read"] in (0, None), p.name
        # Every whole block of the repeated prompt is read from the cache (blocks of 16 tokens).
        assert warm["tokens"]["cache_read"] == warm_sim["cached_tokens"] >= PROMPT_TOKENS - 16, (p.name, warm)
        assert warm["cache"]["cached_tokens"] == warm_sim["cached_tokens"], (p.name, warm["cache"])
        # The server read the warm prompt in under half the time, and the proxy saw it sooner (by how much more
        # than the server's gain depends on the machine: the relay's hop is the benchmark's).
        cold_server, warm_server = (s["first_token"] - s["arrival"] for s in (cold_sim, warm_sim))
        assert cold_server > 0.2 and warm_server < cold_server / 2, (p.name, cold_server, warm_server)
        assert warm["ttft"] < cold["ttft"], (p.name, cold["ttft"], warm["ttft"])


def test_ttft_of_every_protocol_is_the_servers_plus_the_relays_hop(traffic: Traffic) -> None:
    for p in PROTOCOLS:
        for rec, sim in traffic.pairs[p.name][:2]:
            # One monotonic clock: the proxy received the request before the simulator did, and saw the
            # first token after the simulator wrote it and before the client had read the answer (a hop of a
            # few ms when quiet, 450 ms once under two busy loops: its size is the benchmark's).
            server_ttft = sim["first_token"] - sim["arrival"]
            assert server_ttft - 0.001 <= rec["ttft"] <= rec["client_s"], (p.name, rec["ttft"], server_ttft, rec)
            assert rec["ttfb"] <= rec["ttft"], p.name


def test_ollama_phases_are_the_ones_the_server_reports(traffic: Traffic) -> None:
    for name in ("ollama_chat", "ollama_generate"):
        for rec, sim in traffic.pairs[name]:
            assert rec["queue_source"] == rec["prefill_source"] == "server", rec
            assert rec["prefill"] == pytest.approx(sim["prefill_s"], abs=0.002), (rec["prefill"], sim["prefill_s"])
            # The queue is the server's plus the proxy's own line (body read to sent upstream: microseconds when
            # quiet, 5 ms once under two busy loops), which lies inside the relay's part of the whole request.
            relay = rec["e2e"] - (sim["last_token"] - sim["arrival"])
            assert sim["queue_s"] - 0.002 <= rec["queue"] <= sim["queue_s"] + relay + 0.002, (rec, sim)
