"""The settings' types: one frozen ``Settings`` and its parts, each passed down by constructors.

``llmtap.config.load`` builds them at the edge; nothing here reads a file, a variable or a certificate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from llmtap.config.options import default

__all__ = [
    "DEFAULT_SHAPES",
    "EXPLICIT",
    "EXPONENTIAL",
    "MIB",
    "OTHER_SHAPE",
    "SEMCONV_LATEST",
    "SHAPES_MAX",
    "SLO",
    "Admin",
    "Attribution",
    "ClickHouseRecords",
    "ConfigError",
    "ContentEvent",
    "Records",
    "Route",
    "Settings",
    "Shape",
    "TelemetrySettings",
    "Timeouts",
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
    #: Time to the first output token (the answer's first chunk, after any reasoning) and to the second token (after
    #: ``shape``: positional constructions of the first three figures keep their meaning).
    ttfot: float | None = None
    ttst: float | None = None

    @property
    def configured(self) -> bool:
        """True when at least one objective is set."""
        return any(v is not None for v in self.limits().values())

    def limits(self) -> dict[str, float]:
        """The configured objectives by figure (``ttft``, ``tpot``, ``e2e``, ``ttfot``, ``ttst``), in seconds."""
        pairs = (self.ttft, self.tpot, self.e2e, self.ttfot, self.ttst)
        return {k: v for k, v in zip(("ttft", "tpot", "e2e", "ttfot", "ttst"), pairs, strict=True) if v is not None}


#: The shape of a request no configured class takes (or whose input tokens are unknown).
OTHER_SHAPE = "other"
#: Classes ``shapes:`` may define at most: each one adds its series to the latency histograms.
SHAPES_MAX = 16


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
    #: HTTPS upstreams: a CA bundle file and directory to verify the upstream with instead of the default roots;
    #: a client certificate for mutual TLS (its key in ``tls_key`` or in the same file); the name sent as SNI
    #: and verified, when it is not the URL's host; ``tls_verify=False`` verifies nothing. Settings only: the
    #: relay builds the context from them, and reads the files, when it makes the upstream's client
    #: (``llmtap.relay.tls``).
    tls_ca: str | None = None
    tls_ca_dir: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    tls_verify: bool = default("tls_verify")
    #: Each ``tls_*`` setting by the name messages give it (``--upstream-ca (tls_ca)``, ``FILE: routes[0].tls_ca``),
    #: for ``llmtap.relay.tls`` to name a file that does not load as the user wrote it; not part of the route's value.
    tls_labels: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
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
class TelemetrySettings:
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
    #: The traces' OTLP headers, for the server-span forwarder; the SDK's exporters read every signal's themselves.
    traces_headers: Mapping[str, str] = field(default_factory=dict)
    #: OTLP logs (the records' copy, ``--record-logs``): the same variables, ``OTEL_EXPORTER_OTLP_LOGS_*``.
    logs_exporter: str = "none"
    logs_endpoint: str | None = None
    logs_endpoint_specific: bool = False
    logs_protocol: str = "grpc"
    #: Seconds one trace export may take (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` or ``OTEL_EXPORTER_OTLP_TIMEOUT``,
    #: in seconds as the SDK's exporters read them); the forwarded server spans take the same.
    traces_timeout: float = 10.0
    metric_export_interval_ms: int = 10_000
    semconv_latest: bool = False
    capture_content: bool = False
    chunk_spans: str = default("chunk_spans")
    chunk_span_cap: int = default("chunk_span_cap")
    #: Which requests keep their chunk spans (``llmtap.telemetry.emit.chunkdetail``): a sampled share, and the tail.
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
    #: Forward the spans ``/v1/traces`` took to the OTLP traces endpoint, as they came
    #: (``llmtap.telemetry.fleet.forward``); only when traces go out over OTLP.
    forward_server_spans: bool = default("forward_server_spans")
    #: This replica's admin listener as its peers reach it (``host:port``), and the secret they share: the
    #: relay names the replica in the ``tracestate`` it sends upstream, and a server span that names another
    #: replica is passed there (``llmtap.telemetry.fleet.peers``). None: one replica, no routing.
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
    """Request records (``--record DIR``): a dataset of JSON-lines files (``llmtap.telemetry.records.dataset``).

    A new file past ``max_bytes`` or ``rotate_s`` seconds; closed files kept within ``keep_bytes`` and ``keep_s``;
    ``logs``: each record also goes out as an OTLP log record (``llmtap.telemetry.records.sinks``)."""

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
    #: ``--record-journal DIR``: the folder of the record journal (``llmtap.telemetry.journal.spool``), None: no
    #: journal; ``journal_bytes``: its bound per telemetry process.
    journal: str | None = None
    journal_bytes: int = int(default("record_journal_mb") * MIB)

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


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who sent a request and what it cost: what metrics may carry, what goes upstream, the
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


@dataclass(frozen=True, slots=True)
class ContentEvent:
    """The opt-in content event (``gen_ai.client.inference.operation.details``): each field's rule and its bound.

    ``rules`` empty (the default) means no event; a field it does not name is dropped."""

    rules: tuple[tuple[str, str], ...] = ()
    max_bytes: int = default("content_event_max_bytes")

    @property
    def on(self) -> bool:
        """Whether the event is emitted at all: only when a field was named."""
        return bool(self.rules)


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
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    slo: SLO = field(default_factory=SLO)
    #: The request shapes (``shapes:``), matched in order; a request none takes is ``OTHER_SHAPE``.
    shapes: tuple[Shape, ...] = DEFAULT_SHAPES
    inject_usage: bool = default("inject_usage")
    #: Send the caller's ``x-slo-*`` headers upstream too (they are read and judged either way).
    forward_slo_headers: bool = default("forward_slo_headers")
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
    #: The most bytes the relay decompresses of one response (``llmtap.compression``); past it the stream is cut.
    max_inflate_bytes: int = default("max_inflate_bytes")
    log_level: str = default("log_level")
    #: ``--access-log PATH``: one line per finished request, by the telemetry process (``-``: its stderr).
    access_log: str | None = default("access_log")
    record: Records = field(default_factory=Records)
    #: Relay processes sharing the proxy port (SO_REUSEPORT).
    workers: int = default("workers")
    #: Telemetry processes; each request's tape goes to one of them by its trace id, and they tell each other what
    #: must stay whole per upstream (``llmtap.telemetry.fleet.siblings``).
    telemetry_workers: int = default("telemetry_workers")
    #: ``TELEMETRY_SCHEDULING``: how the telemetry processes yield the CPU to the relays.
    telemetry_scheduling: str = default("telemetry_scheduling")
    #: Microseconds of telemetry work between two yields of the core (``llmtap.telemetry.sched``).
    telemetry_yield: int = default("telemetry_yield")
    #: Milliseconds a relay gathers its tapes before writing them to the telemetry process (``SocketChannel``).
    telemetry_gather: int = default("telemetry_gather")
    #: Attribution dimensions and prices.
    attribution: Attribution = field(default_factory=Attribution)
    #: The opt-in content event (off unless ``--content-event`` names a field).
    content: ContentEvent = field(default_factory=ContentEvent)
