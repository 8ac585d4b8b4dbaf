"""Ollama's native API and Gemini generateContent: transcripts split at every byte, named edge cases, fuzz,
and both through the proxy on real sockets.

The transcripts (tests/transcripts/ollama, tests/transcripts/gemini) are built from the documented wire
formats, as their READMEs say: no real Ollama or Gemini endpoint is reachable here.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings, strategies as st
from opentelemetry.sdk.trace import ReadableSpan

from llmtap.config.load import build
from llmtap.providers import Gemini, Ollama, Provider, provider_for
from llmtap.providers.gemini import model_from_path
from llmtap.providers.sse import Decoder, Event, JSONArrayDecoder, NDJSONDecoder, SSEDecoder
from llmtap.telemetry import semconv as sc
from llmtap.types import Facts, ServerTiming, Usage
from tests.conftest import ServerThread, Telemetry

TRANSCRIPTS = Path(__file__).parents[1] / "transcripts"
CHAT, GENERATE = Ollama(generate=False), Ollama(generate=True)
GEMINI, VERTEX = Gemini(vertex=False), Gemini(vertex=True)

fuzz = settings(max_examples=300, deadline=None)


def body(name: str) -> bytes:
    return (TRANSCRIPTS / f"{name}.body").read_bytes()


def content_type(name: str) -> str:
    for line in (TRANSCRIPTS / f"{name}.headers").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.lower() == "content-type":
            return value.strip()
    raise AssertionError(f"{name} has no content-type")


def decoder_of(name: str) -> Callable[[], Decoder]:
    factories: dict[str, Callable[[], Decoder]] = {
        "application/x-ndjson": NDJSONDecoder,
        "text/event-stream": SSEDecoder,
    }
    return factories.get(content_type(name).split(";")[0], JSONArrayDecoder)


def parse(
    provider: Provider, raw: bytes, pieces: list[bytes] | None = None, decoder: Decoder | None = None
) -> list[Facts | None]:
    """Decode ``raw`` (fed as ``pieces``) and run every event through a fresh parser of ``provider``."""
    decoder = decoder or JSONArrayDecoder()
    parser = provider.stream_parser()
    events = [e for piece in (pieces or [raw]) for e in decoder.feed(piece)] + decoder.flush()
    return [parser.feed(e) for e in events]


def run(provider: Provider, name: str, pieces: list[bytes] | None = None) -> list[Facts | None]:
    return parse(provider, body(name), pieces, decoder_of(name)())


def fold(results: list[Facts | None]) -> Facts:
    """What a timeline makes of a stream: content joined, the last usage and timing, every finish reason."""
    total = Facts()
    for facts in results:
        if facts is None:
            continue
        total.has_content |= facts.has_content
        total.content += facts.content
        total.usage = facts.usage or total.usage
        total.server_timing = facts.server_timing or total.server_timing
        total.finish_reasons += facts.finish_reasons
        total.response_id = total.response_id or facts.response_id
        total.response_model = total.response_model or facts.response_model
        if facts.error_type and not total.error_type:
            total.error_type, total.error_message = facts.error_type, facts.error_message
        total.done |= facts.done
    return total


def telemetry_view(facts: Facts) -> tuple[Any, ...]:
    """What a streamed and a whole answer must agree on (ids differ between two real responses)."""
    return (facts.content, facts.usage, facts.finish_reasons, facts.response_model, facts.server_timing)


STREAMS = [
    (CHAT, "ollama/chat-stream"),
    (CHAT, "ollama/chat-stream-cached"),
    (CHAT, "ollama/chat-stream-error"),
    (GENERATE, "ollama/generate-stream"),
    (GEMINI, "gemini/stream-sse"),
    (GEMINI, "gemini/stream-array"),
    (VERTEX, "gemini/vertex-stream-sse"),
]


@pytest.mark.parametrize(("provider", "name"), STREAMS, ids=[n for _, n in STREAMS])
def test_every_byte_split_gives_the_same_facts(provider: Provider, name: str) -> None:
    raw = body(name)
    whole = run(provider, name)
    assert whole and all(f is not None for f in whole)
    for i in range(len(raw) + 1):
        assert run(provider, name, [raw[:i], raw[i:]]) == whole, f"split at byte {i}"
    assert run(provider, name, [raw[i : i + 1] for i in range(len(raw))]) == whole


# Ollama.


def test_ollama_chat_stream() -> None:
    results = run(CHAT, "ollama/chat-stream")
    assert results[0] == Facts(has_content=True, content="The", response_model="llama3.2")
    total = fold(results)
    assert total.content == "The sky is blue because of Rayleigh scattering."
    assert total.usage == Usage(input_tokens=31, output_tokens=10)
    assert total.finish_reasons == ["stop"] and total.done
    # load_duration is the wait for a ready model (queue); nanoseconds become seconds.
    assert total.server_timing == ServerTiming(queue=0.02173625, prefill=0.292061, decode=0.183219)
    last = results[-1]
    assert last is not None and not last.has_content and last.done
    assert [f.server_timing for f in results[:-1] if f is not None] == [None] * (len(results) - 1)


def test_ollama_cached_prompt_tokens() -> None:
    total = fold(run(CHAT, "ollama/chat-stream-cached"))
    assert total.usage == Usage(input_tokens=58, output_tokens=5, cache_read_tokens=41)


def test_ollama_generate_thinking_is_content() -> None:
    results = run(GENERATE, "ollama/generate-stream")
    assert [f.content for f in results if f is not None] == ["Add", " the", " two.", "2 + 2", " = 4", ""]
    total = fold(results)
    assert total.finish_reasons == ["length"] and total.usage == Usage(input_tokens=14, output_tokens=8)
    assert total.server_timing == ServerTiming(queue=1.874210042, prefill=0.401222, decode=0.09451)


@pytest.mark.parametrize(("provider", "name"), [(CHAT, "chat"), (GENERATE, "generate")])
def test_ollama_streamed_equals_non_streamed(provider: Ollama, name: str) -> None:
    streamed = fold(run(provider, f"ollama/{name}-stream"))
    whole = provider.parse_body(body(f"ollama/{name}-nonstream"))
    assert telemetry_view(whole) == telemetry_view(streamed)
    assert whole.has_content and whole.done


def test_ollama_error_line_after_200() -> None:
    total = fold(run(CHAT, "ollama/chat-stream-error"))
    assert total.content == "Once upon" and not total.done
    assert total.error_type == "_OTHER"
    assert total.error_message == "an error was encountered while running the model: unexpected EOF"


def test_ollama_error_body() -> None:
    facts = CHAT.parse_body(body("ollama/error-not-found"))
    assert (facts.error_type, facts.error_message) == ("_OTHER", 'model "llama9" not found, try pulling it first')


def test_ollama_tool_call_arguments_are_content() -> None:
    line = {
        "model": "llama3.2",
        "message": {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Paris"}}}],
        },
        "done": False,
    }
    facts = CHAT.stream_parser().feed(Event("", json.dumps(line)))
    assert facts is not None and facts.has_content and facts.content == '{"city": "Paris"}'


@pytest.mark.parametrize(
    ("metrics", "timing"),
    [
        (
            {"load_duration": -5, "prompt_eval_duration": 10**9, "eval_duration": "12"},
            ServerTiming(prefill=1.0, rejected=["load_duration", "eval_duration"]),
        ),
        (
            {"load_duration": True, "prompt_eval_duration": 1e400, "eval_duration": [1]},
            ServerTiming(rejected=["load_duration", "prompt_eval_duration", "eval_duration"]),
        ),
        ({"load_duration": 10**400}, ServerTiming(rejected=["load_duration"])),
        ({"load_duration": None, "eval_duration": 0}, ServerTiming(decode=0.0)),
        ({"total_duration": 5}, None),
    ],
)
def test_ollama_bad_durations_are_rejected_never_negative(metrics: dict[str, Any], timing: ServerTiming | None) -> None:
    line = json.dumps({"model": "m", "message": {"content": ""}, "done": True, **metrics}).replace("Infinity", "1e400")
    facts = CHAT.stream_parser().feed(Event("", line))
    assert facts is not None and facts.server_timing == timing
    assert CHAT.parse_body(line.encode()).server_timing == timing


def test_ollama_bad_counts_are_dropped() -> None:
    facts = CHAT.parse_body(
        b'{"done": true, "prompt_eval_count": -3, "eval_count": "7", "prompt_eval_cached_count": 2}'
    )
    assert facts.usage == Usage(cache_read_tokens=2)


def test_ollama_inspect_chat() -> None:
    request = {
        "model": "llama3.2",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
        "options": {"num_predict": 64, "temperature": 0.2, "top_p": 0.9, "top_k": 40, "seed": 7, "stop": ["\n\n"]},
    }
    info = CHAT.inspect(json.dumps(request).encode(), inject_usage=True, path="/api/chat")
    assert (info.operation, info.model, info.stream, info.rewritten_body) == ("chat", "llama3.2", True, None)
    assert info.params == {
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop_sequences": ["\n\n"],
    }
    assert info.prompt_text == "Be brief.\nWhy is the sky blue?"
    # Ollama streams unless told not to: absent and null stream, only false does not.
    assert CHAT.inspect(b'{"model": "m", "stream": null}', inject_usage=False).stream
    assert not CHAT.inspect(b'{"model": "m", "stream": false}', inject_usage=False).stream
    # num_predict -1 means "no limit" to Ollama: not a max_tokens.
    assert CHAT.inspect(b'{"options": {"num_predict": -1}}', inject_usage=False).params == {}


def test_ollama_inspect_generate() -> None:
    info = GENERATE.inspect(
        b'{"model": "qwen3", "system": "S", "prompt": "2 + 2?", "stream": false}', inject_usage=True
    )
    assert (info.operation, info.model, info.stream, info.prompt_text) == (
        "text_completion",
        "qwen3",
        False,
        "S\n2 + 2?",
    )


# Gemini.

GEMINI_USAGE = Usage(input_tokens=1037, output_tokens=34, cache_read_tokens=1024, reasoning_tokens=22)


@pytest.mark.parametrize("name", ["stream-sse", "stream-array"])
def test_gemini_stream(name: str) -> None:
    results = run(GEMINI, f"gemini/{name}")
    assert len(results) == 3
    first = results[0]
    assert first is not None and first.has_content and first.content == "The sky appears blue" and not first.done
    # usageMetadata is cumulative: every chunk's output is the count so far, never a delta to add.
    assert [f.usage.output_tokens for f in results if f is not None and f.usage] == [26, 31, 34]
    total = fold(results)
    assert total.content == "The sky appears blue because air scatters short wavelengths more."
    assert total.usage == GEMINI_USAGE
    assert total.finish_reasons == ["STOP"] and total.done
    assert (total.response_id, total.response_model) == ("Xb8tad-KDpOq1MkP0Ju2wQg", "gemini-2.5-flash")


def test_gemini_sse_array_and_whole_agree() -> None:
    sse, array = fold(run(GEMINI, "gemini/stream-sse")), fold(run(GEMINI, "gemini/stream-array"))
    whole = GEMINI.parse_body(body("gemini/nonstream"))
    assert telemetry_view(sse) == telemetry_view(array) == telemetry_view(whole)
    assert whole.usage == GEMINI_USAGE and whole.has_content
    # A streamed array read whole (the tap could not tell it was a stream) folds to the same.
    assert telemetry_view(GEMINI.parse_body(body("gemini/stream-array"))) == telemetry_view(array)


def test_vertex_counts_only_on_the_last_chunk() -> None:
    results = run(VERTEX, "gemini/vertex-stream-sse")
    assert [f.usage for f in results if f is not None] == [None, None, Usage(input_tokens=8, output_tokens=7)]
    assert fold(results).content == "Paris is the capital of France."


def test_gemini_error_body_and_error_in_the_array() -> None:
    facts = GEMINI.parse_body(body("gemini/error-invalid-argument"))
    assert facts.error_type == "INVALID_ARGUMENT" and facts.error_message is not None
    error = {"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}}
    chunk = {"candidates": [{"content": {"parts": [{"text": "Hi"}]}}]}
    total = fold(parse(GEMINI, json.dumps([chunk, error]).encode()))
    assert (total.content, total.error_type, total.error_message) == ("Hi", "UNAVAILABLE", "The model is overloaded.")
    assert GEMINI.parse_body(b'{"error": {"code": 429}}').error_type == "429"


def test_gemini_parts() -> None:
    parts = [
        {"text": "plan", "thought": True},
        {"thoughtSignature": "c2ln"},
        {"functionCall": {"name": "f", "args": {"q": 1}}},
        {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
        {"inlineData": {"mimeType": "image/png", "data": "AA=="}},
    ]
    facts = GEMINI.parse_body(
        json.dumps({"candidates": [{"content": {"parts": parts}, "finishReason": "STOP"}]}).encode()
    )
    assert facts.content == 'plan{"q": 1}print(1)' and facts.finish_reasons == ["STOP"]
    signature_only = {"candidates": [{"content": {"parts": [{"thoughtSignature": "c2ln"}]}}]}
    assert not GEMINI.parse_body(json.dumps(signature_only).encode()).has_content


def test_gemini_usage_fields_arrive_separately_and_are_not_summed() -> None:
    parser = GEMINI.stream_parser()
    feed = [
        {"usageMetadata": {"promptTokenCount": 10, "thoughtsTokenCount": 5}},
        {"usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 3}},
        {"usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 3, "toolUsePromptTokenCount": 4}},
    ]
    usages = [f.usage for f in (parser.feed(Event("", json.dumps(c))) for c in feed) if f is not None]
    assert usages == [
        Usage(input_tokens=10, output_tokens=5, reasoning_tokens=5),
        Usage(input_tokens=10, output_tokens=8, reasoning_tokens=5),
        Usage(input_tokens=14, output_tokens=8, reasoning_tokens=5),
    ]


def test_gemini_inspect() -> None:
    request = {
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "Weather?"}]},
            {"role": "model", "parts": [{"functionCall": {"name": "w", "args": {"city": "Paris"}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "w", "response": {"t": 21}}}]},
        ],
        "tools": [{"functionDeclarations": [{"name": "w"}]}],
        "generationConfig": {
            "maxOutputTokens": 256,
            "temperature": 0.5,
            "topP": 0.95,
            "topK": 40,
            "seed": 3,
            "stopSequences": ["END"],
            "candidateCount": 2,
        },
    }
    path = "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    info = GEMINI.inspect(json.dumps(request).encode(), inject_usage=True, path=path)
    assert (info.operation, info.model, info.stream, info.rewritten_body) == (
        "generate_content",
        "gemini-2.5-flash",
        True,
        None,
    )
    assert info.params == {
        "max_tokens": 256,
        "temperature": 0.5,
        "top_p": 0.95,
        "top_k": 40,
        "seed": 3,
        "stop_sequences": ["END"],
        "choice.count": 2,
    }
    tools = json.dumps(request["tools"])
    assert info.prompt_text == f'Be brief.\nWeather?\n{{"city": "Paris"}}\n{{"t": 21}}\n{tools}'
    snake = {
        "generation_config": {"max_output_tokens": 9, "top_k": 2},
        "system_instruction": {"parts": [{"text": "s"}]},
    }
    info = GEMINI.inspect(json.dumps(snake).encode(), inject_usage=True, path="/v1beta/models/g:generateContent")
    assert (info.stream, info.params, info.prompt_text) == (False, {"max_tokens": 9, "top_k": 2}, "s")
    # A body that is not JSON still has a model and a stream flag: they are in the path.
    info = GEMINI.inspect(b"{", inject_usage=True, path=path)
    assert (info.model, info.stream, info.parse_error) == ("gemini-2.5-flash", True, "invalid_json")


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/v1beta/models/gemini-2.5-flash:generateContent", "gemini-2.5-flash"),
        (
            "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.0-flash-001:streamGenerateContent",
            "gemini-2.0-flash-001",
        ),
        ("/v1beta/tunedModels/my-tuned:generateContent", "my-tuned"),
        ("/v1/projects/p/locations/l/endpoints/123:generateContent", None),
        ("/v1beta/models/:generateContent", None),
        ("/v1beta/models", None),
        ("", None),
    ],
)
def test_model_from_path(path: str, model: str | None) -> None:
    assert model_from_path(path) == model


@pytest.mark.parametrize(
    ("method", "path", "family"),
    [
        ("POST", "/api/chat", "ollama"),
        ("POST", "/ollama/api/generate", "ollama"),
        ("POST", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", "gcp.gemini"),
        ("POST", "/v1beta/models/gemini-2.5-flash:generateContent", "gcp.gemini"),
        ("POST", "/v1/projects/p/locations/l/publishers/google/models/g:generateContent", "gcp.vertex_ai"),
        ("POST", "/v1beta/models/gemini-2.5-flash:countTokens", None),
        ("POST", "/api/tags", None),
        ("GET", "/api/chat", None),
    ],
)
def test_registry(method: str, path: str, family: str | None) -> None:
    provider = provider_for(method, path)
    assert (provider.family if provider else None) == family


# Fuzz: nothing a server sends may raise, and nothing parsed may be negative or not finite.

_KEYS = [
    "model",
    "message",
    "content",
    "thinking",
    "response",
    "tool_calls",
    "function",
    "arguments",
    "done",
    "done_reason",
    "error",
    "prompt_eval_count",
    "prompt_eval_cached_count",
    "eval_count",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
    "candidates",
    "parts",
    "text",
    "functionCall",
    "args",
    "finishReason",
    "usageMetadata",
    "promptTokenCount",
    "candidatesTokenCount",
    "cachedContentTokenCount",
    "thoughtsTokenCount",
    "toolUsePromptTokenCount",
    "responseId",
    "modelVersion",
    "status",
    "code",
]
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["STOP", "stop", ""])
)
JSONISH = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5),
    max_leaves=25,
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).replace("NaN", "1e999").replace("Infinity", "1e999").encode()


def assert_sane(facts: Facts | None) -> None:
    if facts is None:
        return
    if facts.usage is not None:
        for value in (
            facts.usage.input_tokens,
            facts.usage.output_tokens,
            facts.usage.cache_read_tokens,
            facts.usage.reasoning_tokens,
        ):
            assert value is None or (isinstance(value, int) and value >= 0)
    if facts.server_timing is not None:
        for phase in (facts.server_timing.queue, facts.server_timing.prefill, facts.server_timing.decode):
            assert phase is None or (isinstance(phase, float) and math.isfinite(phase) and phase >= 0)


@fuzz
@given(values=st.lists(JSONISH, max_size=4), cut=st.integers(0, 10_000))
def test_fuzz_ollama(values: list[Any], cut: int) -> None:
    raw = b"\n".join(_dumps(v) for v in values)
    for provider in (CHAT, GENERATE):
        for facts in parse(provider, raw, [raw[:cut], raw[cut:]], NDJSONDecoder()):
            assert_sane(facts)
        assert_sane(provider.parse_body(raw))
        provider.inspect(raw, inject_usage=True, path="/api/chat")


@fuzz
@given(values=st.lists(JSONISH, max_size=4), cut=st.integers(0, 10_000), sse=st.booleans())
def test_fuzz_gemini(values: list[Any], cut: int, sse: bool) -> None:
    if sse:
        raw = b"".join(b"data: " + _dumps(v) + b"\r\n\r\n" for v in values)
        decoder: Decoder = SSEDecoder()
    else:
        raw, decoder = _dumps(values), JSONArrayDecoder()
    for facts in parse(GEMINI, raw, [raw[:cut], raw[cut:]], decoder):
        assert_sane(facts)
    assert_sane(GEMINI.parse_body(raw))
    GEMINI.inspect(raw, inject_usage=True, path="/v1beta/models/m:streamGenerateContent")


@fuzz
@given(raw=st.binary(max_size=300))
def test_fuzz_bytes(raw: bytes) -> None:
    for provider in (CHAT, GEMINI):
        for decoder in (NDJSONDecoder(), SSEDecoder(), JSONArrayDecoder()):
            for facts in parse(provider, raw, None, decoder):
                assert_sane(facts)
        assert_sane(provider.parse_body(raw))
        provider.inspect(raw, inject_usage=True, path=":")


# Through the proxy, on real sockets: the path reaches inspect, and the framing reaches the tap.


class Replay:
    """An upstream that answers every POST with one transcript, sent in ``pieces`` a little apart."""

    def __init__(self, name: str, separator: bytes) -> None:
        self.name = name
        raw = body(name)
        self.pieces = [piece + separator for piece in raw.split(separator)]
        self.pieces[-1] = self.pieces[-1].removesuffix(separator)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        status = int((TRANSCRIPTS / f"{self.name}.headers").read_text().split()[1])
        headers = [(b"content-type", content_type(self.name).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for piece in self.pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(0.02)  # separate reads at the proxy, as tokens arrive from a real server
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def through_proxy(
    proxy_factory: Any, telemetry: Telemetry, replay: Replay, path: str, request: dict[str, Any]
) -> tuple[bytes, ReadableSpan, list[ReadableSpan]]:
    with ServerThread(replay, lifespan="off") as upstream:
        # Every request keeps its chunk spans (read below).
        running = proxy_factory(
            build({"upstream": upstream.url, "read_timeout": 5, "chunk_detail_sample": 1.0}, env={})
        )
        response = httpx.post(running.url + path, json=request, timeout=10)
        running.flush()
    roots = [s for s in telemetry.finished() if sc.ROUTE in (s.attributes or {})]
    assert len(roots) == 1
    root = roots[0]
    chunks = [s for s in telemetry.finished() if s.name == sc.SPAN_CHUNK]
    return response.content, root, chunks


@pytest.mark.e2e
def test_ollama_through_the_proxy(proxy_factory: Any, telemetry: Telemetry) -> None:
    request = {"model": "llama3.2", "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    content, root, chunks = through_proxy(
        proxy_factory, telemetry, Replay("ollama/chat-stream", b"\n"), "/api/chat", request
    )
    assert content == body("ollama/chat-stream")
    attrs = root.attributes or {}
    assert root.name == "chat llama3.2" and attrs[sc.PROVIDER_NAME] == "ollama" and attrs[sc.REQUEST_STREAM] is True
    assert (attrs[sc.USAGE_INPUT_TOKENS], attrs[sc.USAGE_OUTPUT_TOKENS]) == (31, 10)
    assert attrs[sc.RESPONSE_FINISH_REASONS] == ("stop",)
    # The NDJSON was decoded as it came (a body parsed at the end makes one chunk); reads may coalesce.
    assert 2 <= len(chunks) <= 9


@pytest.mark.e2e
def test_gemini_array_stream_through_the_proxy(proxy_factory: Any, telemetry: Telemetry) -> None:
    request = {"contents": [{"role": "user", "parts": [{"text": "Why is the sky blue?"}]}]}
    path = "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    content, root, chunks = through_proxy(
        proxy_factory, telemetry, Replay("gemini/stream-array", b",\r\n"), path, request
    )
    assert content == body("gemini/stream-array")
    attrs = root.attributes or {}
    assert root.name == "generate_content gemini-2.5-flash" and attrs[sc.REQUEST_MODEL] == "gemini-2.5-flash"
    assert attrs[sc.PROVIDER_NAME] == "gcp.gemini" and attrs[sc.REQUEST_STREAM] is True
    assert (attrs[sc.USAGE_INPUT_TOKENS], attrs[sc.USAGE_OUTPUT_TOKENS], attrs[sc.USAGE_CACHE_READ]) == (1037, 34, 1024)
    # The array was decoded element by element as it came, not parsed whole at the end (one chunk).
    assert 2 <= len(chunks) <= 3
