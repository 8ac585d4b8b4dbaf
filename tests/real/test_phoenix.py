"""A real trace backend: Arize Phoenix receives llmtap's traces, and its REST API gives back the span tree.

Phoenix runs offline from its own virtual environment (``.ci/install.d/25-phoenix.sh``). Two paths in: the
proxy's OTLP/HTTP exporter straight to Phoenix, and the proxy over OTLP/gRPC to rotel running
``collectors/rotel/rotel.env``, which forwards to Phoenix's gRPC port. Each path gets its own Phoenix
project (the ``openinference.project.name`` resource attribute), and each must read back as whole traces:
the root ``chat {model}`` span with its GenAI attributes (which Phoenix also maps onto its own LLM fields),
the queue, prefill and decode children, and one chunk span per content chunk under decode.
"""

from __future__ import annotations

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

from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE, TOOLS, Scripted, free_port, require_real
from tests.real.test_collectors import (
    CHUNKS,
    ROTEL_ENV,
    TOKENS,
    TTFT,
    Proc,
    answers,
    clean_env,
    listening,
    read_env_file,
    rotel_binary,
    start_llmtap,
    stream_chat,
)
from tests.real.test_reference_openai import CLIENT, PYTHON

PHOENIX = TOOLS / "phoenix" / "bin" / "phoenix"
REQUESTS = 2
SPANS_PER_TRACE = 1 + 3 + CHUNKS  # root, queue/prefill/decode, chunks


@dataclass
class Phoenix:
    """A running ``phoenix serve``."""

    url: str
    grpc_port: int

    def spans(self, project: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/v1/projects/{project}/spans", params={"limit": 500}, timeout=10)
        if r.status_code == 404:  # the project appears with its first span
            return []
        r.raise_for_status()
        data = r.json()["data"]
        assert isinstance(data, list)
        return data


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    require_real(PHOENIX.is_file(), "Arize Phoenix", "run .ci/install.d/25-phoenix.sh")
    tmp = tmp_path_factory.mktemp("phoenix")
    port, grpc_port = free_port(), free_port()
    env = clean_env(
        PHOENIX_WORKING_DIR=str(tmp),
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(port),
        PHOENIX_GRPC_PORT=str(grpc_port),
        PHOENIX_TELEMETRY_ENABLED="false",
        # Otherwise it fetches resources from the internet at start.
        PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
    )
    proc = Proc([str(PHOENIX), "serve"], tmp / "phoenix.log", env)
    try:
        url = f"http://127.0.0.1:{port}"
        # A first start creates its database (over 120 s seen at a load average of 8): a deadline, not a bound.
        proc.wait_until("Phoenix /healthz", answers(f"{url}/healthz"), timeout=400)
        proc.wait_until("Phoenix gRPC port", listening(grpc_port), timeout=30)
        yield Phoenix(url, grpc_port)
    finally:
        proc.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    up = Scripted(SCRIPT_TTFT=str(TTFT), SCRIPT_GAP="0.005", SCRIPT_CHUNKS=str(CHUNKS))
    yield up
    up.close()


def send_and_read_back(
    phoenix: Phoenix, upstream: Scripted, project: str, env: dict[str, str], log: Path
) -> list[dict[str, Any]]:
    """Stream ``REQUESTS`` chats through a proxy exporting with ``env``; wait for Phoenix to hold them all."""
    base = {
        "OTEL_SERVICE_NAME": "llmtap",
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
        "OTEL_METRICS_EXPORTER": "none",  # Phoenix takes traces only
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    proxy = start_llmtap(upstream.url, log, {**base, **env})
    try:
        with httpx.Client(timeout=10) as client:
            for _ in range(REQUESTS):
                assert stream_chat(client, proxy.url)[-1] == "[DONE]"
        deadline = time.monotonic() + PATIENCE
        while len(spans := phoenix.spans(project)) < REQUESTS * SPANS_PER_TRACE:
            assert time.monotonic() < deadline, f"{len(spans)} spans in Phoenix project {project}:\n{proxy.proc.tail()}"
            time.sleep(0.25)
        return spans
    finally:
        proxy.proc.close()


def check_trees(spans: list[dict[str, Any]]) -> None:
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == REQUESTS and len(spans) == REQUESTS * SPANS_PER_TRACE
    for root in roots:
        assert root["name"] == "chat scripted"
        # Phoenix recognised the GenAI attributes as an LLM call and mapped them onto its own fields.
        assert root["span_kind"] == "LLM"
        attrs = root["attributes"]
        assert attrs["llm.model_name"] == "scripted"
        assert attrs["llm.token_count.completion"] == TOKENS
        assert attrs[sc.OPERATION_NAME] == sc.OP_CHAT
        assert attrs[sc.REQUEST_MODEL] == attrs[sc.RESPONSE_MODEL] == "scripted"
        assert attrs[sc.USAGE_OUTPUT_TOKENS] == TOKENS
        assert attrs[sc.RESPONSE_FINISH_REASONS] == ["stop"]
        assert attrs[sc.RESPONSE_TIME_TO_FIRST_CHUNK] >= TTFT
        assert root["status_code"] != "ERROR"
        trace = [s for s in spans if s["context"]["trace_id"] == root["context"]["trace_id"]]
        children = {s["name"]: s for s in trace if s["parent_id"] == root["context"]["span_id"]}
        assert set(children) == {sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE}
        decode = children[sc.SPAN_DECODE]
        assert decode["attributes"][sc.OUTPUT_TOKENS] == TOKENS
        chunks = [s for s in trace if s["parent_id"] == decode["context"]["span_id"]]
        assert {s["name"] for s in chunks} == {sc.SPAN_CHUNK}
        assert sorted(s["attributes"][sc.CHUNK_INDEX] for s in chunks) == list(range(CHUNKS))
        assert sum(s["attributes"][sc.CHUNK_TOKENS] for s in chunks) == TOKENS
        assert all(root["start_time"] <= s["start_time"] and s["end_time"] <= root["end_time"] for s in trace)


@pytest.mark.real
def test_phoenix_receives_traces_over_otlp_http(phoenix: Phoenix, upstream: Scripted, tmp_path: Path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    spans = send_and_read_back(phoenix, upstream, "llmtap-http", env, tmp_path / "llmtap.log")
    check_trees(spans)
    print(f"\nPhoenix, OTLP/HTTP: {len(spans)} spans read back in {REQUESTS} traces")


@pytest.mark.real
def test_phoenix_receives_traces_through_rotel(phoenix: Phoenix, upstream: Scripted, tmp_path: Path) -> None:
    binary = rotel_binary()
    require_real(binary is not None, "rotel", "pip install rotel, part of the test extra")
    assert binary is not None
    grpc_port, http_port = free_port(), free_port()
    rotel_env = {
        **read_env_file(ROTEL_ENV),
        "ROTEL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc_port}",
        "ROTEL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}",
        "ROTEL_OTLP_EXPORTER_ENDPOINT": f"http://127.0.0.1:{phoenix.grpc_port}",
        "ROTEL_PID_FILE": str(tmp_path / "rotel.pid"),
        "ROTEL_LOG_FILE": str(tmp_path / "rotel.log"),
    }
    rotel = Proc([str(binary), "start"], tmp_path / "rotel.out", clean_env(**rotel_env))
    try:
        rotel.wait_until("rotel gRPC port", listening(grpc_port))
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        spans = send_and_read_back(phoenix, upstream, "llmtap-rotel", env, tmp_path / "llmtap.log")
    finally:
        rotel.close()
    check_trees(spans)
    print(f"\nPhoenix through rotel: {len(spans)} spans read back in {REQUESTS} traces")


@pytest.mark.real
def test_phoenix_counts_one_generation_under_an_instrumented_application(phoenix: Phoenix, tmp_path: Path) -> None:
    """The application traces (the openai SDK under opentelemetry-instrumentation-openai-v2) and llmtap too,
    both into one Phoenix project: each call is one LLM span, the application's, and its tokens count once."""
    require_real(
        PYTHON.is_file(), "opentelemetry-instrumentation-openai-v2", "run .ci/install.d/27-openai-reference.sh"
    )
    project = "llmtap-under-app"
    resource = f"openinference.project.name={project}"
    port = free_port()
    simulator = Proc(
        [sys.executable, "-m", "llmtap", "simulate", "--profile", "fast", "--port", str(port)], tmp_path / "sim.log"
    )
    env = {
        "OTEL_SERVICE_NAME": "llmtap",
        "OTEL_RESOURCE_ATTRIBUTES": resource,
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    try:
        simulator.wait_until("llmtap simulate", listening(port))
        limits = ("--max-concurrency", "1", "--queue-limit", "0")  # the client's refused call is refused
        proxy = start_llmtap(f"http://127.0.0.1:{port}", tmp_path / "llmtap.log", env, *limits)
        try:
            client = subprocess.run(
                [str(PYTHON), str(CLIENT), f"{proxy.url}/v1", phoenix.url],
                env=clean_env(OTEL_SERVICE_NAME="app", OTEL_RESOURCE_ATTRIBUTES=resource),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert client.returncode == 0, client.stderr[-4000:]
            calls = [json.loads(line) for line in client.stdout.splitlines()]
            app_ids = {c["span_id"] for c in calls}
            deadline = time.monotonic() + PATIENCE
            while True:
                spans = phoenix.spans(project)
                # llmtap's span under each call (the application nests a call made while a stream is open under
                # that stream's span, so its own spans are told apart by their ids)
                under = [s for s in spans if s["parent_id"] in app_ids and s["context"]["span_id"] not in app_ids]
                if len(under) >= len(calls) or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            truth = httpx.get(f"http://127.0.0.1:{port}/debug/requests", timeout=5).json()["requests"]
        finally:
            proxy.proc.close()
    finally:
        simulator.close()
    assert len(under) == len(calls), f"{len(under)} llmtap spans under {len(calls)} application calls"
    llm = [s for s in spans if s["span_kind"] == "LLM"]
    # One generation per call, the application's own; llmtap's hop spans and their children are not.
    assert sorted(s["context"]["span_id"] for s in llm) == sorted(app_ids), [(s["name"], s["span_kind"]) for s in spans]
    assert all(s["name"].startswith(("POST ", "GET ")) for s in under), [s["name"] for s in under]
    counted = sum(s["attributes"].get("llm.token_count.prompt", 0) for s in spans)
    completed = sum(s["attributes"].get("llm.token_count.completion", 0) for s in spans)
    # Tokens counted once: what the application's spans report, no more than the model processed.
    assert 0 < counted <= sum(r["prompt_tokens"] for r in truth), (counted, truth)
    assert 0 < completed <= sum(r["output_tokens"] for r in truth), (completed, truth)
    print(f"\nPhoenix, application + llmtap: {len(llm)} LLM spans for {len(calls)} calls, {counted} prompt tokens")
