"""Protocol modules against real vLLM transcripts (tests/transcripts) and named synthetic edge cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from llmtap.providers import (
    PROVIDERS,
    AnthropicMessages,
    OpenAIChat,
    OpenAICompletions,
    OpenAIResponses,
    Provider,
    provider_for,
)
from llmtap.providers.openai_common import load_object
from llmtap.providers.sse import Event, SSEDecoder
from llmtap.types import Facts, Prepared, Usage

TRANSCRIPTS = Path(__file__).parents[1] / "transcripts"
CHAT, COMPLETIONS, RESPONSES, MESSAGES = OpenAIChat(), OpenAICompletions(), OpenAIResponses(), AnthropicMessages()


def body(name: str) -> bytes:
    return (TRANSCRIPTS / f"{name}.body").read_bytes()


def events(raw: bytes) -> list[Event]:
    decoder = SSEDecoder()
    return decoder.feed(raw) + decoder.flush()


def sse(*blocks: tuple[str, Any]) -> bytes:
    """A synthetic SSE body: (event name or '', payload as JSON-able or a raw string) per event."""
    out = []
    for name, payload in blocks:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        out.append((f"event: {name}\n" if name else "") + f"data: {data}\n\n")
    return "".join(out).encode()


def feed_all(provider: Provider, raw: bytes) -> list[Facts | None]:
    parser = provider.stream_parser()
    return [parser.feed(event) for event in events(raw)]


def fold(results: list[Facts | None]) -> Facts:
    """What a timeline makes of a stream: content joined, last usage, every finish reason, first ids."""
    total = Facts()
    for facts in results:
        if facts is None:
            continue
        total.has_content |= facts.has_content
        total.content += facts.content
        total.usage = facts.usage or total.usage
        total.finish_reasons += facts.finish_reasons
        total.response_id = total.response_id or facts.response_id
        total.response_model = total.response_model or facts.response_model
        total.system_fingerprint = total.system_fingerprint or facts.system_fingerprint
        total.error_type = total.error_type or facts.error_type
        total.done |= facts.done
    return total


def first_content(results: list[Facts | None]) -> int:
    return next(i for i, facts in enumerate(results) if facts is not None and facts.has_content)


# Streams: first content, usage, finish reasons, errors.


def test_chat_role_only_first_chunk_is_not_content() -> None:
    results = feed_all(CHAT, body("chat-stream"))
    first = results[0]
    assert first is not None and not first.has_content and first.response_id == "chatcmpl-a4408b88914d15a8"
    index = first_content(results)
    assert index == 1 and results[index] == Facts(
        has_content=True, content=" fname", response_id="chatcmpl-a4408b88914d15a8", response_model="tiny"
    )
    total = fold(results)
    assert total.usage is None and total.finish_reasons == ["length"] and total.done
    assert results[-1] == Facts(done=True)


def test_chat_empty_deltas_are_not_content() -> None:
    def chunk(delta: dict[str, Any]) -> dict[str, Any]:
        return {"id": "c", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    raw = sse(("", chunk({"role": "assistant", "content": ""})), ("", chunk({"content": ""})), ("", chunk({})))
    raw += sse(("", chunk({"content": None, "tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]})))
    raw += sse(("", chunk({"reasoning_content": "hmm"})), ("", chunk({"content": "Hi"})), ("", "[DONE]"))
    results = feed_all(CHAT, raw)
    assert first_content(results) == 4
    assert [f.content for f in results if f is not None and f.has_content] == ["hmm", "Hi"]


def test_chat_content_kinds_reasoning_refusal_tool_arguments() -> None:
    deltas: list[dict[str, Any]] = [
        {"reasoning": "think"},
        {"refusal": "no"},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"function_call": {"arguments": "1}"}},
    ]
    raw = sse(*(("", {"choices": [{"index": 0, "delta": d}]}) for d in deltas))
    assert [f.content for f in feed_all(CHAT, raw) if f is not None] == ["think", "no", '{"a":', "1}"]


def test_chat_usage_chunk_with_empty_choices() -> None:
    results = feed_all(CHAT, body("chat-stream-usage"))
    usage_facts = results[-2]
    assert usage_facts is not None and not usage_facts.has_content
    assert usage_facts.usage == Usage(input_tokens=18, output_tokens=12, cache_read_tokens=0)


def test_continuous_usage_is_cumulative_not_summed() -> None:
    results = feed_all(CHAT, body("chat-stream-continuous-usage"))
    reported = [f.usage.output_tokens for f in results if f is not None and f.usage is not None]
    assert reported == [0, 1, 2, 3, 4, 5, 6, 6]
    assert fold(results).usage == Usage(input_tokens=17, output_tokens=6, cache_read_tokens=0)


def test_cached_tokens_from_the_second_identical_prompt() -> None:
    first, second = (
        fold(feed_all(CHAT, body("chat-stream-cached-1"))),
        fold(feed_all(CHAT, body("chat-stream-cached-2"))),
    )
    assert first.usage == Usage(input_tokens=1413, output_tokens=8, cache_read_tokens=0)
    # vLLM's own prompt_tokens_details.created_cache_tokens is not OpenAI's cache_write_tokens: not mapped.
    assert second.usage == Usage(input_tokens=1413, output_tokens=8, cache_read_tokens=1376)


def test_openai_usage_details_cache_write_and_reasoning() -> None:
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 40,
        "prompt_tokens_details": {"cached_tokens": 60, "cache_write_tokens": 30},
        "completion_tokens_details": {"reasoning_tokens": 25},
    }
    facts = CHAT.stream_parser().feed(Event("", json.dumps({"choices": [], "usage": usage})))
    assert facts is not None and facts.usage == Usage(100, 40, 60, 30, 25)


def test_duplicate_usage_chunks_are_not_added() -> None:
    usage_chunk = {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    raw = sse(("", {"choices": [{"index": 0, "delta": {"content": "x"}}]}), ("", usage_chunk), ("", usage_chunk))
    assert fold(feed_all(CHAT, raw)).usage == Usage(input_tokens=5, output_tokens=7)


def test_completions_stream() -> None:
    results = feed_all(COMPLETIONS, body("completions-stream-usage"))
    assert first_content(results) == 0
    total = fold(results)
    assert total.content == " fnametopliared success remo case////////z(_"
    assert total.usage == Usage(input_tokens=6, output_tokens=10, cache_read_tokens=0)
    assert total.finish_reasons == ["length"] and total.response_model == "tiny" and total.done


def test_responses_stream() -> None:
    raw = body("responses-stream")
    results = feed_all(RESPONSES, raw)
    assert events(raw)[0].event == "response.created"
    created = results[0]
    assert created == Facts(response_id="resp_86951a11ba01e00a", response_model="tiny")
    assert first_content(results) == 4 and results[1:4] == [
        Facts(response_id="resp_86951a11ba01e00a", response_model="tiny"),
        None,
        None,
    ]
    final = results[-1]
    assert final is not None and final.done and not final.has_content
    assert final.usage == Usage(
        input_tokens=19, output_tokens=8, cache_read_tokens=0, cache_write_tokens=0, reasoning_tokens=0
    )
    assert final.finish_reasons == ["max_output_tokens"]
    assert fold(results).content == " ================= standard bytes999stant).ctorating"


def test_responses_reasoning_and_tool_deltas_are_content() -> None:
    parser = RESPONSES.stream_parser()
    for kind in ("reasoning_text", "reasoning_summary_text", "function_call_arguments", "refusal"):
        facts = parser.feed(
            Event(f"response.{kind}.delta", json.dumps({"type": f"response.{kind}.delta", "delta": "d"}))
        )
        # Reasoning ends TTFT, not the time to the first output token.
        assert facts == Facts(has_content=True, content="d", reasoning=kind.startswith("reasoning"))
    added = {"type": "response.output_item.added", "item": {"type": "message"}}
    assert parser.feed(Event("response.output_item.added", json.dumps(added))) is None


def test_responses_in_band_errors() -> None:
    parser = RESPONSES.stream_parser()
    error = parser.feed(Event("error", json.dumps({"type": "error", "code": "server_error", "message": "boom"})))
    assert error is not None and (error.error_type, error.error_message) == ("server_error", "boom")
    failed = {
        "type": "response.failed",
        "response": {"id": "r", "status": "failed", "error": {"code": "rate_limit_exceeded", "message": "slow"}},
    }
    facts = parser.feed(Event("response.failed", json.dumps(failed)))
    assert (
        facts is not None
        and facts.done
        and facts.error_type == "rate_limit_exceeded"
        and facts.finish_reasons == ["failed"]
    )


def test_anthropic_stream_without_ping() -> None:
    results = feed_all(MESSAGES, body("messages-stream"))
    start = results[0]
    assert start is not None and not start.has_content and start.usage == Usage(input_tokens=17, output_tokens=0)
    assert results[1] is None  # content_block_start
    assert first_content(results) == 2
    total = fold(results)
    assert total.usage == Usage(input_tokens=17, output_tokens=8, cache_read_tokens=0, cache_write_tokens=0)
    assert total.finish_reasons == ["max_tokens"] and total.response_id == "chatcmpl-b93774dfd8101957" and total.done


def test_anthropic_ping_anywhere_changes_nothing() -> None:
    raw = body("messages-stream")
    blocks = raw.split(b"\n\n")
    ping = b'event: ping\ndata: {"type": "ping"}'
    with_pings = b"\n\n".join([blocks[0], ping, *blocks[1:4], ping, *blocks[4:]])
    plain, pinged = feed_all(MESSAGES, raw), feed_all(MESSAGES, with_pings)
    assert len(pinged) == len(plain) + 2 and pinged[1] is None and pinged[5] is None
    assert fold(pinged) == fold(plain) and first_content(pinged) == first_content(plain) + 1


def test_anthropic_error_event_after_200() -> None:
    start = {"type": "message_start", "message": {"id": "msg_1", "model": "claude", "usage": {"input_tokens": 3}}}
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    total = fold(feed_all(MESSAGES, sse(("message_start", start), ("content_block_delta", delta), ("error", error))))
    assert (total.error_type, total.content, total.done) == ("overloaded_error", "Hel", False)


def test_anthropic_cache_sums_and_cumulative_replace() -> None:
    cached = {"input_tokens": 10, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}
    start = {"type": "message_start", "message": {"id": "m", "usage": {**cached, "output_tokens": 1}}}
    first_delta = {"type": "message_delta", "delta": {"stop_reason": None}, "usage": {"output_tokens": 30}}
    last_delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {**cached, "output_tokens": 50},
    }
    results = feed_all(
        MESSAGES, sse(("message_start", start), ("message_delta", first_delta), ("message_delta", last_delta))
    )
    expected = Usage(input_tokens=130, output_tokens=50, cache_read_tokens=100, cache_write_tokens=20)
    middle = results[1]
    assert middle is not None and middle.usage == Usage(130, 30, 100, 20)
    assert fold(results).usage == expected and fold(results).finish_reasons == ["end_turn"]


def test_anthropic_delta_kinds() -> None:
    parser = MESSAGES.stream_parser()
    kinds = {"thinking_delta": "thinking", "input_json_delta": "partial_json", "signature_delta": "signature"}
    got = [
        parser.feed(Event("content_block_delta", json.dumps({"delta": {"type": t, k: "v"}}))) for t, k in kinds.items()
    ]
    assert got == [Facts(has_content=True, content="v", reasoning=True), Facts(has_content=True, content="v"), None]
    block_start = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert parser.feed(Event("content_block_start", json.dumps(block_start))) is None
    assert parser.feed(Event("future_event", "{}")) is None
    assert parser.feed(Event("message_stop", '{"type": "message_stop"}')) == Facts(done=True)


def test_openai_in_band_error() -> None:
    for provider in (CHAT, COMPLETIONS):
        facts = provider.stream_parser().feed(
            Event("", '{"error": {"message": "boom", "type": "server_error", "code": null}}')
        )
        assert facts is not None and (facts.error_type, facts.error_message) == ("server_error", "boom")


HOSTILE = [
    "[" * 100_000,
    "1" * 5000,
    '{"usage": {"prompt_tokens": 1e999, "completion_tokens": 99999999999999999999999}}',
    "[1, 2]",
    '"text"',
    "null",
    "{",
    "\udcff",
]


@pytest.mark.parametrize("provider", PROVIDERS, ids=lambda p: p.name)
def test_hostile_json_never_raises(provider: Provider) -> None:
    parser = provider.stream_parser()
    for data in HOSTILE:
        facts = parser.feed(Event("message_delta", data))
        assert facts is None or facts.usage is None
        assert provider.parse_body(data.encode("utf-8", "surrogateescape")).usage is None
        info = provider.inspect(data.encode("utf-8", "surrogateescape"), inject_usage=True)
        assert info.rewritten_body is None
    assert parser.malformed == len(HOSTILE) - 1  # the usage object parses; its values are just rejected
    assert provider.inspect(b"{", inject_usage=True).parse_error == "invalid_json"
    assert provider.inspect(b"[]", inject_usage=True).parse_error == "not_an_object"


# Non-streamed bodies: the same facts as the stream (STYLE habit 5).


def test_chat_streamed_equals_non_streamed() -> None:
    streamed, whole = fold(feed_all(CHAT, body("chat-stream-usage"))), CHAT.parse_body(body("chat-nonstream"))
    assert whole.usage == streamed.usage == Usage(input_tokens=18, output_tokens=12, cache_read_tokens=0)
    assert (whole.finish_reasons, whole.response_model, whole.content) == (
        streamed.finish_reasons,
        streamed.response_model,
        streamed.content,
    )
    # openai.response.system_fingerprint: vLLM sends it in the whole body and in the stream's usage chunk.
    assert whole.system_fingerprint == streamed.system_fingerprint == "vllm-0.32.0-358ce51c"
    assert whole.has_content and not whole.done


def test_completions_streamed_equals_non_streamed() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
    common = {"id": "cmpl-1", "object": "text_completion", "model": "m"}
    whole = {**common, "choices": [{"index": 0, "text": "a b c", "finish_reason": "stop"}], "usage": usage}
    chunks = [
        {**common, "choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {**common, "choices": [{"index": 0, "text": " b c", "finish_reason": "stop"}]},
        {**common, "choices": [], "usage": usage},
    ]
    streamed = fold(feed_all(COMPLETIONS, sse(*(("", c) for c in chunks), ("", "[DONE]"))))
    parsed = COMPLETIONS.parse_body(json.dumps(whole).encode())
    assert (parsed.content, parsed.usage, parsed.finish_reasons, parsed.response_id) == (
        streamed.content,
        streamed.usage,
        streamed.finish_reasons,
        streamed.response_id,
    )


def test_responses_streamed_equals_non_streamed() -> None:
    streamed, whole = (
        fold(feed_all(RESPONSES, body("responses-stream"))),
        RESPONSES.parse_body(body("responses-nonstream")),
    )
    assert whole.usage == streamed.usage and whole.usage is not None and whole.usage.input_tokens == 19
    assert (whole.finish_reasons, whole.response_model) == (streamed.finish_reasons, streamed.response_model)
    assert whole.content == " most copystract documentationresponseJarchiveted"


def test_messages_streamed_equals_non_streamed() -> None:
    streamed, whole = fold(feed_all(MESSAGES, body("messages-stream"))), MESSAGES.parse_body(body("messages-nonstream"))
    assert (
        whole.usage
        == streamed.usage
        == Usage(input_tokens=17, output_tokens=8, cache_read_tokens=0, cache_write_tokens=0)
    )
    assert (whole.finish_reasons, whole.response_model) == (streamed.finish_reasons, streamed.response_model)
    assert whole.content == 'giddelimpedversal["ams Not av'


@pytest.mark.parametrize(
    ("name", "error_type"),
    [
        ("error-unknown-model", "NotFoundError"),
        ("error-too-long", "BadRequestError"),
        ("error-bad-json", "Bad Request"),
    ],
)
def test_vllm_error_bodies(name: str, error_type: str) -> None:
    for provider in PROVIDERS:
        facts = provider.parse_body(body(name))
        assert facts.error_type == error_type and facts.error_message


def test_anthropic_error_body() -> None:
    facts = MESSAGES.parse_body(b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}')
    assert (facts.error_type, facts.error_message) == ("overloaded_error", "Overloaded")


# Requests: inspect.


def request(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize("provider", [CHAT, COMPLETIONS], ids=lambda p: p.name)
def test_usage_injected_when_absent(provider: Provider) -> None:
    info = provider.inspect(request(stream=True), inject_usage=True)
    assert info.stream and info.strip_usage and info.rewritten_body is not None
    assert json.loads(info.rewritten_body)["stream_options"] == {"include_usage": True}
    # Spliced, not re-serialized: the client's bytes as sent, then the option before the closing brace.
    sent = request(stream=True)
    assert info.rewritten_body == sent[:-1] + b',"stream_options":{"include_usage":true}}'
    assert provider.prepare(sent, inject_usage=True) == Prepared(info.rewritten_body, True)


def test_usage_not_injected_when_asked_not_streamed_or_disabled() -> None:
    asked = CHAT.inspect(request(stream=True, stream_options={"include_usage": True}), inject_usage=True)
    whole = CHAT.inspect(request(), inject_usage=True)
    disabled = CHAT.inspect(request(stream=True), inject_usage=False)
    for info in (asked, whole, disabled):
        assert info.rewritten_body is None and not info.strip_usage
    assert asked.stream and not whole.stream


def test_injection_keeps_other_stream_options() -> None:
    options = {"include_usage": False, "include_obfuscation": False, "continuous_usage_stats": True}
    info = CHAT.inspect(request(stream=True, stream_options=options), inject_usage=True)
    assert info.rewritten_body is not None
    sent = json.loads(info.rewritten_body)
    # continuous_usage_stats had no effect without include_usage (vLLM), so it must not start now.
    assert sent["stream_options"] == {
        "include_usage": True,
        "include_obfuscation": False,
        "continuous_usage_stats": False,
    }
    assert sent["messages"] == [{"role": "user", "content": "hi"}]


def test_body_that_cannot_be_reserialised_is_spliced_as_sent() -> None:
    # 1e999 parses to inf and a lone surrogate cannot be UTF-8: re-serialising either would corrupt the
    # request, but splicing leaves the client's spelling of them alone.
    for raw in (b'{"stream": true, "temperature": 1e999}', b'{"stream": true, "user": "\\ud800"}'):
        info = CHAT.inspect(raw, inject_usage=True)
        assert info.stream and info.strip_usage and info.parse_error is None
        assert info.rewritten_body == raw[:-1] + b',"stream_options":{"include_usage":true}}'


def test_chat_params_and_prompt_text() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:x"}}],
        },
        {"role": "assistant", "tool_calls": [{"id": "t", "function": {"name": "f", "arguments": '{"q":1}'}}]},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    fields = {
        "max_tokens": 9,
        "max_completion_tokens": 20,
        "temperature": 0.5,
        "top_p": 1,
        "stop": "END",
        "seed": 7,
        "n": 2,
    }
    info = CHAT.inspect(
        request(messages=messages, tools=tools, presence_penalty=0.1, frequency_penalty=True, **fields),
        inject_usage=False,
    )
    assert (info.operation, info.model) == ("chat", "m")
    assert info.params == {
        "max_tokens": 20,
        "temperature": 0.5,
        "top_p": 1.0,
        "presence_penalty": 0.1,
        "seed": 7,
        "stop_sequences": ["END"],
        "choice.count": 2,
    }
    assert info.prompt_text == 'Be brief.\nLook:\n{"q":1}\n' + json.dumps(tools)
    assert "n" not in CHAT.inspect(request(n=1), inject_usage=False).params


def test_completions_and_responses_inspect() -> None:
    info = COMPLETIONS.inspect(b'{"model":"m","prompt":["a","b"],"max_tokens":5,"stop":["x","y"]}', inject_usage=False)
    assert (info.operation, info.prompt_text, info.params) == (
        "text_completion",
        "a\nb",
        {"max_tokens": 5, "stop_sequences": ["x", "y"]},
    )
    raw = b'{"model":"m","stream":true,"instructions":"sys","input":"q","max_output_tokens":8}'
    info = RESPONSES.inspect(raw, inject_usage=True)
    assert (info.operation, info.stream, info.prompt_text, info.params) == ("chat", True, "sys\nq", {"max_tokens": 8})
    assert info.rewritten_body is None and not info.strip_usage


def test_anthropic_params_and_prompt_text() -> None:
    raw = {
        "model": "claude",
        "stream": True,
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["\n\nHuman:"],
        "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}],
            },
        ],
    }
    info = MESSAGES.inspect(json.dumps(raw).encode(), inject_usage=True)
    assert (info.operation, info.model, info.stream, info.rewritten_body) == ("chat", "claude", True, None)
    assert info.params == {
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["\n\nHuman:"],
    }
    assert info.prompt_text == 'sys\nq\n{"a": 1}\nr'


# The registry.


@pytest.mark.parametrize(
    ("method", "path", "name"),
    [
        ("POST", "/v1/chat/completions", "openai_chat"),
        ("POST", "/openai/v1/chat/completions/", "openai_chat"),
        ("post", "/v1/completions?x=1", "openai_completions"),
        ("POST", "/v1/responses", "openai_responses"),
        ("POST", "/anthropic/v1/messages", "anthropic"),
        ("POST", "/v1/threads/th_1/messages", None),
        ("POST", "/v1/messages/count_tokens", None),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/embeddings", "openai_embeddings"),
        ("POST", "/api/embed", "ollama_embed"),
        ("POST", "/api/embeddings", "ollama_embed"),
        ("GET", "/v1/embeddings", None),
    ],
)
def test_provider_for(method: str, path: str, name: str | None) -> None:
    provider = provider_for(method, path)
    assert (provider.name if provider else None) == name


def test_provider_identity() -> None:
    assert [(p.name, p.family, p.framing) for p in PROVIDERS] == [
        ("openai_chat", "openai", "sse"),
        ("openai_completions", "openai", "sse"),
        ("openai_responses", "openai", "sse"),
        ("anthropic", "anthropic", "sse"),
        ("ollama_chat", "ollama", "ndjson"),
        ("ollama_generate", "ollama", "ndjson"),
        ("gemini", "gcp.gemini", "json-array"),
        ("gemini", "gcp.vertex_ai", "json-array"),
        ("ollama_embed", "ollama", "ndjson"),
        ("openai_embeddings", "openai", "sse"),
    ]


# --- parsing a chunk's JSON ---------------------------------------------------------------------------------------


def _reference_load(raw: str) -> tuple[Any, str | None]:
    """What ``load_object`` gives, by ``json.loads`` alone (the scanner it calls first must agree)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        return None, "too_deep"
    except ValueError:
        return None, "invalid_json"
    return (value, None) if isinstance(value, dict) else (None, "not_an_object")


JSON_PIECES = ["{", "}", '"a"', ":", ",", "1", "[", "]", "null", "NaN", '"\\u00e9"', '"\\ud800"', " ", "\n", "\ufeff"]
JSON_PIECES += ['"', "\\", "1e999", "-0", "tru", "true", "9" * 5000]


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.lists(st.sampled_from(JSON_PIECES), max_size=40).map("".join),
        st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5) | st.none(), max_size=5).map(
            json.dumps
        ),
        st.tuples(
            st.dictionaries(st.text(max_size=3), st.integers(), max_size=3), st.sampled_from(["", " ", "x", "}"])
        ).map(lambda t: json.dumps(t[0]) + t[1]),
    )
)
def test_a_chunks_json_parses_as_json_loads_says(raw: str) -> None:
    """The scanner called directly for a text starting with ``{`` gives what ``json.loads`` gives, reason included:
    trailing text, whitespace, deep nesting, huge integers, lone surrogates, a byte-order mark."""
    assert load_object(raw) == _reference_load(raw)


def test_deep_nesting_is_too_deep_not_a_crash() -> None:
    raw = '{"a":' * 100_000 + "1" + "}" * 100_000
    assert load_object(raw) == (None, "too_deep")
