"""The simulator's server spans: vLLM's ``llm_request`` over OTLP/HTTP, joined by llmtap to the request it relayed.

Unit: a span carries vLLM's attribute names, parented on the ``traceparent`` received and back-dated to arrival.
End to end: ``run_in_thread(..., spans=SpanExporter(url))`` exports to llmtap's admin listener, and llmtap's root
spans then take queue and prefill from the server (``source = server``), equal to the simulator's own truth.
"""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from llmtap.config.types import Route, Settings, TelemetrySettings
from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.spans import SpanExporter, parse_traceparent, request_span, traces_url
from llmtap.simulator.truth import RequestRecord
from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE, Telemetry
from tests.telemetry.test_serverspans import _Forward


def test_traceparent_and_endpoint_are_read_as_vllm_reads_them() -> None:
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{trace}-{parent}-01".encode()) == (bytes.fromhex(trace), bytes.fromhex(parent))
    for bad in (None, b"", b"01-" + trace.encode() + b"-" + parent.encode() + b"-01", b"00-zz-00f067aa0ba902b7-01"):
        assert parse_traceparent(bad) is None
    assert parse_traceparent(b"00-" + b"0" * 32 + b"-" + parent.encode() + b"-01") is None  # all-zero: invalid
    assert traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert traces_url("http://h:9/v1/traces") == "http://h:9/v1/traces"
    with pytest.raises(ValueError, match="http"):
        traces_url("h:4317")


def test_a_span_carries_vllms_names_and_the_records_phases() -> None:
    record = RequestRecord(id="chatcmpl-1", route="chat", arrival=100.0, model="m", admitted=100.25)
    record.add_chunk(100.75, 1, 100.75)
    record.add_chunk(101.0, 2, 101.0)
    record.prompt_tokens, record.max_tokens = 12, 3
    parent = (bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736"), bytes.fromhex("00f067aa0ba902b7"))
    span = request_span(record, parent, 101.5, b"\x01" * 8)
    assert (span.name, span.trace_id, span.parent_span_id) == ("llm_request", parent[0], parent[1])
    assert span.kind == span.SpanKind.SPAN_KIND_SERVER
    assert (span.end_time_unix_nano - span.start_time_unix_nano) == pytest.approx(1.5e9, abs=1e3)
    attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}
    # vLLM's SpanAttributes names (standards B.2), in seconds: the ones llmtap's join reads among them.
    assert attrs["gen_ai.latency.time_in_queue"] == 0.25 and attrs["gen_ai.latency.time_in_model_prefill"] == 0.5
    assert attrs["gen_ai.latency.time_in_model_decode"] == 0.25 and attrs["gen_ai.latency.e2e"] == 1.5
    assert attrs["gen_ai.latency.time_to_first_token"] == 0.75
    assert (attrs["gen_ai.usage.prompt_tokens"], attrs["gen_ai.usage.completion_tokens"]) == (12, 3)
    assert attrs["gen_ai.request.id"] == "chatcmpl-1"


def _outcomes(telemetry: Telemetry) -> dict[str, int]:
    points = telemetry.metrics().get(sc.METRIC_SERVER_SPANS, [])
    return {p.attributes["llmtap.server_span.outcome"]: int(p.value) for p in points}


def _roots(telemetry: Telemetry) -> list[dict[str, Any]]:
    return [dict(s.attributes or {}) for s in telemetry.finished() if sc.ROUTE in (s.attributes or {})]


@pytest.mark.e2e
def test_llmtap_joins_the_simulators_spans_and_takes_its_queue_and_prefill(
    proxy_factory: Any, telemetry: Telemetry
) -> None:
    # The simulator starts first (llmtap's route names it), so it exports to a forwarder told llmtap's admin address
    # once llmtap runs. Two slots and six concurrent requests: the later ones wait in line, so its queue is not 0.
    class Forward(_Forward):
        target = ""

    forwarder = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=forwarder.serve_forever, daemon=True).start()
    sim = run_in_thread(
        get_profile("fast", max_num_seqs=2),
        spans=SpanExporter(f"http://127.0.0.1:{forwarder.server_address[1]}", interval=0.2),
    )
    try:
        route = Route(prefix="/", upstream=sim.url, name="default", provider="llmtap-sim")
        settings = Settings(routes=(route,), telemetry=TelemetrySettings(server_spans_wait=PATIENCE))
        running = proxy_factory(settings, admin=True)
        assert running.admin is not None
        Forward.target = running.admin.url + "/v1/traces"
        chat = {"model": "llmtap-sim", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}

        def one() -> None:
            with httpx.stream("POST", running.url + "/v1/chat/completions", json=chat, timeout=30) as r:
                assert r.status_code == 200
                r.read()

        # The simulator's /metrics is not vLLM's, so llmtap learns that it traces from its first span (late: its
        # request was recorded without waiting); from then on every request waits for its span.
        one()
        deadline = time.monotonic() + PATIENCE
        while _outcomes(telemetry).get("late", 0) < 1:
            assert time.monotonic() < deadline, _outcomes(telemetry)
            time.sleep(0.02)
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + PATIENCE
        while Forward.spans < 7 or len(_roots(telemetry)) < 7:
            assert time.monotonic() < deadline, (Forward.spans, len(_roots(telemetry)))
            time.sleep(0.02)
        truth = {r["id"]: r for r in httpx.get(sim.url + "/debug/requests").json()["requests"]}
    finally:
        sim.stop()
        forwarder.shutdown()
        forwarder.server_close()
    roots = _roots(telemetry)
    joined = [a for a in roots if a.get(sc.QUEUE_UPSTREAM_SOURCE) == "server"]
    assert len(roots) == 7 and len(joined) == 6 and _outcomes(telemetry)["matched"] == 6
    assert any(a[sc.QUEUE_UPSTREAM_DURATION] > 0 for a in joined)  # some waited for a slot
    for attrs in joined:
        assert attrs[sc.PREFILL_SOURCE] == "server"
        server = truth[attrs[sc.RESPONSE_ID]]
        assert attrs[sc.QUEUE_UPSTREAM_DURATION] == pytest.approx(server["queue_s"], abs=2e-6)
        assert attrs[sc.PREFILL_DURATION] == pytest.approx(server["prefill_s"], abs=2e-6)
