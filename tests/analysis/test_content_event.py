"""The opt-in content event ``gen_ai.client.inference.operation.details``: rules per field, a bound, never on by
accident; end to end, ``llmtap serve`` in front of the simulator exports it to a real OTLP/HTTP receiver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmtap.analysis.content import bound, content_of, digest
from llmtap.analysis.timeline import Output, Timeline
from llmtap.config.load import build
from llmtap.config.types import ConfigError
from llmtap.providers.anthropic import AnthropicMessages
from llmtap.telemetry import semconv as sc
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.procs import Llmtap, Simulator
from tests.telemetry.test_metrics_standard import otlp_env, wait_for

SYSTEM_TEXT = "You are terse."
USER_TEXT = "Name three rivers."


def anthropic_timeline(output: str) -> Timeline:
    """A finished Anthropic request with a system prompt, one user message and ``output``."""
    tl = Timeline(
        method="POST",
        path="/v1/messages",
        route="default",
        upstream="",
        server_address="",
        server_port=0,
        protocol="anthropic",
        provider_name="anthropic",
        received=0.0,
        received_wall_ns=0,
    )
    body = {"model": "m", "system": SYSTEM_TEXT, "messages": [{"role": "user", "content": USER_TEXT}]}
    tl.request = AnthropicMessages().inspect(json.dumps(body).encode(), inject_usage=False)
    tl.output = Output("o200k_base", keep=len(output))
    tl.output.add(output)
    tl.finish_reasons = ["end_turn"]
    return tl


def test_each_field_follows_its_rule() -> None:
    tl = anthropic_timeline("Nile, Amazon, Yangtze.")
    got = content_of(tl, (("system", "hash"), ("input", "keep"), ("output", "keep")), 4096)
    assert got.values == {
        "system": digest([{"type": "text", "content": SYSTEM_TEXT}]),
        "input": [{"role": "user", "parts": [{"type": "text", "content": USER_TEXT}]}],
        "output": [
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": "Nile, Amazon, Yangtze."}],
                "finish_reason": "end_turn",
            }
        ],
    }
    assert got.cut == []
    assert got.values["system"].startswith("sha256:") and SYSTEM_TEXT not in got.values["system"]
    # Dropped, or not named: absent.
    assert content_of(tl, (("input", "drop"),), 4096).values == {}
    assert content_of(tl, (), 4096).values == {}


def test_a_long_field_is_cut_to_the_bound_and_said() -> None:
    tl = anthropic_timeline("é" * 10_000)  # two bytes each in UTF-8
    got = content_of(tl, (("input", "keep"), ("output", "keep")), 512)
    assert got.cut == ["output"]
    out = got.values["output"]
    size = len(json.dumps(out, ensure_ascii=False).encode())
    assert 400 < size <= 512  # cut near the bound, never past it
    assert out[0]["parts"][0]["content"] == "é" * len(out[0]["parts"][0]["content"])
    # Many messages: whole ones while they fit, the first that does not shortened, none after it.
    messages = [{"role": "user", "parts": [{"type": "text", "content": "x" * 100}]} for _ in range(10)]
    kept, cut = bound(messages, 600)
    assert cut and 1 < len(kept) < 10 and len(json.dumps(kept).encode()) <= 600
    assert kept[:-1] == messages[: len(kept) - 1]
    assert bound(messages, 10_000) == (messages, False)


def test_the_event_is_never_on_by_accident() -> None:
    base = {"upstream": "http://127.0.0.1:1"}
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert not build(base, env=env).content.on
    # OpenTelemetry's own content variable puts content on spans; it does not turn the event on.
    assert not build(base, env={**env, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "EVENT_ONLY"}).content.on
    on = build({**base, "content_event": "input=keep,output=hash"}, env=env).content
    assert on.on and on.rules == (("input", "keep"), ("output", "hash"))
    with pytest.raises(ConfigError, match="FIELD=RULE"):
        build({**base, "content_event": "input=redact"}, env=env)
    with pytest.raises(ConfigError, match="FIELD=RULE"):
        build({**base, "content_event": "prompt=keep"}, env=env)


@pytest.fixture(scope="module")
def simulator() -> Iterator[Simulator]:
    sim = Simulator()
    yield sim
    sim.close()


def _chat(proxy: Llmtap) -> None:
    body = {
        "model": "llmtap-sim",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": USER_TEXT}],
    }
    with proxy.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        r.read()


def _events(receiver: HTTPReceiver, name: str) -> list[tuple[Any, dict[str, Any]]]:
    return [(lr, attributes(lr.attributes)) for lr in receiver.received.log_records() if lr.event_name == name]


@pytest.mark.e2e
def test_the_event_reaches_a_real_receiver_only_when_named(simulator: Simulator, tmp_path: Path) -> None:
    receiver = HTTPReceiver()
    env = otlp_env(receiver, OTEL_BLRP_SCHEDULE_DELAY="50", OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true")
    try:
        # Default settings, content capture on for spans, the records' log records on: no content event.
        proxy = Llmtap(simulator.url, tmp_path / "off.log", "--record-logs", "true", env=env)
        try:
            _chat(proxy)
            wait_for("the request's record log record", lambda: bool(_events(receiver, "llmtap.request")), proxy)
            proxy.client.post("/v1/chat/completions", json={"model": "x"})  # a second request, a later batch
            wait_for("two record log records", lambda: len(_events(receiver, "llmtap.request")) == 2, proxy)
        finally:
            proxy.close()
        assert _events(receiver, sc.EVENT_OPERATION_DETAILS) == []

        proxy = Llmtap(
            simulator.url,
            tmp_path / "on.log",
            "--content-event",
            "system=hash,input=keep,output=keep",
            "--content-event-max-bytes",
            "512",
            env=env,
        )
        try:
            _chat(proxy)
            wait_for("the content event", lambda: bool(_events(receiver, sc.EVENT_OPERATION_DETAILS)), proxy)
        finally:
            proxy.close()
    finally:
        receiver.close()
    [(record, attrs)] = _events(receiver, sc.EVENT_OPERATION_DETAILS)
    assert record.severity_number == 5  # DEBUG, as the conventions ask
    assert len(record.trace_id) == 16 and any(record.trace_id) and any(record.span_id)
    assert attrs[sc.OPERATION_NAME] == "chat" and attrs[sc.REQUEST_MODEL] == "llmtap-sim"
    # The OpenAI chat system message is part of the chat history: it is an input message here, kept.
    assert attrs[sc.INPUT_MESSAGES] == [
        {"role": "system", "parts": [{"type": "text", "content": SYSTEM_TEXT}]},
        {"role": "user", "parts": [{"type": "text", "content": USER_TEXT}]},
    ]
    output = attrs[sc.OUTPUT_MESSAGES]
    assert output[0]["role"] == "assistant" and output[0]["parts"][0]["content"]
    assert sc.SYSTEM_INSTRUCTIONS not in attrs  # hashed, but the OpenAI chat request has no separate system prompt
    assert sc.CONTENT_TRUNCATED not in attrs
