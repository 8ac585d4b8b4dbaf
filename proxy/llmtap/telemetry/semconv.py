"""Every telemetry name llmtap emits, defined once.

GenAI names follow the released OpenTelemetry semantic conventions v1.41.1
(https://github.com/open-telemetry/semantic-conventions/tree/v1.41.1/docs/gen-ai); with
``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` the newer names of
open-telemetry/semantic-conventions-genai are used instead (see ``MetricNames``). What the
conventions lack lives under ``llmtap.``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ADMIN_REASON",
    "API_KEY_FINGERPRINT",
    "BUCKETS_DURATION",
    "BUCKETS_SERVER_TPOT",
    "BUCKETS_SERVER_TTFT",
    "BUCKETS_TOKENS",
    "CACHE_CHANGED_REGION",
    "CACHE_CLASS",
    "CACHE_EXPECTED_PREFIX",
    "CACHE_READ_TOKENS",
    "CHUNK_BYTES",
    "CHUNK_COUNT",
    "CHUNK_DETAIL",
    "CHUNK_FOLDED",
    "CHUNK_GAP",
    "CHUNK_INDEX",
    "CHUNK_TOKENS",
    "CLICKHOUSE_OUTCOME",
    "CONTENT_DROP_REASONS",
    "CONTENT_TRUNCATED",
    "COST_AMOUNT",
    "COST_CURRENCY",
    "COST_PRICES",
    "COST_SOURCE",
    "COST_STATUS",
    "CUT_REASON",
    "DECODE_DURATION",
    "DECODE_GAP_MAX",
    "DECODE_GAP_MAX_AT",
    "DECODE_GAP_MAX_INDEX",
    "DECODE_GAP_P50",
    "DECODE_GAP_P99",
    "DECODE_ITL_P50",
    "DECODE_ITL_P99",
    "DECODE_SERVER_DURATION",
    "DRIFT_DIRECTION",
    "E2E",
    "ERROR_TYPE",
    "EVENT_CHUNK",
    "EVENT_OPERATION_DETAILS",
    "HOP_COST_AMOUNT",
    "HOP_FINISH_REASONS",
    "HOP_OPERATION",
    "HOP_PROVIDER",
    "HOP_REQUEST_MODEL",
    "HOP_RESPONSE_ID",
    "HOP_RESPONSE_MODEL",
    "HOP_TIME_TO_FIRST_CHUNK",
    "HTTP_METHOD",
    "HTTP_STATUS",
    "INPUT_MESSAGES",
    "INPUT_SIZE",
    "INPUT_TOKENS",
    "INPUT_TOKENS_SOURCE",
    "LATEST",
    "MALFORMED_EVENTS",
    "METRIC_ACTIVE_STREAMS",
    "METRIC_ADMIN_REFUSED",
    "METRIC_ATTRIBUTION_DROPPED",
    "METRIC_CACHE_READ",
    "METRIC_CACHE_REQUESTS",
    "METRIC_CACHE_WRITE",
    "METRIC_CLICKHOUSE_INSERTS",
    "METRIC_CLIENT_TIMEOUTS",
    "METRIC_CONNECTIONS_REFUSED",
    "METRIC_CONTENT_EVENTS_DROPPED",
    "METRIC_COST",
    "METRIC_COST_UNPRICED",
    "METRIC_DECODE",
    "METRIC_EVENT_STREAMS",
    "METRIC_EXPORTS_FAILED",
    "METRIC_FACTS_DROPPED",
    "METRIC_INPUT_TOKENS",
    "METRIC_ITL",
    "METRIC_JOURNAL_RECORDS",
    "METRIC_JOURNAL_SIZE",
    "METRIC_LABELS_EVICTED",
    "METRIC_LIVE_SAMPLES_DROPPED",
    "METRIC_MALFORMED",
    "METRIC_OBJECTIVE_IGNORED",
    "METRIC_OBJECTIVE_REQUESTS",
    "METRIC_OTLP_FORWARDED",
    "METRIC_OTLP_REJECTED",
    "METRIC_OTLP_ROUTED",
    "METRIC_OUTPUT_TOKENS",
    "METRIC_OVERHEAD",
    "METRIC_PREFILL",
    "METRIC_QUEUE",
    "METRIC_QUEUE_REJECTED",
    "METRIC_QUEUE_WAITING",
    "METRIC_RECORDS_DROPPED",
    "METRIC_RECORDS_RECOVERED",
    "METRIC_RELAY_CHUNK_DELAY",
    "METRIC_REQUESTS",
    "METRIC_RESPONSES_CUT",
    "METRIC_SERVER_SPANS",
    "METRIC_SLO_OBJECTIVE",
    "METRIC_SPANS_DROPPED",
    "METRIC_START_TIME",
    "METRIC_TELEMETRY_DROPPED",
    "METRIC_TIMING_REJECTED",
    "METRIC_TOKEN_DRIFT",
    "METRIC_TPOT",
    "METRIC_TRACE_CONTEXT_IGNORED",
    "METRIC_TTFB",
    "METRIC_TTFOT",
    "METRIC_TTFT",
    "METRIC_TTST",
    "METRIC_UNATTRIBUTED",
    "METRIC_UPSTREAM_TTFT",
    "OBJECTIVE_FIGURE",
    "OBJECTIVE_IGNORED",
    "OBJECTIVE_OUTCOME",
    "OBJECTIVE_TPOT_LIMIT",
    "OBJECTIVE_TPOT_OUTCOME",
    "OBJECTIVE_TTFT_LIMIT",
    "OBJECTIVE_TTFT_OUTCOME",
    "OPENAI_API_TYPE",
    "OPENAI_SYSTEM_FINGERPRINT",
    "OPERATION_NAME",
    "OP_CHAT",
    "OTLP_FORWARD_OUTCOME",
    "OTLP_REJECT_REASON",
    "OUTCOME",
    "OUTPUT_MESSAGES",
    "OUTPUT_TOKENS",
    "OUTPUT_TOKENS_SOURCE",
    "OVERSIZED_EVENTS",
    "PREFILL_DURATION",
    "PREFILL_SOURCE",
    "PROMPT_FINGERPRINT",
    "PROMPT_REGION_TOKENS",
    "PROMPT_SHARED_PREFIX",
    "PROMPT_VERSION",
    "PROPERTY_PREFIX",
    "PROTOCOL",
    "PROVIDER_NAME",
    "PROXY_OVERHEAD",
    "QUEUE_DURATION",
    "QUEUE_PROXY_DURATION",
    "QUEUE_SOURCE",
    "QUEUE_UPSTREAM_DURATION",
    "QUEUE_UPSTREAM_SOURCE",
    "REFUSAL_REASON",
    "RELAY_CHUNK_DELAY_MAX",
    "RELAY_CHUNK_DELAY_P99",
    "RELEASED",
    "REQUEST_CHOICE_COUNT",
    "REQUEST_FREQUENCY_PENALTY",
    "REQUEST_MAX_TOKENS",
    "REQUEST_MODEL",
    "REQUEST_PARSE_ERROR",
    "REQUEST_PRESENCE_PENALTY",
    "REQUEST_SEED",
    "REQUEST_STOP_SEQUENCES",
    "REQUEST_STREAM",
    "REQUEST_TEMPERATURE",
    "REQUEST_TOP_K",
    "REQUEST_TOP_P",
    "RESPONSE_BYTES",
    "RESPONSE_FINISH_REASONS",
    "RESPONSE_ID",
    "RESPONSE_MODEL",
    "RESPONSE_TIME_TO_FIRST_CHUNK",
    "ROUTE",
    "SCHEMA_URL",
    "SERVER_ADDRESS",
    "SERVER_PORT",
    "SERVER_REQUEST_DURATION",
    "SERVER_SPAN_OUTCOME",
    "SERVER_TIME_PER_OUTPUT_TOKEN",
    "SERVER_TIME_TO_FIRST_TOKEN",
    "SHAPE",
    "SLO_OUTCOME",
    "SPAN_CHUNK",
    "SPAN_DECODE",
    "SPAN_PREFILL",
    "SPAN_QUEUE",
    "SPAN_ROLE",
    "SPAN_UNATTRIBUTED",
    "STREAM_UNREAD",
    "SYSTEM_INSTRUCTIONS",
    "TELEMETRY_ATTRIBUTE",
    "TELEMETRY_REASON",
    "TENANT",
    "TIMEOUT_KIND",
    "TIMING_FIELD",
    "TOKEN_MODALITY",
    "TOKEN_TYPE",
    "TPOT",
    "TRACE_CONTEXT_REASON",
    "TTFB",
    "TTFOT",
    "TTST",
    "UNCACHED_INPUT_TOKENS",
    "UPSTREAM_SLOTS",
    "UPSTREAM_SLOTS_CONFIDENCE",
    "UPSTREAM_SLOTS_SOURCE",
    "UPSTREAM_TTFT",
    "UPSTREAM_UNATTRIBUTED_DURATION",
    "URL_PATH",
    "USAGE_CACHE_CREATION",
    "USAGE_CACHE_READ",
    "USAGE_CACHE_WRITE",
    "USAGE_INPUT_TOKENS",
    "USAGE_OUTPUT_TOKENS",
    "USAGE_REASONING",
    "USER_ID",
    "MetricNames",
    "dimension_attribute",
    "schema_url",
]

#: The released conventions llmtap's default names follow, as the ``schema_url`` of its meter's and tracer's
#: instrumentation scope (https://github.com/open-telemetry/semantic-conventions/blob/main/schemas/1.41.1).
#: The latest experimental GenAI names have no published schema: with them the scope carries none.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.1"


def schema_url(latest: bool) -> str | None:
    """The ``schema_url`` of llmtap's instrumentation scope for one naming flavour."""
    return None if latest else SCHEMA_URL


# --- span and metric attributes (gen-ai-spans.md, v1.41.1) ---
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_STREAM = "gen_ai.request.stream"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
USAGE_CACHE_CREATION = "gen_ai.usage.cache_creation.input_tokens"  # v1.41.1
USAGE_CACHE_WRITE = "gen_ai.usage.cache_write.input_tokens"  # semantic-conventions-genai PR #440
USAGE_REASONING = "gen_ai.usage.reasoning.output_tokens"
TOKEN_TYPE = "gen_ai.token.type"
TOKEN_MODALITY = "gen_ai.token.modality"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
#: The content event (semantic-conventions-genai ``model/gen-ai/events.yaml``), opt-in:
#: ``llmtap.telemetry.records.content``.
EVENT_OPERATION_DETAILS = "gen_ai.client.inference.operation.details"
#: The content event's fields cut to its bound (``system``, ``input``, ``output``).
CONTENT_TRUNCATED = "llmtap.content.truncated"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
# OpenAI's own (v1.41.1 docs/gen-ai/openai.md, both Recommended)
OPENAI_API_TYPE = "openai.api.type"
OPENAI_SYSTEM_FINGERPRINT = "openai.response.system_fingerprint"

# gen_ai.operation.name values
OP_CHAT = "chat"
OP_TEXT_COMPLETION = "text_completion"

# --- llmtap attributes: what the conventions lack ---
ROUTE = "llmtap.route"
PROTOCOL = "llmtap.protocol"
OUTCOME = "llmtap.outcome"
SLO_OUTCOME = "llmtap.slo"
INPUT_SIZE = "llmtap.request.input_size"
#: The request shape class by input and output tokens (``shapes:``).
SHAPE = "llmtap.request.shape"
PROMPT_VERSION = "llmtap.prompt.version"
REQUEST_PARSE_ERROR = "llmtap.request.parse_error"
TTFB = "llmtap.time_to_first_byte"
#: After a reasoning model's thinking: the answer's first chunk (AIPerf's time to first output token), and the gap
#: from the first content chunk to the second (AIPerf's time to second token), seconds.
TTFOT = "llmtap.time_to_first_output_token"
TTST = "llmtap.time_to_second_token"
UPSTREAM_TTFT = "llmtap.upstream.time_to_first_chunk"
TPOT = "llmtap.time_per_output_token"
E2E = "llmtap.duration"
QUEUE_DURATION = "llmtap.queue.duration"
QUEUE_SOURCE = "llmtap.queue.source"
QUEUE_PROXY_DURATION = "llmtap.queue.proxy.duration"
QUEUE_UPSTREAM_DURATION = "llmtap.queue.upstream.duration"
QUEUE_UPSTREAM_SOURCE = "llmtap.queue.upstream.source"
PREFILL_DURATION = "llmtap.prefill.duration"
PREFILL_SOURCE = "llmtap.prefill.source"
DECODE_DURATION = "llmtap.decode.duration"
DECODE_SERVER_DURATION = "llmtap.decode.server.duration"  # the server's own decode time, from its span
# Upstream TTFT that the server's own queue and prefill (both reported) leave out: its own part, never folded
# into either.
UPSTREAM_UNATTRIBUTED_DURATION = "llmtap.upstream.unattributed.duration"
UPSTREAM_SLOTS = "llmtap.upstream.slots"  # the slot count the estimator replayed with
UPSTREAM_SLOTS_SOURCE = "llmtap.upstream.slots.source"  # configured, or server_metrics (learned)
UPSTREAM_SLOTS_CONFIDENCE = "llmtap.upstream.slots.confidence"
INPUT_TOKENS = "llmtap.usage.input_tokens"  # every count, from usage or tiktoken (its source beside it)
OUTPUT_TOKENS = "llmtap.usage.output_tokens"
CACHE_READ_TOKENS = "llmtap.usage.cache_read.input_tokens"
INPUT_TOKENS_SOURCE = "llmtap.usage.input_tokens.source"
OUTPUT_TOKENS_SOURCE = "llmtap.usage.output_tokens.source"
UNCACHED_INPUT_TOKENS = "llmtap.usage.uncached_input_tokens"
#: The request's proxy overhead (as ``llmtap.proxy.overhead`` records it), and the p99 and largest delay the
#: relay added to a chunk (upstream read to client write), in seconds, on the request's span.
PROXY_OVERHEAD = "llmtap.proxy.overhead"
RELAY_CHUNK_DELAY_P99 = "llmtap.relay.chunk_delay.p99"
RELAY_CHUNK_DELAY_MAX = "llmtap.relay.chunk_delay.max"
CHUNK_COUNT = "llmtap.decode.chunks"
CHUNK_INDEX = "llmtap.chunk.index"
CHUNK_TOKENS = "llmtap.chunk.tokens"
CHUNK_BYTES = "llmtap.chunk.bytes"
CHUNK_GAP = "llmtap.chunk.gap"
CHUNK_FOLDED = "llmtap.chunk.folded"
# The decode span's chunk statistics, on every request: whether its chunk spans were kept, and why.
CHUNK_DETAIL = "llmtap.chunk.detail"  # error, cancelled, slo_missed, tail, sampled; or summary
DECODE_GAP_P50 = "llmtap.decode.gap.p50"  # chunk gaps (time per output chunk), seconds
DECODE_GAP_P99 = "llmtap.decode.gap.p99"
DECODE_GAP_MAX = "llmtap.decode.gap.max"
DECODE_GAP_MAX_INDEX = "llmtap.decode.gap.max.index"  # the chunk that ended the largest gap
DECODE_GAP_MAX_AT = "llmtap.decode.gap.max.at"  # seconds from the first content chunk to that chunk
DECODE_ITL_P50 = "llmtap.decode.itl.p50"  # inter-token latency: each gap spread over its chunk's tokens
DECODE_ITL_P99 = "llmtap.decode.itl.p99"
MALFORMED_EVENTS = "llmtap.stream.malformed_events"
OVERSIZED_EVENTS = "llmtap.stream.oversized_events"
STREAM_UNREAD = "llmtap.stream.unread"  # why the tap stopped reading the response: inflate_limit, body_limit
RESPONSE_BYTES = "llmtap.response.bytes"
TELEMETRY_REASON = "llmtap.telemetry.reason"
SERVER_SPAN_OUTCOME = "llmtap.server_span.outcome"  # matched, late, unmatched, missing, duplicate
OTLP_REJECT_REASON = "llmtap.otlp.reason"  # why the span receiver refused a body
OTLP_FORWARD_OUTCOME = "llmtap.otlp.outcome"  # sent, dropped, failed, unowned: a received span passed on
TRACE_CONTEXT_REASON = "llmtap.trace_context.reason"  # why a client's trace header was ignored
ADMIN_REASON = "llmtap.admin.reason"  # why the admin listener closed, refused or ignored something
CLICKHOUSE_OUTCOME = "llmtap.clickhouse.outcome"  # ok, failed: an INSERT of records into ClickHouse
TELEMETRY_ATTRIBUTE = "llmtap.telemetry.attribute"  # the metric attribute a label guard bounds
DRIFT_DIRECTION = "llmtap.tokens.drift.direction"
# Prompt fingerprints and cache diagnosis (one attribute per prompt region: tools, system, m0.., rest).
CACHE_CLASS = "llmtap.cache.class"
CACHE_CHANGED_REGION = "llmtap.cache.changed_region"
CACHE_EXPECTED_PREFIX = "llmtap.cache.expected_prefix_tokens"
PROMPT_FINGERPRINT = "llmtap.prompt.fingerprint"  # + ".{region}": the region's short sha256
PROMPT_REGION_TOKENS = "llmtap.prompt.tokens"  # + ".{region}": the region's token length
PROMPT_SHARED_PREFIX = "llmtap.prompt.shared_prefix_tokens"
# The admission queue and timings a server reported but llmtap could not trust.
TIMING_FIELD = "llmtap.server_timing.field"
# Client connections the relay cut for a timeout, or refused.
TIMEOUT_KIND = "llmtap.timeout.kind"
REFUSAL_REASON = "llmtap.refusal.reason"
CUT_REASON = "llmtap.cut.reason"  # why the relay itself cut a response short

SPAN_ROLE = "llmtap.span.role"  # generation or hop (telemetry.span_role)
# A hop span (span_role hop) names the request's GenAI facts here, so no backend counts it as a generation.
HOP_OPERATION = "llmtap.operation"
HOP_PROVIDER = "llmtap.provider"
HOP_REQUEST_MODEL = "llmtap.request.model"
HOP_RESPONSE_MODEL = "llmtap.response.model"
HOP_RESPONSE_ID = "llmtap.response.id"
HOP_FINISH_REASONS = "llmtap.response.finish_reasons"
HOP_TIME_TO_FIRST_CHUNK = "llmtap.time_to_first_chunk"

# Span names (DESIGN "Span model"); the root span is "{operation} {model}" (a hop: "{method} {path}").
SPAN_QUEUE = "llmtap.queue"
SPAN_PREFILL = "llmtap.prefill"
SPAN_UNATTRIBUTED = "llmtap.upstream.unattributed"
SPAN_DECODE = "llmtap.decode"
SPAN_CHUNK = "llmtap.decode.chunk"
EVENT_CHUNK = "llmtap.decode.chunk"


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Metric names for one semantic-conventions flavour."""

    operation_duration: str
    time_to_first_chunk: str
    time_per_output_chunk: str
    token_usage: str | None  # v1.41.1 histogram with gen_ai.token.type; None in the latest conventions
    input_tokens_counter: str | None  # latest: counters with gen_ai.token.modality
    output_tokens_counter: str | None
    cache_read_counter: str | None
    cache_write_counter: str | None
    input_tokens_histogram: str | None
    output_tokens_histogram: str | None
    reasoning_counter: str | None = None  # latest: the reasoning subset of the output tokens


# v1.41.1 model/gen-ai/metrics.yaml
RELEASED = MetricNames(
    operation_duration="gen_ai.client.operation.duration",
    time_to_first_chunk="gen_ai.client.operation.time_to_first_chunk",
    time_per_output_chunk="gen_ai.client.operation.time_per_output_chunk",
    token_usage="gen_ai.client.token.usage",
    input_tokens_counter=None,
    output_tokens_counter=None,
    cache_read_counter=None,
    cache_write_counter=None,
    input_tokens_histogram=None,
    output_tokens_histogram=None,
)
# semantic-conventions-genai docs/gen-ai/non-normative/migration.md (v1.41 -> latest)
LATEST = MetricNames(
    operation_duration="gen_ai.client.inference.duration",
    time_to_first_chunk="gen_ai.client.inference.time_to_first_chunk",
    time_per_output_chunk="gen_ai.client.inference.time_per_output_chunk",
    token_usage=None,
    input_tokens_counter="gen_ai.client.inference.usage.input_tokens",
    output_tokens_counter="gen_ai.client.inference.usage.output_tokens",
    cache_read_counter="gen_ai.client.inference.usage.cache_read.input_tokens",
    cache_write_counter="gen_ai.client.inference.usage.cache_write.input_tokens",
    input_tokens_histogram="gen_ai.client.inference.operation.input_tokens",
    output_tokens_histogram="gen_ai.client.inference.operation.output_tokens",
    reasoning_counter="gen_ai.client.inference.usage.reasoning.output_tokens",
)

# The model server's own metrics (v1.41.1, kept unchanged in the latest conventions). A proxy's values would
# include its hop and collide with the series a real server emits: llmtap emits them only when asked
# (``telemetry.server_metrics``).
SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"

# The conventions' advisory ExplicitBucketBoundaries (v1.41.1 docs/gen-ai/gen-ai-metrics.md; the latest
# conventions keep them, their token histograms taking the token-usage ones).
#: gen_ai.client.operation.duration, .time_to_first_chunk, .time_per_output_chunk, gen_ai.server.request.duration.
BUCKETS_DURATION: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
#: gen_ai.client.token.usage (and the latest conventions' per-request token histograms).
BUCKETS_TOKENS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
#: gen_ai.server.time_to_first_token.
BUCKETS_SERVER_TTFT: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
#: gen_ai.server.time_per_output_token.
BUCKETS_SERVER_TPOT: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip

# llmtap metrics
METRIC_TTFT = "llmtap.time_to_first_token"  # TTFT by route, request shape and prompt version, fine buckets
METRIC_TPOT = "llmtap.time_per_output_token"
METRIC_TTFB = "llmtap.time_to_first_byte"
METRIC_TTFOT = "llmtap.time_to_first_output_token"  # by route and request shape, fine buckets
METRIC_TTST = "llmtap.time_to_second_token"
METRIC_UPSTREAM_TTFT = "llmtap.upstream.time_to_first_chunk"
METRIC_ITL = "llmtap.inter_token_latency"
METRIC_QUEUE = "llmtap.queue.duration"
METRIC_PREFILL = "llmtap.prefill.duration"
METRIC_DECODE = "llmtap.decode.duration"
METRIC_UNATTRIBUTED = "llmtap.upstream.unattributed.duration"
METRIC_CACHE_READ = "llmtap.usage.cache_read.input_tokens"
METRIC_CACHE_WRITE = "llmtap.usage.cache_write.input_tokens"
METRIC_INPUT_TOKENS = "llmtap.usage.input_tokens"
METRIC_OUTPUT_TOKENS = "llmtap.usage.output_tokens"
METRIC_REQUESTS = "llmtap.requests"
METRIC_ACTIVE_STREAMS = "llmtap.streams.active"
METRIC_OVERHEAD = "llmtap.proxy.overhead"
METRIC_RELAY_CHUNK_DELAY = "llmtap.relay.chunk_delay"  # per relayed read: upstream read to client write
METRIC_TOKEN_DRIFT = "llmtap.tokens.drift"
METRIC_TELEMETRY_DROPPED = "llmtap.telemetry.tapes.dropped"  # tapes that never became telemetry, by reason
METRIC_FACTS_DROPPED = "llmtap.telemetry.facts.dropped"  # lessons one telemetry process could not pass to another
METRIC_SPANS_DROPPED = "llmtap.telemetry.spans.dropped"  # never reached the collector, by reason
METRIC_RECORDS_DROPPED = "llmtap.telemetry.records.dropped"  # request records never written (--record), by reason
#: Content events (``--content-event``) that never left, by reason: ``CONTENT_DROP_REASONS``.
METRIC_CONTENT_EVENTS_DROPPED = "llmtap.telemetry.content_events.dropped"
#: Why a content event was lost: the export queue was full, the collector refused or could not be reached, the
#: event could not be made, or the OpenTelemetry SDK installed has no logs API llmtap can use.
CONTENT_DROP_REASONS = ("otlp_queue_full", "otlp_export_failed", "unmade", "sdk_too_old")
# The record journal: records of the last run made again at start, and what the journal holds now.
METRIC_RECORDS_RECOVERED = "llmtap.telemetry.records.recovered"
METRIC_JOURNAL_SIZE = "llmtap.telemetry.journal.size"  # bytes of tapes on disk
METRIC_JOURNAL_RECORDS = "llmtap.telemetry.journal.records"  # requests kept until every sink has their record
#: When this telemetry process started (Unix seconds): its counters start from 0 then (a restart is visible).
METRIC_START_TIME = "llmtap.telemetry.start_time"
METRIC_EXPORTS_FAILED = "llmtap.telemetry.exports.failed"  # metric exports the collector did not take
METRIC_LABELS_EVICTED = "llmtap.telemetry.labels.evicted"  # label values that lost their slot, by attribute
METRIC_MALFORMED = "llmtap.stream.malformed_events"
METRIC_CACHE_REQUESTS = "llmtap.cache.requests"
METRIC_QUEUE_WAITING = "llmtap.queue.waiting"
METRIC_QUEUE_REJECTED = "llmtap.queue.rejected"
METRIC_TIMING_REJECTED = "llmtap.server_timing.rejected"
METRIC_CLIENT_TIMEOUTS = "llmtap.client.timeouts"
METRIC_CONNECTIONS_REFUSED = "llmtap.connections.refused"
METRIC_RESPONSES_CUT = "llmtap.responses.cut"  # responses the relay cut short for a limit of its own, by reason
METRIC_SERVER_SPANS = "llmtap.server_spans"  # the upstream's spans (and requests without one), by join outcome
METRIC_OTLP_REJECTED = "llmtap.otlp.rejected"  # OTLP bodies the span receiver refused, by reason
METRIC_OTLP_FORWARDED = "llmtap.otlp.forwarded"  # the receiver's spans passed on to the traces backend, by outcome
METRIC_OTLP_ROUTED = "llmtap.otlp.routed"  # the receiver's spans passed to the replica that relayed them, by outcome
METRIC_TRACE_CONTEXT_IGNORED = "llmtap.trace_context.ignored"  # client trace headers too long to read, by reason
METRIC_ADMIN_REFUSED = "llmtap.admin.refused"  # admin connections and requests refused or cut, by reason
METRIC_EVENT_STREAMS = "llmtap.admin.event_streams"  # the live view's /events streams open now
# Latency values the live view stopped keeping past its bound (its percentiles then read from buckets, marked)
METRIC_LIVE_SAMPLES_DROPPED = "llmtap.admin.live_samples.dropped"
METRIC_CLICKHOUSE_INSERTS = "llmtap.telemetry.clickhouse.inserts"  # batches of records sent to ClickHouse, by outcome

# Attribution and cost
#: Who sent a request (``llmtap.analysis.attribution``): on spans always, on metrics when the operator allows.
TENANT = "llmtap.tenant"
#: The end user: the general registry's ``user.id`` (https://opentelemetry.io/docs/specs/semconv/registry/attributes/user/).
USER_ID = "user.id"
API_KEY_FINGERPRINT = "llmtap.api_key.fingerprint"
PROPERTY_PREFIX = "llmtap.property."
#: A request's cost, by the GenAI convention of open-telemetry/semantic-conventions-genai#443 (in its
#: ``model/gen-ai/registry.yaml``, status development; that repository has no release yet): the amount, its
#: ISO 4217 currency, and ``provider`` (the response stated it) or ``local`` (the proxy's price table).
COST_AMOUNT = "gen_ai.usage.cost.amount"
COST_CURRENCY = "gen_ai.usage.cost.currency"
COST_SOURCE = "gen_ai.usage.cost.source"
#: ``priced``, ``unknown_model`` or ``no_usage`` (``llmtap.analysis.cost``); where the price came from.
COST_STATUS = "llmtap.cost.status"
COST_PRICES = "llmtap.cost.prices"
HOP_COST_AMOUNT = "llmtap.cost.amount"  # a hop span's cost (its client's span is the generation)
METRIC_COST = "llmtap.cost.usd"  # the sum of priced requests' cost, USD, by model, route and the allowed dimensions
METRIC_COST_UNPRICED = "llmtap.cost.unpriced"  # requests with no cost, by llmtap.cost.status
METRIC_ATTRIBUTION_DROPPED = "llmtap.attribution.dropped"  # x-llmtap-property-* headers past the per-request bound

# Per-request objectives: the latency a caller asked for one request in its x-slo-ttft-ms and x-slo-tpot-ms headers
# (the Gateway API Inference Extension's names; ``llmtap.analysis.objectives``), and whether the request met it.
OBJECTIVE_TTFT_LIMIT = "llmtap.objective.ttft_limit"  # seconds
OBJECTIVE_TPOT_LIMIT = "llmtap.objective.tpot_limit"  # seconds
OBJECTIVE_TTFT_OUTCOME = "llmtap.objective.ttft_outcome"  # met or violated
OBJECTIVE_TPOT_OUTCOME = "llmtap.objective.tpot_outcome"
OBJECTIVE_IGNORED = "llmtap.objective.ignored"  # the figures whose header was ignored as invalid
OBJECTIVE_FIGURE = "llmtap.objective.figure"  # ttft or tpot (metric attribute)
OBJECTIVE_OUTCOME = "llmtap.objective.outcome"  # met or violated (metric attribute)
METRIC_SLO_OBJECTIVE = "llmtap.slo.objective"  # each route and shape's objective percentile (burn-rate budgets)
METRIC_OBJECTIVE_REQUESTS = "llmtap.objective.requests"  # requests judged by their own objective, by figure, outcome
METRIC_OBJECTIVE_IGNORED = "llmtap.objective.headers_ignored"  # x-slo-* headers ignored as invalid, by figure


def dimension_attribute(dimension: str) -> str:
    """The span and metric attribute of an attribution dimension (``tenant``: ``llmtap.tenant``)."""
    if dimension == "tenant":
        return TENANT
    if dimension == "user":
        return USER_ID
    if dimension == "api_key":
        return API_KEY_FINGERPRINT
    return PROPERTY_PREFIX + dimension.removeprefix("property.")
