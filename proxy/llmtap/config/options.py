"""Every setting of ``llmtap serve`` once: its flag, ``LLMTAP_*`` variable, key in the YAML file, default,
validation and help (``OPTIONS``).

The command line (``llmtap.cli``), the settings' resolution (``llmtap.config.load.build``), the file's schema
and the settings page (``docs/settings.md``, ``python -m llmtap.config.options``) are all made from this table. A
new setting is one more ``option(...)`` line here, and its use where ``build`` makes ``Settings``.

This module knows nothing of ``Settings``: a value that does not parse raises ``Invalid`` (``llmtap.config.kinds``)
with what was expected; ``llmtap.config.sources`` turns that into a ``ConfigError`` naming where it came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtap.config.kinds import (
    METRIC_MODELS_MAX,
    Invalid,
    Kind,
    address,
    binary,
    boolean,
    buffer_size,
    byte_size,
    check_url,
    choice,
    content_rules,
    dimension_names,
    host_name,
    integer,
    model_names,
    number,
    path,
    percentile,
    share,
    structure,
    text,
    url,
    version,
)

__all__ = [
    "CHUNK_SPAN_MODES",
    "GROUPS",
    "HISTOGRAM_BUCKETS",
    "METRIC_MODELS_MAX",
    "OPTIONS",
    "POSITIVE_SECONDS",
    "REMOVED",
    "ROUTE_OPTIONS",
    "SPAN_ROLES",
    "STANDARD_VARIABLES",
    "Invalid",
    "Kind",
    "Option",
    "address",
    "binary",
    "boolean",
    "buffer_size",
    "by_group",
    "byte_size",
    "check_url",
    "choice",
    "default",
    "file_keys",
    "file_paths",
    "host_name",
    "integer",
    "json_schema",
    "model_names",
    "number",
    "option",
    "path",
    "percentile",
    "structure",
    "text",
    "url",
    "version",
]


# ----------------------------------------------------------------------------------------------
# The table.

#: Sections of ``llmtap serve --help`` and of ``docs/settings.md``, in their order.
GROUPS = {
    "listen": "where llmtap listens",
    "admin": "the admin listener: who may send to it and what it holds",
    "upstream": "upstreams (several, with their own settings, as routes in --config)",
    "tls": "HTTPS upstreams (per route as tls_* keys in --config)",
    "timeouts": "upstream timeouts and shutdown (seconds)",
    "clients": "clients: slow or idle connections and how many (timeouts in seconds)",
    "limits": "sizes and pools",
    "telemetry": "telemetry (the OTLP exporters follow the standard OTEL_* variables)",
    "slo": "service-level objectives: a request that meets every one counts for goodput",
    "queue": "admission queue and queue/prefill estimates (per route in --config)",
    "records": "request records and prompt caching (see llmtap compare)",
    "attribution": "attribution and cost: who sent a request, and what it cost",
    "process": "processes and logging",
    "route": "keys of a route in the file only (routes: [...])",
}

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: where it can be given, what it accepts, and what it is when not given."""

    #: The setting's name: the flag's ``dest`` and the key ``llmtap.config.load.build`` looks it up by.
    name: str
    kind: Kind
    default: Any
    help: str
    group: str
    #: ``--port``; None: no flag.
    flag: str | None
    #: ``LLMTAP_PORT``; None: no variable.
    env: str | None
    #: Its place in the YAML file, dotted (``listen.port``); None: not in the file's top level.
    key: str | None
    #: Its key in each of the file's ``routes:`` (a per-route setting; the top-level value is the default).
    route_key: str | None = None
    #: For a flag that takes no value: what giving it sets (``--no-inject-usage``: False).
    switch: Any = None
    #: The default in words, where the value alone would not say it (``the read timeout``).
    default_text: str | None = None

    def shown_default(self) -> str:
        """The default as ``--help`` and the docs give it."""
        if self.default_text is not None:
            return self.default_text
        return "none" if self.default is None else self.kind.show(self.default)

    def parse(self, value: Any) -> Any:
        """The value checked and converted; ``Invalid`` when it does not fit."""
        return self.kind.parse(value)


def option(
    name: str,
    kind: Kind,
    default: Any,
    help: str,
    group: str,
    *,
    flag: str | None = AUTO,
    env: str | None = AUTO,
    key: str | None = AUTO,
    route_key: str | None = None,
    switch: Any = None,
    default_text: str | None = None,
) -> Option:
    """An ``Option``; the flag, variable and file key follow from ``name`` unless given (None: there is none)."""
    return Option(
        name=name,
        kind=kind,
        default=default,
        help=help,
        group=group,
        flag="--" + name.replace("_", "-") if flag == AUTO else flag,
        env="LLMTAP_" + name.upper() if env == AUTO else env,
        key=name if key == AUTO else key,
        route_key=route_key,
        switch=switch,
        default_text=default_text,
    )


def _route(name: str, kind: Kind, default: Any, help: str, group: str, **kw: Any) -> Option:
    """An option that each route may set for itself, with the same name in the file's top level and routes."""
    return option(name, kind, default, help, group, route_key=name, **kw)


def _tls(name: str, key: str, kind: Kind, help: str) -> Option:
    return option(name, kind, None, help, "tls", key=key, route_key=key)


PORT = integer(0, 65535, metavar="PORT")
SECONDS = number(unit="seconds", metavar="SECONDS")
POSITIVE_SECONDS = number(above=True, unit="seconds", metavar="SECONDS")
MS = number(unit="milliseconds", metavar="MS")
CHUNK_SPAN_MODES = ("spans", "events", "off")
#: How the telemetry processes yield the CPU to the relays (``llmtap.telemetry.sched``).
TELEMETRY_SCHEDULING = ("idle", "nice", "normal")
#: What the proxy's span is in a trace (``auto``: the hop when a request arrives with a ``traceparent``).
SPAN_ROLES = ("auto", "generation", "hop")
#: Buckets of the ``gen_ai.*`` histograms: the conventions' advisory ones, or llmtap's fine ones.
HISTOGRAM_BUCKETS = ("standard", "fine")
LOG_LEVELS = ("debug", "info", "warning", "error")

#: The file's ``shapes:`` and a route's ``slo`` (checked in depth by ``llmtap.config.routes``).
SHAPES_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "maxProperties": 16,
    "additionalProperties": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            k: {"type": "integer", "minimum": 0}
            for k in ("min_input_tokens", "max_input_tokens", "min_output_tokens", "max_output_tokens")
        },
    },
}
_OBJECTIVE: Mapping[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "shape": {"type": "string"},
        "percentile": {"type": ["number", "string"]},
        "ttft_ms": {"type": "number", "minimum": 0},
        "tpot_ms": {"type": "number", "minimum": 0},
        "e2e_ms": {"type": "number", "minimum": 0},
        "ttfot_ms": {"type": "number", "minimum": 0},
        "ttst_ms": {"type": "number", "minimum": 0},
    },
}
ROUTE_SLO_SCHEMA: Mapping[str, Any] = {"oneOf": [_OBJECTIVE, {"type": "array", "items": _OBJECTIVE}]}

_TABLE = (
    # where llmtap listens
    option("host", text("ADDRESS"), "127.0.0.1", "the proxy's listen address", "listen", key="listen.host"),
    option("port", PORT, 8080, "the proxy's listen port, 0 for any free one", "listen", key="listen.port"),
    option("admin_host", text("ADDRESS"), "127.0.0.1", "the admin listener's address", "listen", key="admin.host"),
    option(
        "admin_port",
        PORT,
        9464,
        "the admin listener's port: /metrics, /healthz, /readyz and the live view",
        "listen",
        key="admin.port",
    ),
    # the admin listener
    option(
        "admin_token_file",
        path(),
        None,
        "file holding the bearer token that /v1/traces (the span receiver) and the live view's /events ask of "
        "peers beyond loopback; without a token those refuse such peers (403)",
        "admin",
        key="admin.token_file",
        default_text="none: loopback peers only",
    ),
    option(
        "admin_token",
        text("TOKEN"),
        None,
        "the same token given in the environment (never a flag or a file key: a secret stays out of both)",
        "admin",
        flag=None,
        key=None,
        default_text="none",
    ),
    option(
        "admin_loopback_token",
        boolean(),
        False,
        "ask the token of loopback peers too (in a pod, every container shares the loopback)",
        "admin",
        key="admin.loopback_token",
        switch=True,
    ),
    option(
        "admin_max_body_bytes",
        byte_size(),
        4 << 20,
        "largest OTLP body /v1/traces takes as sent (413 past it)",
        "admin",
        key="admin.max_body_bytes",
    ),
    option(
        "admin_max_inflated_bytes",
        byte_size(),
        16 << 20,
        "largest OTLP body /v1/traces takes once inflated (413 past it)",
        "admin",
        key="admin.max_inflated_bytes",
    ),
    option(
        "admin_max_inflate_ratio",
        integer(1),
        64,
        "a gzip body may inflate to this many times its size (or 1 MiB, whichever is more); 413 past it",
        "admin",
        key="admin.max_inflate_ratio",
    ),
    option(
        "admin_max_connections",
        integer(2),
        256,
        "admin connections open at once; past it the one idle longest is closed for the new one (a request in "
        "progress never is), else 503",
        "admin",
        key="admin.max_connections",
    ),
    option(
        "admin_max_event_streams",
        integer(0),
        32,
        "live view /events streams open at once (each browser tab holds one); past it 503",
        "admin",
        key="admin.max_event_streams",
    ),
    # upstreams
    option(
        "upstream",
        url(),
        None,
        "upstream base URL, e.g. https://api.openai.com (replaces the file's route for /)",
        "upstream",
        route_key="upstream",
        default_text="none: the routes of --config",
    ),
    option(
        "provider",
        text("NAME"),
        None,
        "gen_ai.provider.name to report, e.g. openai, anthropic, vllm",
        "upstream",
        route_key="provider",
        default_text="from the API the request speaks",
    ),
    option("config", path(), None, "YAML file with routes and settings", "upstream", key=None),
    # HTTPS upstreams
    _tls("upstream_ca", "tls_ca", path(), "CA bundle to verify the upstream with instead of the default roots"),
    _tls("upstream_ca_dir", "tls_ca_dir", path("DIR"), "directory of hashed CA certificates"),
    _tls("upstream_cert", "tls_cert", path(), "client certificate for mutual TLS, PEM; may hold its key too"),
    _tls("upstream_key", "tls_key", path(), "the client certificate's key, PEM"),
    _tls("upstream_server_name", "tls_server_name", host_name(), "name sent as SNI and verified, when not the URL's"),
    option(
        "upstream_insecure",
        boolean(),
        False,
        "do not verify the upstream's certificate at all (logged as a warning)",
        "tls",
        key=None,
        switch=True,
    ),
    option(
        "tls_verify",
        boolean(),
        True,
        "verify the upstream's certificate (the file's way to say --upstream-insecure)",
        "tls",
        flag=None,
        env=None,
        route_key="tls_verify",
    ),
    # upstream timeouts and shutdown
    option("connect_timeout", SECONDS, 10.0, "upstream connect timeout", "timeouts", key="timeouts.connect"),
    option(
        "read_timeout",
        SECONDS,
        600.0,
        "longest wait for the upstream's response headers, and between chunks unless --idle-timeout is set",
        "timeouts",
        key="timeouts.read",
    ),
    option(
        "idle_timeout",
        SECONDS,
        None,
        "longest silence between two chunks of a response",
        "timeouts",
        key="timeouts.idle",
        default_text="the read timeout",
    ),
    option(
        "write_timeout", SECONDS, 60.0, "longest wait to send the request upstream", "timeouts", key="timeouts.write"
    ),
    option(
        "pool_timeout", SECONDS, 10.0, "longest wait for a free upstream connection", "timeouts", key="timeouts.pool"
    ),
    option(
        "drain_timeout",
        SECONDS,
        30.0,
        "on SIGTERM, how long streams in flight may finish",
        "timeouts",
        key="timeouts.drain",
    ),
    option(
        "flush_timeout", SECONDS, 5.0, "on exit, how long telemetry may take to flush", "timeouts", key="timeouts.flush"
    ),
    # clients
    option(
        "client_header_timeout",
        POSITIVE_SECONDS,
        20.0,
        "a request's line and headers must all arrive this soon after its first byte, else 408",
        "clients",
        key="timeouts.client_header",
    ),
    option(
        "client_body_timeout",
        POSITIVE_SECONDS,
        60.0,
        "longest silence while a request body is arriving; past it 408 and the request is dropped",
        "clients",
        key="timeouts.client_body",
    ),
    option(
        "keep_alive_timeout",
        POSITIVE_SECONDS,
        75.0,
        "a connection without a request in progress is closed after this",
        "clients",
        key="timeouts.keep_alive",
    ),
    option(
        "max_client_connections",
        integer(1),
        None,
        "client connections open at once per relay process; past it 503",
        "clients",
        default_text="from the descriptor limit, at most 4096",
    ),
    # -- relay: what one client may hold; one block, kept together --
    option(
        "client_send_timeout",
        POSITIVE_SECONDS,
        60.0,
        "longest time a client may take none of a response it holds back; past it the connection, its "
        "admission slot and the upstream request are dropped",
        "clients",
        key="timeouts.client_send",
    ),
    option(
        "client_upload_timeout",
        POSITIVE_SECONDS,
        10.0,
        "longest silence of a request body still arriving while it holds an admission slot; past it 408 and "
        "the slot is freed",
        "clients",
        key="timeouts.client_upload",
    ),
    option(
        "max_connections_per_client",
        integer(0),
        None,
        "client connections one peer address may hold open at once per relay process; past it 503 (0: no bound)",
        "clients",
        default_text="three quarters of max_client_connections",
    ),
    option(
        "max_inflate_bytes",
        byte_size(),
        256 << 20,
        "most bytes the relay decompresses of one response (only to remove the usage event it asked for); "
        "past it the stream is cut",
        "limits",
    ),
    # sizes and pools
    option("max_request_bytes", byte_size(), 64 << 20, "largest request body (413 past it)", "limits"),
    option("max_header_bytes", byte_size(), 64 << 10, "largest request line plus headers (431 past it)", "limits"),
    option(
        "max_inspect_bytes",
        integer(0, metavar="BYTES", show=binary),
        8 << 20,
        "largest request body read for its model and stream flag",
        "limits",
    ),
    option(
        "stream_buffer_bytes",
        buffer_size(),
        128 << 10,
        "receive buffer per upstream connection: what a slow client can make a stream hold (0: the kernel's)",
        "limits",
    ),
    option(
        "max_connections",
        integer(1),
        1000,
        "connections to each upstream at most (the pool), per relay process",
        "limits",
    ),
    # telemetry
    option(
        "chunk_spans",
        choice(*CHUNK_SPAN_MODES, aliases={False: "off"}),
        "spans",
        "one span per decode chunk, span events, or off",
        "telemetry",
        key="telemetry.chunk_spans",
    ),
    option(
        "chunk_span_cap",
        integer(1),
        200,
        "chunk spans per request at most",
        "telemetry",
        key="telemetry.chunk_span_cap",
    ),
    # chunk detail decided in the proxy (llmtap.telemetry.emit.chunkdetail)
    option(
        "chunk_detail_sample",
        share(),
        0.05,
        "share of the requests nothing else marks (failed, cancelled, objective missed, slower than the route's "
        "recent tail) that keep a span per chunk, chosen by trace id; the others get chunk statistics on their "
        "decode span (1: every request keeps them)",
        "telemetry",
        key="telemetry.chunk_detail_sample",
    ),
    option(
        "chunk_detail_tail",
        percentile(),
        0.99,
        "a request whose time to first token or largest chunk gap is above this percentile of its route's recent "
        "requests keeps a span per chunk",
        "telemetry",
        key="telemetry.chunk_detail_tail",
    ),
    option(
        "telemetry_queue",
        integer(1),
        4096,
        "finished requests waiting for the exporters at most",
        "telemetry",
        key="telemetry.queue_size",
    ),
    option(
        "prometheus",
        boolean(),
        True,
        "serve /metrics on the admin listener",
        "telemetry",
        flag="--no-prometheus",
        key="telemetry.prometheus",
        switch=False,
    ),
    option(
        "metric_models",
        model_names(),
        (),
        "model names that always keep their own metric label, however rarely used",
        "telemetry",
        key="telemetry.metric_models",
    ),
    option(
        "histogram_buckets",
        choice(*HISTOGRAM_BUCKETS),
        "fine",
        "gen_ai.* histogram buckets: llmtap's fine ones (percentiles within a few %; /metrics writes only the "
        "bounds over the values' range), or the conventions' advisory ones (standard: a p99 can read half again high)",
        "telemetry",
        key="telemetry.histogram_buckets",
    ),
    option(
        "server_metrics",
        boolean(),
        False,
        "also emit gen_ai.server.* (the model server's metric names; llmtap's values include its hop)",
        "telemetry",
        key="telemetry.server_metrics",
        switch=True,
    ),
    option(
        "span_role",
        choice(*SPAN_ROLES),
        "auto",
        "the proxy span: the GenAI generation, or the HTTP hop under a traced client's own (auto: the hop "
        "when a valid traceparent arrives)",
        "telemetry",
        key="telemetry.span_role",
    ),
    option(
        "offline_token_usage",
        boolean(),
        False,
        "report tiktoken's counts as gen_ai.usage.* when the upstream reports no usage",
        "telemetry",
        key="telemetry.offline_token_usage",
        switch=True,
    ),
    option(
        "server_spans_wait",
        SECONDS,
        10.0,
        "how long a finished request waits for the upstream's own span of it (a vLLM exporting its traces to "
        "the admin listener's /v1/traces); 0: never",
        "telemetry",
        key="telemetry.server_spans_wait",
    ),
    option(
        "forward_server_spans",
        boolean(),
        True,
        "forward the upstream's own spans (those /v1/traces takes) to the OTLP traces backend, unchanged, so "
        "a trace shows both sides; only when traces go out over OTLP",
        "telemetry",
        flag="--no-forward-server-spans",
        key="telemetry.forward_server_spans",
        switch=False,
    ),
    option(
        "peer_address",
        address(),
        None,
        "this replica's admin listener as the other replicas reach it (e.g. $(POD_IP):9464): the model server's "
        "spans then reach the replica that relayed their request, wherever the server sends them (docs/fleet.md)",
        "telemetry",
        key="telemetry.peer_address",
        default_text="none: one replica, no routing",
    ),
    option(
        "peer_token",
        text("TOKEN"),
        None,
        "a secret the replicas share: signs this replica's address in the tracestate sent upstream and goes "
        "with every span passed to another replica; required with peer_address",
        "telemetry",
        flag=None,
        key="telemetry.peer_token",
    ),
    option(
        "inject_usage",
        boolean(),
        True,
        "add stream_options.include_usage to OpenAI streams (and take the usage out again)",
        "telemetry",
        flag="--no-inject-usage",
        switch=False,
    ),
    option(
        "server_timing",
        boolean(),
        False,
        "add a Server-Timing header to each relayed response: the proxy's own time, its admission wait and "
        "the upstream's time to headers, in ms (the body is unchanged)",
        "telemetry",
        switch=True,
    ),
    # SLOs
    option("slo_ttft_ms", MS, None, "time-to-first-token objective", "slo", key="slo.ttft_ms"),
    option("slo_tpot_ms", MS, None, "time-per-output-token objective", "slo", key="slo.tpot_ms"),
    option("slo_e2e_ms", MS, None, "end-to-end objective", "slo", key="slo.e2e_ms"),
    option(
        "slo_ttfot_ms",
        MS,
        None,
        "time-to-first-output-token objective (the answer's first chunk, after any reasoning)",
        "slo",
        key="slo.ttfot_ms",
    ),
    option("slo_ttst_ms", MS, None, "time-to-second-token objective", "slo", key="slo.ttst_ms"),
    option(
        "slo_percentile",
        percentile(),
        0.99,
        "the percentile that counts for these objectives (llmtap slo's verdict)",
        "slo",
        key="slo.percentile",
    ),
    option(
        "forward_slo_headers",
        boolean(),
        False,
        "send the caller's per-request objectives (x-slo-ttft-ms, x-slo-tpot-ms) upstream too, for an upstream "
        "or gateway that schedules by them; llmtap reads and judges them either way",
        "slo",
        key="slo.forward_headers",
        switch=True,
    ),
    option(
        "shapes",
        structure("a mapping of shape names to token bounds", (Mapping,), SHAPES_SCHEMA),
        None,
        "request shape classes, matched in order: {NAME: {min_input_tokens, max_input_tokens, min_output_tokens, "
        "max_output_tokens}}; a request none takes is other",
        "slo",
        flag=None,
        env=None,
        key="shapes",
        default_text="long_prompt (input >= 2048, output <= 2048), short_prompt (input <= 1024, output <= 512)",
    ),
    # admission queue and estimates
    _route(
        "max_concurrency",
        integer(1),
        None,
        "requests in flight to an upstream at most, over every relay process",
        "queue",
        default_text="no limit",
    ),
    _route("queue_limit", integer(0), 100, "requests waiting in line at most, over every relay process", "queue"),
    _route("queue_timeout", SECONDS, None, "longest wait in line", "queue", default_text="no limit"),
    _route("queue_full_status", choice(429, 503), 503, "status of a request the line cannot take", "queue"),
    _route("retry_after", integer(0, metavar="SECONDS"), 1, "Retry-After of a refused request, seconds", "queue"),
    _route(
        "server_slots",
        integer(1),
        None,
        "sequences the upstream runs at once (vLLM --max-num-seqs), to infer its queueing",
        "queue",
        default_text="learned",
    ),
    _route(
        "prefill_rate",
        number(above=True, metavar="TOKENS_PER_S"),
        None,
        "upstream prefill rate, input tokens per second",
        "queue",
        default_text="learned",
    ),
    # records and caching
    option(
        "record",
        path("DIR"),
        None,
        "write one JSON record per request into the folder DIR (DIR/date=YYYY-MM-DD/hour=HH/*.jsonl, each process "
        "its own files, closed files gzip-compressed)",
        "records",
        key="record.path",
    ),
    option(
        "record_journal",
        path("DIR"),
        None,
        "keep every request's tape in a bounded journal in DIR until every record sink (files, ClickHouse, OTLP "
        "logs) has its record, and replay what it holds at the next start (after a crash, a kill or a shutdown "
        "whose sinks were down); 'off': no journal. Without --record, set it (on a volume) to keep ClickHouse and "
        "OTLP-log records across restarts",
        "records",
        key="record.journal",
        default_text="DIR/.journal with --record, else off",
    ),
    option(
        "record_journal_mb",
        number(above=True, metavar="MB"),
        256.0,
        "bytes the record journal holds at most, per telemetry process; past it the oldest tapes are no longer kept "
        "for a restart (said in the log; lost, counted as journal_full, if a sink still lacks them at shutdown)",
        "records",
        key="record.journal_mb",
    ),
    option(
        "record_max_mb",
        number(above=True, metavar="MB"),
        64.0,
        "start a new record file past this size",
        "records",
        key="record.max_mb",
    ),
    option(
        "record_rotate_minutes",
        number(above=True, metavar="MINUTES"),
        60.0,
        "start a new record file after this long (and whenever the UTC hour turns)",
        "records",
        key="record.rotate_minutes",
    ),
    option(
        "record_keep_mb",
        number(above=True, metavar="MB"),
        2048.0,
        "closed record files kept in DIR at most, all processes' together; the oldest go first",
        "records",
        key="record.keep_mb",
    ),
    option(
        "record_keep_hours",
        number(above=True, metavar="HOURS"),
        168.0,
        "record files older than this are removed",
        "records",
        key="record.keep_hours",
    ),
    option(
        "record_format",
        choice("jsonl", "parquet"),
        "jsonl",
        "what a closed record file becomes: gzip-compressed JSON lines, or Parquet (pip install llmtap[parquet])",
        "records",
        key="record.format",
    ),
    option(
        "record_logs",
        boolean(),
        False,
        "also emit each record as an OTLP log record (event llmtap.request) to the OTLP logs endpoint",
        "records",
        key="record.logs",
    ),
    option(
        "content_event",
        content_rules(),
        None,
        "emit the content event gen_ai.client.inference.operation.details (an OTLP log record: system instructions, "
        "input and output messages) with a rule per field, keep, hash or drop, e.g. input=keep,output=hash; a field "
        "not named is dropped; no event unless named here",
        "records",
        key="content.event",
        default_text="off",
    ),
    option(
        "content_event_max_bytes",
        byte_size(256),
        16 << 10,
        "the most of each field the content event carries (its JSON, UTF-8); a longer field is cut and the event "
        "names it in llmtap.content.truncated",
        "records",
        key="content.max_bytes",
    ),
    option(
        "record_clickhouse",
        url(),
        None,
        "also send each record to this ClickHouse HTTP interface (http://host:8123), in batches from a thread of "
        "its own; the table is created if missing",
        "records",
        key="record.clickhouse",
        default_text="off",
    ),
    option(
        "record_clickhouse_table",
        text("NAME"),
        "llmtap_records",
        "ClickHouse table of the records (NAME or DATABASE.NAME)",
        "records",
        key="record.clickhouse_table",
    ),
    option(
        "record_clickhouse_user",
        text("USER"),
        None,
        "ClickHouse user (else the URL's, else ClickHouse's default)",
        "records",
        flag=None,
        key="record.clickhouse_user",
    ),
    option(
        "record_clickhouse_password",
        text("PASSWORD"),
        None,
        "ClickHouse password; only from the environment (or the file below), never a flag",
        "records",
        flag=None,
        key=None,
    ),
    option(
        "record_clickhouse_password_file",
        path("FILE"),
        None,
        "read the ClickHouse password from FILE (a mounted Secret); its trailing newline is ignored",
        "records",
        key="record.clickhouse_password_file",
    ),
    option(
        "record_clickhouse_ttl_days",
        integer(0),
        30,
        "days ClickHouse keeps a record (TTL; 0: until deleted); ClickHouse before 19.6 has no TTL, and the log "
        "says so",
        "records",
        key="record.clickhouse_ttl_days",
    ),
    option(
        "record_clickhouse_queue",
        integer(1),
        100_000,
        "records waiting for ClickHouse at most; past it, or past record_clickhouse_queue_mb, a record is dropped "
        "and counted",
        "records",
        key="record.clickhouse_queue",
    ),
    option(
        "record_clickhouse_queue_mb",
        number(above=True, metavar="MB"),
        64.0,
        "bytes of records waiting for ClickHouse at most",
        "records",
        key="record.clickhouse_queue_mb",
    ),
    _route(
        "prompt_version",
        version(),
        None,
        "prompt version of requests without an x-llmtap-prompt-version header",
        "records",
    ),
    _route(
        "cache_min_tokens",
        integer(1),
        None,
        "shortest prompt the upstream caches",
        "records",
        default_text="16 for a self-hosted server (its provider, else a loopback, private or in-cluster address), "
        "1024 for a hosted API",
    ),
    # attribution and cost
    option(
        "metric_dimensions",
        dimension_names(),
        (),
        "attribution dimensions llmtap's request, token and cost counters carry (tenant, user, api_key, "
        "property.<name>); spans and records carry every one",
        "attribution",
        key="attribution.metric_dimensions",
    ),
    option(
        "metric_dimension_values",
        integer(1, 1000),
        20,
        "values of each dimension on metrics at most (the most used keep theirs; the rest read _OTHER)",
        "attribution",
        key="attribution.metric_values",
    ),
    option(
        "forward_llmtap_headers",
        boolean(),
        False,
        "send the caller's x-llmtap-* headers (tenant, user, properties, prompt version) upstream too",
        "attribution",
        key="attribution.forward_headers",
        switch=True,
    ),
    option(
        "attribution_key",
        text("KEY"),
        None,
        "the secret of API-key fingerprints (a keyed hash, never the key); only from the environment or the file below",
        "attribution",
        flag=None,
        key=None,
        default_text="one made at first start and kept in $XDG_STATE_HOME/llmtap/attribution.key",
    ),
    option(
        "attribution_key_file",
        path("FILE"),
        None,
        "read the fingerprints' secret from FILE (a mounted Secret; replicas that share it share fingerprints)",
        "attribution",
        key="attribution.key_file",
    ),
    option(
        "prices",
        path("FILE"),
        None,
        "a price table (JSON or YAML, per million tokens) that wins over the shipped one model by model",
        "attribution",
        key="attribution.prices",
        default_text="the shipped table (dated; docs/attribution.md)",
    ),
    # processes and logging
    option("log_level", choice(*LOG_LEVELS), "info", "what llmtap logs", "process"),
    option(
        "access_log",
        path("PATH"),
        None,
        "one line per request (method, path, status, TTFT, tokens in and out, duration) to PATH, - for stderr; "
        "written by the telemetry process",
        "process",
        default_text="off",
    ),
    option("workers", integer(1), 1, "relay processes sharing the port, one per core", "process"),
    option(
        "telemetry_workers",
        integer(1),
        1,
        "telemetry processes, requests spread over them (one upstream's too); /metrics merges them",
        "process",
    ),
    option(
        "telemetry_scheduling",
        choice(*TELEMETRY_SCHEDULING),
        "nice",
        "how the telemetry processes yield the CPU to the relays: nice (niced by 5: a share of a busy core), idle "
        "(worker threads at SCHED_IDLE: they run only when no relay wants the core, so a core kept busy drops their "
        "tapes, counted; the admin listener's thread niced), or normal",
        "process",
    ),
    option(
        "telemetry_yield",
        integer(0),
        500,
        "microseconds of work after which a telemetry process looks whether a relay waits for the core it runs on, "
        "and hands the core to it if so (telemetry_scheduling idle or nice); 0: never, and the kernel gives a "
        "waiting relay the core back only at its next tick",
        "process",
    ),
    option(
        "telemetry_gather",
        integer(0, 1000),
        250,
        "milliseconds a relay gathers the tapes of finished streams before it writes them to the telemetry process, "
        "all in one write: the telemetry process then takes them in one turn, which costs it less CPU a chunk than "
        "waking for each; records and metrics appear that much later, a change of readiness goes at once; "
        "0: each event-loop turn's tapes leave at its end, as they do with --workers above 1 (the queue/prefill "
        "estimate needs every relay's requests in the order they ended)",
        "process",
    ),
    # the file's routes only
    option(
        "prefix",
        text("PATH"),
        "/",
        "requests whose path starts with this go to the route's upstream",
        "route",
        flag=None,
        env=None,
        key=None,
        route_key="prefix",
    ),
    option(
        "name",
        text(),
        None,
        "the route's name in telemetry",
        "route",
        flag=None,
        env=None,
        key=None,
        route_key="name",
        default_text="the prefix without slashes, or default",
    ),
    option(
        "route_slo",
        structure("an objective or a list of them", (Mapping, list), ROUTE_SLO_SCHEMA),
        None,
        "the route's objectives: [{shape, percentile, ttft_ms, tpot_ms, e2e_ms, ttfot_ms, ttst_ms}], the first for a "
        "request's shape "
        "(none: every shape) judges it",
        "route",
        flag=None,
        env=None,
        key=None,
        route_key="slo",
        default_text="the global slo",
    ),
    option(
        "strip_prefix",
        boolean(),
        False,
        "send the path upstream without the prefix",
        "route",
        flag=None,
        env=None,
        key=None,
        route_key="strip_prefix",
    ),
)

#: Every option by name, in the order of ``--help``.
OPTIONS: Mapping[str, Option] = {o.name: o for o in _TABLE}
#: Options an earlier version had, by flag and file key, and what to use now.
REMOVED: Mapping[str, str] = {
    "--record-files": "records are now kept by total size and age: --record-keep-mb, --record-keep-hours",
    "record.files": "records are now kept by total size and age: record.keep_mb, record.keep_hours",
}
#: The options each route may set for itself, by their key in ``routes[]``.
ROUTE_OPTIONS: Mapping[str, Option] = {o.route_key: o for o in _TABLE if o.route_key is not None}


def default(name: str) -> Any:
    """An option's default (what the ``Settings`` dataclasses default to as well)."""
    return OPTIONS[name].default


def file_keys() -> dict[str, set[str] | None]:
    """The file's top-level keys; a section's value is the set of keys it holds, None for a plain value."""
    keys: dict[str, set[str] | None] = {"routes": None}
    for o in _TABLE:
        if o.key is None:
            continue
        section, _, sub = o.key.partition(".")
        if sub:
            found = keys.setdefault(section, set())
            assert found is not None, o.key
            found.add(sub)
        else:
            keys[section] = None
    return keys


def file_paths() -> list[str]:
    """Every key the file accepts, dotted (``listen.port``), with ``routes[].KEY`` for a route's."""
    return [*(o.key for o in _TABLE if o.key is not None), *(f"routes[].{key}" for key in ROUTE_OPTIONS)]


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the YAML file, closed: an editor can check and complete it."""

    def describe(o: Option) -> dict[str, Any]:
        extra = {"default": o.default} if o.default is not None and not isinstance(o.default, tuple) else {}
        return {**o.kind.schema, "description": o.help, **extra}

    properties: dict[str, Any] = {}
    for o in _TABLE:
        if o.key is None:
            continue
        section, _, sub = o.key.partition(".")
        if sub:
            box = properties.setdefault(section, {"type": "object", "additionalProperties": False, "properties": {}})
            box["properties"][sub] = describe(o)
        else:
            properties[section] = describe(o)
    route = {
        "type": "object",
        "additionalProperties": False,
        "required": ["upstream"],
        "properties": {key: describe(o) for key, o in ROUTE_OPTIONS.items()},
    }
    properties["routes"] = {"type": "array", "items": route, "description": "upstreams by path prefix"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "llmtap serve --config FILE",
        "type": "object",
        "additionalProperties": False,
        "properties": dict(sorted(properties.items())),
    }


def by_group(options: Iterable[Option] = _TABLE) -> dict[str, list[Option]]:
    """Options in the order of ``GROUPS``."""
    out: dict[str, list[Option]] = {group: [] for group in GROUPS}
    for o in options:
        out[o.group].append(o)
    return {group: found for group, found in out.items() if found}


@dataclass(frozen=True, slots=True)
class Variable:
    """A standard ``OTEL_*`` variable llmtap reads (not in ``OPTIONS``: its name and meaning are the SDK's)."""

    name: str
    help: str
    default: str = field(default="")


STANDARD_VARIABLES = (
    Variable("OTEL_EXPORTER_OTLP_ENDPOINT", "where traces and metrics go over OTLP; unset: OTLP off", "unset"),
    Variable("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "traces' own endpoint, used as is", "unset"),
    Variable("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "metrics' own endpoint, used as is", "unset"),
    Variable("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc or http/protobuf (also per signal: _TRACES_, _METRICS_)", "grpc"),
    Variable("OTEL_EXPORTER_OTLP_HEADERS", "k=v,k2=v2 sent with every export (also per signal)", "none"),
    Variable(
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "seconds an export may take, as the SDK reads it (also per signal); the forwarded server spans' too",
        "10",
    ),
    Variable("OTEL_TRACES_EXPORTER", "otlp, console or none", "otlp with an endpoint, else none"),
    Variable("OTEL_METRICS_EXPORTER", "otlp, console or none", "otlp with an endpoint, else none"),
    Variable("OTEL_METRIC_EXPORT_INTERVAL", "milliseconds between metric exports", "10000"),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
        "explicit_bucket_histogram or base2_exponential_bucket_histogram (OTLP only)",
        "explicit_bucket_histogram",
    ),
    Variable("OTEL_SDK_DISABLED", "true: no OTLP export at all (/metrics stays)", "false"),
    Variable("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental: the latest GenAI names", "unset"),
    Variable("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true: prompts and completions on spans", "false"),
    Variable("OTEL_SERVICE_NAME", "the service.name resource attribute", "llmtap"),
)
