"""docs/reference.md against what ``llmtap serve`` emits: a run in front of the simulator, its spans, metrics and
content events captured by a real OTLP/HTTP receiver, their names compared with the reference both ways.

- Everything emitted is in the reference, on the span (or event, or log record) the reference puts it on, and
  every metric emitted has its section.
- Everything the reference says a span carries is emitted by this run, except the names listed in ``STAGED_ELSEWHERE``
  with the condition this run does not stage (each checked to be in the reference, and not emitted here, so the
  list cannot outlive its reason); the same for metrics.
- No attribute the run emits is one the reference calls "declared, not emitted".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmtap.telemetry import semconv as sc
from tests.e2e.test_otlp import HTTPReceiver, Received, attributes
from tests.support.procs import Llmtap, Simulator
from tests.telemetry.test_metrics_standard import otlp_env, wait_for

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference.md"
CONTENT_EVENT = f"log {sc.EVENT_OPERATION_DETAILS}"
KEY = "sk-reference-0123456789abcdefghij"

#: Attributes the reference lists on a span that this run does not make, by what it takes.
STAGED_ELSEWHERE: dict[str, dict[str, str]] = {
    "root": {
        sc.ERROR_TYPE: "a failed or cancelled request",
        sc.REQUEST_CHOICE_COUNT: "n > 1",
        sc.REQUEST_FREQUENCY_PENALTY: "a request that sets it",
        sc.REQUEST_PRESENCE_PENALTY: "a request that sets it",
        sc.REQUEST_SEED: "a request that sets it",
        sc.REQUEST_STOP_SEQUENCES: "a request that sets it",
        sc.REQUEST_TOP_K: "a request that sets it",
        sc.REQUEST_TOP_P: "a request that sets it",
        sc.REQUEST_TEMPERATURE: "a request that sets it",
        sc.USAGE_CACHE_WRITE: "cache writes reported, latest conventions",
        sc.USAGE_REASONING: "reasoning tokens reported",
        sc.MALFORMED_EVENTS: "a malformed stream event",
        sc.OVERSIZED_EVENTS: "an oversized stream event",
        sc.STREAM_UNREAD: "a response the tap stopped reading",
        sc.REQUEST_PARSE_ERROR: "a request body that is not JSON",
        sc.DECODE_SERVER_DURATION: "a server that reports its decode time",
        sc.UPSTREAM_UNATTRIBUTED_DURATION: "a server span that leaves upstream time unattributed",
    },
}

#: Metrics the reference has a section for that this run does not make, by what they take.
_LATEST = "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental (tests/e2e/test_otlp.py's latest run)"
METRICS_STAGED_ELSEWHERE: dict[str, str] = {
    "gen_ai.client.inference.usage.input_tokens": _LATEST,
    "gen_ai.client.inference.usage.output_tokens": _LATEST,
    "gen_ai.client.inference.usage.cache_read.input_tokens": _LATEST,
    "gen_ai.client.inference.usage.cache_write.input_tokens": _LATEST,
    "gen_ai.client.inference.usage.reasoning.output_tokens": _LATEST,
    "gen_ai.client.inference.operation.input_tokens": _LATEST,
    "gen_ai.client.inference.operation.output_tokens": _LATEST,
    "gen_ai.server.request.duration": "telemetry.server_metrics: true",
    "gen_ai.server.time_per_output_token": "telemetry.server_metrics: true",
    "gen_ai.server.time_to_first_token": "telemetry.server_metrics: true",
    sc.METRIC_ATTRIBUTION_DROPPED: "more x-llmtap-property-* headers than a request may carry",
    sc.METRIC_COST_UNPRICED: "a request of a model no price table names",
    sc.METRIC_OTLP_ROUTED: "several telemetry processes and a server exporting its spans",
    sc.METRIC_CLICKHOUSE_INSERTS: "--record-clickhouse",
    sc.METRIC_RECORDS_DROPPED: "a record sink (--record, --record-logs, ClickHouse)",
    sc.METRIC_RECORDS_RECOVERED: "a record journal (--record-journal) that replays a run",
    sc.METRIC_UNATTRIBUTED: "a server exporting its spans, with upstream time they do not cover",
    sc.METRIC_SLO_OBJECTIVE: "objectives in the settings (slo:), whose percentiles the burn-rate rules read",
}


@pytest.fixture(scope="module")
def simulator() -> Iterator[Simulator]:
    sim = Simulator()
    yield sim
    sim.close()


def generic(name: str) -> str:
    """A name as the reference writes its family: ``llmtap.prompt.tokens.{region}``, ``llmtap.property.{name}``."""
    for prefix in (sc.PROMPT_FINGERPRINT, sc.PROMPT_REGION_TOKENS):
        if name.startswith(prefix + "."):
            return prefix + ".{region}"
    if name.startswith(sc.PROPERTY_PREFIX):
        return sc.PROPERTY_PREFIX + "{name}"
    return name


def documented() -> tuple[dict[str, set[str]], set[str], set[str]]:
    """The reference's attributes by span (its ``## Spans`` sections), its metric sections, and the attributes it
    calls declared, not emitted."""
    text = REFERENCE.read_text(encoding="utf-8")
    spans_part = text.split("\n## Spans\n", 1)[1].split("\n## Attributes\n", 1)[0]
    spans: dict[str, set[str]] = {}
    for heading, body in re.findall(r"^### (.+)\n\n(.+)$", spans_part, flags=re.M):
        spans[section_key(heading)] = set(re.findall(r"`([^`]+)`", body))
    metrics_part = text.split("\n## Metric attribute sets\n", 1)[1].split("\n## Spans\n", 1)[0]
    metrics = set(re.findall(r"^### (\S+)$", metrics_part, flags=re.M))
    unemitted = set(re.findall(r"^\| `([^`]+)` \| [^|]+ \| declared, not emitted \|", text, flags=re.M))
    return spans, metrics, unemitted


def section_key(heading: str) -> str:
    """A span section's key: ``root``, ``hop``, ``relay``, a span's name, ``event NAME`` or ``log NAME``."""
    if heading.startswith("root under"):
        return "hop"
    if heading.startswith("root of a plain relay"):
        return "relay"
    if heading.startswith("root"):
        return "root"
    name = heading.split("`")[1]
    return f"log {name}" if heading.endswith("(log record)") else name


def emitted(received: Received) -> dict[str, set[str]]:
    """The attribute names of what the receiver got, by span (as the reference keys them) and content event."""
    out: dict[str, set[str]] = {}
    for _, span in received.spans():
        attrs = attributes(span.attributes)
        if span.kind == span.SPAN_KIND_CLIENT:
            key = "root" if sc.OPERATION_NAME in attrs else "relay"
        elif span.kind == span.SPAN_KIND_SERVER:
            key = "hop"
        else:
            key = span.name
        out.setdefault(key, set()).update(generic(a) for a in attrs)
        for event in span.events:
            out.setdefault(f"event {event.name}", set()).update(generic(a) for a in attributes(event.attributes))
    for record in received.log_records():
        if record.event_name == sc.EVENT_OPERATION_DETAILS:
            out.setdefault(CONTENT_EVENT, set()).update(attributes(record.attributes))
    return out


def metric_names(received: Received) -> set[str]:
    return set(received.latest_metrics())


def _traffic(proxy: Llmtap) -> None:
    """Streamed and unary chat, an Anthropic message, a traced client's request (a hop), a plain relay; attributed,
    with per-request objectives."""
    headers = {
        "authorization": f"Bearer {KEY}",
        "x-llmtap-tenant": "acme",
        "x-llmtap-property-team": "search",
        "x-llmtap-prompt-version": "v1",
        "x-slo-ttft-ms": "500",
        "x-slo-tpot-ms": "50",
    }
    chat = {
        "model": "llmtap-sim",
        "max_tokens": 8,
        "user": "user-7",
        "messages": [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Hello?"}],
    }
    for stream in (True, False):
        r = proxy.client.post("/v1/chat/completions", json={**chat, "stream": stream}, headers=headers)
        assert r.status_code == 200, r.text
    message = {
        "model": "llmtap-sim",
        "max_tokens": 8,
        "stream": True,
        "system": "Answer in one word.",
        "messages": [{"role": "user", "content": "Colour of the sky?"}],
    }
    # An objective that cannot be read, on a root span (``llmtap.objective.ignored``).
    assert proxy.client.post("/v1/messages", json=message, headers={"x-slo-ttft-ms": "-3"}).status_code == 200
    # A traced client's request whose objective cannot be read (``llmtap.objective.ignored``).
    traced = {
        **headers,
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "x-slo-tpot-ms": "soon",
    }
    assert proxy.client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=traced).status_code == 200
    proxy.client.get("/v1/models")  # no LLM protocol: a plain relay


@pytest.mark.e2e
def test_the_reference_lists_what_a_run_emits_and_emits_what_it_lists(simulator: Simulator, tmp_path: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"llmtap-sim": {"input": 2.0, "output": 8.0}}}), encoding="utf-8")
    receiver = HTTPReceiver()
    env = otlp_env(
        receiver,
        OTEL_BLRP_SCHEDULE_DELAY="50",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true",
        LLMTAP_CHUNK_DETAIL_SAMPLE="1",
        LLMTAP_CHUNK_SPAN_CAP="2",  # the tail of each stream folds into one span
    )
    proxy = Llmtap(
        simulator.url,
        tmp_path / "llmtap.log",
        "--prices",
        str(prices),
        "--server-slots",
        "4",
        "--content-event",
        "system=keep,input=keep,output=keep",
        "--content-event-max-bytes",
        "256",
        env=env,
    )
    try:
        _traffic(proxy)
        got: dict[str, set[str]] = {}

        def arrived() -> bool:
            got.clear()
            got.update(emitted(receiver.received))
            return {"root", "hop", "relay", CONTENT_EVENT} <= set(got) and sc.TENANT in got["root"]

        wait_for("the run's spans and content events", arrived, proxy)
        wait_for("metrics", lambda: sc.METRIC_COST in metric_names(receiver.received), proxy)
    finally:
        proxy.close()
        receiver.close()
    got = emitted(receiver.received)
    metrics = metric_names(receiver.received)
    spans, sections, unemitted = documented()

    # Emitted, so documented: on the span the reference puts it on.
    undocumented = {key: sorted(names - spans.get(key, set())) for key, names in got.items()}
    undocumented = {k: v for k, v in undocumented.items() if v}
    assert undocumented == {}, f"emitted, missing from docs/reference.md: {undocumented}"
    assert metrics - sections == set(), f"metrics emitted without a section: {sorted(metrics - sections)}"
    flat = set().union(*got.values())
    assert flat & unemitted == set(), "emitted, yet the reference says declared, not emitted"

    # Documented, so emitted (or staged by another test, for a reason named above).
    for key, reasons in STAGED_ELSEWHERE.items():
        assert set(reasons) <= spans[key], f"{key}: staged-elsewhere names the reference does not list"
        emitted_after_all = set(reasons) & got.get(key, set())
        assert emitted_after_all == set(), f"{key}: emitted here after all, drop from the list: {emitted_after_all}"
    missing = {
        key: sorted(names - got.get(key, set()) - set(STAGED_ELSEWHERE.get(key, {})))
        for key, names in spans.items()
        if key in got
    }
    missing = {k: v for k, v in missing.items() if v}
    assert missing == {}, f"docs/reference.md lists them, the run did not emit them: {missing}"
    assert set(METRICS_STAGED_ELSEWHERE) <= sections
    assert set(METRICS_STAGED_ELSEWHERE) & metrics == set(), "metrics emitted here after all, drop from the list"
    unmade = sorted(sections - metrics - set(METRICS_STAGED_ELSEWHERE))
    assert unmade == [], f"docs/reference.md has sections for metrics the run did not emit: {unmade}"
