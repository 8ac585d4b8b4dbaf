"""The simulator's answers beyond text, read by the ``openai`` and ``anthropic`` SDKs, streamed and whole.

Chat: a tool call whose arguments stream (``tools`` / ``tool_choice``), ``n`` choices by index, reasoning deltas
(``reasoning_effort``). Messages: a tool_use block with ``input_json_delta``, extended thinking (``thinking_delta``
then ``signature_delta``). Each streamed answer, as the SDK assembles it, equals the whole answer to the same
request, and llmtap, in front, reads each as a successful stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from llmtap.config.types import Route, Settings
from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.parts import ARGUMENT_KEY
from llmtap.telemetry import semconv as sc
from tests.conftest import Telemetry

MODEL = "llmtap-sim"
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CLOCK: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    running = run_in_thread(get_profile("fast"))
    yield running.url
    running.stop()


@pytest.fixture
def chat(sim: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sim + "/v1", api_key="k", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(sim: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=sim, api_key="k", max_retries=0) as client:
        yield client


def test_chat_tool_call_streams_its_arguments_and_equals_the_whole_answer(chat: openai.OpenAI) -> None:
    whole = chat.chat.completions.create(model=MODEL, messages=USER, max_tokens=7, tools=[WEATHER, CLOCK])
    (call,) = whole.choices[0].message.tool_calls or []
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert list(arguments) == [ARGUMENT_KEY] and arguments[ARGUMENT_KEY]
    # A named tool_choice picks that function; the SDK's stream helper assembles the streamed arguments.
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    with chat.chat.completions.stream(
        model=MODEL, messages=USER, max_tokens=7, tools=[WEATHER, CLOCK], tool_choice=named
    ) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls or []
    assert streamed.function.name == "get_time" and len(pieces) == 7  # one piece a token
    assert json.loads(streamed.function.arguments) == arguments  # the same tokens, whole or streamed
    assert final.choices[0].finish_reason == "tool_calls"
    none = chat.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls


def test_chat_n_choices_come_with_their_index(chat: openai.OpenAI) -> None:
    whole = chat.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    stream = chat.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, n=3, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finished[choice.index] = choice.finish_reason or finished.get(choice.index)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 12


def test_chat_reasoning_comes_first_in_its_own_deltas(chat: openai.OpenAI) -> None:
    whole = chat.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, reasoning_effort="low")
    message = whole.choices[0].message
    reasoning = (message.model_extra or {})["reasoning"]
    assert reasoning and message.content
    stream = chat.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, reasoning_effort="low", stream=True)
    kinds, thought, said = [], "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = (delta.model_extra or {}).get("reasoning")
        if extra:
            kinds.append("reasoning")
            thought += extra
        elif delta.content:
            kinds.append("content")
            said += delta.content
    assert kinds == ["reasoning"] * 4 + ["content"] * 4  # half the tokens think, then the answer
    assert (thought, said) == (reasoning, message.content)


def test_messages_thinking_then_tool_use_streamed_equals_whole(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    whole = claude.messages.create(model=MODEL, max_tokens=8, messages=USER, tools=tools, thinking=thinking)
    assert [b.type for b in whole.content] == ["thinking", "tool_use"] and whole.stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=USER, tools=tools, thinking=thinking) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds == ["thinking_delta"] * 4 + ["signature_delta"] + ["input_json_delta"] * 4
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens == 8
    think, use = final.content
    assert think.type == "thinking" and whole.content[0].type == "thinking"
    assert (think.thinking, think.signature) != ("", "")
    assert think.thinking == whole.content[0].thinking
    assert use.type == "tool_use" and whole.content[1].type == "tool_use"
    assert use.name == "get_weather" and use.input == whole.content[1].input
    assert list(use.input) == [ARGUMENT_KEY]


def test_messages_text_answer_is_unchanged_without_tools_or_thinking(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=5, messages=USER) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.stop_reason == "max_tokens"


def test_responses_reasoning_summary_then_function_call_streamed_equals_whole(chat: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    reasoning: Any = {"effort": "low", "summary": "auto"}
    ask: Any = {"model": MODEL, "input": "Weather in Paris?", "max_output_tokens": 8, "tools": tools}
    whole = chat.responses.create(**ask, reasoning=reasoning)
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    with chat.responses.stream(**ask, reasoning=reasoning) as stream:
        kinds = [e.type for e in stream if e.type.endswith(".delta")]
        final = stream.get_final_response()
    assert kinds == ["response.reasoning_summary_text.delta"] * 4 + ["response.function_call_arguments.delta"] * 4
    think, call = final.output
    assert think.type == "reasoning" and whole.output[0].type == "reasoning"
    assert [s.text for s in think.summary] == [s.text for s in whole.output[0].summary] != [""]
    assert call.type == "function_call" and whole.output[1].type == "function_call"
    assert call.name == "get_weather" and json.loads(call.arguments) == json.loads(whole.output[1].arguments)
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 4
    plain = chat.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert [item.type for item in plain.output] == ["message"]


@pytest.mark.e2e
def test_llmtap_reads_every_shape_as_a_whole_stream(sim: str, proxy_factory: Any, telemetry: Telemetry) -> None:
    proxy = proxy_factory(Settings(routes=(Route(prefix="/", upstream=sim, name="r", provider="llmtap-sim"),)))
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with (
        openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0) as client,
        anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0) as claude,
    ):
        list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, tools=[WEATHER], stream=True))
        list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, n=2, stream=True))
        effort = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=6, reasoning_effort="low", stream=True
        )
        list(effort)
        with claude.messages.stream(model=MODEL, max_tokens=6, messages=USER, tools=tools, thinking=thinking) as stream:
            stream.get_final_message()
    proxy.flush()
    roots: list[dict[str, Any]] = [
        dict(s.attributes or {}) for s in telemetry.finished() if sc.ROUTE in (s.attributes or {})
    ]
    assert len(roots) == 4 and not [a for a in roots if sc.ERROR_TYPE in a]
    # Usage is the server's (n = 2 doubles it); the first token is the first content of any kind.
    assert sorted(a[sc.USAGE_OUTPUT_TOKENS] for a in roots) == [6, 6, 6, 12]
    assert all(a[sc.UPSTREAM_TTFT] > 0 for a in roots)
