"""One frozen ``Settings``, built at the edge from flags, ``LLMTAP_*`` variables, a YAML file and ``OTEL_*``.

Precedence: flags, then environment, then the file, then defaults. Anything wrong raises
``ConfigError`` with a one-line message; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from proxy.labels import LABEL_CAP, clean
from proxy.versions import INVALID_VERSION, VERSION_MAX_BYTES, version_label

CHUNK_SPAN_MODES = ("spans", "events", "off")
#: What the proxy's span is in a trace: the GenAI generation (``chat {model}``, with usage), or the HTTP hop
#: under the client's own generation span (no ``gen_ai.*``, so trace backends count one generation);
#: ``auto``: the hop when the request arrives with a ``traceparent``, the generation otherwise.
SPAN_ROLES = ("auto", "generation", "hop")
#: The client for upstreams: llmtap's own HTTP/1.1 one (``proxy.relay.upstream_http``), or httpx's.
UPSTREAM_CLIENTS = ("lean", "httpx")
SEMCONV_LATEST = "gen_ai_latest_experimental"
#: Buckets of the ``gen_ai.*`` histograms: the conventions' advisory ones, or llmtap's fine ones.
HISTOGRAM_BUCKETS = ("standard", "fine")
#: ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``: the histograms' aggregation over OTLP.
EXPLICIT = "explicit_bucket_histogram"
EXPONENTIAL = "base2_exponential_bucket_histogram"


class ConfigError(ValueError):
    """A configuration the proxy cannot run with; the message is one line, meant for the user."""


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in seconds; a request that meets all configured ones counts for goodput."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @property
    def configured(self) -> bool:
        """True when at least one objective is set."""
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))


@dataclass(frozen=True, slots=True)
class Route:
    """Requests whose path starts with ``prefix`` go to ``upstream``, and nowhere else."""

    prefix: str
    upstream: str
    name: str
    provider: str | None = None
    strip_prefix: bool = False
    #: The admission queue: at most this many requests in flight to the upstream (None: no limit) ...
    max_concurrency: int | None = None
    #: ... with at most this many waiting in line, first come first served ...
    queue_limit: int = 100
    #: ... and at most this long (seconds; None: no limit). A request the line cannot take gets this
    #: status (429 or 503) with ``Retry-After``.
    queue_timeout: float | None = None
    queue_full_status: int = 503
    retry_after: int = 1
    #: How many sequences the upstream server runs at once (vLLM ``--max-num-seqs``): lets the
    #: estimator replay its admissions. None: learn the unloaded TTFT line instead.
    server_slots: int | None = None
    #: The upstream's prefill rate in input tokens per second, when known; else learned.
    prefill_rate: float | None = None
    #: The prompt version of requests that send no ``x-llmtap-prompt-version`` header (None: none).
    prompt_version: str | None = None
    #: The shortest prompt the upstream caches, in tokens (None: by the kind of server, see ``cachediag``).
    cache_min_tokens: int | None = None
    #: HTTPS upstreams (``proxy.relay.tls``): a CA bundle file and directory to verify the upstream with instead of
    #: the default roots; a client certificate for mutual TLS (its key in ``tls_key`` or in the same file);
    #: the name sent as SNI and verified, when it is not the URL's host; ``tls_verify=False`` verifies nothing.
    tls_ca: str | None = None
    tls_ca_dir: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    tls_verify: bool = True

    @property
    def host(self) -> str:
        """The upstream's host name."""
        return urlsplit(self.upstream).hostname or ""

    @property
    def port(self) -> int:
        """The upstream's port, explicit or by scheme."""
        parts = urlsplit(self.upstream)
        return parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Timeouts in seconds: the upstream's (connect, response headers, silence between chunks), clients', shutdown's.

    ``read`` bounds the wait for the response headers and, unless ``idle`` is set, every silence between
    two chunks of the body. On SIGTERM, streams in flight get ``drain`` seconds to finish, then telemetry
    gets ``flush`` seconds to reach the collector; past either, what is left is cut (and counted).

    A client must send a whole request head within ``client_header`` of its first byte, may fall silent
    for at most ``client_body`` while its request body is still arriving, and may keep a connection open
    without a request for at most ``keep_alive`` (a new connection as one between requests; nginx's
    ``client_header_timeout``, ``client_body_timeout`` and ``keepalive_timeout``).
    """

    connect: float = 10.0
    read: float = 600.0
    write: float = 60.0
    pool: float = 10.0
    idle: float | None = None
    drain: float = 30.0
    flush: float = 5.0
    client_header: float = 20.0
    client_body: float = 60.0
    keep_alive: float = 75.0  # nginx's default: past what clients keep an idle connection (httpx: 5 s)

    @property
    def between_chunks(self) -> float:
        """The longest silence allowed between two chunks of a response body."""
        return self.read if self.idle is None else self.idle


@dataclass(frozen=True, slots=True)
class Telemetry:
    """Where telemetry goes and how much of it; mostly from the standard ``OTEL_*`` variables."""

    sdk_disabled: bool = False
    traces_exporter: str = "none"
    metrics_exporter: str = "none"
    traces_endpoint: str | None = None
    metrics_endpoint: str | None = None
    #: True when the endpoint came from the signal's own variable (used as is; a base one gets ``/v1/<signal>``).
    traces_endpoint_specific: bool = False
    metrics_endpoint_specific: bool = False
    traces_protocol: str = "grpc"
    metrics_protocol: str = "grpc"
    traces_headers: Mapping[str, str] = field(default_factory=dict)
    metrics_headers: Mapping[str, str] = field(default_factory=dict)
    metric_export_interval_ms: int = 10_000
    semconv_latest: bool = False
    capture_content: bool = False
    chunk_spans: str = "spans"
    chunk_span_cap: int = 200
    queue_size: int = 4096
    prometheus: bool = True
    #: Model names that always keep their own label on metrics, however rarely used (``LLMTAP_METRIC_MODELS``).
    metric_models: tuple[str, ...] = ()
    #: ``standard``: the ``gen_ai.*`` histograms use the conventions' advisory buckets; ``fine``: llmtap's
    #: (2^(1/8) apart), as its own latency histograms always do.
    histogram_buckets: str = "standard"
    #: Also emit ``gen_ai.server.*``, the model server's own metric names, with values that include the hop.
    server_metrics: bool = False
    #: How histograms go over OTLP (``/metrics`` is always explicit buckets): ``EXPLICIT`` or ``EXPONENTIAL``.
    histogram_aggregation: str = EXPLICIT
    #: ``SPAN_ROLES``: the proxy span's role in the trace.
    span_role: str = "auto"
    #: Report tiktoken's counts as ``gen_ai.usage.*`` when the upstream reports no usage ("offline token
    #: counting", which the GenAI conventions allow only when the user enables it); they are always under
    #: ``llmtap.usage.*`` with their source.
    offline_token_usage: bool = False
    #: How long a finished request to an upstream that exports its own spans (vLLM's
    #: ``--otlp-traces-endpoint`` pointed at the admin listener's ``/v1/traces``) waits for its span, seconds;
    #: 0: never (the span then counts as late). Covers vLLM's default batch delay of 5 s.
    server_spans_wait: float = 10.0


@dataclass(frozen=True, slots=True)
class Records:
    """Request records (``--record PATH``): JSON lines, a new file past ``max_bytes``, ``files`` files at most."""

    path: str | None = None
    max_bytes: int = 64 << 20
    files: int = 5


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the proxy needs to run; immutable, passed down by constructors."""

    routes: tuple[Route, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9464
    timeouts: Timeouts = field(default_factory=Timeouts)
    telemetry: Telemetry = field(default_factory=Telemetry)
    slo: SLO = field(default_factory=SLO)
    inject_usage: bool = True
    max_inspect_bytes: int = 8 * 1024 * 1024
    #: A request body larger than this is refused with 413; its request line and headers together
    #: may hold at most ``max_header_bytes`` (431).
    max_request_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    #: The receive buffer (SO_RCVBUF) of each upstream connection: with a client that reads slowly, about
    #: what one stream can make the proxy hold. 0 leaves the kernel's own, which grows to megabytes.
    stream_buffer_bytes: int = 128 * 1024
    #: Connections to each upstream at most (the pool).
    max_connections: int = 1000
    #: Client connections open at once, per relay process, at most; past it a new one is answered 503 and
    #: closed. None: derived from the descriptor limit at start (``proxy.relay.protocol.connection_cap``).
    max_client_connections: int | None = None
    #: ``lean``: upstreams, HTTP and HTTPS, go through ``proxy.relay.upstream_http`` (less CPU per chunk); ``httpx``:
    #: through httpx's own transport (with the same TLS context).
    upstream_client: str = "lean"
    log_level: str = "info"
    record: Records = field(default_factory=Records)
    #: Relay processes sharing the proxy port (SO_REUSEPORT).
    workers: int = 1
    #: Telemetry processes; each upstream's tapes go to one of them (so its estimator sees all its requests).
    telemetry_workers: int = 1


# ----------------------------------------------------------------------------------------------
# Building settings at the edge.

#: Route options that can also be given once for every route (flags, ``LLMTAP_*``, top level of the file).
_ROUTE_OPTIONS = (
    "max_concurrency",
    "queue_limit",
    "queue_timeout",
    "queue_full_status",
    "retry_after",
    "server_slots",
    "prefill_rate",
    "prompt_version",
    "cache_min_tokens",
)
#: The TLS settings of a route (``routes[].tls_*`` in the file) and, for the ``--upstream`` route and as the
#: default of every https:// route of the file, their flag and ``LLMTAP_*`` variable.
_TLS_OPTIONS = {
    "tls_ca": ("upstream_ca", "LLMTAP_UPSTREAM_CA"),
    "tls_ca_dir": ("upstream_ca_dir", "LLMTAP_UPSTREAM_CA_DIR"),
    "tls_cert": ("upstream_cert", "LLMTAP_UPSTREAM_CERT"),
    "tls_key": ("upstream_key", "LLMTAP_UPSTREAM_KEY"),
    "tls_server_name": ("upstream_server_name", "LLMTAP_UPSTREAM_SERVER_NAME"),
    "tls_verify": ("upstream_insecure", "LLMTAP_UPSTREAM_INSECURE"),
}
_FILE_KEYS = {
    "listen": {"host", "port"},
    "admin": {"host", "port"},
    "routes": None,
    "timeouts": {
        "connect",
        "read",
        "idle",
        "write",
        "pool",
        "drain",
        "flush",
        "client_header",
        "client_body",
        "keep_alive",
    },
    "telemetry": {
        "chunk_spans",
        "chunk_span_cap",
        "queue_size",
        "prometheus",
        "metric_models",
        "histogram_buckets",
        "server_metrics",
        "span_role",
        "offline_token_usage",
        "server_spans_wait",
    },
    "slo": {"ttft_ms", "tpot_ms", "e2e_ms"},
    "inject_usage": None,
    "max_inspect_bytes": None,
    "max_request_bytes": None,
    "max_header_bytes": None,
    "stream_buffer_bytes": None,
    "max_connections": None,
    "max_client_connections": None,
    "upstream_client": None,
    "workers": None,
    "telemetry_workers": None,
    "log_level": None,
    "upstream": None,
    "provider": None,
    "record": {"path", "max_mb", "files"},
    **dict.fromkeys(_ROUTE_OPTIONS),
    **dict.fromkeys(_TLS_OPTIONS),
}
_ROUTE_KEYS = {"prefix", "upstream", "provider", "strip_prefix", "name", *_ROUTE_OPTIONS, *_TLS_OPTIONS}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{what}: expected true or false, got {value!r}")


def _number(value: Any, what: str, *, integer: bool = False, minimum: float = 0.0) -> float:
    try:
        number = int(value) if integer else float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number) or number < minimum:
        raise ConfigError(f"{what}: expected a number >= {minimum:g}, got {value!r}")
    return number


def _optional_number(value: Any, what: str) -> float | None:
    return None if value is None else _number(value, what)


def _positive(value: Any, what: str) -> float:
    """A length of time that must pass before anything is cut: 0 would cut at once."""
    number = _number(value, what)
    if number <= 0:
        raise ConfigError(f"{what}: expected seconds > 0, got {value!r}")
    return number


def _size(value: Any, what: str) -> int:
    """A byte limit: a whole number of at least 1 KiB (anything smaller could not hold one request line)."""
    return int(_number(value, what, integer=True, minimum=1024))


def _buffer(value: Any) -> int:
    size = int(_number(value, "stream_buffer_bytes", integer=True))
    if 0 < size < 4096:
        raise ConfigError(f"stream_buffer_bytes: expected 0 (the kernel's) or at least 4096, got {value!r}")
    return size


def _port(value: Any, what: str) -> int:
    port = int(_number(value, what, integer=True))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what}: expected a port 0-65535, got {value!r}")
    return port


def check_url(url: Any, what: str) -> str:
    """A normalized upstream base URL (http or https, a host, no query), else ``ConfigError``."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{what}: expected a URL such as https://api.openai.com, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{what}: bad URL {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what}: bad URL {url!r}: needs http:// or https:// and a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"{what}: bad URL {url!r}: no query, fragment or credentials allowed")
    del port
    return url.rstrip("/")


def _headers(text: str | None, what: str = "OTEL_EXPORTER_OTLP_HEADERS") -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS`` form: ``k1=v1,k2=v2`` with percent-encoded values."""
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: bad entry {item.strip()!r}; expected key=value")
        out[unquote(key.strip()).lower()] = unquote(value.strip())
    return out


def _otlp_endpoint(env: Mapping[str, str], signal: str) -> str | None:
    """Signal endpoint as the OTLP exporter spec resolves it (signal-specific wins, base gets ``/v1/<signal>``)."""
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return check_url(specific, f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base:
        return check_url(base, "OTEL_EXPORTER_OTLP_ENDPOINT")
    return None


def telemetry_from_env(env: Mapping[str, str], file_section: Mapping[str, Any] | None = None) -> Telemetry:
    """The telemetry settings from ``OTEL_*`` (and the file's ``telemetry:`` section and ``LLMTAP_*``)."""
    section = dict(file_section or {})
    disabled = _bool(env.get("OTEL_SDK_DISABLED", "false"), "OTEL_SDK_DISABLED")
    values: dict[str, Any] = {"sdk_disabled": disabled}
    for signal in ("traces", "metrics"):
        endpoint = _otlp_endpoint(env, signal)
        exporter = env.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
        if not exporter:
            # With no endpoint anywhere, exporting to the SDK's default localhost:4317 would only log
            # errors: stay quiet until the user names a backend. /metrics is always there.
            exporter = "otlp" if endpoint else "none"
        if exporter not in ("otlp", "console", "none"):
            raise ConfigError(f"OTEL_{signal.upper()}_EXPORTER: {exporter!r} is not one of otlp, console, none")
        protocol_key = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
        if not env.get(protocol_key):
            protocol_key = "OTEL_EXPORTER_OTLP_PROTOCOL"
        protocol = (env.get(protocol_key) or "grpc").strip()
        if protocol not in ("grpc", "http/protobuf"):
            raise ConfigError(f"{protocol_key}: {protocol!r} is not one of grpc, http/protobuf")
        if exporter == "otlp" and endpoint is None:
            # Asked for OTLP by name without an endpoint: the spec's default (a local collector or sidecar).
            endpoint = "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318"
        headers = _headers(env.get("OTEL_EXPORTER_OTLP_HEADERS"))
        headers_key = f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS"
        headers.update(_headers(env.get(headers_key), headers_key))
        values[f"{signal}_exporter"] = "none" if disabled else exporter
        values[f"{signal}_endpoint"] = endpoint
        values[f"{signal}_endpoint_specific"] = bool(env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))
        values[f"{signal}_protocol"] = protocol
        values[f"{signal}_headers"] = headers
    values["metric_export_interval_ms"] = int(
        _number(env.get("OTEL_METRIC_EXPORT_INTERVAL", 10_000), "OTEL_METRIC_EXPORT_INTERVAL", integer=True, minimum=1)
    )
    opt_in = {v.strip() for v in env.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")}
    values["semconv_latest"] = SEMCONV_LATEST in opt_in
    capture = env.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().upper()
    values["capture_content"] = capture in ("TRUE", "1", "SPAN_ONLY", "SPAN_AND_EVENT", "EVENT_ONLY")
    chunk_spans = env.get("LLMTAP_CHUNK_SPANS", section.get("chunk_spans", "spans"))
    if chunk_spans is False:  # YAML 1.1 reads a bare ``off`` as false
        chunk_spans = "off"
    if chunk_spans not in CHUNK_SPAN_MODES:
        raise ConfigError(f"chunk_spans: {chunk_spans!r} is not one of {', '.join(CHUNK_SPAN_MODES)}")
    values["chunk_spans"] = chunk_spans
    cap = env.get("LLMTAP_CHUNK_SPAN_CAP", section.get("chunk_span_cap", 200))
    values["chunk_span_cap"] = int(_number(cap, "chunk_span_cap", integer=True, minimum=1))
    qsize = env.get("LLMTAP_TELEMETRY_QUEUE", section.get("queue_size", 4096))
    values["queue_size"] = int(_number(qsize, "queue_size", integer=True, minimum=1))
    values["prometheus"] = _bool(env.get("LLMTAP_PROMETHEUS", section.get("prometheus", True)), "prometheus")
    values["metric_models"] = _metric_models(env.get("LLMTAP_METRIC_MODELS", section.get("metric_models")))
    buckets = str(env.get("LLMTAP_HISTOGRAM_BUCKETS", section.get("histogram_buckets", "standard"))).strip().lower()
    if buckets not in HISTOGRAM_BUCKETS:
        raise ConfigError(f"histogram_buckets: {buckets!r} is not one of {', '.join(HISTOGRAM_BUCKETS)}")
    values["histogram_buckets"] = buckets
    server = env.get("LLMTAP_SERVER_METRICS", section.get("server_metrics", False))
    values["server_metrics"] = _bool(server, "server_metrics")
    # The SDK's OTLP exporters read this variable too, but warn and carry on at a typo: here it is an error.
    key = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    aggregation = env.get(key, "").strip().lower() or EXPLICIT
    if aggregation not in (EXPLICIT, EXPONENTIAL):
        raise ConfigError(f"{key}: {aggregation!r} is not one of {EXPLICIT}, {EXPONENTIAL}")
    values["histogram_aggregation"] = aggregation
    role = env.get("LLMTAP_SPAN_ROLE", section.get("span_role", "auto"))
    if role not in SPAN_ROLES:
        raise ConfigError(f"span_role: {role!r} is not one of {', '.join(SPAN_ROLES)}")
    values["span_role"] = role
    offline = env.get("LLMTAP_OFFLINE_TOKEN_USAGE", section.get("offline_token_usage", False))
    values["offline_token_usage"] = _bool(offline, "offline_token_usage")
    wait = env.get("LLMTAP_SERVER_SPANS_WAIT", section.get("server_spans_wait", 10.0))
    values["server_spans_wait"] = _number(wait, "server_spans_wait")
    return Telemetry(**values)


#: Names ``metric_models`` may list: each one adds its series to every instrument.
METRIC_MODELS_MAX = 256


def _metric_models(value: Any) -> tuple[str, ...]:
    """``metric_models``: a list in the file, comma-separated in ``LLMTAP_METRIC_MODELS``."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ConfigError(f"metric_models: expected a list of model names, got {value!r}")
    names = tuple(dict.fromkeys(str(item).strip() for item in items if str(item).strip()))
    for name in names:
        if clean(name, LABEL_CAP, label=True) != name:
            raise ConfigError(
                f"metric_models: {name[:40]!r}: a name of at most {LABEL_CAP} characters, no control characters"
            )
    if len(names) > METRIC_MODELS_MAX:
        raise ConfigError(f"metric_models: at most {METRIC_MODELS_MAX} names, got {len(names)}")
    return names


def _version(value: Any, what: str) -> str:
    label = version_label(str(value))
    if label is None or label == INVALID_VERSION:
        raise ConfigError(f"{what}: a label of 1 to {VERSION_MAX_BYTES} bytes without control characters expected")
    return label


def _records(pick: Any, section: Mapping[str, Any]) -> Records:
    """``--record PATH`` and its rotation: ``--record-max-mb`` per file, ``--record-files`` files at most."""
    path = pick("record", "LLMTAP_RECORD", section.get("path"), None)
    max_mb = _number(pick("record_max_mb", "LLMTAP_RECORD_MAX_MB", section.get("max_mb"), 64), "record max_mb")
    if max_mb <= 0:
        raise ConfigError(f"record max_mb: expected a size in MB > 0, got {max_mb:g}")
    files = pick("record_files", "LLMTAP_RECORD_FILES", section.get("files"), 5)
    files = int(_number(files, "record files", integer=True, minimum=1))
    return Records(path=str(path) if path else None, max_bytes=max(int(max_mb * (1 << 20)), 1024), files=files)


def _route_options(raw: Mapping[str, Any], where: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The admission-queue and estimator options of one route, over the defaults for every route."""
    merged = {**defaults, **{k: raw[k] for k in _ROUTE_OPTIONS if k in raw and raw[k] is not None}}
    out: dict[str, Any] = {}
    for key in ("max_concurrency", "server_slots"):
        if merged.get(key) is not None:
            out[key] = int(_number(merged[key], f"{where}{key}", integer=True, minimum=1))
    if merged.get("queue_limit") is not None:
        out["queue_limit"] = int(_number(merged["queue_limit"], f"{where}queue_limit", integer=True))
    if merged.get("queue_timeout") is not None:
        out["queue_timeout"] = _number(merged["queue_timeout"], f"{where}queue_timeout")
    if merged.get("retry_after") is not None:
        out["retry_after"] = int(_number(merged["retry_after"], f"{where}retry_after", integer=True))
    if merged.get("prefill_rate") is not None:
        rate = _number(merged["prefill_rate"], f"{where}prefill_rate")
        if rate <= 0:
            raise ConfigError(f"{where}prefill_rate: expected tokens per second > 0, got {merged['prefill_rate']!r}")
        out["prefill_rate"] = rate
    if merged.get("prompt_version") is not None:
        out["prompt_version"] = _version(merged["prompt_version"], f"{where}prompt_version")
    if merged.get("cache_min_tokens") is not None:
        out["cache_min_tokens"] = int(
            _number(merged["cache_min_tokens"], f"{where}cache_min_tokens", integer=True, minimum=1)
        )
    if merged.get("queue_full_status") is not None:
        status = int(_number(merged["queue_full_status"], f"{where}queue_full_status", integer=True))
        if status not in (429, 503):
            raise ConfigError(f"{where}queue_full_status: expected 429 or 503, got {merged['queue_full_status']!r}")
        out["queue_full_status"] = status
    return out


def _tls_options(
    raw: Mapping[str, Any], upstream: str, defaults: Mapping[str, Any], label: Callable[[str], str]
) -> dict[str, Any]:
    """A route's ``tls_*`` settings over the defaults for every https:// route; the files are loaded here."""
    given = {k: raw[k] for k in _TLS_OPTIONS if raw.get(k) is not None}
    if not upstream.startswith("https://"):
        if given:
            raise ConfigError(f"{label(sorted(given)[0])}: TLS settings need an https:// upstream, got {upstream}")
        return {}
    merged = {**{k: v for k, v in defaults.items() if v is not None}, **given}
    out: dict[str, Any] = {}
    for key in ("tls_ca", "tls_ca_dir", "tls_cert", "tls_key"):
        if merged.get(key) is not None:
            path = str(merged[key])
            if not path.strip():
                raise ConfigError(f"{label(key)}: expected a file name, got {merged[key]!r}")
            out[key] = str(Path(path).expanduser())
    name = merged.get("tls_server_name")
    if name is not None:
        name = str(name).strip()
        if not name or any(c.isspace() or c in "/:@" for c in name):
            raise ConfigError(f"{label('tls_server_name')}: expected a host name, got {merged['tls_server_name']!r}")
        out["tls_server_name"] = name
    if merged.get("tls_verify") is not None:
        out["tls_verify"] = _bool(merged["tls_verify"], label("tls_verify"))
    from proxy.relay import tls  # proxy.relay.tls reads Route from here

    options = tls.TLSOptions(
        ca=out.get("tls_ca"),
        ca_dir=out.get("tls_ca_dir"),
        cert=out.get("tls_cert"),
        key=out.get("tls_key"),
        server_name=out.get("tls_server_name"),
        verify=out.get("tls_verify", True),
    )
    tls.context(options, label)  # built now: a file that does not load stops the start, not a request
    return out


def _route(
    raw: Any,
    index: int,
    default_provider: str | None,
    defaults: Mapping[str, Any] | None = None,
    tls_defaults: Mapping[str, Any] | None = None,
    label: Callable[[str], str] | None = None,
) -> Route:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"routes[{index}]: expected a mapping with prefix and upstream")
    unknown = set(raw) - _ROUTE_KEYS
    if unknown:
        raise ConfigError(
            f"routes[{index}]: unknown key {sorted(unknown, key=str)[0]!r}; known: {', '.join(sorted(_ROUTE_KEYS))}"
        )
    prefix = str(raw.get("prefix", "/"))
    if not prefix.startswith("/"):
        raise ConfigError(f"routes[{index}].prefix: must start with '/', got {prefix!r}")
    upstream = check_url(raw.get("upstream"), f"routes[{index}].upstream")
    name = str(raw.get("name") or (prefix.strip("/") or "default"))
    provider = raw.get("provider", default_provider)
    strip = _bool(raw.get("strip_prefix", False), f"routes[{index}].strip_prefix")
    options = _route_options(raw, f"routes[{index}].", defaults or {})
    options.update(_tls_options(raw, upstream, tls_defaults or {}, label or (lambda key: f"routes[{index}].{key}")))
    return Route(
        prefix=prefix.rstrip("/") or "/", upstream=upstream, name=name, provider=provider, strip_prefix=strip, **options
    )


def _upstream_label(key: str) -> str:
    """A TLS setting as the single-upstream flag names it."""
    flag = _TLS_OPTIONS[key][0].replace("_", "-")
    return f"--{flag} ({key})"


def load_file(path: str | Path) -> dict[str, Any]:
    """Read and shape-check a YAML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r}: invalid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level")
    for key, value in data.items():
        if key not in _FILE_KEYS:
            raise ConfigError(f"config file: unknown key {key!r}; known: {', '.join(sorted(_FILE_KEYS))}")
        allowed = _FILE_KEYS[key]
        if allowed is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config file: {key!r} must be a mapping")
            extra = set(value) - allowed
            if extra:
                raise ConfigError(
                    f"config file: unknown key {key}.{sorted(extra, key=str)[0]}; known: {', '.join(sorted(allowed))}"
                )
    return data


def build(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from parsed CLI flags (``None`` means not given), the environment and the config file."""
    env = os.environ if env is None else env

    def pick(flag: str, env_name: str, file_value: Any, default: Any) -> Any:
        value = flags.get(flag)
        if value is not None:
            return value
        if env_name in env and env[env_name] != "":
            return env[env_name]
        return default if file_value is None else file_value

    config_path = flags.get("config") or env.get("LLMTAP_CONFIG")
    data = load_file(config_path) if config_path else {}
    listen, admin = data.get("listen", {}), data.get("admin", {})
    provider = pick("provider", "LLMTAP_PROVIDER", data.get("provider"), None)

    upstream = pick("upstream", "LLMTAP_UPSTREAM", data.get("upstream"), None)
    routes: list[Route] = []
    raw_routes = data.get("routes") or []
    if not isinstance(raw_routes, list):
        raise ConfigError("config file: 'routes' must be a list")
    route_defaults = {key: pick(key, f"LLMTAP_{key.upper()}", data.get(key), None) for key in _ROUTE_OPTIONS}
    tls_defaults = {key: pick(flag, env_name, data.get(key), None) for key, (flag, env_name) in _TLS_OPTIONS.items()}
    if tls_defaults["tls_verify"] is not None:  # given as --upstream-insecure / LLMTAP_UPSTREAM_INSECURE
        tls_defaults["tls_verify"] = not _bool(tls_defaults["tls_verify"], "upstream_insecure")
    if data.get("tls_verify") is not None and pick("upstream_insecure", "LLMTAP_UPSTREAM_INSECURE", None, None) is None:
        tls_defaults["tls_verify"] = data["tls_verify"]  # the file's own key says it the other way round
    routes.extend(_route(raw, i, provider, route_defaults, tls_defaults) for i, raw in enumerate(raw_routes))
    if upstream is not None:
        check_url(upstream, "upstream")
        routes = [r for r in routes if r.prefix != "/"]
        default = {"prefix": "/", "upstream": upstream, "name": "default"}
        routes.append(_route(default, len(routes), provider, route_defaults, tls_defaults, _upstream_label))
    given = sorted(key for key, value in tls_defaults.items() if value is not None)
    if given and routes and not any(r.upstream.startswith("https://") for r in routes):
        raise ConfigError(f"{_upstream_label(given[0])}: TLS settings need an https:// upstream")
    if not routes:
        raise ConfigError("no upstream: pass --upstream URL, set LLMTAP_UPSTREAM, or give routes in --config FILE")
    prefixes = [r.prefix for r in routes]
    if len(set(prefixes)) != len(prefixes):
        raise ConfigError("routes: two routes share one prefix")
    # Longest prefix first, so /openai/v1 wins over /openai.
    routes.sort(key=lambda r: len(r.prefix), reverse=True)

    slo_file = data.get("slo", {})

    def slo_value(flag: str, env_name: str, key: str) -> float | None:
        value = pick(flag, env_name, slo_file.get(key), None)
        return None if value is None else _number(value, key) / 1000.0

    timeouts_file = data.get("timeouts", {})
    tdefault = Timeouts()
    timeouts = Timeouts(
        connect=_number(
            pick("connect_timeout", "LLMTAP_CONNECT_TIMEOUT", timeouts_file.get("connect"), tdefault.connect),
            "connect timeout",
        ),
        read=_number(
            pick("read_timeout", "LLMTAP_READ_TIMEOUT", timeouts_file.get("read"), tdefault.read), "read timeout"
        ),
        write=_number(timeouts_file.get("write", tdefault.write), "write timeout"),
        pool=_number(timeouts_file.get("pool", tdefault.pool), "pool timeout"),
        idle=_optional_number(
            pick("idle_timeout", "LLMTAP_IDLE_TIMEOUT", timeouts_file.get("idle"), None), "idle timeout"
        ),
        drain=_number(
            pick("drain_timeout", "LLMTAP_DRAIN_TIMEOUT", timeouts_file.get("drain"), tdefault.drain), "drain timeout"
        ),
        flush=_number(
            pick("flush_timeout", "LLMTAP_FLUSH_TIMEOUT", timeouts_file.get("flush"), tdefault.flush), "flush timeout"
        ),
        client_header=_positive(
            pick(
                "client_header_timeout",
                "LLMTAP_CLIENT_HEADER_TIMEOUT",
                timeouts_file.get("client_header"),
                tdefault.client_header,
            ),
            "client header timeout",
        ),
        client_body=_positive(
            pick(
                "client_body_timeout",
                "LLMTAP_CLIENT_BODY_TIMEOUT",
                timeouts_file.get("client_body"),
                tdefault.client_body,
            ),
            "client body timeout",
        ),
        keep_alive=_positive(
            pick(
                "keep_alive_timeout", "LLMTAP_KEEP_ALIVE_TIMEOUT", timeouts_file.get("keep_alive"), tdefault.keep_alive
            ),
            "keep-alive timeout",
        ),
    )
    client_cap = pick(
        "max_client_connections", "LLMTAP_MAX_CLIENT_CONNECTIONS", data.get("max_client_connections"), None
    )
    telemetry_env = dict(env)
    for flag in ("chunk_spans", "histogram_buckets", "server_metrics", "span_role", "offline_token_usage"):
        if flags.get(flag) is not None:
            telemetry_env[f"LLMTAP_{flag.upper()}"] = str(flags[flag])
    level = str(pick("log_level", "LLMTAP_LOG_LEVEL", data.get("log_level"), "info")).lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log level: {level!r} is not one of debug, info, warning, error")
    client = str(pick("upstream_client", "LLMTAP_UPSTREAM_CLIENT", data.get("upstream_client"), "lean")).lower()
    if client not in UPSTREAM_CLIENTS:
        raise ConfigError(f"upstream_client: {client!r} is not one of {', '.join(UPSTREAM_CLIENTS)}")
    return Settings(
        routes=tuple(routes),
        host=str(pick("host", "LLMTAP_HOST", listen.get("host"), "127.0.0.1")),
        port=_port(pick("port", "LLMTAP_PORT", listen.get("port"), 8080), "port"),
        admin_host=str(pick("admin_host", "LLMTAP_ADMIN_HOST", admin.get("host"), "127.0.0.1")),
        admin_port=_port(pick("admin_port", "LLMTAP_ADMIN_PORT", admin.get("port"), 9464), "admin port"),
        timeouts=timeouts,
        telemetry=telemetry_from_env(telemetry_env, data.get("telemetry")),
        slo=SLO(
            ttft=slo_value("slo_ttft_ms", "LLMTAP_SLO_TTFT_MS", "ttft_ms"),
            tpot=slo_value("slo_tpot_ms", "LLMTAP_SLO_TPOT_MS", "tpot_ms"),
            e2e=slo_value("slo_e2e_ms", "LLMTAP_SLO_E2E_MS", "e2e_ms"),
        ),
        inject_usage=_bool(pick("inject_usage", "LLMTAP_INJECT_USAGE", data.get("inject_usage"), True), "inject_usage"),
        max_inspect_bytes=int(
            _number(
                pick("max_inspect_bytes", "LLMTAP_MAX_INSPECT_BYTES", data.get("max_inspect_bytes"), 8 << 20),
                "max_inspect_bytes",
                integer=True,
            )
        ),
        max_request_bytes=_size(
            pick("max_request_bytes", "LLMTAP_MAX_REQUEST_BYTES", data.get("max_request_bytes"), 64 << 20),
            "max_request_bytes",
        ),
        max_header_bytes=_size(
            pick("max_header_bytes", "LLMTAP_MAX_HEADER_BYTES", data.get("max_header_bytes"), 64 << 10),
            "max_header_bytes",
        ),
        stream_buffer_bytes=_buffer(
            pick("stream_buffer_bytes", "LLMTAP_STREAM_BUFFER_BYTES", data.get("stream_buffer_bytes"), 128 << 10)
        ),
        max_connections=int(
            _number(
                pick("max_connections", "LLMTAP_MAX_CONNECTIONS", data.get("max_connections"), 1000),
                "max_connections",
                integer=True,
                minimum=1,
            )
        ),
        max_client_connections=None
        if client_cap is None
        else int(_number(client_cap, "max_client_connections", integer=True, minimum=1)),
        upstream_client=client,
        log_level=level,
        record=_records(pick, data.get("record", {})),
        workers=int(
            _number(pick("workers", "LLMTAP_WORKERS", data.get("workers"), 1), "workers", integer=True, minimum=1)
        ),
        telemetry_workers=int(
            _number(
                pick("telemetry_workers", "LLMTAP_TELEMETRY_WORKERS", data.get("telemetry_workers"), 1),
                "telemetry_workers",
                integer=True,
                minimum=1,
            )
        ),
    )
