"""Metrics as the conventions say, read off a real ``llmtap serve``: its ``/metrics`` and a real OTLP receiver.

The ``gen_ai.*`` histograms carry the conventions' advisory buckets and attribute lists by default, llmtap's
fine buckets with ``--histogram-buckets fine``, and are exponential over OTLP with the standard
``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``; ``gen_ai.server.*`` (the model server's own
names) appear only when asked for; counters a dashboard panel reads exist at 0 before any event; the
instrumentation scope names the conventions' schema.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS, OVERHEAD_BUCKETS, TOKEN_BUCKETS
from tests.conftest import PATIENCE, Scripted
from tests.e2e.test_otlp import HTTPReceiver
from tests.support.procs import ROOT, Llmtap

CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
DURATION = "gen_ai_client_operation_duration_seconds"
GEN_AI_SECONDS = (
    DURATION,
    "gen_ai_client_operation_time_to_first_chunk_seconds",
    "gen_ai_client_operation_time_per_output_chunk_seconds",
)
TOKEN_USAGE = "gen_ai_client_token_usage"
OVERHEAD = "llmtap_proxy_overhead_seconds"
CHUNK_DELAY = "llmtap_relay_chunk_delay_seconds"
LLMTAP_SECONDS = (
    "llmtap_time_to_first_token_seconds",
    "llmtap_inter_token_latency_seconds",
    "llmtap_time_per_output_token_seconds",
    "llmtap_queue_duration_seconds",
)
#: The conventions' metric attributes as Prometheus labels (gen-ai-metrics.md v1.41.1), and the bucket bound.
CONVENTION_LABELS = {
    "gen_ai_operation_name",
    "gen_ai_provider_name",
    "gen_ai_request_model",
    "gen_ai_response_model",
    "server_address",
    "server_port",
    "error_type",
    "gen_ai_token_type",
    "le",
}


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    up = Scripted(SCRIPT_TTFT="0.02", SCRIPT_GAP="0.005", SCRIPT_CHUNKS="6")
    yield up
    up.close()


def labels(line: str) -> dict[str, str]:
    """The labels of one sample line (values in this test's data hold no quotes or commas)."""
    inside = line.partition("{")[2].rpartition("}")[0]
    return dict(item.split("=", 1) for item in inside.replace('"', "").split(",") if item)


def series(text: str, name: str) -> list[str]:
    """The sample lines of one metric family member (``name`` exactly, before its labels)."""
    return [line for line in text.splitlines() if line.split("{", 1)[0].split(" ", 1)[0] == name]


def bounds(text: str, histogram: str) -> list[float]:
    """The finite ``le`` values of a histogram's first series, in order."""
    lines = series(text, histogram + "_bucket")
    assert lines, f"no {histogram} on /metrics"
    first = {k: v for k, v in labels(lines[0]).items() if k != "le"}
    les = [labels(line)["le"] for line in lines if {k: v for k, v in labels(line).items() if k != "le"} == first]
    assert les[-1] == "+Inf"
    return [float(le) for le in les[:-1]]


def chat(proxy: Llmtap, headers: dict[str, str] | None = None) -> None:
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"


def wait_for(what: str, check: Callable[[], bool], proxy: Llmtap, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{proxy.logs()[-3000:]}"
        time.sleep(0.05)


def recorded(proxy: Llmtap) -> str:
    """``/metrics`` once the one request made so far is on it."""
    wait_for("request on /metrics", lambda: any(series(proxy.metrics(), DURATION + "_count")), proxy)
    return proxy.metrics()


def test_default_buckets_are_fine_and_attributes_the_conventions(upstream: Scripted, tmp_path: Path) -> None:
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log")
    try:
        chat(proxy)
        text = recorded(proxy)
        # Every latency histogram takes the fine buckets, gen_ai.* too: /metrics writes those over the values' range.
        for name in (*GEN_AI_SECONDS, *LLMTAP_SECONDS):
            assert bounds(text, name) and set(bounds(text, name)) <= set(DURATION_BUCKETS), name
        assert set(bounds(text, TOKEN_USAGE)) <= set(TOKEN_BUCKETS)
        # The gen_ai.* series carry the conventions' attributes and no other; llmtap's carry the route.
        genai = [line for line in text.splitlines() if line.startswith("gen_ai_")]
        assert genai and {key for line in genai for key in labels(line)} <= CONVENTION_LABELS
        assert all(labels(line)["llmtap_route"] == "default" for line in series(text, LLMTAP_SECONDS[0] + "_count"))
        # The model server's own names are not a proxy's to emit unless asked.
        assert "gen_ai_server_" not in text
    finally:
        proxy.close()


def test_standard_setting_gives_the_conventions_buckets(upstream: Scripted, tmp_path: Path) -> None:
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--histogram-buckets", "standard")
    try:
        chat(proxy)
        text = recorded(proxy)
        for name in GEN_AI_SECONDS:
            assert bounds(text, name) and set(bounds(text, name)) <= set(sc.BUCKETS_DURATION), name
        assert set(bounds(text, TOKEN_USAGE)) <= set(sc.BUCKETS_TOKENS)
        # llmtap's own latency histograms keep the fine buckets whatever the setting.
        for name in LLMTAP_SECONDS:
            assert set(bounds(text, name)) <= set(DURATION_BUCKETS), name
    finally:
        proxy.close()


def test_fine_setting_and_server_metrics(upstream: Scripted, tmp_path: Path) -> None:
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--histogram-buckets", "fine", "--server-metrics")
    try:
        chat(proxy)
        text = recorded(proxy)
        for name in GEN_AI_SECONDS:
            assert set(bounds(text, name)) <= set(DURATION_BUCKETS), name
        assert set(bounds(text, TOKEN_USAGE)) <= set(TOKEN_BUCKETS)
        for name in ("gen_ai_server_time_to_first_token_seconds", "gen_ai_server_request_duration_seconds"):
            assert set(bounds(text, name)) <= set(DURATION_BUCKETS), name
            assert sum(float(line.rpartition(" ")[2]) for line in series(text, name + "_count")) == 1, name
    finally:
        proxy.close()


def test_server_metrics_take_their_own_advice(upstream: Scripted, tmp_path: Path) -> None:
    env = {"LLMTAP_SERVER_METRICS": "true", "LLMTAP_HISTOGRAM_BUCKETS": "standard"}
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        chat(proxy)
        text = recorded(proxy)
        # With the standard buckets, each gen_ai.server.* histogram takes its own advice (written sparse).
        for name, advised in (
            ("gen_ai_server_time_to_first_token_seconds", sc.BUCKETS_SERVER_TTFT),
            ("gen_ai_server_time_per_output_token_seconds", sc.BUCKETS_SERVER_TPOT),
            ("gen_ai_server_request_duration_seconds", sc.BUCKETS_DURATION),
        ):
            assert bounds(text, name) and set(bounds(text, name)) <= set(advised), name
    finally:
        proxy.close()


def test_counters_read_zero_before_any_event(upstream: Scripted, tmp_path: Path) -> None:
    config = tmp_path / "llmtap.yaml"
    config.write_text(
        "max_concurrency: 2\n"
        "routes:\n"
        f"  - {{prefix: /a, upstream: '{upstream.url}', strip_prefix: true, name: a}}\n"
        f"  - {{prefix: /b, upstream: '{upstream.url}', strip_prefix: true, name: b}}\n",
        encoding="utf-8",
    )
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--config", str(config))
    try:
        # Each counter's label beside the route, and the values it reads 0 for (None: the route alone).
        want: dict[str, tuple[str, tuple[str, ...]] | None] = {
            "llmtap_queue_rejected_total": ("error_type", ("queue_full", "queue_timeout")),
            "llmtap_server_timing_rejected_total": ("llmtap_server_timing_field", ("queue", "prefill", "decode")),
            "llmtap_queue_waiting": None,
            "llmtap_stream_malformed_events_total": None,
        }

        def present() -> bool:
            text = proxy.metrics()
            return all(series(text, name) for name in want)

        wait_for("counters at 0", present, proxy)
        text = proxy.metrics()
        routes = ("a", "b", "default")  # the file's two and --upstream's
        for name, keyed in want.items():
            seen = {frozenset(labels(line).items()): line.rpartition(" ")[2] for line in series(text, name)}
            if keyed is None:
                expected = {frozenset({("llmtap_route", r)}) for r in routes}
            else:
                key, values = keyed
                expected = {frozenset({("llmtap_route", r), (key, v)}) for r in routes for v in values}
            assert set(seen) == expected, (name, seen)
            assert set(seen.values()) == {"0"}, (name, seen)
    finally:
        proxy.close()


def total(text: str, name: str, **where: str) -> float:
    """The sum of a metric's samples on ``/metrics`` (those whose labels include ``where``)."""
    lines = [line for line in series(text, name) if where.items() <= labels(line).items()]
    return sum(float(line.rpartition(" ")[2]) for line in lines)


def test_a_hop_is_counted_in_llmtaps_metrics_only(upstream: Scripted, tmp_path: Path) -> None:
    """A request whose client traces (a valid ``traceparent``) is a hop: its client's instrumentation reports the
    generation, in the gen_ai.client.* metrics too, so llmtap records it in its own metrics alone. A request with
    no ``traceparent`` and one with an invalid one (treated as none) are generations, counted in both."""
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log")
    try:
        chat(proxy, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
        chat(proxy, {"traceparent": "00-zzzz-bad-01"})
        chat(proxy)
        # The overhead histogram is a request's last instrument: once it has all three, every instrument has.
        wait_for("three requests on /metrics", lambda: total(proxy.metrics(), OVERHEAD + "_count") == 3, proxy)
        text = proxy.metrics()
        # llmtap's own metrics see every request through the proxy ...
        assert total(text, "llmtap_requests_total") == 3
        for name in LLMTAP_SECONDS[:3]:
            assert total(text, name + "_count") >= 3, name
        prompt = total(text, "llmtap_usage_input_tokens_total") / 3
        assert prompt > 0 and prompt == int(prompt)
        # ... the gen_ai.client.* ones the two generations only: the hop's is its client's to count.
        for name in GEN_AI_SECONDS[:2]:
            assert total(text, name + "_count") == 2, name
        assert total(text, TOKEN_USAGE + "_count", gen_ai_token_type="input") == 2
        assert total(text, TOKEN_USAGE + "_sum", gen_ai_token_type="input") == 2 * prompt
    finally:
        proxy.close()


def test_the_proxys_own_cost_resolves_microseconds(upstream: Scripted, tmp_path: Path) -> None:
    """Issue 31: the overhead histogram and the relay's delay per chunk have buckets from 10 us (a healthy relay
    adds well under a millisecond); each relayed read of a stream is one sample of the delay, by route alone."""
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log")
    try:
        chat(proxy)
        wait_for("the request on /metrics", lambda: total(proxy.metrics(), OVERHEAD + "_count") == 1, proxy)
        text = proxy.metrics()
        # The buckets: 10 us to 100 ms, most of them below a millisecond.
        assert OVERHEAD_BUCKETS[0] == 1e-5 and OVERHEAD_BUCKETS[-1] == 0.1
        assert sum(b < 0.001 for b in OVERHEAD_BUCKETS) >= 20
        for name in (OVERHEAD, CHUNK_DELAY):
            # /metrics writes a histogram sparse: an unbroken run of its bounds, over the range its values span.
            found = bounds(text, name)
            start = OVERHEAD_BUCKETS.index(found[0])
            assert found == list(OVERHEAD_BUCKETS[start : start + len(found)]), name
        # A relayed read goes to the client in the same callback: its delay lies well under a millisecond.
        assert bounds(text, CHUNK_DELAY)[0] < 0.001
        # One sample per relayed read: at least one per content chunk (six), each a delay of its own.
        assert total(text, CHUNK_DELAY + "_count") >= 6
        assert total(text, CHUNK_DELAY + "_sum") > 0
        assert {key for line in series(text, CHUNK_DELAY + "_count") for key in labels(line)} == {"llmtap_route"}
    finally:
        proxy.close()


def test_server_timing_header_is_opt_in_and_leaves_the_body_alone(upstream: Scripted, tmp_path: Path) -> None:
    """``--server-timing`` adds one ``Server-Timing`` field (W3C Server Timing) with the proxy's own time and the
    upstream's time to headers; without it there is none. The body's events are the same either way."""
    plain = Llmtap(upstream.url, tmp_path / "plain.log")
    timed = Llmtap(upstream.url, tmp_path / "timed.log", "--server-timing")
    try:
        seen = []
        for proxy in (plain, timed):
            with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10) as r:
                assert r.status_code == 200
                body = r.read()
            contents = [
                json.loads(line[6:])["choices"][0]["delta"].get("content")
                for line in body.decode().splitlines()
                if line.startswith("data: {")
            ]
            seen.append((r.headers.get_list("server-timing"), contents, body.endswith(b"data: [DONE]\n\n")))
        (none, plain_contents, plain_done), (fields, timed_contents, timed_done) = seen
        assert none == []
        assert timed_contents == plain_contents and plain_done and timed_done
        (field,) = fields
        metrics = {}
        for entry in field.split(","):
            name, *params = (part.strip() for part in entry.split(";"))
            metrics[name] = dict(p.split("=", 1) for p in params)
        assert set(metrics) == {"llmtap", "llmtap-upstream"}
        proxy_ms, upstream_ms = float(metrics["llmtap"]["dur"]), float(metrics["llmtap-upstream"]["dur"])
        assert 0 <= proxy_ms < 10_000 and 0 < upstream_ms < 10_000
        assert metrics["llmtap"]["desc"] == '"proxy"'
    finally:
        plain.close()
        timed.close()


def otlp_env(receiver: HTTPReceiver, **extra: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        **extra,
    }


def test_base2_variable_gives_exponential_histograms_over_otlp(upstream: Scripted, tmp_path: Path) -> None:
    receiver = HTTPReceiver()
    env = otlp_env(
        receiver, OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION="base2_exponential_bucket_histogram"
    )
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        chat(proxy)
        names = (sc.RELEASED.operation_duration, sc.RELEASED.time_to_first_chunk, sc.METRIC_TTFT, sc.METRIC_ITL)
        wait_for("metrics over OTLP", lambda: set(names) <= set(receiver.received.latest_metrics()), proxy)
        metrics = receiver.received.latest_metrics()
        for name in names:
            _, metric = metrics[name]
            assert metric.WhichOneof("data") == "exponential_histogram", name
            (point,) = metric.exponential_histogram.data_points
            assert point.count >= 1 and point.scale > 0, name
        # The same request's TTFT, exponential over OTLP and in explicit standard buckets on /metrics.
        _, ttft = metrics[sc.METRIC_TTFT]
        text = recorded(proxy)
        ((line,),) = [series(text, "llmtap_time_to_first_token_seconds_sum")]
        assert float(line.rpartition(" ")[2]) == pytest.approx(ttft.exponential_histogram.data_points[0].sum)
        assert set(bounds(text, DURATION)) <= set(DURATION_BUCKETS)
    finally:
        proxy.close()
        receiver.close()


def test_an_unknown_aggregation_stops_the_start(upstream: Scripted) -> None:
    key = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
    result = subprocess.run(
        [sys.executable, "-m", "llmtap", "serve", "--upstream", upstream.url, "--port", "0", "--admin-port", "0"],
        cwd=ROOT,
        env={**clean, key: "base2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    # A one-line error naming the variable and what it takes, not the SDK's warning and a start without it.
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("llmtap: error: ") and key in line and "base2_exponential_bucket_histogram" in line


@pytest.mark.parametrize("latest", [False, True], ids=["released", "latest"])
def test_schema_url_on_the_exported_scope(latest: bool, upstream: Scripted, tmp_path: Path) -> None:
    receiver = HTTPReceiver()
    extra = {"OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental"} if latest else {}
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=otlp_env(receiver, **extra))
    try:
        chat(proxy)
        got = receiver.received
        wait_for("a trace", lambda: any(s.name == "chat scripted" for _, s in got.spans()), proxy)
        wait_for("request metrics", lambda: sc.METRIC_TTFT in got.latest_metrics(), proxy)
        with got.lock:
            spans = [ss for request in got.traces for rs in request.resource_spans for ss in rs.scope_spans]
            metrics = [sm for request in got.metrics for rm in request.resource_metrics for sm in rm.scope_metrics]
        want = "" if latest else sc.SCHEMA_URL
        assert spans and {(ss.scope.name, ss.schema_url) for ss in spans} == {("llmtap", want)}
        # One scope for every metric: the request's instruments and the exporters' own counters alike.
        assert metrics and {(sm.scope.name, sm.schema_url) for sm in metrics} == {("llmtap", want)}
        assert {sm.scope.version for sm in metrics} == {ss.scope.version for ss in spans} != {""}
    finally:
        proxy.close()
        receiver.close()


def test_latest_token_counters_over_otlp_reasoning_and_unknown_modality(upstream: Scripted, tmp_path: Path) -> None:
    """Under ``gen_ai_latest_experimental`` every token counter of the migration guide arrives, the reasoning one
    too; the scripted server's usage names no modality, so none reads ``text``: the conventions ask ``unknown``."""
    receiver = HTTPReceiver()
    env = otlp_env(receiver, OTEL_SEMCONV_STABILITY_OPT_IN="gen_ai_latest_experimental")
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        chat(proxy)
        names = (
            str(sc.LATEST.input_tokens_counter),
            str(sc.LATEST.output_tokens_counter),
            "gen_ai.client.inference.usage.reasoning.output_tokens",
        )
        got = receiver.received
        wait_for("token counters over OTLP", lambda: set(names) <= set(got.latest_metrics()), proxy)
        metrics = got.latest_metrics()
        for name in names:
            _, metric = metrics[name]
            assert metric.unit == "{token}" and metric.WhichOneof("data") == "sum", name
            modalities = {
                kv.value.string_value
                for point in metric.sum.data_points
                for kv in point.attributes
                if kv.key == sc.TOKEN_MODALITY
            }
            assert modalities == {"unknown"}, (name, modalities)
        _, output = metrics[str(sc.LATEST.output_tokens_counter)]
        assert sum(p.as_int for p in output.sum.data_points) > 0
        _, reasoning = metrics["gen_ai.client.inference.usage.reasoning.output_tokens"]
        assert sum(p.as_int for p in reasoning.sum.data_points) == 0  # the scripted usage reports no reasoning
    finally:
        proxy.close()
        receiver.close()
