"""Generates ``docs/reference.md``: every metric, span and attribute llmtap emits, from the code that emits them.

``python docs/generate/reference.py`` writes the file; with ``--check`` it fails when the file is stale. Names,
units, instrument types, descriptions and buckets are read from ``telemetry/emit/instruments.py`` (through a meter that
writes down what it is asked to create); which attributes each metric and span carries is
read from a run of the real recorder over a set of requests that touch every path (stream and unary,
server timings, errors, cancellations, rejections, folded chunks). What a name means is written here,
once, next to the name: a name the code emits or ``semconv.py`` declares without a definition below
stops the generator, so the reference and the code cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opentelemetry.metrics import (
    CallbackT,
    Counter,
    Histogram,
    NoOpMeter,
    ObservableCounter,
    ObservableGauge,
    UpDownCounter,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from llmtap.analysis.objectives import RequestObjective
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import SLO, Route, Settings, TelemetrySettings
from llmtap.providers import provider_for
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS, TOKEN_BUCKETS, create, objective_gauge
from llmtap.telemetry.emit.metrics import CONVENTIONS, OWN, SHAPE
from llmtap.telemetry.emit.setup import process_metrics
from llmtap.telemetry.exposition.prometheus import metric_name
from llmtap.telemetry.fleet import forward
from llmtap.telemetry.recorder import Recorder
from llmtap.types import Facts, ServerTiming, Usage
from llmtap.wire.messages import (
    CLIENT_TIMEOUT_KINDS,
    CONNECTION_REFUSAL_REASONS,
    RESPONSE_CUT_REASONS,
    Stats,
    encode_stats,
)

OUT = Path(__file__).resolve().parent.parent / "reference.md"

# --- what each name means ------------------------------------------------------------------------

_SOURCE = (
    "`server` (the server reported it: its own span, sent to `/v1/traces`, or its response), `proxy` (measured "
    "at the proxy), `estimated` (inferred, see queue)"
)

#: Attribute name: (type, exact definition). ``{region}`` stands for a prompt region: tools, system, m0.., rest.
ATTRIBUTES: dict[str, tuple[str, str]] = {
    sc.OPERATION_NAME: ("string", "`chat` for chat and messages APIs, `text_completion` for legacy completions."),
    sc.PROVIDER_NAME: ("string", "The route's `provider` setting, else the wire protocol's family (`openai`, ...)."),
    sc.REQUEST_MODEL: (
        "string",
        "The model the client asked for, cut at 1,024 characters (on metrics at 256, control characters "
        "replaced); on metrics up to 64 names used often lately, the `telemetry.metric_models` ones, others `_OTHER`.",
    ),
    sc.REQUEST_STREAM: ("boolean", "Set to true if and only if the client asked for a streamed answer."),
    sc.REQUEST_MAX_TOKENS: ("int", "`max_tokens` (or `max_completion_tokens`) as the client sent it."),
    sc.REQUEST_TEMPERATURE: ("double", "`temperature` as the client sent it."),
    sc.REQUEST_TOP_P: ("double", "`top_p` as the client sent it."),
    sc.REQUEST_TOP_K: ("int", "`top_k` as the client sent it."),
    sc.REQUEST_FREQUENCY_PENALTY: ("double", "`frequency_penalty` as the client sent it."),
    sc.REQUEST_PRESENCE_PENALTY: ("double", "`presence_penalty` as the client sent it."),
    sc.REQUEST_STOP_SEQUENCES: ("string[]", "`stop` as the client sent it, always as a list."),
    sc.REQUEST_SEED: ("int", "`seed` as the client sent it."),
    sc.REQUEST_CHOICE_COUNT: ("int", "`n`: how many answers the client asked for, when not 1."),
    sc.RESPONSE_ID: ("string", "The response id the upstream gave (`chatcmpl-...`, `msg_...`)."),
    sc.RESPONSE_MODEL: ("string", "The model the upstream says answered (bounded like the request model)."),
    sc.OPENAI_API_TYPE: ("string", "`chat_completions` or `responses`: which OpenAI API the request used."),
    sc.OPENAI_SYSTEM_FINGERPRINT: ("string", "OpenAI's `system_fingerprint`: the backend configuration that answered."),
    sc.RESPONSE_FINISH_REASONS: ("string[]", "One finish reason per choice; `error` when the stream failed."),
    sc.RESPONSE_TIME_TO_FIRST_CHUNK: ("double", "TTFT in seconds (streams only): see Timing definitions."),
    sc.USAGE_INPUT_TOKENS: (
        "int",
        "Input tokens the upstream reported, cached ones included (Anthropic: input + cache read + cache write); "
        "absent when it reported none (tiktoken's count is `llmtap.usage.input_tokens`, unless "
        "`telemetry.offline_token_usage`) and for a request that never reached the model.",
    ),
    sc.USAGE_OUTPUT_TOKENS: ("int", "Output tokens the upstream reported, reasoning included; absent as above."),
    sc.USAGE_CACHE_READ: ("int", "Input tokens the upstream read from its prompt cache."),
    sc.USAGE_CACHE_CREATION: ("int", "Input tokens written to the prompt cache (v1.41.1 name)."),
    sc.USAGE_CACHE_WRITE: ("int", "Input tokens written to the prompt cache (latest experimental name)."),
    sc.USAGE_REASONING: ("int", "Output tokens spent on reasoning, when the upstream reports them."),
    sc.TOKEN_TYPE: ("string", "`input` or `output`."),
    sc.TOKEN_MODALITY: (
        "string",
        "`unknown` for the counts a provider reports (none breaks them down by modality that llmtap reads) and "
        "on the 0 recorded for a response without usage; `text` for llmtap's own tokenizer counts "
        "(`telemetry.offline_token_usage`).",
    ),
    sc.INPUT_MESSAGES: (
        "string or any",
        "The prompt (system part and messages, role and text) as JSON, at most 16 KiB of text, only when "
        "`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT` is true. On the content event (`--content-event "
        "input=keep` or `hash`): the messages in structured form, or `sha256:<hex>` of them.",
    ),
    sc.SYSTEM_INSTRUCTIONS: (
        "any",
        "Content event only (`--content-event system=keep` or `hash`): instructions sent apart from the chat history "
        "(Anthropic's `system`, the Responses API's `instructions`) as parts, or `sha256:<hex>` of them.",
    ),
    sc.CONTENT_TRUNCATED: (
        "string[]",
        "Content event only: the fields (`system`, `input`, `output`) cut to `--content-event-max-bytes`.",
    ),
    sc.OUTPUT_MESSAGES: (
        "string or any",
        "The completion as JSON, at most 16 KiB, only when `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT` "
        "is true. On the content event (`--content-event output=keep` or `hash`): structured, or its `sha256:<hex>`.",
    ),
    sc.ERROR_TYPE: (
        "string",
        "Why the request failed: an upstream error type or status code, `upstream_unreachable`, "
        "`connect_timeout`, `timeout` (no headers in time), `idle_timeout` (silence between chunks), "
        "`upstream_closed`, `upstream_protocol_error`, `request_too_large`, `queue_full`, `queue_timeout`, "
        "`shutdown` (cut at the drain deadline), `cancelled` (the client left), or `_OTHER`; on metrics up to 32 "
        "types used often lately.",
    ),
    sc.SERVER_ADDRESS: ("string", "The upstream's host name."),
    sc.SERVER_PORT: ("int", "The upstream's port."),
    sc.HTTP_METHOD: ("string", "The client's HTTP method."),
    sc.HTTP_STATUS: ("int", "The status the client got (the upstream's, or the proxy's own 4xx/5xx)."),
    sc.URL_PATH: ("string", "The path the client called (no query string)."),
    sc.ROUTE: ("string", "The name of the route that matched the request (configuration)."),
    sc.PROTOCOL: ("string", "The wire protocol llmtap parsed: `openai_chat`, `anthropic`, `ollama`, ..."),
    sc.OUTCOME: ("string", "`ok`, `error` or `cancelled` (the client left before the end)."),
    sc.SLO_OUTCOME: (
        "string",
        "`met` when every objective of the request's SLO held (TTFT, TPOT, E2E; its route's `slo` for its shape, "
        "else the global `slo`), `missed` otherwise (errors and cancellations "
        "always miss), `none` when no SLO is configured.",
    ),
    sc.INPUT_SIZE: (
        "string",
        "The request's shape by input tokens: `le_256`, `le_1k`, `le_4k`, `le_16k`, `le_64k`, `gt_64k`, `unknown`.",
    ),
    sc.SHAPE: (
        "string",
        "The request's shape class by input and output tokens: the first class of `shapes:` whose bounds hold "
        "(default `long_prompt`: input >= 2048, output <= 2048; `short_prompt`: input <= 1024, output <= 512), "
        "else `other` (also when the input is unknown). On metrics as it is: the names come from the "
        "configuration, at most 16 and `other`.",
    ),
    sc.PROMPT_VERSION: (
        "string",
        "The client's `x-llmtap-prompt-version` header (or `--prompt-version`); on metrics up to 8 versions used "
        "often lately, others `_OTHER`.",
    ),
    sc.REQUEST_PARSE_ERROR: ("string", "Why the request body could not be read (it was relayed unchanged)."),
    sc.TTFB: ("double", "TTFB in seconds: request received to the first response body byte."),
    sc.TTFOT: (
        "double",
        "Time to the first output token, seconds: request received to the first chunk of the answer itself, after "
        "any reasoning (OpenAI-style `reasoning_content`/`reasoning`, Anthropic `thinking`, Responses reasoning "
        "events); equal to TTFT when the first content is answer content (streams only).",
    ),
    sc.TTST: (
        "double",
        "Time to the second token, seconds: the first content chunk to the second (AIPerf's TTST; streams only).",
    ),
    sc.UPSTREAM_TTFT: ("double", "Seconds from sending the request upstream to the first content chunk."),
    sc.TPOT: ("double", "TPOT in seconds: see Timing definitions."),
    sc.E2E: ("double", "Seconds from request received to the end of the stream."),
    sc.QUEUE_DURATION: ("double", "Seconds queued: the proxy's own queue plus the upstream's, when known."),
    sc.QUEUE_SOURCE: ("string", f"Source of the upstream part of the queue, else `proxy`: {_SOURCE}."),
    sc.QUEUE_PROXY_DURATION: ("double", "Seconds in the proxy's admission queue: body read to admitted."),
    sc.PROXY_OVERHEAD: (
        "double",
        "Seconds of the proxy's own time in the request's TTFT, as `llmtap.proxy.overhead` records it (requests sent "
        "upstream).",
    ),
    sc.RELAY_CHUNK_DELAY_P99: (
        "double",
        "Seconds: the p99 of the delay the relay added to each upstream read, its arrival to its write to the "
        "client's socket.",
    ),
    sc.RELAY_CHUNK_DELAY_MAX: ("double", "Seconds: the largest delay the relay added to one upstream read."),
    sc.QUEUE_UPSTREAM_DURATION: ("double", "Seconds the upstream server queued the request, reported or estimated."),
    sc.QUEUE_UPSTREAM_SOURCE: ("string", f"Source of the upstream queue: {_SOURCE}."),
    sc.PREFILL_DURATION: (
        "double",
        "Seconds reading the prompt: server-reported; else estimated; else (`upstream_ttft`) request sent to first "
        "content chunk, server queueing included.",
    ),
    sc.PREFILL_SOURCE: ("string", f"{_SOURCE}, or `upstream_ttft` (request sent to first content chunk)."),
    sc.DECODE_SERVER_DURATION: (
        "double",
        "Seconds the server itself decoded (first to last token), from its span; `llmtap.decode.duration` stays "
        "the proxy's measurement.",
    ),
    sc.UPSTREAM_UNATTRIBUTED_DURATION: (
        "double",
        "Seconds of a stream's upstream TTFT that the server's own queue and prefill (both reported) leave out: "
        "its request handling before its queue, handing out its first token, the network. Its own part (and "
        "span), never folded into queue or prefill.",
    ),
    sc.UPSTREAM_SLOTS: ("int", "The upstream's slot count the queue estimate replayed (vLLM `--max-num-seqs`)."),
    sc.UPSTREAM_SLOTS_SOURCE: (
        "string",
        "`configured` (the route's `server_slots`) or `server_metrics` (learned from the upstream's `/metrics`: "
        "the peak of `vllm:num_requests_running`, given once `vllm:num_requests_waiting` > 0, raised to the most "
        "requests llmtap saw decoding at once).",
    ),
    sc.UPSTREAM_SLOTS_CONFIDENCE: (
        "double",
        "1 when configured; learned: `1 - 2^-n` after `n` samples at that peak with requests waiting.",
    ),
    sc.SERVER_SPAN_OUTCOME: (
        "string",
        "`matched` (joined its request in time), `late` (came after its request was written; counted only), "
        "`unmatched` (no request of llmtap is its parent), `missing` (a request whose span did not come within "
        "`telemetry.server_spans_wait`), `duplicate` (a further span for a request that already has one; never "
        "joined).",
    ),
    sc.OTLP_REJECT_REASON: (
        "string",
        "Why `/v1/traces` refused a body: `bad_body` (400: not OTLP protobuf, bad gzip), `too_large` (413: over "
        "`admin.max_body_bytes` as sent), `inflated_too_large` (413: over `admin.max_inflated_bytes` inflated, or "
        "over `admin.max_inflate_ratio` times its size past 1 MiB), `unsupported_type` (415: not "
        "`application/x-protobuf`, or not gzip), `unauthorized` (401: no or a wrong bearer token, or marked as passed "
        "on by another replica without `telemetry.peer_token`), `forbidden` "
        "(403: a peer beyond loopback, or any with `admin.loopback_token`, and no token configured).",
    ),
    sc.ADMIN_REASON: (
        "string",
        "What the admin listener refused or cut: `connection_evicted` (the connection waiting longest, closed for "
        "a new one past `admin.max_connections`), `connection_limit` (503: every open connection had a request "
        "in progress), `event_streams` (503: `admin.max_event_streams` live-view streams open), `unauthorized` "
        "(401) and `forbidden` (403): `/events` without the token a peer needs.",
    ),
    sc.TRACE_CONTEXT_REASON: (
        "string",
        "Which client trace header was ignored as over 512 characters (the OpenTelemetry SDK reads none longer): "
        "`traceparent_too_long` (the request starts a new trace), `tracestate_too_long` (the parent is kept).",
    ),
    sc.OTLP_FORWARD_OUTCOME: (
        "string",
        "What became of a span `/v1/traces` took, forwarded unchanged to llmtap's OTLP traces backend: `sent` "
        f"(the backend took it), `dropped` (the forward queue, {forward.MAX_QUEUED} bodies or "
        f"{forward.MAX_QUEUED_BYTES >> 20} MiB, was full, or it still waited at shutdown), `failed` (the backend "
        "refused it, was unreachable, or took longer than `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, 10 s by default; no "
        "retry), `unowned` (not forwarded: no request this process relayed is in its trace, within "
        "`telemetry.server_spans_wait`, at least 2 s). On `llmtap.otlp.routed`, a span passed to the replica that "
        "relayed its request (`telemetry.peer_address`, docs/fleet.md): `sent`, `dropped` (the same queue's bounds), "
        "`failed` (refused, unreachable, or over 2 s).",
    ),
    sc.CLICKHOUSE_OUTCOME: (
        "string",
        "What became of one INSERT of request records into ClickHouse (`--record-clickhouse`): `ok`, or `failed` "
        "(unreachable, or it answered an error; the batch is tried again, with a growing pause).",
    ),
    sc.DECODE_DURATION: ("double", "Seconds from the first content chunk to the last."),
    sc.INPUT_TOKENS: (
        "int",
        "Input tokens from the best source (usage, else tiktoken), only for a request that reached the model; "
        "also on `llmtap.prefill`.",
    ),
    sc.OUTPUT_TOKENS: ("int", "Output tokens from the best source (usage, else tiktoken); also on `llmtap.decode`."),
    sc.CACHE_READ_TOKENS: ("int", "Cache-read input tokens, on `llmtap.prefill`."),
    sc.SPAN_ROLE: ("string", "`hop` on a root span that is the proxy hop under a traced client's generation."),
    sc.HOP_OPERATION: ("string", "On a hop span: the operation (`gen_ai.operation.name` of a generation)."),
    sc.HOP_PROVIDER: ("string", "On a hop span: the provider (`gen_ai.provider.name` of a generation)."),
    sc.HOP_REQUEST_MODEL: ("string", "On a hop span: the model asked for."),
    sc.HOP_RESPONSE_MODEL: ("string", "On a hop span: the model that answered."),
    sc.HOP_RESPONSE_ID: ("string", "On a hop span: the response id."),
    sc.HOP_FINISH_REASONS: ("string[]", "On a hop span: the finish reasons."),
    sc.HOP_TIME_TO_FIRST_CHUNK: (
        "double",
        "TTFT in seconds (streams), on every root span, generation or hop: what the collectors' slow-TTFT "
        "sampling rule keys on.",
    ),
    sc.INPUT_TOKENS_SOURCE: ("string", "`usage` (the upstream reported it) or the tiktoken encoding that counted it."),
    sc.OUTPUT_TOKENS_SOURCE: (
        "string",
        "`usage` (the upstream reported it), the tiktoken encoding that counted it, or `estimated` (past the first "
        "million characters, at the tokens per character counted before).",
    ),
    sc.UNCACHED_INPUT_TOKENS: ("int", "Input tokens minus cache-read tokens: what prefill had to read."),
    sc.CHUNK_COUNT: ("int", "Content chunks in the stream."),
    sc.CHUNK_INDEX: ("int", "The chunk's position, from 0."),
    sc.CHUNK_TOKENS: ("int", "Tokens the chunk carried: usage apportioned by tiktoken counts, at least 1 each."),
    sc.CHUNK_BYTES: ("int", "Bytes of the upstream read that carried the chunk."),
    sc.CHUNK_GAP: ("double", "Chunk gap in seconds (0 for the first): see Timing definitions."),
    sc.CHUNK_FOLDED: ("int", "How many chunks past the cap this one span or event stands for."),
    sc.CHUNK_DETAIL: (
        "string",
        "Why the request kept a span per chunk (`error`, `cancelled`, `slo_missed`, `tail`, `sampled`), or `summary`: "
        "its chunk statistics only (`--chunk-detail-sample`, `--chunk-detail-tail`).",
    ),
    sc.DECODE_GAP_P50: ("double", "Median chunk gap of the request, seconds."),
    sc.DECODE_GAP_P99: ("double", "99th percentile chunk gap of the request, seconds."),
    sc.DECODE_GAP_MAX: ("double", "The request's largest chunk gap, seconds."),
    sc.DECODE_GAP_MAX_INDEX: ("int", "The chunk that ended the largest gap (its `llmtap.chunk.index`)."),
    sc.DECODE_GAP_MAX_AT: ("double", "Seconds from the first content chunk to the chunk that ended the largest gap."),
    sc.DECODE_ITL_P50: ("double", "Median inter-token latency of the request (each gap spread over its tokens)."),
    sc.DECODE_ITL_P99: ("double", "99th percentile inter-token latency of the request, seconds."),
    sc.MALFORMED_EVENTS: ("int", "Stream events llmtap could not parse (relayed unchanged)."),
    sc.OVERSIZED_EVENTS: ("int", "Stream events larger than the decoder keeps (relayed unchanged)."),
    sc.STREAM_UNREAD: (
        "string",
        "Why llmtap stopped reading the response before its end (it relayed every byte): `inflate_limit` (it "
        "inflated past 64 MiB, or past 256 times its compressed size), `body_limit` (a whole body past 32 MiB).",
    ),
    sc.RESPONSE_BYTES: ("int", "Response body bytes relayed to the client."),
    sc.TELEMETRY_REASON: (
        "string",
        "Why telemetry was dropped: `queue_full` (the recorder's queue, or the span export queue), "
        "`export_failed` (the collector refused or could not be reached), `shutdown` (still queued at the flush "
        "deadline); for tapes also `channel_full`, `evicted`, `partial` and, read in part, `inflate_limit` and "
        "`body_limit`; for records `no_space`, `io_error` and `invalid`, as OTLP log records (`--record-logs`) "
        "`otlp_queue_full` and `otlp_export_failed`, and for the ClickHouse sink `clickhouse_queue_full` (its queue "
        "was at its bound), `clickhouse_rejected` (ClickHouse refused a batch three times), `clickhouse_unsent` "
        "(still queued at shutdown).",
    ),
    sc.TELEMETRY_ATTRIBUTE: (
        "string",
        "The metric attribute whose values a label guard bounds: `gen_ai.request.model` (request and response "
        "models), `llmtap.prompt.version`, `error.type`.",
    ),
    sc.DRIFT_DIRECTION: ("string", "`over`, `under` or `exact`: tiktoken's count against the reported usage."),
    sc.CACHE_CLASS: (
        "string",
        "Why the prompt was or was not served from cache: `hit`, `cold`, `miss_changed`, `miss_evicted`, "
        "`too_short`, `unknown`.",
    ),
    sc.CACHE_CHANGED_REGION: ("string", "For `miss_changed`: the prompt region where it first differs."),
    sc.CACHE_EXPECTED_PREFIX: ("int", "Tokens the upstream could have read from cache (shared with a recent prompt)."),
    f"{sc.PROMPT_FINGERPRINT}.{{region}}": ("string", "A short sha256 of one prompt region, never its text."),
    f"{sc.PROMPT_REGION_TOKENS}.{{region}}": ("int", "Tokens in one prompt region."),
    sc.PROMPT_SHARED_PREFIX: ("int", "Tokens this prompt shares with the most similar recent one."),
    sc.TIMING_FIELD: ("string", "Which server-reported timing field was ignored as malformed or absurd."),
    sc.TIMEOUT_KIND: (
        "string",
        "Which client timeout closed the connection: `header` (no whole request line and headers within "
        "`timeouts.client_header` of the first byte; 408), `body` (a request body silent for "
        "`timeouts.client_body`; 408 when no response had started), `idle` (no request for `timeouts.keep_alive`), "
        "`send` (the client took none of a response it held back for `timeouts.client_send`), `upload` (a request "
        "body silent for `timeouts.client_upload` while its request held an admission slot; 408).",
    ),
    sc.REFUSAL_REASON: (
        "string",
        "Why a client connection was refused with 503: `limit` (`max_client_connections` were open in its relay), "
        "`per_client` (its address held `max_connections_per_client` open ones).",
    ),
    sc.CUT_REASON: (
        "string",
        "Why the relay cut a response short: `inflate_limit` (it decompressed past `max_inflate_bytes`, to remove "
        "the usage event it asked for).",
    ),
    # Attribution and cost (issue 31; docs/attribution.md)
    sc.OBJECTIVE_TTFT_LIMIT: (
        "double",
        "The TTFT the caller asked for this request, in seconds: its `x-slo-ttft-ms` header (the Gateway API "
        "Inference Extension's name) when valid.",
    ),
    sc.OBJECTIVE_TPOT_LIMIT: ("double", "The TPOT the caller asked for, in seconds: its `x-slo-tpot-ms` header."),
    sc.OBJECTIVE_TTFT_OUTCOME: (
        "string",
        "`met` or `violated`: the request's TTFT against `llmtap.objective.ttft_limit` (a failed or cancelled "
        "request violated it; a non-streamed answer is not judged).",
    ),
    sc.OBJECTIVE_TPOT_OUTCOME: (
        "string",
        "`met` or `violated`: the request's TPOT against `llmtap.objective.tpot_limit` (a failed or cancelled "
        "request violated it; an answer of one chunk met it).",
    ),
    sc.OBJECTIVE_IGNORED: (
        "string[]",
        "The figures (`ttft`, `tpot`) whose `x-slo-*` header was ignored: not a plain number of milliseconds "
        "above 0 and at most an hour.",
    ),
    sc.OBJECTIVE_FIGURE: ("string", "The figure a per-request objective bounds: `ttft` or `tpot`."),
    sc.OBJECTIVE_OUTCOME: ("string", "Whether the request met its own objective for the figure: `met`, `violated`."),
    sc.TENANT: ("string", "The caller's `x-llmtap-tenant` header (at most 256 characters, cleaned)."),
    sc.USER_ID: (
        "string",
        "The end user: `x-llmtap-user`, else the body's OpenAI `safety_identifier` or `user`, Anthropic "
        "`metadata.user_id` (at most 256 characters, cleaned).",
    ),
    sc.API_KEY_FINGERPRINT: (
        "string",
        "12 hex characters: a keyed BLAKE2b of the request's API key (`authorization`, `x-api-key`, `api-key`, "
        "`x-goog-api-key`), never the key.",
    ),
    f"{sc.PROPERTY_PREFIX}{{name}}": (
        "string",
        "An `x-llmtap-property-<name>` header (name folded to `[a-z0-9_]`; at most 16 a request).",
    ),
    sc.COST_AMOUNT: (
        "double",
        "What the request cost: the cost the response stated (a `usage.cost` field, a gateway's "
        "`x-litellm-response-cost` header), else its reported tokens at the price table's prices; absent when "
        "unknown, never 0 (semantic-conventions-genai #443, development, no release yet).",
    ),
    sc.COST_CURRENCY: ("string", "`USD`."),
    sc.COST_SOURCE: (
        "string",
        "`provider` (the response stated the cost) or `local` (llmtap computed it from the reported tokens and its "
        "price table, named in `llmtap.cost.prices`).",
    ),
    sc.COST_STATUS: (
        "string",
        "`priced`, `unknown_model` (no price for the model: no amount, never 0) or `no_usage` (the upstream "
        "reported no tokens).",
    ),
    sc.COST_PRICES: (
        "string",
        "Where the price came from: `default <date>` (the shipped table) or `file` (`--prices`).",
    ),
    sc.HOP_COST_AMOUNT: ("double", "On a hop span: what the request cost, USD."),
}

#: Attributes of metrics the reference run cannot provoke (they count failures of llmtap itself).
UNEXERCISED: dict[str, tuple[str, ...]] = {
    sc.METRIC_TELEMETRY_DROPPED: (sc.TELEMETRY_REASON,),
    sc.METRIC_SPANS_DROPPED: (sc.TELEMETRY_REASON,),
    sc.METRIC_FACTS_DROPPED: (sc.TELEMETRY_REASON,),
    sc.METRIC_RECORDS_DROPPED: (sc.TELEMETRY_REASON,),
    sc.METRIC_CONTENT_EVENTS_DROPPED: (sc.TELEMETRY_REASON,),
    sc.METRIC_SERVER_SPANS: (sc.SERVER_SPAN_OUTCOME,),
    sc.METRIC_OTLP_REJECTED: (sc.OTLP_REJECT_REASON,),
    sc.METRIC_OTLP_FORWARDED: (sc.OTLP_FORWARD_OUTCOME,),
    sc.METRIC_OTLP_ROUTED: (sc.OTLP_FORWARD_OUTCOME,),
    sc.METRIC_ADMIN_REFUSED: (sc.ADMIN_REASON,),
    sc.METRIC_TRACE_CONTEXT_IGNORED: (sc.TRACE_CONTEXT_REASON,),
    sc.METRIC_CLICKHOUSE_INSERTS: (sc.CLICKHOUSE_OUTCOME,),
}

_SERVER_SETTING = "`telemetry.server_metrics: true`"

#: The gen_ai.client.* metrics leave a hop to its client's own instrumentation (``attributes.is_hop``).
_NOT_HOP = " Not for a hop (a request its client traces): the client's own instrumentation records it."

_CHUNK_GAPS = "One sample per chunk gap of a streamed request (past 8192, that many spread evenly)."

#: Metric name: when it is recorded (its description, from the code, says what it measures).
METRICS: dict[str, str] = {
    sc.RELEASED.operation_duration: "Every LLM request, with `error.type` when it failed." + _NOT_HOP,
    sc.LATEST.operation_duration: "Every LLM request, with `error.type` when it failed." + _NOT_HOP,
    sc.RELEASED.time_to_first_chunk: "Streamed requests that got a first content chunk." + _NOT_HOP,
    sc.LATEST.time_to_first_chunk: "Streamed requests that got a first content chunk." + _NOT_HOP,
    sc.RELEASED.time_per_output_chunk: _CHUNK_GAPS + _NOT_HOP,
    sc.LATEST.time_per_output_chunk: _CHUNK_GAPS + _NOT_HOP,
    str(sc.RELEASED.token_usage): "Every LLM request with a token count, once per `gen_ai.token.type`." + _NOT_HOP,
    str(sc.LATEST.input_tokens_counter): "Every LLM request with an input token count." + _NOT_HOP,
    str(sc.LATEST.output_tokens_counter): "Every LLM request with an output token count." + _NOT_HOP,
    str(sc.LATEST.cache_read_counter): "Every LLM request whose usage reports cache reads." + _NOT_HOP,
    str(sc.LATEST.cache_write_counter): "Every LLM request whose usage reports cache writes." + _NOT_HOP,
    str(sc.LATEST.reasoning_counter): "Every LLM request: the reasoning tokens its usage reports, else 0." + _NOT_HOP,
    str(sc.LATEST.input_tokens_histogram): "Every LLM request with an input token count." + _NOT_HOP,
    str(sc.LATEST.output_tokens_histogram): "Every LLM request with an output token count." + _NOT_HOP,
    sc.SERVER_TIME_TO_FIRST_TOKEN: f"Only with {_SERVER_SETTING}: successful streamed requests.",
    sc.SERVER_TIME_PER_OUTPUT_TOKEN: f"Only with {_SERVER_SETTING}: as `llmtap.time_per_output_token`.",
    sc.SERVER_REQUEST_DURATION: f"Only with {_SERVER_SETTING}: every LLM request, hops included.",
    sc.METRIC_TTFT: "Streamed requests that got a first content chunk, as "
    "`gen_ai.client.operation.time_to_first_chunk`.",
    sc.METRIC_TPOT: "Successful requests with a decode to time: two content chunks or more, two output tokens or more.",
    sc.METRIC_TTFB: "Every LLM request that got a response body byte.",
    sc.METRIC_TTFOT: "Streamed requests that got answer content.",
    sc.METRIC_TTST: "Streamed requests of two content chunks or more.",
    sc.METRIC_UPSTREAM_TTFT: "Streamed requests that got a first content chunk.",
    sc.METRIC_ITL: "Streamed requests: one sample per output token after the first chunk (past 8192, that many spread evenly).",  # noqa: E501
    sc.METRIC_QUEUE: "Every LLM request whose queue time is known.",
    sc.METRIC_PREFILL: "Streamed requests whose prefill is known.",
    sc.METRIC_DECODE: "Streamed requests with a first and last content chunk.",
    sc.METRIC_UNATTRIBUTED: "Streamed requests whose server reported both its queue and its prefill.",
    sc.METRIC_CACHE_READ: "Every LLM request whose usage reports cache reads.",
    sc.METRIC_CACHE_WRITE: "Every LLM request whose usage reports cache writes.",
    sc.METRIC_INPUT_TOKENS: "Every LLM request with an input token count.",
    sc.METRIC_OUTPUT_TOKENS: "Every LLM request with an output token count.",
    sc.METRIC_REQUESTS: "Every finished LLM request, once.",
    sc.METRIC_ACTIVE_STREAMS: "+1 when a request arrives, -1 when its record is written or dropped.",
    sc.METRIC_OVERHEAD: "Every request that was sent upstream.",
    sc.METRIC_RELAY_CHUNK_DELAY: "Every upstream read the relay handed to the client's socket, one sample each.",
    sc.METRIC_TOKEN_DRIFT: (
        "Where usage reports the input or the output, tiktoken's count of the whole prompt and of the whole output"
        " against it, on at most one request a second per route (the token figures are usage's and need neither)."
    ),
    sc.METRIC_TELEMETRY_DROPPED: "Each request whose tape was dropped: the relay's channel or the recorder's queue was full.",  # noqa: E501
    sc.METRIC_FACTS_DROPPED: "With `--telemetry-workers` above 1: each lesson of the state kept whole per upstream "
    "(a request's end, an idle request's TTFT, a prompt's block chain, a slot count) that one telemetry process "
    "could not pass to another (`channel_full`) or could not queue (`queue_full`); both read 0 from the start.",
    sc.METRIC_LABELS_EVICTED: "Each label value that lost its slot to a more frequent one.",
    sc.METRIC_RECORDS_DROPPED: "Each request record that a failed write (`--record`), a full queue or failed "
    "export of its log record (`--record-logs`), ClickHouse, or the record journal's bound (`journal_full`) lost; "
    "0 per reason from the start.",
    sc.METRIC_CONTENT_EVENTS_DROPPED: "With `--content-event`: each content event the export queue's bound "
    "(`otlp_queue_full`), a refused or unanswered export (`otlp_export_failed`), a failure to make it (`unmade`) or "
    "a logs SDK too old (`sdk_too_old`) lost; 0 per reason from the start. A field past "
    "`--content-event-max-bytes` is cut, not dropped (`llmtap.content.truncated`).",
    sc.METRIC_RECORDS_RECOVERED: "Once the record journal's replay at start is done (`--record-journal`): the "
    "records of the last run it made again; reads 0 from the start with a journal.",
    sc.METRIC_JOURNAL_SIZE: "Each scrape or export, with a record journal: the bytes of tapes it holds now.",
    sc.METRIC_JOURNAL_RECORDS: "Each scrape or export, with a record journal: the requests it keeps until every "
    "record sink has their record.",
    sc.METRIC_SPANS_DROPPED: "Each scrape or export, with an OTLP trace exporter: the spans dropped so far, by "
    "`llmtap.telemetry.reason`.",
    sc.METRIC_EXPORTS_FAILED: "Each scrape or export, with an OTLP metric exporter: metric exports the collector did "
    "not take so far.",
    sc.METRIC_START_TIME: "Each scrape or export: when the telemetry process started (a restart shows as a new value; "
    "its counters start from 0 then).",
    sc.METRIC_MALFORMED: "Streams with events llmtap could not parse; every route reads 0 from the start.",
    sc.METRIC_CACHE_REQUESTS: "Every LLM request, once, by its cache class.",
    sc.METRIC_QUEUE_WAITING: "+1 when a request joins a route's admission queue, -1 when it leaves.",
    sc.METRIC_QUEUE_REJECTED: "Each request the admission queue refused; every route reads 0 for each `error.type` "
    "from the start.",
    sc.METRIC_TIMING_REJECTED: "Each server-reported timing field that was ignored; every route reads 0 for each "
    "phase (`queue`, `prefill`, `decode`) from the start.",
    sc.METRIC_CLIENT_TIMEOUTS: "Each client connection a relay closed for a timeout; each kind reads 0 from the start.",
    sc.METRIC_CONNECTIONS_REFUSED: "Each client connection a relay refused; every reason reads 0 from the start.",
    sc.METRIC_RESPONSES_CUT: "Each response a relay cut short for a limit of its own; every reason reads 0 from the "
    "start.",
    sc.METRIC_SERVER_SPANS: "Each span the upstream sent to `/v1/traces` with latency attributes, and each request "
    "that waited for one in vain; every outcome reads 0 from the start.",
    sc.METRIC_OTLP_REJECTED: "Each body `/v1/traces` refused; every reason reads 0 from the start.",
    sc.METRIC_OTLP_FORWARDED: "Each span `/v1/traces` took, once forwarded to the traces backend or not "
    "(`telemetry.forward_server_spans`, only when traces go out over OTLP); every outcome reads 0 from the start.",
    sc.METRIC_OTLP_ROUTED: "Each span `/v1/traces` passed to the replica named in its `tracestate` (with "
    "`telemetry.peer_address`), or to the telemetry process of this replica that recorded its request (with "
    "`--telemetry-workers` above 1); `sent`, `dropped` and `failed` read 0 from the start.",
    sc.METRIC_ADMIN_REFUSED: "Each admin connection or request refused or cut; every reason reads 0 from the start.",
    sc.METRIC_EVENT_STREAMS: "The live view's open `/events` streams, up and down as they open and end.",
    sc.METRIC_LIVE_SAMPLES_DROPPED: "Each latency value the live view let go past its bound; reads 0 from the start.",
    sc.METRIC_TRACE_CONTEXT_IGNORED: "Each client trace header too long to read; every reason reads 0 from the start.",
    sc.METRIC_CLICKHOUSE_INSERTS: "Each INSERT of a batch of records into ClickHouse (`--record-clickhouse`); every "
    "outcome reads 0 from the start.",
    sc.METRIC_COST: "Each priced LLM request, by its cost; with the attribution dimensions `metric_dimensions` allows.",
    sc.METRIC_COST_UNPRICED: "Each LLM request without a cost (no price for its model, or no reported usage).",
    sc.METRIC_SLO_OBJECTIVE: "Each scrape or export: one series per route and shape with an objective (the "
    "burn-rate rules of `llmtap slo --rules` read their budget from it).",
    sc.METRIC_OBJECTIVE_REQUESTS: "Each request with a valid `x-slo-ttft-ms` or `x-slo-tpot-ms` header, once per "
    "figure judged.",
    sc.METRIC_OBJECTIVE_IGNORED: "Each `x-slo-*` header ignored as invalid.",
    sc.METRIC_ATTRIBUTION_DROPPED: "Each request with more than 16 `x-llmtap-property-*` headers, by those dropped.",
}

#: The timing definitions every figure rests on (DESIGN, "Timing definitions"); all from one monotonic clock.
TIMINGS: tuple[tuple[str, str], ...] = (
    ("TTFT", "Request received by the proxy to the first chunk that carries generated content: text, tool-call "
     "arguments or reasoning. Role-only deltas, `response.created`, `message_start` and `ping` do not count."),
    ("TTFB", "Request received to the first response body byte; reported beside TTFT, never instead of it."),
    ("TTFOT", "Time to the first output token: request received to the first chunk of the answer itself, after a "
     "reasoning model's thinking (reasoning deltas, Anthropic `thinking` blocks); TTFT when there is no reasoning."),
    ("TTST", "Time to the second token: the first content chunk to the second (AIPerf's definition)."),
    ("upstream TTFT", "Request sent upstream to the first content chunk."),
    ("content chunk", "All generated content that arrived in one read from the upstream connection."),
    ("chunk gap", "End of the previous content chunk to the end of this one."),
    ("ITL", "A chunk gap divided over the tokens its chunk carried: one sample per token."),
    ("TPOT", "(last content chunk - first content chunk) / (output tokens - 1)."),
    ("E2E", "Request received to the end of the stream (or the failure, or the client leaving)."),
    ("decode", "First content chunk to last content chunk."),
    ("queue", "The proxy's admission queue (body read to admitted, measured) plus the upstream server's queue: "
     "reported by the server (its own span sent to `/v1/traces`, or vLLM, TGI, Ollama, NIM in the response), else "
     "estimated by replaying the server's slots (configured, or learned from its `/metrics`) or from the "
     "unloaded-TTFT envelope, marked `estimated`."),
    ("prefill", "Server-reported (its span or its response), else estimated (`uncached tokens / prefill rate`), "
     "else upstream TTFT (`upstream_ttft`, server queueing included); each with its `llmtap.prefill.source`."),
    ("goodput", "Requests per second that met every configured SLO; errors and cancellations count as missed."),
)  # fmt: skip


#: Released metric names the latest conventions rename (the same instrument, another name).
RENAMED = {
    sc.RELEASED.operation_duration: sc.LATEST.operation_duration,
    sc.RELEASED.time_to_first_chunk: sc.LATEST.time_to_first_chunk,
    sc.RELEASED.time_per_output_chunk: sc.LATEST.time_per_output_chunk,
}


# --- reading the instruments ---------------------------------------------------------------------


@dataclass(slots=True)
class Instrument:
    """One instrument as ``instruments.create`` asked a meter for it."""

    name: str
    kind: str
    unit: str
    description: str
    buckets: Sequence[float] | None = None
    #: The buckets with ``telemetry.histogram_buckets: fine``.
    fine_buckets: Sequence[float] | None = None


class _CatalogMeter(NoOpMeter):
    """A meter that writes down every instrument it is asked to create."""

    def __init__(self) -> None:
        super().__init__("llmtap-docs")
        self.created: list[Instrument] = []

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Counter:
        self.created.append(Instrument(name, "counter", unit, description))
        return super().create_counter(name, unit, description)

    def create_observable_gauge(
        self,
        name: str,
        callbacks: Sequence[CallbackT] | None = None,
        unit: str = "",
        description: str = "",
    ) -> ObservableGauge:
        self.created.append(Instrument(name, "gauge", unit, description))
        return super().create_observable_gauge(name, callbacks, unit, description)

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> UpDownCounter:
        self.created.append(Instrument(name, "up-down counter", unit, description))
        return super().create_up_down_counter(name, unit, description)

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> Histogram:
        self.created.append(Instrument(name, "histogram", unit, description, explicit_bucket_boundaries_advisory))
        return super().create_histogram(
            name, unit, description, explicit_bucket_boundaries_advisory=explicit_bucket_boundaries_advisory
        )

    def create_observable_counter(
        self, name: str, callbacks: Any = None, unit: str = "", description: str = ""
    ) -> ObservableCounter:
        self.created.append(Instrument(name, "counter", unit, description))
        return super().create_observable_counter(name, callbacks, unit, description)


def instruments(*, latest: bool) -> list[Instrument]:
    """Every instrument of one naming flavour (the opt-in ``gen_ai.server.*`` ones too), with the buckets of
    either ``telemetry.histogram_buckets`` setting; then the telemetry process's own (``setup.process_metrics``)."""
    standard, fine = _CatalogMeter(), _CatalogMeter()
    create(standard, latest=latest, server=True)
    create(fine, latest=latest, fine=True, server=True)
    for meter in (standard, fine):
        objective_gauge(meter, lambda: ())
    for ins, other in zip(standard.created, fine.created, strict=True):
        ins.fine_buckets = other.buckets
    exporters: Any = SimpleNamespace(observe=None)  # present: their instruments are made
    process_metrics(standard, 0.0, exporters, exporters)
    return standard.created


# --- exercising the recorder ---------------------------------------------------------------------

_T0 = 100.0
_WALL = 1_700_000_000_000_000_000
_ROUTE = Route(prefix="/", upstream="http://upstream:8000", name="default", provider="vllm", server_slots=4)
#: Who sent the first request: every attribution dimension (``llmtap.analysis.attribution``).
_ATTRIBUTION = {"tenant": "acme", "user": "user-7", "api_key": "0123456789ab", "property.team": "search"}
_BODY: dict[str, Any] = {
    "model": "example-model",
    "messages": [
        {"role": "system", "content": "You answer questions about an invoice. " * 8},
        {"role": "user", "content": "What is the total?"},
    ],
    "max_tokens": 64,
    "temperature": 0.2,
    "top_p": 0.9,
    "top_k": 40,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "stop": ["END"],
    "seed": 7,
    "n": 2,
}


def _timeline(
    *,
    stream: bool = True,
    chunks: int = 5,
    relay: bool = False,
    body: dict[str, Any] | None = None,
    raw: bytes = b"",
    at: float = _T0,
) -> Timeline:
    provider = provider_for("POST", "/v1/chat/completions")
    assert provider is not None
    tl = Timeline(
        method="POST",
        path="/v1/chat/completions",
        route=_ROUTE.name,
        upstream=_ROUTE.upstream,
        server_address=_ROUTE.host,
        server_port=_ROUTE.port,
        protocol=None if relay else provider.name,
        provider_name=_ROUTE.provider or provider.family,
        received=at,
        received_wall_ns=_WALL,
        body_read=at + 0.001,
        admitted=at + 0.002,
        sent=at + 0.003,
        headers=at + 0.05,
        first_byte=at + 0.05,
        status_code=200,
        prompt_version="v2" if body is None else None,
    )
    if not relay:
        content = raw or json.dumps({**(_BODY if body is None else body), "stream": stream}).encode()
        tl.request = provider.inspect(content, inject_usage=True)
    for i in range(chunks):
        tl.add_chunk(at + 0.2 + i * 0.02, 40, f" word{i}")
        tl.relay_delays.append(0.00002 * (i + 1))  # what the relay added to each read
    tl.end = at + 0.2 + chunks * 0.02
    tl.response_bytes = 40 * chunks + 100
    return tl


def _requests() -> Iterable[Timeline]:
    """Requests that between them take every path the recorder has."""
    full = _timeline()
    full.apply(
        Facts(
            usage=Usage(input_tokens=120, output_tokens=11, cache_read_tokens=96, cache_write_tokens=8,
                        reasoning_tokens=2, cost=0.00042),
            finish_reasons=["stop", "stop"],
            response_id="chatcmpl-1",
            response_model="example-model-2025",
            system_fingerprint="fp_example",
            server_timing=ServerTiming(queue=0.05, prefill=0.1),
        )
    )  # fmt: skip
    full.malformed_events, full.oversized_events, full.rejected_timings = 1, 1, ["decode"]
    full.attribution = dict(_ATTRIBUTION)
    full.request_objective = RequestObjective(ttft=0.5, tpot=0.05)
    yield full
    again = _timeline()
    # The server's own timing in full, its decode too (``llmtap.decode.server.duration``).
    again.apply(
        Facts(
            usage=Usage(input_tokens=120, output_tokens=10),
            response_model="gpt-4o",  # priced by the shipped table: a local cost
            finish_reasons=["length"],
            server_timing=ServerTiming(queue=0.01, prefill=0.15, decode=0.08),
        )
    )
    again.request_objective = RequestObjective(tpot=0.001, invalid=["ttft"])
    yield again
    yield _timeline(chunks=3)  # no usage: tiktoken counts
    unary = _timeline(stream=False, chunks=1)
    unary.apply(Facts(usage=Usage(input_tokens=120, output_tokens=9), finish_reasons=["stop"]))
    yield unary
    failed = _timeline(chunks=0)
    failed.status_code = 500
    failed.fail("500", "upstream error")
    yield failed
    left = _timeline(chunks=2)
    left.fail("cancelled", cancelled=True)
    yield left
    refused = _timeline(chunks=0)
    refused.sent = refused.headers = refused.first_byte = None
    refused.status_code = 503
    refused.fail("queue_full", "the admission queue is full")
    yield refused
    yield _timeline(chunks=9)  # past the chunk cap: the tail folds
    bomb = _timeline(chunks=2)
    bomb.unread = "inflate_limit"  # the tap stopped reading it
    yield bomb
    yield _timeline(chunks=1, relay=True)
    # A client that traces: with span_role auto, llmtap's root is the hop under the client's generation.
    hop = _timeline(chunks=3)
    hop.parent = ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "")
    hop.apply(
        Facts(
            usage=Usage(input_tokens=120, output_tokens=10),
            finish_reasons=["stop"],
            response_id="chatcmpl-2",
            response_model="gpt-4o",
            system_fingerprint="fp_example",
            server_timing=ServerTiming(queue=0.02),
        )
    )
    hop.attribution = dict(_ATTRIBUTION)
    hop.request_objective = RequestObjective(ttft=0.5, invalid=["tpot"])
    yield hop
    # No prompt version and another system prompt (the cache diagnosis names the changed region), and a
    # body that is not JSON at all: no model, relayed unchanged.
    changed = [{"role": "system", "content": "You answer questions about a receipt. " * 8}, *_BODY["messages"][1:]]
    other = _timeline(body={"model": _BODY["model"], "messages": changed}, at=_T0 + 10)
    other.apply(Facts(usage=Usage(input_tokens=120, output_tokens=10, cache_read_tokens=0)))
    yield other
    yield _timeline(raw=b"{not json", chunks=1)


@dataclass(slots=True)
class Observed:
    """Attribute names (and value types) seen on each metric and span."""

    metric_attrs: dict[str, list[set[str]]] = field(default_factory=dict)
    span_attrs: dict[str, set[str]] = field(default_factory=dict)
    span_kinds: dict[str, str] = field(default_factory=dict)
    types: dict[str, set[str]] = field(default_factory=dict)


def _generic(name: str) -> str:
    for prefix in (sc.PROMPT_FINGERPRINT, sc.PROMPT_REGION_TOKENS):
        if name.startswith(prefix + "."):
            return prefix + ".{region}"
    if name.startswith(sc.PROPERTY_PREFIX):
        return sc.PROPERTY_PREFIX + "{name}"
    return name


def _type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, list | tuple):
        # Structured content (the content event's messages: maps in a list) is OTLP's AnyValue.
        return "any" if any(isinstance(v, dict) for v in value) else "string[]"
    return "string"


def _note(out: Observed, attrs: Any) -> set[str]:
    keys = set()
    for key, value in (attrs or {}).items():
        name = _generic(key)
        keys.add(name)
        out.types.setdefault(name, set()).add(_type(value))
    return keys


def exercise(*, latest: bool, chunk_mode: str, out: Observed) -> None:
    """Record ``_requests()`` with a real recorder and write down what it emitted."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry = TelemetrySettings(
        semconv_latest=latest,
        capture_content=True,
        chunk_spans=chunk_mode,
        chunk_span_cap=4,
        chunk_detail_sample=1.0,  # every request shows its chunk spans and events, for the reference
        server_metrics=True,
    )
    settings = Settings(routes=(_ROUTE,), slo=SLO(ttft=0.5, tpot=0.05), telemetry=telemetry)
    recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        for tl in _requests():
            recorder.record(tl)
        # A relay reporting one stream active and one request in the admission line, then none, and a client
        # connection cut for each timeout and one refused.
        none = (
            tuple((kind, 0) for kind in CLIENT_TIMEOUT_KINDS),
            tuple((r, 0) for r in CONNECTION_REFUSAL_REASONS),
            tuple((r, 0) for r in RESPONSE_CUT_REASONS),
        )
        some = (
            tuple((kind, 1) for kind in CLIENT_TIMEOUT_KINDS),
            tuple((r, 1) for r in CONNECTION_REFUSAL_REASONS),
            tuple((r, 1) for r in RESPONSE_CUT_REASONS),
        )
        recorder.take(0, encode_stats(Stats(True, 0, ((_ROUTE.name, 1),), ((_ROUTE.name, 1),), *none)))
        recorder.take(0, encode_stats(Stats(True, 0, ((_ROUTE.name, 0),), ((_ROUTE.name, 0),), *some)))
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    seen = out.metric_attrs.setdefault(metric.name, [])
                    seen.extend(_note(out, p.attributes) for p in metric.data.data_points)
        for span in spans.get_finished_spans():
            name = span.name
            if span.kind == SpanKind.CLIENT:
                root = span.attributes is not None and sc.OPERATION_NAME in span.attributes
                name = "root" if root else "relay"
            elif span.kind == SpanKind.SERVER:
                name = "hop"
            out.span_kinds[name] = span.kind.name
            out.span_attrs.setdefault(name, set()).update(_note(out, span.attributes))
            for event in span.events:
                key = f"event {event.name}"
                out.span_kinds[key] = "event"
                out.span_attrs.setdefault(key, set()).update(_note(out, event.attributes))
    finally:
        recorder.close()
        tracer_provider.shutdown()
        meter_provider.shutdown()
    content_events(out)


def content_events(out: Observed) -> None:
    """The content event of a chat request and of an Anthropic one (instructions sent apart), every field kept,
    with a bound the chat's input exceeds: what the event carries at most."""
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    from llmtap.analysis.finish import Finished
    from llmtap.analysis.summary import Summary
    from llmtap.config.types import ContentEvent
    from llmtap.telemetry.records.content import ContentEmitter

    exporter = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    rules = ContentEvent(rules=(("system", "keep"), ("input", "keep"), ("output", "keep")), max_bytes=256)
    emitter = ContentEmitter(rules, exporter)
    chat = _timeline()
    chat.apply(Facts(finish_reasons=["stop"], response_id="chatcmpl-3", response_model="example-model-2025"))
    messages = provider_for("POST", "/v1/messages")
    assert messages is not None
    anthropic = _timeline()
    anthropic.protocol = messages.name
    body = {"model": "example-model", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}
    anthropic.request = messages.inspect(json.dumps(body).encode(), inject_usage=False)
    for tl in (chat, anthropic):
        tl.trace_id, tl.span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        emitter.emit(Finished(tl, Summary(), None))
    emitter.close()
    for data in exporter.get_finished_logs():
        out.span_kinds[CONTENT_EVENT] = "log record"
        out.span_attrs.setdefault(CONTENT_EVENT, set()).update(_note(out, data.log_record.attributes))


# --- writing the reference -----------------------------------------------------------------------


def declared_attributes() -> set[str]:
    """Every attribute name ``semconv`` declares (span, event and metric names aside)."""
    out = set()
    for key, value in vars(sc).items():
        if (
            not key.isupper()
            or not isinstance(value, str)
            or key.startswith(("SPAN_", "EVENT_", "METRIC_", "OP_", "SCHEMA"))
        ):
            continue
        if key.startswith("SERVER_") and value.startswith("gen_ai.server."):
            continue  # server-side metric names
        generic = key in ("PROMPT_FINGERPRINT", "PROMPT_REGION_TOKENS", "PROPERTY_PREFIX")
        out.add(_generic(value + ".x" if key != "PROPERTY_PREFIX" else value + "x") if generic else value)
    return out


def _buckets(bounds: Sequence[float] | None) -> str:
    if bounds is None:
        return "the SDK's default"
    if tuple(bounds) == DURATION_BUCKETS:
        span = f"from 1 ms to {bounds[-1]:.0f} s, each 2^(1/8) (about 9%) above the last"
        return f"llmtap's fine ones, {len(bounds)} bounds {span}"
    if tuple(bounds) == TOKEN_BUCKETS:
        span = f"from 1 to {bounds[-1]:,.0f} tokens, each about 2^(1/4) above the last"
        return f"llmtap's fine ones, {len(bounds)} bounds {span}"
    advised = tuple(bounds) in (sc.BUCKETS_DURATION, sc.BUCKETS_TOKENS, sc.BUCKETS_SERVER_TTFT, sc.BUCKETS_SERVER_TPOT)
    listed = ", ".join(f"{b:.0f}" if b >= 1 and float(b).is_integer() else f"{b:g}" for b in bounds)
    return f"the conventions' advice, {len(bounds)} bounds: {listed}" if advised else listed


def _bucket_lines(ins: Instrument) -> str:
    """The buckets of a histogram under either setting, and the ``/metrics`` lines one label set of it takes."""
    if ins.buckets == ins.fine_buckets:
        return f"- buckets, either setting: {_buckets(ins.buckets)}; {_lines(ins.buckets)} lines per label set"
    return (
        f"- buckets, `standard` (default): {_buckets(ins.buckets)}; {_lines(ins.buckets)} lines per label set\n"
        f"- buckets, `fine`: {_buckets(ins.fine_buckets)}; {_lines(ins.fine_buckets)} lines per label set"
    )


def _lines(bounds: Sequence[float] | None) -> int:
    """``/metrics`` lines of one histogram series: a bucket per bound and ``+Inf``, ``_sum``, ``_count``."""
    return len(bounds or ()) + 3


#: The attribute sets of metrics (``llmtap.telemetry.emit.metrics``), as the reference names them.
SET_CONVENTIONS = "the conventions'"
SET_OWN = "llmtap's"
SET_SHAPED = "llmtap's, by request shape"


def attribute_set(name: str, seen: Iterable[str]) -> str | None:
    """Which attribute set a metric carries, from what the run saw on it; stops the generator when a ``gen_ai.*``
    metric carries more than the conventions list (``gen_ai.token.type`` or modality aside)."""
    keys = set(seen)
    if name.startswith("gen_ai."):
        extra = keys - set(CONVENTIONS) - {sc.TOKEN_TYPE, sc.TOKEN_MODALITY}
        if extra:
            raise SystemExit(
                f"docs/generate/reference.py: {name} carries {', '.join(sorted(extra))}, not in the conventions' list"
            )
        return SET_CONVENTIONS
    if not {sc.OPERATION_NAME, sc.ROUTE} <= keys:
        return None
    return SET_SHAPED if set(SHAPE) <= keys else SET_OWN


def _histogram_section(released: list[Instrument]) -> list[str]:
    genai = next(i for i in released if i.name == sc.RELEASED.operation_duration)
    own = next(i for i in released if i.name == sc.METRIC_TTFT)
    return [
        "## Histograms: buckets and aggregation",
        "",
        "Explicit buckets by default, on `/metrics` and over OTLP alike, the same for every latency histogram:",
        "",
        "- fine buckets, 2^(1/8) (about 9%) apart from 1 ms to 131 s (tokens: 2^(1/4) apart), on llmtap's own",
        "  histograms always and on the `gen_ai.*` ones by default (`telemetry.histogram_buckets: fine`). A",
        "  percentile read from them with `histogram_quantile` lies within a few percent of the exact value.",
        f"  Over OTLP each point carries all {len(own.buckets or ())} bounds.",
        "- `/metrics` writes them sparse: of each histogram, the bounds of the range its values span, from the",
        "  bound below the lowest bucket holding a value (where `histogram_quantile` interpolates from) to the",
        "  bound of the highest, the same on every series, and a bound once written stays. A bound left out",
        "  counts what the one below it counts, so every quantile reads exactly as from all the bounds, while a",
        f"  series costs a line per bucket its values span, not {_lines(own.buckets)}. A value inside the range seen",
        "  so far never makes a bound appear; in the `rate()` window in which one beyond it does, that value",
        "  counts in the next bound up.",
        "- `telemetry.histogram_buckets: standard` (`--histogram-buckets standard`) gives the `gen_ai.*`",
        "  histograms the conventions' advisory boundaries instead, for dashboards keyed on those `le` values:",
        f"  at most {_lines(genai.buckets)} lines per label set, and a percentile read from them can be half again",
        "  high: they double at each step.",
        "- `OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram` makes",
        "  every histogram exponential over OTLP (at most 160 buckets over the range its values span, as narrow",
        "  as that range allows), whatever the setting says; any other value than that or",
        "  `explicit_bucket_histogram` stops the start. `/metrics` keeps explicit buckets: the Prometheus text",
        "  format has no native histograms.",
        "",
        "How far a percentile read back from each lies from the exact value: `python -m bench.probes.buckets` and",
        "`python -m bench.probes.page` (`bench/RESULTS.md`); what each backend gets: docs/reading-the-numbers.md.",
        "",
    ]


def _attribute_sets(observed: Observed, names: Iterable[str]) -> list[str]:
    members: dict[str, list[str]] = {SET_CONVENTIONS: [], SET_OWN: [], SET_SHAPED: []}
    for name in names:
        seen = observed.metric_attrs.get(name)
        chosen = attribute_set(name, set().union(*seen)) if seen else None
        if chosen is not None:
            members[chosen].append(name)
    return [
        "## Metric attribute sets",
        "",
        "Metric attributes are a bounded subset of the span's. A metric may add its own (a source, an outcome),",
        "named in its section below; llmtap's process counters carry only theirs.",
        "",
        "| set | attributes | metrics |",
        "| --- | --- | --- |",
        f"| {SET_CONVENTIONS} | {_code(CONVENTIONS)} (`error.type` on the durations, when the request failed; "
        "token usage adds `gen_ai.token.type`, the latest conventions' token counters `gen_ai.token.modality`) "
        f"| {_code(members[SET_CONVENTIONS])} |",
        f"| {SET_OWN} | the conventions' and {_code(OWN)} | {_code(members[SET_OWN])} |",
        f"| {SET_SHAPED} | llmtap's and {_code(SHAPE)} | {_code(members[SET_SHAPED])} |",
        "",
        "The `gen_ai.*` metrics carry the conventions' list and nothing else, so they read as any",
        "instrumentation's do; what llmtap's dashboards group by (route, shape, prompt version) lives on its own",
        "metrics. Series per model and route: see the README (Telemetry).",
        "",
    ]


def _code(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names)) or "none"


def render(observed: Observed, released: list[Instrument], latest: list[Instrument]) -> str:
    """The reference as Markdown."""
    missing = sorted((set(observed.types) | declared_attributes()) - set(ATTRIBUTES))
    unnamed = sorted({i.name for i in released + latest} - set(METRICS))
    if missing or unnamed:
        raise SystemExit(
            "docs/generate/reference.py: no definition for "
            + ", ".join(missing + unnamed)
            + " (add it to ATTRIBUTES or METRICS, then run python docs/generate/reference.py)"
        )
    for name, seen in observed.types.items():
        declared = ATTRIBUTES[name][0]
        if seen != set(declared.split(" or ")):
            raise SystemExit(
                f"docs/generate/reference.py: {name} is declared {declared} but emitted as {', '.join(sorted(seen))}"
            )
    lines = [
        "# Telemetry reference",
        "",
        "<!-- Generated by `python docs/generate/reference.py` from proxy/llmtap/telemetry/semconv.py,",
        "     proxy/llmtap/telemetry/emit/instruments.py and a run of the recorder. Do not edit:",
        "     CI runs `python docs/generate/reference.py --check`. -->",
        "",
        "Every metric, span and attribute llmtap emits. Names follow the OpenTelemetry GenAI semantic conventions",
        "v1.41.1; with `OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental` the names in the last column",
        "of the metric table replace them. Prometheus names are what `/metrics` on the admin listener shows.",
        "The meter's and tracer's instrumentation scope is `llmtap`, with the `schema_url`",
        f"{sc.SCHEMA_URL} (none with the latest experimental names: they have no published schema).",
        "How to read the numbers: [reading-the-numbers.md](reading-the-numbers.md).",
        "",
        "## Timing definitions",
        "",
        "All times come from one monotonic clock in the proxy.",
        "",
        "| figure | definition |",
        "| --- | --- |",
        *(f"| {name} | {text} |" for name, text in TIMINGS),
        "",
        "## Metrics",
        "",
        "| metric | Prometheus | type | unit | recorded | latest-conventions name |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    released_names = {i.name for i in released}
    shown = released + [i for i in latest if i.name not in released_names and i.name not in RENAMED.values()]
    for ins in shown:
        prom = metric_name(ins.name, ins.unit, counter=ins.kind == "counter")
        lines.append(
            f"| [`{ins.name}`](#{ins.name.replace('.', '')}) | `{prom}` | {ins.kind} | `{ins.unit}` "
            f"| {METRICS[ins.name]} | {_latest_cell(ins.name, released_names)} |"
        )
    lines += [
        "",
        "A request is a hop when its client traces it (`telemetry.span_role: auto`, the default, and a valid",
        "`traceparent`; every request with `hop`): the client's own instrumentation reports the generation, in",
        "its span and its `gen_ai.client.*` metrics, so llmtap records none of the `gen_ai.client.*` metrics for",
        "it and a backend summing them counts each generation once. llmtap's own metrics (`llmtap.*`, `llmtap_*`",
        "on `/metrics`) count every request through the proxy, hop or not.",
        "",
    ]
    lines += _histogram_section(released)
    lines += _attribute_sets(observed, [i.name for i in shown])
    for ins in shown:
        lines += _metric_section(ins, observed)
    lines += [
        "## Spans",
        "",
        "One trace per request: the root span (a child of the client's `traceparent`), and under it",
        "`llmtap.queue`, `llmtap.prefill` and `llmtap.decode`, with one `llmtap.decode.chunk` span (or event, with",
        "`--chunk-spans events`) per content chunk up to the cap; past it the tail folds into one.",
        "",
        "The root's role (`telemetry.span_role`, `--span-role`, `LLMTAP_SPAN_ROLE`): `generation` makes it the",
        "GenAI `CLIENT` span `{gen_ai.operation.name} {gen_ai.request.model}` with `gen_ai.usage.*`; `hop` makes it",
        "a `SERVER` span `{method} {path}` with no `gen_ai.*` attribute at all (its GenAI facts under `llmtap.*`),",
        "so that under a client's own generation span trace backends count one generation and its tokens once;",
        "`auto` (the default) is `hop` when the request arrives with a valid `traceparent`, `generation` otherwise:",
        "an invalid one is treated as none (a new trace, and the client's `tracestate` is not sent upstream).",
        "Child spans never carry `gen_ai.usage.*`.",
        "",
    ]
    for name in sorted(observed.span_attrs, key=_span_order):
        kind = observed.span_kinds[name].lower()
        lines += [f"### {SPAN_TITLES.get(name, f'`{name}`')} ({kind})", "", _code(observed.span_attrs[name]), ""]
    lines += [
        "## Attributes",
        "",
        "| attribute | type | on spans | on metrics | definition |",
        "| --- | --- | --- | --- | --- |",
    ]
    on_metrics = {a for seen in observed.metric_attrs.values() for keys in seen for a in keys}
    on_metrics.update(a for names in UNEXERCISED.values() for a in names)
    for name in sorted(ATTRIBUTES):
        kind, text = ATTRIBUTES[name]
        spans = sorted(s for s, keys in observed.span_attrs.items() if name in keys)
        where = ", ".join(f"`{s}`" for s in spans) if spans else "–"
        if name not in observed.types and name not in on_metrics:
            where = "declared, not emitted"
        lines.append(f"| `{name}` | {kind} | {where} | {'yes' if name in on_metrics else '–'} | {text} |")
    return "\n".join(lines) + "\n"


def _latest_cell(name: str, released: set[str]) -> str:
    if name in RENAMED:
        return f"`{RENAMED[name]}`"
    if name == sc.RELEASED.token_usage:
        return "replaced by the `gen_ai.client.inference.*` token metrics below"
    if name not in released:
        return "(latest conventions only)"
    return "same"


#: The content event, as the reference lists it (a log record, not a span: ``llmtap.telemetry.records.content``).
CONTENT_EVENT = f"log {sc.EVENT_OPERATION_DETAILS}"

SPAN_TITLES = {
    CONTENT_EVENT: f"`{sc.EVENT_OPERATION_DETAILS}`, opt-in (`--content-event`), severity DEBUG",
    "root": "root: `{gen_ai.operation.name} {gen_ai.request.model}`",
    "relay": "root of a plain relay (no LLM protocol): `{http.request.method}`",
    "hop": "root under a traced client (`telemetry.span_role` hop, or auto with a `traceparent`): "
    "`{http.request.method} {url.path}`",
}


def _span_order(name: str) -> int:
    order = ["root", "hop", sc.SPAN_QUEUE, sc.SPAN_UNATTRIBUTED, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_CHUNK]
    order += [f"event {sc.EVENT_CHUNK}", "relay", CONTENT_EVENT]
    return order.index(name) if name in order else len(order)


def _metric_section(ins: Instrument, observed: Observed) -> list[str]:
    seen = observed.metric_attrs.get(ins.name) or [set(UNEXERCISED.get(ins.name, ()))]
    always = set.intersection(*seen) if seen else set()
    sometimes = set.union(*seen) - always if seen else set()
    lines = [
        f"### {ins.name}",
        "",
        f"{ins.description} Recorded: {METRICS[ins.name]}",
        "",
        f"- Prometheus: `{metric_name(ins.name, ins.unit, counter=ins.kind == 'counter')}`; type {ins.kind}; "
        f"unit `{ins.unit}`",
    ]
    if ins.kind == "histogram":
        lines.append(_bucket_lines(ins))
    if seen:
        lines.append(f"- attributes, always: {_code(always)}")
        lines.append(f"- attributes, when known: {_code(sometimes)}")
    lines.append("")
    return lines


def generate() -> str:
    """The reference, freshly generated."""
    observed = Observed()
    exercise(latest=False, chunk_mode="spans", out=observed)
    exercise(latest=True, chunk_mode="events", out=observed)
    return render(observed, instruments(latest=False), instruments(latest=True))


def main(argv: Sequence[str] | None = None, *, write: Callable[[str], object] = sys.stdout.write) -> int:
    """``python docs/generate/reference.py [--check] [--out PATH]``."""
    p = argparse.ArgumentParser(prog="python docs/generate/reference.py", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail when the file differs from what the code says")
    p.add_argument("--out", type=Path, default=OUT, help=f"where the reference goes (default {OUT})")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            write(f"{args.out} is stale: run python docs/generate/reference.py\n")
            return 1
        write(f"{args.out} is up to date\n")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    write(f"wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
