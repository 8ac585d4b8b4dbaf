"""The metric instruments: names from ``semconv``, units, descriptions and bucket boundaries.

Bucket scheme (one for every latency histogram). Every histogram in seconds takes ``DURATION_BUCKETS``: bounds 2^(1/8)
(about 9%) apart from 1 ms to about 131 s, so ``histogram_quantile`` lands within a few percent of the exact value
wherever the data is (``python -m bench.probes.buckets``, ``python -m bench.probes.page``); token counts take
``TOKEN_BUCKETS``, 2^(1/4) apart. The ``gen_ai.*`` histograms take them too by default (``telemetry.histogram_buckets:
fine``); ``standard`` gives those the conventions' advisory boundaries (``semconv.BUCKETS_*``, which double at each
step: a p99 read from them can be half again high), for dashboards keyed on those ``le`` values. llmtap's own latency
histograms keep the fine buckets whatever the setting: the dashboards, the live view and ``llmtap compare`` read them.

So many bounds cost little on ``/metrics``: the reader writes a histogram sparse, only the bounds over the range
of the values its series hold (``prometheus``). Over OTLP each point carries every bound, or with
``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram`` every
histogram is exponential (``setup``). A new latency histogram follows the scheme by being created with
``_seconds`` (or ``DURATION_BUCKETS`` as its advisory boundaries): its page then stays small and its
percentiles close by the same rule.
The proxy's own cost (overhead, the relay's delay per chunk) lives under a millisecond: its buckets
(``OVERHEAD_BUCKETS``) start at 10 us.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation, UpDownCounter

from llmtap.telemetry import semconv as sc

__all__ = [
    "DURATION_BUCKETS",
    "OVERHEAD_BUCKETS",
    "TOKEN_BUCKETS",
    "Instruments",
    "Objectives",
    "create",
    "objective_gauge",
]

#: Fine duration buckets: 1 ms to ~131 s in steps of 2^(1/8).
DURATION_BUCKETS: tuple[float, ...] = tuple(round(0.001 * 2 ** (i / 8), 7) for i in range(137))
#: The proxy's own cost (``llmtap.proxy.overhead``, ``llmtap.relay.chunk_delay``): 10 us to 100 ms in steps
#: of 2^(1/3) (41 bounds), since a healthy relay adds well under a millisecond.
OVERHEAD_BUCKETS: tuple[float, ...] = (*(round(1e-5 * 2 ** (i / 3), 9) for i in range(40)), 0.1)
#: Fine token buckets: 1 to ~2M tokens in steps of 2^(1/4), rounded to distinct integers.
TOKEN_BUCKETS: tuple[float, ...] = tuple(sorted({float(round(2 ** (i / 4))) for i in range(85)}))
#: Size of the relative drift between tiktoken and reported usage (its sign is an attribute).
DRIFT_BUCKETS: tuple[float, ...] = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)


@dataclass(slots=True)
class Instruments:
    """Every instrument the recorder writes to, created once per meter."""

    names: sc.MetricNames
    operation_duration: Histogram
    time_to_first_chunk: Histogram
    time_per_output_chunk: Histogram
    token_usage: Histogram | None
    input_tokens_counter: Counter | None
    output_tokens_counter: Counter | None
    cache_read_counter: Counter | None
    cache_write_counter: Counter | None
    reasoning_counter: Counter | None
    input_tokens_histogram: Histogram | None
    output_tokens_histogram: Histogram | None
    server_ttft: Histogram | None  # gen_ai.server.*: only with telemetry.server_metrics
    server_tpot: Histogram | None
    server_duration: Histogram | None
    ttft: Histogram
    tpot: Histogram
    ttfb: Histogram
    ttfot: Histogram
    ttst: Histogram
    upstream_ttft: Histogram
    itl: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    unattributed: Histogram
    cache_read: Counter
    cache_write: Counter
    input_tokens: Counter
    output_tokens: Counter
    requests: Counter
    active_streams: UpDownCounter
    overhead: Histogram
    relay_chunk_delay: Histogram
    drift: Histogram
    telemetry_dropped: Counter
    facts_dropped: Counter
    labels_evicted: Counter
    records_dropped: Counter
    content_events_dropped: Counter
    records_recovered: Counter
    malformed: Counter
    queue_waiting: UpDownCounter
    queue_rejected: Counter
    timing_rejected: Counter
    cache_requests: Counter
    client_timeouts: Counter
    connections_refused: Counter
    responses_cut: Counter
    server_spans: Counter
    otlp_rejected: Counter
    otlp_forwarded: Counter
    otlp_routed: Counter
    admin_refused: Counter
    trace_context_ignored: Counter
    event_streams: UpDownCounter
    live_samples_dropped: Counter
    clickhouse_inserts: Counter
    # Attribution and cost
    cost: Counter
    cost_unpriced: Counter
    attribution_dropped: Counter
    # Per-request objectives (x-slo-* headers)
    objective_requests: Counter
    objective_ignored: Counter


def _histogram(meter: Meter, name: str, unit: str, description: str, buckets: Sequence[float]) -> Histogram:
    return meter.create_histogram(name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets)


def _seconds(meter: Meter, name: str, description: str) -> Histogram:
    """One of llmtap's own latency histograms: fine buckets, whatever the setting."""
    return _histogram(meter, name, "s", description, DURATION_BUCKETS)


#: Each route and shape's objective as the gauge shows it: (percentile, attributes).
Objectives = Callable[[], Iterable[tuple[float, dict[str, str]]]]


def objective_gauge(meter: Meter, objectives: Objectives) -> None:
    """The objectives' percentiles by route and shape, for burn-rate rules to read their budget from
    (``llmtap.analysis.burnrate``): observed at each scrape or export, so they never go stale."""

    def observe(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value, attrs) for value, attrs in objectives()]

    meter.create_observable_gauge(
        sc.METRIC_SLO_OBJECTIVE,
        callbacks=[observe],
        unit="1",
        description="The share of requests each route and shape's objective asks to meet (its percentile: 0.99 for "
        "p99; routes[].slo, else the global slo), by llmtap.route and llmtap.request.shape; the error budget is the "
        "rest.",
    )


def create(meter: Meter, *, latest: bool, fine: bool = False, server: bool = False) -> Instruments:
    """Create the instruments, with the latest experimental GenAI names when ``latest``.

    ``fine``: the ``gen_ai.*`` histograms get llmtap's fine buckets instead of the conventions' advisory
    ones; ``server``: the ``gen_ai.server.*`` histograms exist too.

    Long on purpose: a declarative table, one ``create_*`` call per instrument with its name, unit and
    description, read top to bottom (and by ``docs/generate/reference.py``); split, it would only be scattered.
    """
    names = sc.LATEST if latest else sc.RELEASED

    def seconds(name: str, description: str, advised: Sequence[float] = sc.BUCKETS_DURATION) -> Histogram:
        return _histogram(meter, name, "s", description, DURATION_BUCKETS if fine else advised)

    def tokens(name: str | None, description: str) -> Histogram | None:
        buckets = TOKEN_BUCKETS if fine else sc.BUCKETS_TOKENS
        return None if name is None else _histogram(meter, name, "{token}", description, buckets)

    def counter(name: str | None, description: str) -> Counter | None:
        return None if name is None else meter.create_counter(name, unit="{token}", description=description)

    def server_side(name: str, description: str, advised: Sequence[float]) -> Histogram | None:
        return seconds(name, description, advised) if server else None

    return Instruments(
        names=names,
        operation_duration=seconds(names.operation_duration, "Request received by the proxy to stream end."),
        time_to_first_chunk=seconds(
            names.time_to_first_chunk, "Request received to the first chunk carrying generated content (streaming)."
        ),
        time_per_output_chunk=seconds(
            names.time_per_output_chunk, "End of the previous content chunk to the end of this one (streaming)."
        ),
        token_usage=tokens(names.token_usage, "Tokens used, by gen_ai.token.type."),
        input_tokens_counter=counter(names.input_tokens_counter, "Input tokens, cached included."),
        output_tokens_counter=counter(names.output_tokens_counter, "Output tokens, reasoning included."),
        cache_read_counter=counter(names.cache_read_counter, "Input tokens read from the provider's prompt cache."),
        cache_write_counter=counter(names.cache_write_counter, "Input tokens written to the provider's prompt cache."),
        reasoning_counter=counter(names.reasoning_counter, "Output tokens spent reasoning (a subset of the output)."),
        input_tokens_histogram=tokens(names.input_tokens_histogram, "Input tokens per request."),
        output_tokens_histogram=tokens(names.output_tokens_histogram, "Output tokens per request."),
        server_ttft=server_side(
            sc.SERVER_TIME_TO_FIRST_TOKEN,
            "Time to first token, as the proxy saw it (successful requests).",
            sc.BUCKETS_SERVER_TTFT,
        ),
        server_tpot=server_side(
            sc.SERVER_TIME_PER_OUTPUT_TOKEN,
            "(last content chunk - first content chunk) / (output tokens - 1).",
            sc.BUCKETS_SERVER_TPOT,
        ),
        server_duration=server_side(
            sc.SERVER_REQUEST_DURATION, "Time to last byte of the response.", sc.BUCKETS_DURATION
        ),
        ttft=_seconds(
            meter,
            sc.METRIC_TTFT,
            "Request received to the first chunk carrying generated content (streaming), by route and request shape.",
        ),
        tpot=_seconds(
            meter,
            sc.METRIC_TPOT,
            "(last content chunk - first content chunk) / (output tokens - 1), by route and request shape.",
        ),
        ttfb=_seconds(meter, sc.METRIC_TTFB, "Request received to the first response body byte."),
        ttfot=_seconds(
            meter,
            sc.METRIC_TTFOT,
            "Request received to the first chunk of the answer itself, after any reasoning (streaming); TTFT "
            "without reasoning.",
        ),
        ttst=_seconds(
            meter, sc.METRIC_TTST, "The first content chunk to the second: the first decode step (streaming)."
        ),
        upstream_ttft=_seconds(meter, sc.METRIC_UPSTREAM_TTFT, "Request sent upstream to the first content chunk."),
        itl=_seconds(
            meter, sc.METRIC_ITL, "A chunk gap divided over the tokens its chunk carried; one sample per token."
        ),
        queue=_seconds(meter, sc.METRIC_QUEUE, "Time queued before the model starts reading, by llmtap.queue.source."),
        prefill=_seconds(meter, sc.METRIC_PREFILL, "Time reading the prompt, by llmtap.prefill.source."),
        decode=_seconds(meter, sc.METRIC_DECODE, "First content chunk to last content chunk."),
        unattributed=_seconds(
            meter,
            sc.METRIC_UNATTRIBUTED,
            "Upstream TTFT that the server's own queue and prefill (both reported) leave out.",
        ),
        cache_read=meter.create_counter(
            sc.METRIC_CACHE_READ, unit="{token}", description="Input tokens read from the prompt cache."
        ),
        cache_write=meter.create_counter(
            sc.METRIC_CACHE_WRITE, unit="{token}", description="Input tokens written to the prompt cache."
        ),
        input_tokens=meter.create_counter(
            sc.METRIC_INPUT_TOKENS, unit="{token}", description="Input tokens, by source."
        ),
        output_tokens=meter.create_counter(
            sc.METRIC_OUTPUT_TOKENS, unit="{token}", description="Output tokens, by source."
        ),
        requests=meter.create_counter(
            sc.METRIC_REQUESTS, unit="{request}", description="Finished requests, by llmtap.outcome and llmtap.slo."
        ),
        active_streams=meter.create_up_down_counter(
            sc.METRIC_ACTIVE_STREAMS, unit="{request}", description="Requests in flight through the proxy."
        ),
        overhead=_histogram(
            meter,
            sc.METRIC_OVERHEAD,
            "s",
            "The proxy's own time in TTFT: request in to request sent, first content in to first content out.",
            OVERHEAD_BUCKETS,
        ),
        relay_chunk_delay=_histogram(
            meter,
            sc.METRIC_RELAY_CHUNK_DELAY,
            "s",
            "Per relayed upstream read: its arrival to its write to the client's socket, by route.",
            OVERHEAD_BUCKETS,
        ),
        drift=meter.create_histogram(
            sc.METRIC_TOKEN_DRIFT,
            unit="1",
            description="|tiktoken count - reported usage| / reported usage, by gen_ai.token.type and direction.",
            explicit_bucket_boundaries_advisory=DRIFT_BUCKETS,
        ),
        telemetry_dropped=meter.create_counter(
            sc.METRIC_TELEMETRY_DROPPED,
            unit="{item}",
            description="Tapes that did not become telemetry, in whole or in part, by llmtap.telemetry.reason; "
            "with a record journal it goes on across telemetry restarts (kept in the journal's counters.json).",
        ),
        facts_dropped=meter.create_counter(
            sc.METRIC_FACTS_DROPPED,
            unit="{item}",
            description="What one telemetry process learned of a request that the others could not be told "
            "(queue/prefill estimator, cache diagnosis; --telemetry-workers above 1), by llmtap.telemetry.reason.",
        ),
        labels_evicted=meter.create_counter(
            sc.METRIC_LABELS_EVICTED,
            unit="{value}",
            description="Label values (model, prompt version, error type) that lost their slot on metrics to a "
            "more frequent one, by llmtap.telemetry.attribute; later requests with them read _OTHER.",
        ),
        records_dropped=meter.create_counter(
            sc.METRIC_RECORDS_DROPPED,
            unit="{record}",
            description="Request records lost (--record files, ClickHouse, --record-logs log records, the record "
            "journal), by llmtap.telemetry.reason; with a record journal it goes on across telemetry restarts (kept "
            "in the journal's counters.json).",
        ),
        content_events_dropped=meter.create_counter(
            sc.METRIC_CONTENT_EVENTS_DROPPED,
            unit="{event}",
            description="Content events (gen_ai.client.inference.operation.details, --content-event) that never "
            "reached the OTLP logs endpoint, by llmtap.telemetry.reason: otlp_queue_full, otlp_export_failed (refused "
            "or unreachable), unmade (could not be made), sdk_too_old (the logs SDK installed cannot send them).",
        ),
        records_recovered=meter.create_counter(
            sc.METRIC_RECORDS_RECOVERED,
            unit="{record}",
            description="Records of requests the last run of this telemetry process began and did not get into "
            "every sink, made again from the record journal at start (--record-journal); it goes on across "
            "telemetry restarts (kept in the journal's counters.json).",
        ),
        malformed=meter.create_counter(
            sc.METRIC_MALFORMED,
            unit="{event}",
            description="Stream events the proxy could not parse (relayed unchanged).",
        ),
        queue_waiting=meter.create_up_down_counter(
            sc.METRIC_QUEUE_WAITING, unit="{request}", description="Requests waiting in a route's admission queue."
        ),
        queue_rejected=meter.create_counter(
            sc.METRIC_QUEUE_REJECTED,
            unit="{request}",
            description="Requests the admission queue refused, by error.type (queue_full, queue_timeout).",
        ),
        timing_rejected=meter.create_counter(
            sc.METRIC_TIMING_REJECTED,
            unit="{field}",
            description="Server-reported timing fields ignored as malformed or absurd, by llmtap.server_timing.field.",
        ),
        cache_requests=meter.create_counter(
            sc.METRIC_CACHE_REQUESTS,
            unit="{request}",
            description="Requests by prompt-cache class (llmtap.cache.class): hit, cold, miss_changed, ...",
        ),
        client_timeouts=meter.create_counter(
            sc.METRIC_CLIENT_TIMEOUTS,
            unit="{connection}",
            description="Client connections closed for a timeout, by llmtap.timeout.kind (header, body, idle, "
            "send, upload).",
        ),
        connections_refused=meter.create_counter(
            sc.METRIC_CONNECTIONS_REFUSED,
            unit="{connection}",
            description="Client connections refused with 503, by llmtap.refusal.reason (limit, per_client).",
        ),
        responses_cut=meter.create_counter(
            sc.METRIC_RESPONSES_CUT,
            unit="{response}",
            description="Responses the relay cut short for a limit of its own, by llmtap.cut.reason (inflate_limit).",
        ),
        server_spans=meter.create_counter(
            sc.METRIC_SERVER_SPANS,
            unit="{span}",
            description="The upstream's request spans by llmtap.server_span.outcome (matched, late, unmatched, "
            "duplicate); missing: requests whose span did not come in time.",
        ),
        otlp_rejected=meter.create_counter(
            sc.METRIC_OTLP_REJECTED,
            unit="{request}",
            description="OTLP bodies the span receiver refused, by llmtap.otlp.reason.",
        ),
        otlp_forwarded=meter.create_counter(
            sc.METRIC_OTLP_FORWARDED,
            unit="{span}",
            description="Spans the span receiver took, forwarded to the OTLP traces backend, by llmtap.otlp.outcome "
            "(sent, dropped, failed; unowned: of a trace this process did not relay, not forwarded).",
        ),
        otlp_routed=meter.create_counter(
            sc.METRIC_OTLP_ROUTED,
            unit="{span}",
            description="Spans the span receiver passed to the replica that relayed their request, by "
            "llmtap.otlp.outcome (sent, dropped, failed).",
        ),
        admin_refused=meter.create_counter(
            sc.METRIC_ADMIN_REFUSED,
            unit="{request}",
            description="What the admin listener refused or cut, by llmtap.admin.reason: connection_evicted (the "
            "longest idle, for a new one past admin_max_connections), connection_limit (503: none idle), "
            "event_streams (503 past admin_max_event_streams), unauthorized and forbidden (/events without the token).",
        ),
        trace_context_ignored=meter.create_counter(
            sc.METRIC_TRACE_CONTEXT_IGNORED,
            unit="{header}",
            description="Client traceparent or tracestate headers ignored as over 512 characters, by "
            "llmtap.trace_context.reason (traceparent_too_long, tracestate_too_long).",
        ),
        event_streams=meter.create_up_down_counter(
            sc.METRIC_EVENT_STREAMS, unit="{stream}", description="The live view's /events streams open now."
        ),
        live_samples_dropped=meter.create_counter(
            sc.METRIC_LIVE_SAMPLES_DROPPED,
            unit="{sample}",
            description="Latency values the live view stopped keeping past its bound (250,000): windows reaching "
            "back past them read their percentiles from buckets, marked.",
        ),
        clickhouse_inserts=meter.create_counter(
            sc.METRIC_CLICKHOUSE_INSERTS,
            unit="{insert}",
            description="Batches of request records sent to ClickHouse (--record-clickhouse), by "
            "llmtap.clickhouse.outcome (ok, failed).",
        ),
        cost=meter.create_counter(
            sc.METRIC_COST,
            unit="{USD}",
            description="What priced requests cost (reported tokens at the price table's prices), by model, route "
            "and the attribution dimensions the operator allows.",
        ),
        cost_unpriced=meter.create_counter(
            sc.METRIC_COST_UNPRICED,
            unit="{request}",
            description="Requests without a cost, by llmtap.cost.status: unknown_model (no price for the model), "
            "no_usage (the upstream reported no tokens).",
        ),
        attribution_dropped=meter.create_counter(
            sc.METRIC_ATTRIBUTION_DROPPED,
            unit="{header}",
            description="x-llmtap-property-* headers dropped past the 16 a request keeps.",
        ),
        objective_requests=meter.create_counter(
            sc.METRIC_OBJECTIVE_REQUESTS,
            unit="{request}",
            description="Requests that carried their own objective (x-slo-ttft-ms, x-slo-tpot-ms), by route, shape, "
            "llmtap.objective.figure and llmtap.objective.outcome (met or violated).",
        ),
        objective_ignored=meter.create_counter(
            sc.METRIC_OBJECTIVE_IGNORED,
            unit="{header}",
            description="x-slo-ttft-ms and x-slo-tpot-ms headers ignored as invalid (not a number, not above 0, "
            "past an hour), by route and llmtap.objective.figure; the request went on without them.",
        ),
    )
