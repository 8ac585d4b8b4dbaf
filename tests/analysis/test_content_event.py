"""The opt-in content event ``gen_ai.client.inference.operation.details``: rules per field, a bound, never on by
accident; end to end, ``llmtap serve`` in front of the simulator exports it to a real OTLP/HTTP receiver."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult

from llmtap.analysis.content import bound, content_of, digest
from llmtap.analysis.finish import Finished
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Output, Timeline
from llmtap.config.load import build
from llmtap.config.types import ConfigError, ContentEvent
from llmtap.providers.anthropic import AnthropicMessages
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.records import content as content_module
from llmtap.telemetry.records.content import ContentEmitter
from llmtap.telemetry.records.content_drops import ContentUnavailable
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.net import free_port
from tests.support.procs import Llmtap, Simulator
from tests.telemetry.test_metrics_standard import otlp_env, total, wait_for

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


class _Held(LogRecordExporter):
    """An exporter whose every export waits until ``release`` is set, then answers ``result``."""

    def __init__(self, result: LogRecordExportResult) -> None:
        self.release = threading.Event()
        self.result = result
        self.exported = 0

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        self.release.wait(30)
        self.exported += len(batch)
        return self.result

    def shutdown(self) -> None:
        self.release.set()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def _finished(protocol: str | None = "anthropic") -> Finished:
    tl = anthropic_timeline("Nile.")
    tl.protocol = protocol
    tl.trace_id, tl.span_id = "1" * 32, "2" * 16
    return Finished(tl, Summary(), None)


@pytest.mark.parametrize("result", [LogRecordExportResult.SUCCESS, LogRecordExportResult.FAILURE])
def test_events_past_the_queue_or_refused_are_counted_by_reason_and_said_once(
    result: LogRecordExportResult, caplog: pytest.LogCaptureFixture
) -> None:
    refused = result == LogRecordExportResult.FAILURE
    lost: list[tuple[str, int]] = []
    held = _Held(result)
    emitter = ContentEmitter(_rules(), held, capacity=2, on_drop=lambda r, n: lost.append((r, n)))
    with caplog.at_level(logging.WARNING, logger="llmtap.telemetry"):
        for _ in range(5):  # two wait for export; the three past the bound are dropped at once
            emitter.emit(_finished())
        emitter.emit(_finished(protocol=None))  # a request no protocol names has no event: not a loss
        assert lost == [("otlp_queue_full", 1)] * 3
        held.release.set()
        emitter.close()
    assert held.exported == 2
    assert lost[3:] == ([("otlp_export_failed", 2)] if refused else [])
    assert emitter.exported == (0 if refused else 2)
    said = [r.getMessage() for r in caplog.records if "content events lost" in r.getMessage()]
    assert len(said) == (2 if refused else 1), said  # each reason once, with its cause
    assert "otlp_queue_full" in said[0] and "2 events already wait for export" in said[0]


def _rules() -> ContentEvent:
    return build(
        {"upstream": "http://127.0.0.1:1", "content_event": "input=keep"},
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
    ).content


def test_an_event_that_cannot_be_made_and_an_sdk_too_old_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    lost: list[tuple[str, int]] = []
    held = _Held(LogRecordExportResult.SUCCESS)
    held.release.set()
    emitter = ContentEmitter(_rules(), held, capacity=2, on_drop=lambda r, n: lost.append((r, n)))

    def unmakeable(request: Finished, rules: ContentEvent) -> dict[str, Any]:
        raise ValueError("a field that cannot be read")

    monkeypatch.setattr(content_module, "details", unmakeable)
    for _ in range(3):  # its room freed each time: never queue_full
        emitter.emit(_finished())
    emitter.close()
    assert lost == [("unmade", 1)] * 3 and held.exported == 0
    lost.clear()
    unavailable = ContentUnavailable("the opentelemetry-sdk installed is too old", lambda r, n: lost.append((r, n)))
    unavailable.emit(_finished())
    unavailable.emit(_finished(protocol=None))
    assert lost == [("sdk_too_old", 1)]


@pytest.mark.e2e
def test_events_a_dead_endpoint_never_took_are_counted_and_a_live_receiver_loses_none(
    simulator: Simulator, tmp_path: Path
) -> None:
    dropped = "llmtap_telemetry_content_events_dropped_total"
    args = ("--content-event", "input=keep,output=keep")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": dead,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
        "OTEL_BLRP_SCHEDULE_DELAY": "50",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
    }
    proxy = Llmtap(simulator.url, tmp_path / "dead.log", *args, env=env)
    try:
        text = proxy.metrics()
        for reason in sc.CONTENT_DROP_REASONS:  # every reason reads 0 from the start
            assert total(text, dropped, llmtap_telemetry_reason=reason) == 0, reason
        for _ in range(2):
            _chat(proxy)
        failed = {"llmtap_telemetry_reason": "otlp_export_failed"}
        wait_for("two events counted lost", lambda: total(proxy.metrics(), dropped, **failed) == 2, proxy)
        assert total(proxy.metrics(), dropped) == 2
    finally:
        proxy.close()
    said = (tmp_path / "dead.log").read_text(encoding="utf-8")
    assert said.count("content events lost (otlp_export_failed)") == 1, said

    receiver = HTTPReceiver()
    proxy = Llmtap(simulator.url, tmp_path / "live.log", *args, env=otlp_env(receiver, OTEL_BLRP_SCHEDULE_DELAY="50"))
    try:
        for _ in range(2):
            _chat(proxy)
        wait_for("two events", lambda: len(_events(receiver, sc.EVENT_OPERATION_DETAILS)) == 2, proxy)
        assert total(proxy.metrics(), dropped) == 0
    finally:
        proxy.close()
        receiver.close()
    assert "content events lost" not in (tmp_path / "live.log").read_text(encoding="utf-8")
