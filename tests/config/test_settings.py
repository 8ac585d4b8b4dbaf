"""Pure units: building ``Settings`` from flags, env, file and ``OTEL_*``; routing and header hygiene."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.config.load import build
from llmtap.config.otel import telemetry_from_env
from llmtap.config.types import ConfigError, Route
from llmtap.relay.app import Router
from llmtap.relay.forward import request_headers, response_headers, upstream_url

UP = "http://127.0.0.1:9"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "llmtap.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- precedence ---------------------------------------------------------------------------------


def test_defaults() -> None:
    s = build({"upstream": UP}, env={})
    assert (s.host, s.port, s.admin_host, s.admin_port) == ("127.0.0.1", 8080, "127.0.0.1", 9464)
    assert s.routes == (Route(prefix="/", upstream=UP, name="default"),)
    assert s.inject_usage is True and s.log_level == "info"
    assert not s.slo.configured
    assert s.telemetry.traces_exporter == "none" and s.telemetry.metrics_exporter == "none"


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "upstream: http://file.example\nlisten: {port: 3003, host: 0.0.0.0}\nadmin: {port: 4003}\n"
        "timeouts: {read: 33, connect: 3}\nlog_level: warning\n",
    )
    env = {"LLMTAP_CONFIG": cfg, "LLMTAP_PORT": "2002", "LLMTAP_READ_TIMEOUT": "22", "LLMTAP_UPSTREAM": "http://env.x"}
    s = build({"port": 1001, "config": None}, env=env)
    assert s.port == 1001  # flag beats env and file
    assert s.timeouts.read == 22.0  # env beats file
    assert s.routes[0].upstream == "http://env.x"
    assert s.admin_port == 4003 and s.host == "0.0.0.0" and s.timeouts.connect == 3.0  # file beats defaults
    assert s.log_level == "warning"
    assert s.timeouts.write == 60.0  # default
    s = build({}, env={**env, "LLMTAP_PORT": "", "LLMTAP_UPSTREAM": ""})  # an empty variable counts as unset
    assert s.port == 3003 and s.routes[0].upstream == "http://file.example"


def test_client_limits_flags_env_file_and_defaults(tmp_path: Path) -> None:
    s = build({"upstream": UP}, env={})
    assert (s.timeouts.client_header, s.timeouts.client_body, s.timeouts.keep_alive) == (20.0, 60.0, 75.0)
    assert s.max_client_connections is None  # derived from the descriptor limit when the relay starts
    cfg = write(
        tmp_path,
        "timeouts: {client_header: 7, client_body: 8, keep_alive: 9}\nmax_client_connections: 100\n",
    )
    s = build({"upstream": UP, "config": cfg}, env={})
    assert (s.timeouts.client_header, s.timeouts.client_body, s.timeouts.keep_alive) == (7.0, 8.0, 9.0)
    assert s.max_client_connections == 100
    env = {"LLMTAP_CLIENT_HEADER_TIMEOUT": "3", "LLMTAP_KEEP_ALIVE_TIMEOUT": "4", "LLMTAP_MAX_CLIENT_CONNECTIONS": "50"}
    s = build({"upstream": UP, "config": cfg, "client_body_timeout": 2.5, "max_client_connections": 10}, env=env)
    assert (s.timeouts.client_header, s.timeouts.client_body, s.timeouts.keep_alive) == (3.0, 2.5, 4.0)
    assert s.max_client_connections == 10


def test_flag_config_wins_over_env_config(tmp_path: Path) -> None:
    (tmp_path / "other.yaml").write_text("listen: {port: 5005}\n", encoding="utf-8")
    cfg = write(tmp_path, "listen: {port: 6006}\n")
    s = build({"upstream": UP, "config": cfg}, env={"LLMTAP_CONFIG": str(tmp_path / "other.yaml")})
    assert s.port == 6006


def test_slo_ms_become_seconds(tmp_path: Path) -> None:
    cfg = write(tmp_path, "slo: {ttft_ms: 250, tpot_ms: 40, e2e_ms: 5000}\n")
    s = build({"upstream": UP, "config": cfg, "slo_tpot_ms": 20.0}, env={"LLMTAP_SLO_E2E_MS": "1500"})
    assert s.slo.ttft == pytest.approx(0.25)
    assert s.slo.tpot == pytest.approx(0.02)
    assert s.slo.e2e == pytest.approx(1.5)
    assert s.slo.configured


def test_chunk_spans_flag_env_file(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare ``off`` as False: it still means the mode "off".
    bare = write(tmp_path, "upstream: http://u.example\ntelemetry: {chunk_spans: off}\n")
    assert build({"config": bare}, env={}).telemetry.chunk_spans == "off"
    cfg = write(tmp_path, "upstream: http://u.example\ntelemetry: {chunk_spans: 'off', chunk_span_cap: 7}\n")
    assert build({"config": cfg}, env={}).telemetry.chunk_spans == "off"
    assert build({"config": cfg}, env={"LLMTAP_CHUNK_SPANS": "events"}).telemetry.chunk_spans == "events"
    s = build({"config": cfg, "chunk_spans": "spans"}, env={"LLMTAP_CHUNK_SPANS": "events"})
    assert s.telemetry.chunk_spans == "spans" and s.telemetry.chunk_span_cap == 7


def test_histogram_buckets_server_metrics_and_aggregation(tmp_path: Path) -> None:
    default = build({"upstream": UP}, env={}).telemetry
    assert (default.histogram_buckets, default.server_metrics) == ("fine", False)
    assert default.histogram_aggregation == "explicit_bucket_histogram"
    text = "upstream: http://u.example\ntelemetry: {histogram_buckets: standard, server_metrics: true}\n"
    cfg = write(tmp_path, text)
    t = build({"config": cfg}, env={}).telemetry
    assert (t.histogram_buckets, t.server_metrics) == ("standard", True)
    env = {"LLMTAP_HISTOGRAM_BUCKETS": "fine", "LLMTAP_SERVER_METRICS": "false"}
    t = build({"config": cfg}, env=env).telemetry
    assert (t.histogram_buckets, t.server_metrics) == ("fine", False)
    t = build({"config": cfg, "histogram_buckets": "standard", "server_metrics": True}, env=env).telemetry
    assert (t.histogram_buckets, t.server_metrics) == ("standard", True)
    base2 = "base2_exponential_bucket_histogram"
    variable = {"OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": base2}
    assert build({"upstream": UP}, env=variable).telemetry.histogram_aggregation == base2


# --- routes from a file -------------------------------------------------------------------------


def test_routes_longest_prefix_first(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "provider: openai\n"
        "routes:\n"
        "  - {prefix: /openai, upstream: 'https://api.openai.com/'}\n"
        "  - {prefix: /openai/v2/, upstream: 'http://v2.example:8000', name: v2}\n"
        "  - {prefix: /anthropic, upstream: 'https://api.anthropic.com', provider: anthropic, strip_prefix: true}\n",
    )
    s = build({"config": cfg}, env={})
    assert [r.prefix for r in s.routes] == ["/openai/v2", "/anthropic", "/openai"]
    by = {r.prefix: r for r in s.routes}
    assert by["/openai"].upstream == "https://api.openai.com"  # trailing slash normalized
    assert by["/openai"].name == "openai" and by["/openai/v2"].name == "v2"
    assert by["/openai"].provider == "openai"  # top-level provider is the default
    assert by["/anthropic"].provider == "anthropic" and by["/anthropic"].strip_prefix
    assert not by["/openai"].strip_prefix
    assert by["/openai/v2"].port == 8000 and by["/openai"].port == 443 and by["/openai"].host == "api.openai.com"


def test_upstream_flag_replaces_file_default_route(tmp_path: Path) -> None:
    cfg = write(
        tmp_path, "routes:\n  - {prefix: /, upstream: 'http://a.example'}\n  - {prefix: /b, upstream: 'http://b'}\n"
    )
    s = build({"config": cfg, "upstream": UP}, env={})
    assert [(r.prefix, r.upstream) for r in s.routes] == [("/b", "http://b"), ("/", UP)]


# --- errors: one ConfigError naming the key ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("bogus: 1\n", "unknown key 'bogus'; known: "),
        ("listen: {port: 1, hots: x}\n", "listen.hots"),
        ("slo: {ttft: 100}\n", "unknown key 'slo.ttft'; did you mean 'slo.ttft_ms'?"),
        ("listen: {1: a, b: 2}\n", "listen."),
        ("routes:\n  - {prefix: /a, upstream: 'http://a', strip: true}\n", "routes[0]: unknown key 'strip'"),
        ("routes:\n  - {prefix: /a, upstream: 'localhost:8000'}\n", "routes[0].upstream"),
        ("routes:\n  - {prefix: /a}\n", "routes[0].upstream"),
        ("routes:\n  - {prefix: a, upstream: 'http://a'}\n", "routes[0].prefix"),
        ("routes:\n  - {prefix: /a, upstream: 'http://a', strip_prefix: maybe}\n", "routes[0].strip_prefix"),
        ("routes: {prefix: /a}\n", "'routes' must be a list"),
        ("routes:\n  - {prefix: /a, upstream: 'http://a'}\n  - {prefix: /a/, upstream: 'http://b'}\n", "routes"),
        ("listen: {port: 70000}\n", "port"),
        ("listen: {port: .inf}\n", "port"),
        ("admin: {port: -1}\n", "llmtap.yaml: admin.port: expected an integer from 0 to 65535, got -1"),
        ("timeouts: {read: soon}\n", "timeouts.read: expected a number of seconds >= 0, got 'soon'"),
        ("slo: {e2e_ms: .nan}\n", "e2e_ms"),
        ("max_connections: 0\n", "max_connections"),
        ("inject_usage: perhaps\n", "inject_usage"),
        ("log_level: loud\n", "log_level: expected one of debug, info, warning, error"),
        ("listen: 8080\n", "'listen' must be a mapping"),
        ("- a\n- b\n", "top level"),
        ("routes: [\n", "invalid YAML at line"),
    ],
)
def test_file_errors_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    cfg = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        build({"config": cfg, "upstream": None if "routes:" in text else UP}, env={})
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml"):
        build({"config": str(tmp_path / "missing.yaml")}, env={})
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(ConfigError, match="not UTF-8"):
        build({"config": str(tmp_path / "bin.yaml")}, env={})


@pytest.mark.parametrize(
    "url",
    [
        "localhost:8000",
        "127.0.0.1:8000",
        "ftp://files.example",
        "http://h.example/v1?key=1",
        "http://h.example/#frag",
        "http://user:pw@h.example",
        "http://h.example:99999",
        "http://",
        "",
    ],
)
def test_bad_upstream_url(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        build({"upstream": url}, env={})
    assert str(info.value).startswith(f"--upstream {url or repr(url)}: expected "), str(info.value)


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"port": 70000}, {}, "--port 70000: expected an integer from 0 to 65535"),
        ({}, {"LLMTAP_PORT": "eighty"}, "LLMTAP_PORT=eighty: expected an integer"),
        ({}, {"LLMTAP_ADMIN_PORT": "1.5"}, "LLMTAP_ADMIN_PORT=1.5: expected an integer"),
        ({}, {"LLMTAP_READ_TIMEOUT": "-1"}, "LLMTAP_READ_TIMEOUT=-1: expected a number of seconds >= 0"),
        ({}, {"LLMTAP_READ_TIMEOUT": "nan"}, "LLMTAP_READ_TIMEOUT=nan: "),
        ({"connect_timeout": float("inf")}, {}, "--connect-timeout inf: "),
        ({}, {"LLMTAP_SLO_TTFT_MS": "fast"}, "LLMTAP_SLO_TTFT_MS=fast: expected a number of milliseconds"),
        ({}, {"LLMTAP_MAX_INSPECT_BYTES": "lots"}, "LLMTAP_MAX_INSPECT_BYTES=lots: "),
        ({"client_header_timeout": 0.0}, {}, "--client-header-timeout 0.0: expected a number of seconds > 0"),
        ({}, {"LLMTAP_CLIENT_BODY_TIMEOUT": "-1"}, "LLMTAP_CLIENT_BODY_TIMEOUT=-1: "),
        ({}, {"LLMTAP_KEEP_ALIVE_TIMEOUT": "never"}, "LLMTAP_KEEP_ALIVE_TIMEOUT=never: expected a number"),
        ({}, {"LLMTAP_MAX_CLIENT_CONNECTIONS": "0"}, "LLMTAP_MAX_CLIENT_CONNECTIONS=0: expected an integer >= 1"),
        ({}, {"LLMTAP_MAX_CLIENT_CONNECTIONS": "many"}, "LLMTAP_MAX_CLIENT_CONNECTIONS=many: expected an"),
        ({}, {"LLMTAP_INJECT_USAGE": "2"}, "LLMTAP_INJECT_USAGE=2: expected true or false"),
        ({}, {"LLMTAP_CHUNK_SPANS": "all"}, "LLMTAP_CHUNK_SPANS=all: expected one of spans, events, off"),
        ({}, {"LLMTAP_CHUNK_SPAN_CAP": "0"}, "LLMTAP_CHUNK_SPAN_CAP=0: "),
        ({}, {"LLMTAP_HISTOGRAM_BUCKETS": "coarse"}, "LLMTAP_HISTOGRAM_BUCKETS=coarse: expected one of standard, fine"),
        ({}, {"LLMTAP_SERVER_METRICS": "maybe"}, "LLMTAP_SERVER_METRICS=maybe: expected true or false"),
        (
            {},
            {"OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "exponential"},
            "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION: 'exponential' is not one of",
        ),
        ({}, {"OTEL_SDK_DISABLED": "sometimes"}, "OTEL_SDK_DISABLED"),
        ({}, {"OTEL_METRIC_EXPORT_INTERVAL": "0"}, "OTEL_METRIC_EXPORT_INTERVAL"),
        ({}, {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({}, {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "ftp://c"}, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"),
        ({}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({}, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ({}, {"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, "OTEL_EXPORTER_OTLP_HEADERS"),
        ({}, {"OTEL_EXPORTER_OTLP_METRICS_HEADERS": "=v"}, "OTEL_EXPORTER_OTLP_METRICS_HEADERS"),
    ],
)
def test_bad_values_name_the_key(flags: dict[str, Any], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build({"upstream": UP, **flags}, env=env)
    assert str(info.value).startswith(needle), str(info.value)


def test_no_upstream_at_all() -> None:
    with pytest.raises(ConfigError, match="no upstream"):
        build({}, env={})


# --- OTEL_* -------------------------------------------------------------------------------------


def test_no_endpoint_means_no_exporter() -> None:
    t = telemetry_from_env({})
    assert (t.traces_exporter, t.metrics_exporter) == ("none", "none")
    assert t.traces_endpoint is None and t.metrics_endpoint is None
    assert t.traces_protocol == "grpc" and t.metric_export_interval_ms == 10_000
    assert t.prometheus and not t.sdk_disabled


def test_signal_endpoint_wins_over_base() -> None:
    t = telemetry_from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317/",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4318/v1/traces",
        }
    )
    assert t.traces_endpoint == "http://tempo:4318/v1/traces"
    assert t.metrics_endpoint == "http://collector:4317"
    assert (t.traces_exporter, t.metrics_exporter) == ("otlp", "otlp")


def test_exporter_variables() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    t = telemetry_from_env({**base, "OTEL_METRICS_EXPORTER": "none"})
    assert (t.traces_exporter, t.metrics_exporter) == ("otlp", "none")
    t = telemetry_from_env({"OTEL_TRACES_EXPORTER": "Console"})
    assert t.traces_exporter == "console" and t.metrics_exporter == "none"
    # Asked for OTLP by name with no endpoint: the spec's default local collector, per protocol.
    t = telemetry_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert t.traces_exporter == "otlp" and t.traces_endpoint == "http://localhost:4318"
    t = telemetry_from_env({"OTEL_METRICS_EXPORTER": "otlp"})
    assert t.metrics_endpoint == "http://localhost:4317" and t.traces_exporter == "none"


def test_protocol_per_signal() -> None:
    t = telemetry_from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
        }
    )
    assert (t.traces_protocol, t.metrics_protocol) == ("http/protobuf", "grpc")


def test_headers_parsing() -> None:
    t = telemetry_from_env(
        {
            "OTEL_EXPORTER_OTLP_HEADERS": " X-Tenant=abc , Authorization=Bearer%20tok%3D%3D,,k=a=b",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=traces-only",
        }
    )
    # The traces' own variable replaces the general one whole, as the SDK's exporters read them.
    assert dict(t.traces_headers) == {"x-tenant": "traces-only"}
    t = telemetry_from_env({"OTEL_EXPORTER_OTLP_HEADERS": " X-Tenant=abc , Authorization=Bearer%20tok%3D%3D,,k=a=b"})
    assert dict(t.traces_headers) == {"x-tenant": "abc", "authorization": "Bearer tok==", "k": "a=b"}


def test_sdk_disabled_turns_exporters_off() -> None:
    t = telemetry_from_env({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert t.sdk_disabled and (t.traces_exporter, t.metrics_exporter) == ("none", "none")
    assert not telemetry_from_env({"OTEL_SDK_DISABLED": "false"}).sdk_disabled


@pytest.mark.parametrize(
    ("value", "latest"),
    [("gen_ai_latest_experimental", True), ("http, gen_ai_latest_experimental", True), ("http", False), ("", False)],
)
def test_semconv_opt_in(value: str, latest: bool) -> None:
    assert telemetry_from_env({"OTEL_SEMCONV_STABILITY_OPT_IN": value}).semconv_latest is latest


@pytest.mark.parametrize(
    ("value", "capture"),
    [
        ("true", True),
        ("1", True),
        ("SPAN_ONLY", True),
        ("span_and_event", True),
        ("EVENT_ONLY", True),
        ("false", False),
        ("NO_CONTENT", False),
        ("", False),
    ],
)
def test_capture_content(value: str, capture: bool) -> None:
    env = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": value}
    assert telemetry_from_env(env).capture_content is capture


def test_metric_interval_and_telemetry_file_section() -> None:
    t = telemetry_from_env(
        {"OTEL_METRIC_EXPORT_INTERVAL": "500", "LLMTAP_TELEMETRY_QUEUE": "64"},
        {"queue_size": 8, "prometheus": False, "chunk_span_cap": 3},
    )
    assert t.metric_export_interval_ms == 500 and t.queue_size == 64
    assert t.prometheus is False and t.chunk_span_cap == 3


# --- forward: upstream URL ----------------------------------------------------------------------


def route(prefix: str = "/", upstream: str = "http://up.example:8000", *, strip: bool = False) -> Route:
    return Route(prefix=prefix, upstream=upstream, name="r", strip_prefix=strip)


def test_upstream_url_joins_base_path_and_query() -> None:
    r = route(upstream="http://up.example:8000/api")
    assert upstream_url(r, b"/v1/chat/completions", b"") == "http://up.example:8000/api/v1/chat/completions"
    assert upstream_url(r, b"/v1/models", b"a=1&b=%20") == "http://up.example:8000/api/v1/models?a=1&b=%20"
    assert upstream_url(r, b"", b"") == "http://up.example:8000/api/"


def test_upstream_url_strips_prefix_on_request() -> None:
    r = route("/openai", strip=True)
    assert upstream_url(r, b"/openai/v1/chat/completions", b"") == "http://up.example:8000/v1/chat/completions"
    assert upstream_url(r, b"/openai", b"") == "http://up.example:8000/"
    kept = route("/openai", strip=False)
    assert upstream_url(kept, b"/openai/v1/x", b"") == "http://up.example:8000/openai/v1/x"


def test_upstream_url_keeps_raw_percent_encoding() -> None:
    r = route()
    assert upstream_url(r, b"/v1/files/a%2Fb%20c", b"") == "http://up.example:8000/v1/files/a%2Fb%20c"


@pytest.mark.parametrize(
    "raw",
    [b"//evil.example/x", b"http://evil.example/x", b"https://evil.example:443/x", b"/..//evil.example", b"@evil"],
)
def test_upstream_url_never_changes_host(raw: bytes) -> None:
    url = httpx.URL(upstream_url(route(), raw, b""))
    assert (url.host, url.port, url.scheme) == ("up.example", 8000, "http")


# --- forward: headers ---------------------------------------------------------------------------

TRACE = [(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]


def names(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [k.lower() for k, _ in headers]


def test_request_headers_hygiene() -> None:
    incoming = [
        (b"Host", b"proxy.local"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"1"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"TE", b"trailers"),
        (b"Upgrade", b"h2c"),
        (b"Proxy-Authorization", b"Basic x"),
        (b"X-LLMTAP-Prompt-Version", b"v2"),
        (b"Authorization", b"Bearer sk-test"),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", b"10"),
        (b"traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01"),
        (b"tracestate", b"k=v"),
    ]
    out = request_headers(incoming, trace=None, body_changed=False)
    assert names(out) == [b"authorization", b"content-type", b"content-length", b"traceparent", b"tracestate"]
    assert dict(out)[b"Authorization"] == b"Bearer sk-test"  # case and value kept
    # With tracing on, the proxy's trace context replaces the client's; a changed body drops the length.
    out = request_headers(incoming, trace=TRACE, body_changed=True)
    assert names(out) == [b"authorization", b"content-type", b"traceparent"]
    assert dict(out)[b"traceparent"] == TRACE[0][1]


def test_response_headers_hygiene() -> None:
    upstream = [
        (b"content-type", b"text/event-stream"),
        (b"connection", b"close, x-internal"),
        (b"x-internal", b"1"),
        (b"transfer-encoding", b"chunked"),
        (b"content-length", b"42"),
        (b"x-request-id", b"abc"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]
    out = response_headers(iter(upstream), body_changed=False)
    assert out == [
        (b"content-type", b"text/event-stream"),
        (b"content-length", b"42"),
        (b"x-request-id", b"abc"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]
    assert b"content-length" not in names(response_headers(upstream, body_changed=True))


def test_response_headers_with_nothing_to_drop_are_a_copy_of_the_answers() -> None:
    upstream = [(b"Content-Type", b"application/json"), (b"content-length", b"2"), (b"x-a", b"1")]
    out = response_headers(upstream, body_changed=False)
    assert out == upstream and out is not upstream
    out.append((b"server-timing", b"x"))  # the relay appends to it: the answer's own list stays as it came
    assert len(upstream) == 3
    assert names(response_headers(upstream, body_changed=False, status=204)) == [b"content-type", b"x-a"]
    assert names(response_headers(upstream, body_changed=False, status=304)) == [b"content-type", b"x-a"]
    encoded = [*upstream, (b"Content-Encoding", b"gzip")]
    assert names(response_headers(encoded, body_changed=False, decoded=True)) == names(upstream)
    listed = [*upstream, (b"CONNECTION", b"X-A"), (b"Keep-Alive", b"timeout=5")]
    assert names(response_headers(listed, body_changed=False)) == [b"content-type", b"content-length"]


# --- forward: router ----------------------------------------------------------------------------


def test_router_matches_on_segment_boundary() -> None:
    openai_v1, openai = route("/openai/v1"), route("/openai")
    router = Router((openai_v1, openai))
    assert router.match("/openai/v1/chat") is openai_v1
    assert router.match("/openai/v1") is openai_v1
    assert router.match("/openai/v10") is openai
    assert router.match("/openai") is openai
    assert router.match("/openaiX/v1") is None
    assert router.match("/other") is None
    fallback = route("/")
    assert Router((openai, fallback)).match("/openaiX") is fallback
