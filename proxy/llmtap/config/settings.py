"""One frozen ``Settings``, built at the edge from flags, ``LLMTAP_*`` variables, a YAML file and ``OTEL_*``.

Precedence: flags, then environment, then the file, then defaults. Anything wrong raises
``ConfigError`` with a one-line message; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from llmtap.config import options
from llmtap.config.options import (
    CHUNK_SPAN_MODES,
    HISTOGRAM_BUCKETS,
    METRIC_MODELS_MAX,
    OPTIONS,
    ROUTE_OPTIONS,
    SPAN_ROLES,
    UPSTREAM_CLIENTS,
    Invalid,
    Option,
    default,
)

__all__ = [
    "CHUNK_SPAN_MODES",
    "DEFAULT_SHAPES",
    "EXPLICIT",
    "EXPONENTIAL",
    "HISTOGRAM_BUCKETS",
    "METRIC_MODELS_MAX",
    "OTHER_SHAPE",
    "SLO",
    "SPAN_ROLES",
    "UPSTREAM_CLIENTS",
    "ConfigError",
    "Records",
    "Route",
    "Settings",
    "Shape",
    "Sources",
    "Telemetry",
    "Timeouts",
    "build",
    "telemetry_from_env",
]

SEMCONV_LATEST = "gen_ai_latest_experimental"
#: ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``: the histograms' aggregation over OTLP.
EXPLICIT = "explicit_bucket_histogram"
EXPONENTIAL = "base2_exponential_bucket_histogram"
MIB = 1 << 20


class ConfigError(ValueError):
    """A configuration the proxy cannot run with; the message is one line, meant for the user."""


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in seconds; a request that meets all configured ones counts for goodput."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    #: The percentile that counts (0.95: p95), for the verdict over many requests (``llmtap.analysis.slo``).
    percentile: float = default("slo_percentile")
    #: The request shape this objective holds for (``Shape.name``); None: every shape.
    shape: str | None = None

    @property
    def configured(self) -> bool:
        """True when at least one objective is set."""
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))

    def limits(self) -> dict[str, float]:
        """The configured objectives by figure (``ttft``, ``tpot``, ``e2e``), in seconds."""
        return {k: v for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)) if v is not None}


#: The shape of a request no configured class takes (or whose input tokens are unknown).
OTHER_SHAPE = "other"
#: Classes ``shapes:`` may define at most: each one adds its series to the latency histograms.
SHAPES_MAX = 16
_SHAPE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")


@dataclass(frozen=True, slots=True)
class Shape:
    """A request shape: the requests whose input and output tokens fall within these bounds (inclusive).

    The course's first rule of measuring: agree on the request's shape and on the percentile that counts
    before measuring anything. A bound left out is open on that side.
    """

    name: str
    min_input_tokens: int | None = None
    max_input_tokens: int | None = None
    min_output_tokens: int | None = None
    max_output_tokens: int | None = None


#: The default classes, the course's two workloads: a support assistant (6,200-token prompts, 300-token
#: answers) and code completion (200-token prompts, short answers). Anything else is ``other``.
DEFAULT_SHAPES = (
    Shape("long_prompt", min_input_tokens=2048, max_output_tokens=2048),
    Shape("short_prompt", max_input_tokens=1024, max_output_tokens=512),
)


@dataclass(frozen=True, slots=True)
class Route:
    """Requests whose path starts with ``prefix`` go to ``upstream``, and nowhere else."""

    prefix: str
    upstream: str
    name: str
    provider: str | None = None
    strip_prefix: bool = default("strip_prefix")
    #: The admission queue: at most this many requests in flight to the upstream (None: no limit) ...
    max_concurrency: int | None = None
    #: ... with at most this many waiting in line, first come first served ...
    queue_limit: int = default("queue_limit")
    #: ... and at most this long (seconds; None: no limit). A request the line cannot take gets this
    #: status (429 or 503) with ``Retry-After``.
    queue_timeout: float | None = None
    queue_full_status: int = default("queue_full_status")
    retry_after: int = default("retry_after")
    #: How many sequences the upstream server runs at once (vLLM ``--max-num-seqs``): lets the
    #: estimator replay its admissions. None: learn the unloaded TTFT line instead.
    server_slots: int | None = None
    #: The upstream's prefill rate in input tokens per second, when known; else learned.
    prefill_rate: float | None = None
    #: The prompt version of requests that send no ``x-llmtap-prompt-version`` header (None: none).
    prompt_version: str | None = None
    #: The shortest prompt the upstream caches, in tokens (None: by the kind of server, see ``cachediag``).
    cache_min_tokens: int | None = None
    #: HTTPS upstreams (``llmtap.relay.tls``): a CA bundle file and directory to verify the upstream with instead of
    #: the default roots; a client certificate for mutual TLS (its key in ``tls_key`` or in the same file);
    #: the name sent as SNI and verified, when it is not the URL's host; ``tls_verify=False`` verifies nothing.
    tls_ca: str | None = None
    tls_ca_dir: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    tls_verify: bool = default("tls_verify")
    #: The route's objectives (``routes[].slo``), each for one shape or every shape, with its percentile;
    #: a request is judged by the first one for its shape, else by the global ``slo``.
    slo: tuple[SLO, ...] = ()

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
    ``client_header_timeout``, ``client_body_timeout`` and ``keepalive_timeout``). A client that takes none of
    a response it holds back for ``client_send`` is cut (nginx's ``send_timeout``), and a body still arriving
    while its request holds an admission slot may fall silent for at most ``client_upload``.
    """

    connect: float = default("connect_timeout")
    read: float = default("read_timeout")
    write: float = default("write_timeout")
    pool: float = default("pool_timeout")
    idle: float | None = None
    drain: float = default("drain_timeout")
    flush: float = default("flush_timeout")
    client_header: float = default("client_header_timeout")
    client_body: float = default("client_body_timeout")
    client_send: float = default("client_send_timeout")
    client_upload: float = default("client_upload_timeout")
    keep_alive: float = default(
        "keep_alive_timeout"
    )  # nginx's default: past what clients keep an idle connection (httpx: 5 s)

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
    #: OTLP logs (the records' copy, ``--record-logs``): the same variables, ``OTEL_EXPORTER_OTLP_LOGS_*``.
    logs_exporter: str = "none"
    logs_endpoint: str | None = None
    logs_endpoint_specific: bool = False
    logs_protocol: str = "grpc"
    logs_headers: Mapping[str, str] = field(default_factory=dict)
    #: Seconds one trace export may take (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` or ``OTEL_EXPORTER_OTLP_TIMEOUT``,
    #: in seconds as the SDK's exporters read them); the forwarded server spans take the same.
    traces_timeout: float = 10.0
    metrics_headers: Mapping[str, str] = field(default_factory=dict)
    metric_export_interval_ms: int = 10_000
    semconv_latest: bool = False
    capture_content: bool = False
    chunk_spans: str = default("chunk_spans")
    chunk_span_cap: int = default("chunk_span_cap")
    #: Which requests keep their chunk spans (``llmtap.telemetry.chunkdetail``): a sampled share, and the tail.
    chunk_detail_sample: float = default("chunk_detail_sample")
    chunk_detail_tail: float = default("chunk_detail_tail")
    queue_size: int = default("telemetry_queue")
    prometheus: bool = default("prometheus")
    #: Model names that always keep their own label on metrics, however rarely used (``LLMTAP_METRIC_MODELS``).
    metric_models: tuple[str, ...] = ()
    #: ``standard``: the ``gen_ai.*`` histograms use the conventions' advisory buckets; ``fine`` (the default): llmtap's
    #: (2^(1/8) apart), as its own latency histograms always do.
    histogram_buckets: str = default("histogram_buckets")
    #: Also emit ``gen_ai.server.*``, the model server's own metric names, with values that include the hop.
    server_metrics: bool = default("server_metrics")
    #: How histograms go over OTLP (``/metrics`` is always explicit buckets): ``EXPLICIT`` or ``EXPONENTIAL``.
    histogram_aggregation: str = EXPLICIT
    #: ``SPAN_ROLES``: the proxy span's role in the trace.
    span_role: str = default("span_role")
    #: Report tiktoken's counts as ``gen_ai.usage.*`` when the upstream reports no usage ("offline token
    #: counting", which the GenAI conventions allow only when the user enables it); they are always under
    #: ``llmtap.usage.*`` with their source.
    offline_token_usage: bool = default("offline_token_usage")
    #: How long a finished request to an upstream that exports its own spans (vLLM's
    #: ``--otlp-traces-endpoint`` pointed at the admin listener's ``/v1/traces``) waits for its span, seconds;
    #: 0: never (the span then counts as late). Covers vLLM's default batch delay of 5 s.
    server_spans_wait: float = default("server_spans_wait")
    #: Forward the spans ``/v1/traces`` took to the OTLP traces endpoint, as they came (``llmtap.telemetry.forward``);
    #: only when traces go out over OTLP.
    forward_server_spans: bool = default("forward_server_spans")
    #: This replica's admin listener as its peers reach it (``host:port``), and the secret they share: the
    #: relay names the replica in the ``tracestate`` it sends upstream, and a server span that names another
    #: replica is passed there (``llmtap.telemetry.peers``). None: one replica, no routing.
    peer_address: str | None = None
    peer_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class ClickHouseRecords:
    """Where the records go in ClickHouse (``--record-clickhouse``), and the sink's bounds."""

    url: str
    table: str = default("record_clickhouse_table")
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ttl_days: int = default("record_clickhouse_ttl_days")
    max_records: int = default("record_clickhouse_queue")
    max_bytes: int = int(default("record_clickhouse_queue_mb") * MIB)


@dataclass(frozen=True, slots=True)
class Records:
    """Request records (``--record DIR``): a dataset of JSON-lines files (``llmtap.telemetry.dataset``).

    A new file past ``max_bytes`` or ``rotate_s`` seconds; closed files kept within ``keep_bytes`` and ``keep_s``;
    ``logs``: each record also goes out as an OTLP log record (``llmtap.telemetry.sinks``)."""

    path: str | None = None
    max_bytes: int = int(default("record_max_mb") * MIB)
    rotate_s: float = default("record_rotate_minutes") * 60.0
    keep_bytes: int = int(default("record_keep_mb") * MIB)
    keep_s: float = default("record_keep_hours") * 3600.0
    #: ``jsonl``: closed files are gzip-compressed JSON lines; ``parquet``: Parquet files (``pyarrow``).
    format: str = default("record_format")
    logs: bool = default("record_logs")
    #: ``--record-clickhouse URL``: the records also go to this ClickHouse (``llmtap.store.clickhouse``).
    clickhouse: ClickHouseRecords | None = None

    @property
    def on(self) -> bool:
        """Whether records are made at all."""
        return bool(self.path) or self.logs or self.clickhouse is not None


@dataclass(frozen=True, slots=True)
class Admin:
    """The admin listener's bounds, and the bearer token its span receiver and event stream ask of outsiders."""

    #: The token (from ``admin_token_file`` or ``LLMTAP_ADMIN_TOKEN``); None: peers beyond loopback are refused.
    token: str | None = field(default=None, repr=False)
    #: Ask the token of loopback peers too.
    loopback_token: bool = default("admin_loopback_token")
    max_body_bytes: int = default("admin_max_body_bytes")
    max_inflated_bytes: int = default("admin_max_inflated_bytes")
    max_inflate_ratio: int = default("admin_max_inflate_ratio")
    max_connections: int = default("admin_max_connections")
    max_event_streams: int = default("admin_max_event_streams")


def _admin_token(values: Mapping[str, Any]) -> str | None:
    """The token from its file (one line; surrounding white space dropped) or its variable; a file wins."""
    name = values["admin_token_file"]
    if name is not None:
        try:
            token = Path(name).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"admin_token_file {name}: cannot read it: {exc}") from None
        if not token:
            raise ConfigError(f"admin_token_file {name}: the file is empty")
    else:
        token = (values["admin_token"] or "").strip()
    if token and (len(token) < 16 or any(c.isspace() or not c.isprintable() for c in token)):
        raise ConfigError("the admin token must be at least 16 printable characters, without white space")
    return token or None


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who sent a request and what it cost (issue 31): what metrics may carry, what goes upstream, the
    fingerprints' secret and the user's price table."""

    #: Dimensions llmtap's request, token and cost counters carry (``tenant``, ``user``, ``api_key``,
    #: ``property.<name>``); spans and records carry every one.
    metric_dimensions: tuple[str, ...] = ()
    #: Values of each of them on metrics at most; the rest read ``_OTHER``.
    metric_values: int = default("metric_dimension_values")
    #: Send the caller's ``x-llmtap-*`` headers upstream too.
    forward_headers: bool = default("forward_llmtap_headers")
    #: The fingerprints' secret as given (``LLMTAP_ATTRIBUTION_KEY`` or its file); None: the install's own
    #: (``llmtap.relay.fingerprint``).
    key: bytes | None = field(default=None, repr=False)
    #: ``--prices FILE``: prices that win over the shipped table (``llmtap.analysis.cost``).
    prices: str | None = None


def _attribution(values: Mapping[str, Any]) -> Attribution:
    """The attribution settings; the key from its file, else its variable; the price file checked now."""
    key: str | None = values["attribution_key"]
    key_file = values["attribution_key_file"]
    if key_file is not None:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"attribution_key_file {key_file}: cannot read it: {exc}") from None
    if key is not None and len(key.strip()) < 16:
        raise ConfigError("the attribution key must be at least 16 characters")
    prices = values["prices"]
    if prices is not None:
        from llmtap.analysis.cost import PriceError, PriceTable

        try:
            PriceTable(prices)
        except PriceError as exc:
            raise ConfigError(str(exc)) from None
    return Attribution(
        metric_dimensions=values["metric_dimensions"],
        metric_values=values["metric_dimension_values"],
        forward_headers=values["forward_llmtap_headers"],
        key=key.strip().encode() if key is not None else None,
        prices=prices,
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the proxy needs to run; immutable, passed down by constructors."""

    routes: tuple[Route, ...]
    host: str = default("host")
    port: int = default("port")
    admin_host: str = default("admin_host")
    admin_port: int = default("admin_port")
    admin: Admin = field(default_factory=Admin)
    timeouts: Timeouts = field(default_factory=Timeouts)
    telemetry: Telemetry = field(default_factory=Telemetry)
    slo: SLO = field(default_factory=SLO)
    #: The request shapes (``shapes:``), matched in order; a request none takes is ``OTHER_SHAPE``.
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES
    inject_usage: bool = default("inject_usage")
    #: Add a ``Server-Timing`` header to relayed responses (``llmtap.relay.timing``).
    server_timing: bool = default("server_timing")
    max_inspect_bytes: int = default("max_inspect_bytes")
    #: A request body larger than this is refused with 413; its request line and headers together
    #: may hold at most ``max_header_bytes`` (431).
    max_request_bytes: int = default("max_request_bytes")
    max_header_bytes: int = default("max_header_bytes")
    #: The receive buffer (SO_RCVBUF) of each upstream connection: with a client that reads slowly, about
    #: what one stream can make the proxy hold. 0 leaves the kernel's own, which grows to megabytes.
    stream_buffer_bytes: int = default("stream_buffer_bytes")
    #: Connections to each upstream at most (the pool).
    max_connections: int = default("max_connections")
    #: Client connections open at once, per relay process, at most; past it a new one is answered 503 and
    #: closed. None: derived from the descriptor limit at start (``llmtap.listener.connection_cap``).
    max_client_connections: int | None = None
    #: Client connections one peer address may hold open at once, per relay process (0: no bound); None: three
    #: quarters of the connection cap (``llmtap.listener.per_client_cap``).
    max_connections_per_client: int | None = None
    #: The most bytes the relay decompresses of one response (``llmtap.relay.inflate``); past it the stream is cut.
    max_inflate_bytes: int = default("max_inflate_bytes")
    #: ``lean``: upstreams, HTTP and HTTPS, go through ``llmtap.relay.upstream_http`` (less CPU per chunk); ``httpx``:
    #: through httpx's own transport (with the same TLS context).
    upstream_client: str = default("upstream_client")
    log_level: str = default("log_level")
    #: ``--access-log PATH``: one line per finished request, by the telemetry process (``-``: its stderr).
    access_log: str | None = default("access_log")
    record: Records = field(default_factory=Records)
    #: Relay processes sharing the proxy port (SO_REUSEPORT).
    workers: int = default("workers")
    #: Telemetry processes; each upstream's tapes go to one of them (so its estimator sees all its requests).
    telemetry_workers: int = default("telemetry_workers")
    #: ``TELEMETRY_SCHEDULING``: how the telemetry processes yield the CPU to the relays.
    telemetry_scheduling: str = default("telemetry_scheduling")
    #: Attribution dimensions and prices (issue 31).
    attribution: Attribution = field(default_factory=Attribution)


# ----------------------------------------------------------------------------------------------
# Building settings at the edge, from the table of options (``llmtap.config.options``).

_FILE_KEYS = options.file_keys()
_FILE_PATHS = options.file_paths()


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``; did you mean 'x'?`` for the closest of ``known``, or the list of them when none is close."""
    known = list(known)
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known: {', '.join(sorted(known))}"


def _unknown(where: str, key: Any, known: Iterable[str]) -> ConfigError:
    if str(key) in options.REMOVED:
        return ConfigError(f"{where}{str(key)!r} was removed: {options.REMOVED[str(key)]}")
    return ConfigError(f"{where}unknown key {str(key)!r}{did_you_mean(str(key), known)}")


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file and check its keys against the table (each value is checked where it is used)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {name!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {name!r}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        reason = f": {problem}" if problem else ""
        raise ConfigError(f"config file {name!r}: invalid YAML{where}{reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name!r}: expected a mapping at the top level")
    for key, value in data.items():
        if key not in _FILE_KEYS:
            raise _unknown(f"{name}: ", key, [*_FILE_KEYS, *(p for p in _FILE_PATHS if "." in p)])
        allowed = _FILE_KEYS[key]
        if allowed is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: {key!r} must be a mapping")
            for sub in value:
                if sub not in allowed:
                    raise _unknown(f"{name}: ", f"{key}.{sub}", [f"{key}.{k}" for k in allowed])
    if "routes" in data and not isinstance(data["routes"], list | type(None)):
        raise ConfigError(f"{name}: 'routes' must be a list")
    return data


def _shown(value: Any) -> str:
    """A value as a message quotes it: cut short, and in quotes when it is empty or has spaces."""
    text = str(value)
    if len(text) > 60:
        text = text[:59] + "…"
    return repr(text) if not text or any(c.isspace() for c in text) else text


@dataclass(frozen=True, slots=True)
class Sources:
    """Where settings come from, in order: flags (by option name; None: not given), variables, the file."""

    flags: Mapping[str, Any]
    env: Mapping[str, str]
    data: Mapping[str, Any] = field(default_factory=dict)
    #: The file's name as the user gave it, to name it in messages.
    file: str = "config file"

    def given(self, option: Option) -> tuple[Any, str, bool] | None:
        """The raw value, where it came from (``--port abc``, ``LLMTAP_PORT=abc``, ``FILE: listen.port``) and
        whether that is the file; None when not given anywhere."""
        value = self.flags.get(option.name)
        if value is not None and option.flag is not None:
            shown = (
                option.flag
                if option.switch is not None and value == option.switch
                else f"{option.flag} {_shown(value)}"
            )
            return value, shown, False
        if option.env is not None and self.env.get(option.env, "") != "":
            raw = self.env[option.env]
            return raw, f"{option.env}={_shown(raw)}", False
        if option.key is not None:
            section: Any = self.data
            for part in option.key.split("."):
                section = section.get(part) if isinstance(section, Mapping) else None
            if section is not None:
                return section, f"{self.file}: {option.key}", True
        return None

    def get(self, name: str) -> Any:
        """The option's value from the first source that gives it, checked; else its default."""
        option = OPTIONS[name]
        found = self.given(option)
        if found is None:
            return option.default
        return parse(option, *found)


def parse(option: Option, raw: Any, label: str, in_file: bool) -> Any:
    """``option``'s value from ``raw``, or ``ConfigError`` naming ``label``: what was expected (and, in a file, got)."""
    try:
        return option.parse(raw)
    except Invalid as exc:
        problem = str(exc)
        got = f", got {raw!r}" if in_file and problem.startswith("expected") else ""
        raise ConfigError(f"{label}: {problem}{got}") from None


def _tls_options(
    given: Mapping[str, Any], upstream: str, defaults: Mapping[str, Any], label: Callable[[str], str]
) -> dict[str, Any]:
    """A route's ``tls_*`` settings (checked already) over the defaults for every https:// route; files load here."""
    given = {k: v for k, v in given.items() if k in _TLS_KEYS and v is not None}
    if not upstream.startswith("https://"):
        if given:
            raise ConfigError(f"{label(sorted(given)[0])}: TLS settings need an https:// upstream, got {upstream}")
        return {}
    out = {**{k: v for k, v in defaults.items() if v is not None}, **given}
    from llmtap.relay import tls  # llmtap.relay.tls reads Route from here

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


#: A route's TLS keys and, for the single upstream, the option that gives each one for every https:// route.
_TLS_KEYS = {
    "tls_ca": "upstream_ca",
    "tls_ca_dir": "upstream_ca_dir",
    "tls_cert": "upstream_cert",
    "tls_key": "upstream_key",
    "tls_server_name": "upstream_server_name",
    "tls_verify": "tls_verify",
}
#: The settings a route takes from the top level (flags, variables, file) when it does not set them itself.
_ROUTE_DEFAULTS = [
    o.name
    for key, o in ROUTE_OPTIONS.items()
    if o.key is not None and o.name == key and key not in ("upstream", "provider", *_TLS_KEYS)
]


def _route(
    raw: Any,
    where: str,
    defaults: Mapping[str, Any],
    tls_defaults: Mapping[str, Any],
    label: Callable[[str], str],
) -> Route:
    """One route from the file (``where``: ``FILE: routes[0]``) or the single upstream, over the top-level defaults."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with prefix and upstream")
    for key in raw:
        if key not in ROUTE_OPTIONS:
            raise _unknown(f"{where}: ", key, ROUTE_OPTIONS)
    values = {
        key: parse(ROUTE_OPTIONS[key], value, f"{where}.{key}", True) for key, value in raw.items() if value is not None
    }
    if "upstream" not in values:
        raise ConfigError(f"{where}.upstream: expected a URL such as https://api.openai.com")
    prefix = values.get("prefix", "/")
    if not prefix.startswith("/"):
        raise ConfigError(f"{where}.prefix: must start with '/', got {prefix!r}")
    upstream = values["upstream"]
    queue = {key: values.get(key, defaults.get(key)) for key in _ROUTE_DEFAULTS}
    tls = _tls_options(values, upstream, tls_defaults, label)
    return Route(
        prefix=prefix.rstrip("/") or "/",
        upstream=upstream,
        name=str(values.get("name") or (prefix.strip("/") or "default")),
        provider=values.get("provider", defaults.get("provider")),
        strip_prefix=values.get("strip_prefix", False),
        slo=() if values.get("slo") is None else objectives(values["slo"], f"{where}.slo"),
        **{k: v for k, v in queue.items() if v is not None},
        **tls,
    )


_SHAPE_KEYS = ("min_input_tokens", "max_input_tokens", "min_output_tokens", "max_output_tokens")
_OBJECTIVE_KEYS = ("shape", "percentile", "ttft_ms", "tpot_ms", "e2e_ms")


def _checked(kind: options.Kind, value: Any, what: str) -> Any:
    try:
        return kind.parse(value)
    except Invalid as exc:
        raise ConfigError(f"{what}: {exc}, got {value!r}") from None


def objectives(raw: Any, what: str) -> tuple[SLO, ...]:
    """A route's ``slo``: one objective (a mapping) or a list, each ``{shape, percentile, ttft_ms, ...}``."""
    items = [raw] if isinstance(raw, Mapping) else raw
    if not isinstance(items, list):
        raise ConfigError(f"{what}: expected a list of objectives such as {{shape: long_prompt, ttft_ms: 800}}")
    out: list[SLO] = []
    for i, item in enumerate(items):
        where = f"{what}[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping such as {{shape: long_prompt, percentile: 95, ttft_ms: 800}}"
            )
        for key in item:
            if key not in _OBJECTIVE_KEYS:
                raise _unknown(f"{where}: ", key, _OBJECTIVE_KEYS)
        limits = {
            k: _checked(options.number(unit="milliseconds"), item[f"{k}_ms"], f"{where}.{k}_ms") / 1000
            for k in ("ttft", "tpot", "e2e")
            if item.get(f"{k}_ms") is not None
        }
        if not limits:
            raise ConfigError(f"{where}: give at least one of ttft_ms, tpot_ms, e2e_ms")
        shape = item.get("shape")
        if shape is not None:
            shape = str(shape)
            if shape != OTHER_SHAPE and not _SHAPE_NAME.match(shape):
                raise ConfigError(f"{where}.shape: {shape!r} is not a shape name")
        share = default("slo_percentile")
        if item.get("percentile") is not None:
            share = _checked(options.percentile(), item["percentile"], f"{where}.percentile")
        out.append(SLO(**limits, percentile=share, shape=shape))
    return tuple(out)


def shapes(raw: Any, what: str = "shapes") -> tuple[Shape, ...]:
    """The ``shapes:`` section: class name to its token bounds, matched in the file's order."""
    if raw is None:
        return DEFAULT_SHAPES
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{what}: expected a mapping of class names to bounds, such as {{long_prompt: {{...}}}}")
    if len(raw) > SHAPES_MAX:
        raise ConfigError(f"{what}: at most {SHAPES_MAX} classes (each adds series to the latency metrics)")
    out: list[Shape] = []
    for name, bounds in raw.items():
        name = str(name)
        if name == OTHER_SHAPE or not _SHAPE_NAME.match(name):
            raise ConfigError(
                f"{what}: {name!r} is not a class name (lowercase letters, digits, _ . -, at most 32; not other)"
            )
        bounds = bounds or {}
        if not isinstance(bounds, Mapping):
            raise ConfigError(f"{what}.{name}: expected a mapping of bounds ({', '.join(_SHAPE_KEYS)})")
        for key in bounds:
            if key not in _SHAPE_KEYS:
                raise _unknown(f"{what}.{name}: ", key, _SHAPE_KEYS)
        values = {k: _checked(options.integer(0), v, f"{what}.{name}.{k}") for k, v in bounds.items() if v is not None}
        for kind in ("input", "output"):
            low, high = values.get(f"min_{kind}_tokens"), values.get(f"max_{kind}_tokens")
            if low is not None and high is not None and low > high:
                raise ConfigError(f"{what}.{name}: min_{kind}_tokens {low} is above max_{kind}_tokens {high}")
        out.append(Shape(name, **values))
    return tuple(out)


def _file_label(file: str, index: int) -> Callable[[str], str]:
    """A setting of the file's ``index``-th route as messages name it."""
    return lambda key: f"{file}: routes[{index}].{key}"


def _upstream_label(key: str) -> str:
    """A TLS setting as the single-upstream flag names it."""
    flag = OPTIONS[_TLS_KEYS[key]].flag or key
    return f"{flag} ({key})"


def build(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from parsed CLI flags (by option name; ``None``: not given), the environment and the config file.

    Every option is checked first, in the table's order (the ports before any upstream), then the routes.
    """
    env = os.environ if env is None else env
    config = Sources(flags, env).get("config")
    data = load_file(config) if config else {}
    sources = Sources(flags, env, data, str(config))
    values = {name: sources.get(name) for name, o in OPTIONS.items() if o.group != "route"}

    insecure = sources.given(OPTIONS["upstream_insecure"])
    tls_defaults = {key: values[name] for key, name in _TLS_KEYS.items() if sources.given(OPTIONS[name]) is not None}
    if insecure is not None:  # the flag and variable say it the other way round from the file's tls_verify
        tls_defaults["tls_verify"] = not values["upstream_insecure"]
    defaults = {name: values[name] for name in (*_ROUTE_DEFAULTS, "provider")}
    raw_routes = data.get("routes") or []
    routes = [
        _route(raw, f"{sources.file}: routes[{i}]", defaults, tls_defaults, _file_label(sources.file, i))
        for i, raw in enumerate(raw_routes)
    ]
    upstream = values["upstream"]
    if upstream is not None:
        routes = [r for r in routes if r.prefix != "/"]
        default_route = {"prefix": "/", "upstream": upstream, "name": "default"}
        routes.append(_route(default_route, "upstream", defaults, tls_defaults, _upstream_label))
    given = sorted(key for key, value in tls_defaults.items() if value is not None)
    if given and routes and not any(r.upstream.startswith("https://") for r in routes):
        found = sources.given(OPTIONS["upstream_insecure" if given[0] == "tls_verify" else _TLS_KEYS[given[0]]])
        where = f"{found[1]} ({given[0]})" if found is not None else _upstream_label(given[0])
        raise ConfigError(f"{where}: TLS settings need an https:// upstream")
    if not routes:
        raise ConfigError("no upstream: pass --upstream URL, set LLMTAP_UPSTREAM, or give routes in --config FILE")
    prefixes = [r.prefix for r in routes]
    if len(set(prefixes)) != len(prefixes):
        raise ConfigError(f"{sources.file}: routes: two routes share one prefix")
    # Longest prefix first, so /openai/v1 wins over /openai.
    routes.sort(key=lambda r: len(r.prefix), reverse=True)
    shape_classes = shapes(values["shapes"], f"{sources.file}: shapes")
    known_shapes = {c.name for c in shape_classes} | {OTHER_SHAPE}
    for r in routes:
        for goal in r.slo:
            if goal.shape is not None and goal.shape not in known_shapes:
                raise ConfigError(
                    f"{sources.file}: routes ({r.name}).slo: shape {goal.shape!r} is not a class of shapes: "
                    f"{', '.join(sorted(known_shapes))}"
                )

    def ms(name: str) -> float | None:
        value = values[name]
        return None if value is None else value / 1000.0

    return Settings(
        routes=tuple(routes),
        host=values["host"],
        port=values["port"],
        admin_host=values["admin_host"],
        admin_port=values["admin_port"],
        admin=Admin(
            token=_admin_token(values),
            loopback_token=values["admin_loopback_token"],
            max_body_bytes=values["admin_max_body_bytes"],
            max_inflated_bytes=values["admin_max_inflated_bytes"],
            max_inflate_ratio=values["admin_max_inflate_ratio"],
            max_connections=values["admin_max_connections"],
            max_event_streams=values["admin_max_event_streams"],
        ),
        timeouts=Timeouts(
            connect=values["connect_timeout"],
            read=values["read_timeout"],
            write=values["write_timeout"],
            pool=values["pool_timeout"],
            idle=values["idle_timeout"],
            drain=values["drain_timeout"],
            flush=values["flush_timeout"],
            client_header=values["client_header_timeout"],
            client_body=values["client_body_timeout"],
            client_send=values["client_send_timeout"],
            client_upload=values["client_upload_timeout"],
            keep_alive=values["keep_alive_timeout"],
        ),
        telemetry=telemetry_from_env(env, sources=sources),
        slo=SLO(
            ttft=ms("slo_ttft_ms"), tpot=ms("slo_tpot_ms"), e2e=ms("slo_e2e_ms"), percentile=values["slo_percentile"]
        ),
        shapes=shape_classes,
        inject_usage=values["inject_usage"],
        server_timing=values["server_timing"],
        max_inspect_bytes=values["max_inspect_bytes"],
        max_request_bytes=values["max_request_bytes"],
        max_header_bytes=values["max_header_bytes"],
        stream_buffer_bytes=values["stream_buffer_bytes"],
        max_connections=values["max_connections"],
        max_client_connections=values["max_client_connections"],
        max_connections_per_client=values["max_connections_per_client"],
        max_inflate_bytes=values["max_inflate_bytes"],
        upstream_client=values["upstream_client"],
        log_level=values["log_level"],
        access_log=values["access_log"],
        record=Records(
            path=values["record"],
            max_bytes=max(int(values["record_max_mb"] * MIB), 1024),
            rotate_s=max(values["record_rotate_minutes"] * 60.0, 1.0),
            keep_bytes=int(values["record_keep_mb"] * MIB),
            keep_s=values["record_keep_hours"] * 3600.0,
            format=values["record_format"],
            logs=values["record_logs"],
            clickhouse=_clickhouse_records(values),
        ),
        workers=values["workers"],
        telemetry_workers=values["telemetry_workers"],
        telemetry_scheduling=values["telemetry_scheduling"],
        attribution=_attribution(values),
    )


def _clickhouse_records(values: Mapping[str, Any]) -> ClickHouseRecords | None:
    """``--record-clickhouse`` and its settings; the password from its variable, else its file."""
    if not values["record_clickhouse"]:
        return None
    password = values["record_clickhouse_password"]
    password_file = values["record_clickhouse_password_file"]
    if password is None and password_file:
        try:
            password = Path(password_file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"record_clickhouse_password_file {password_file!r}: {exc.strerror or exc}") from None
    table = values["record_clickhouse_table"]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?", table):
        raise ConfigError(f"record_clickhouse_table {table!r}: expected a name like llmtap_records or db.records")
    return ClickHouseRecords(
        url=values["record_clickhouse"],
        table=table,
        user=values["record_clickhouse_user"],
        password=password,
        ttl_days=values["record_clickhouse_ttl_days"],
        max_records=values["record_clickhouse_queue"],
        max_bytes=max(int(values["record_clickhouse_queue_mb"] * MIB), 1024),
    )


# ----------------------------------------------------------------------------------------------
# Telemetry: the standard OTEL_* variables, and llmtap's own options.


def _bool(value: Any, what: str) -> bool:
    try:
        return bool(options.boolean().parse(value))
    except Invalid:
        raise ConfigError(f"{what}: expected true or false, got {value!r}") from None


def _interval(value: Any) -> int:
    try:
        return int(options.integer(1).parse(value))
    except Invalid as exc:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL={_shown(value)}: {exc}") from None


def _export_timeout(env: Mapping[str, str]) -> float:
    """The traces exporter's timeout, seconds: the signal's variable, else the general one, else 10."""
    key = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
    if not env.get(key, "").strip():
        key = "OTEL_EXPORTER_OTLP_TIMEOUT"
    raw = env.get(key, "").strip()
    if not raw:
        return 10.0
    try:
        return float(options.POSITIVE_SECONDS.parse(raw))
    except Invalid as exc:
        raise ConfigError(f"{key}={_shown(raw)}: {exc}") from None


def check_url(url: Any, what: str) -> str:
    """A normalized upstream base URL (http or https, a host, no query), else ``ConfigError`` naming ``what``."""
    try:
        return options.check_url(url)
    except Invalid as exc:
        raise ConfigError(f"{what}={_shown(url)}: {exc}") from None


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


def telemetry_from_env(
    env: Mapping[str, str], file_section: Mapping[str, Any] | None = None, *, sources: Sources | None = None
) -> Telemetry:
    """The telemetry settings from ``OTEL_*``, and llmtap's own from ``sources`` (by default: ``LLMTAP_*`` in
    ``env`` over the file's ``telemetry:`` section ``file_section``)."""
    if sources is None:
        sources = Sources({}, env, {"telemetry": dict(file_section or {})})
    disabled = _bool(env.get("OTEL_SDK_DISABLED", "false"), "OTEL_SDK_DISABLED")
    values: dict[str, Any] = {"sdk_disabled": disabled}
    for signal in ("traces", "metrics", "logs"):
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
    values["traces_timeout"] = _export_timeout(env)
    values["metric_export_interval_ms"] = _interval(env.get("OTEL_METRIC_EXPORT_INTERVAL", 10_000))
    opt_in = {v.strip() for v in env.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")}
    values["semconv_latest"] = SEMCONV_LATEST in opt_in
    capture = env.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().upper()
    values["capture_content"] = capture in ("TRUE", "1", "SPAN_ONLY", "SPAN_AND_EVENT", "EVENT_ONLY")
    # The SDK's OTLP exporters read this variable too, but warn and carry on at a typo: here it is an error.
    key = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    aggregation = env.get(key, "").strip().lower() or EXPLICIT
    if aggregation not in (EXPLICIT, EXPONENTIAL):
        raise ConfigError(f"{key}: {aggregation!r} is not one of {EXPLICIT}, {EXPONENTIAL}")
    values["histogram_aggregation"] = aggregation
    for field_name, name in _TELEMETRY_OPTIONS.items():
        values[field_name] = sources.get(name)
    if values["peer_address"] is not None and values["peer_token"] is None:
        raise ConfigError(
            "telemetry.peer_address needs telemetry.peer_token (LLMTAP_PEER_TOKEN), a secret the replicas share"
        )
    return Telemetry(**values)


#: ``Telemetry`` fields that are llmtap's own options, and their names in the table.
_TELEMETRY_OPTIONS = {
    "chunk_spans": "chunk_spans",
    "chunk_span_cap": "chunk_span_cap",
    "chunk_detail_sample": "chunk_detail_sample",
    "chunk_detail_tail": "chunk_detail_tail",
    "queue_size": "telemetry_queue",
    "prometheus": "prometheus",
    "metric_models": "metric_models",
    "histogram_buckets": "histogram_buckets",
    "server_metrics": "server_metrics",
    "span_role": "span_role",
    "offline_token_usage": "offline_token_usage",
    "server_spans_wait": "server_spans_wait",
    "forward_server_spans": "forward_server_spans",
    "peer_address": "peer_address",
    "peer_token": "peer_token",
}
