"""Metrics of a finished request: the bounded subset of its span attributes on the GenAI and llmtap instruments.

Two attribute sets. The ``gen_ai.*`` metrics carry the conventions' list and nothing else
(gen-ai-metrics.md v1.41.1: operation, provider, request and response model, server address and port;
``error.type`` on the durations when failed; ``gen_ai.token.type`` on token usage), so they read like any
instrumentation's.
llmtap's own metrics add what its dashboards, live view and ``llmtap compare`` group by: the route, the
stream flag and the prompt version, and on the figures users feel (TTFT, ITL, TPOT) the request shape.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Histogram, MeterProvider, NoOpMeterProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from llmtap import __version__
from llmtap.analysis.cachediag import MISS_CHANGED, Diagnosis
from llmtap.analysis.shapes import names as shape_names, objective as shape_objective
from llmtap.analysis.summary import USAGE, Summary
from llmtap.analysis.timeline import OK, Timeline
from llmtap.config.types import Settings
from llmtap.labels import OTHER, LabelGuard
from llmtap.providers.timing import PHASES
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.attributes import is_hop, usage_value
from llmtap.telemetry.emit.bulk import Batch, Fixed, Kept
from llmtap.telemetry.emit.instruments import Instruments, create, objective_gauge
from llmtap.telemetry.emit.sets import NONE, Sets, SetsCache

if TYPE_CHECKING:
    from llmtap.analysis.finish import Finished

__all__ = ["CONVENTIONS", "OWN", "SHAPE", "Batched", "MetricWriter", "objective_series"]

log = logging.getLogger("llmtap.telemetry")
#: How the admission queue refuses a request (``error.type``).
QUEUE_REFUSALS = ("queue_full", "queue_timeout")

#: What the conventions list for their metrics (gen-ai-metrics.md v1.41.1): every ``gen_ai.*`` metric carries
#: these and no other (``error.type`` only on the durations, when the request failed; token metrics add their
#: token type or modality).
CONVENTIONS = (
    sc.OPERATION_NAME,
    sc.PROVIDER_NAME,
    sc.REQUEST_MODEL,
    sc.RESPONSE_MODEL,
    sc.SERVER_ADDRESS,
    sc.SERVER_PORT,
    sc.ERROR_TYPE,
)
#: An empty context: a sample recorded in it has no current span, so no exemplar (whatever context the
#: recorder's thread has).
_NO_SPAN = Context()
#: What llmtap's own request metrics add to them ...
OWN = (sc.ROUTE, sc.REQUEST_STREAM, sc.PROMPT_VERSION)
#: ... and its figures users feel (TTFT, ITL, TPOT, E2E) and its request counts by SLO outcome on top: the
#: request shape, by input size and by the configured shape classes (names from the configuration, ``other``).
SHAPE = (sc.INPUT_SIZE, sc.SHAPE)


class Labels(NamedTuple):
    """A request's metric attributes: three sets, each a bounded subset of its span's attributes."""

    #: What every ``gen_ai.*`` metric carries (the conventions' ``metric_attributes.gen_ai``).
    common: dict[str, Any]
    #: ... and ``error.type`` when the request failed: the set of the durations (and the latest conventions'
    #: per-request token histograms), the metrics whose lists name it.
    outcome: dict[str, Any]
    #: ... and the route, the stream flag and the prompt version: llmtap's own request metrics.
    own: dict[str, Any]


def objective_series(settings: Settings) -> list[tuple[float, dict[str, str]]]:
    """Each route and shape's objective percentile (the objective its requests are judged by), with its labels."""
    out: list[tuple[float, dict[str, str]]] = []
    for route in settings.routes:
        for shape in shape_names(settings.shapes):
            goal = shape_objective(route, shape, settings.slo)
            if goal is not None:
                out.append((goal.percentile, {sc.ROUTE: route.name, sc.SHAPE: shape}))
    return out


class MetricWriter:
    """Records each finished request on the instruments; the values clients and upstreams choose bounded.

    Model names, prompt versions and error types each pass a ``LabelGuard`` (``llmtap.labels``): a label is
    a clean, short string, and only values used often enough keep one; models listed in
    ``telemetry.metric_models`` always do.
    """

    def __init__(self, settings: Settings, meter_provider: MeterProvider | None) -> None:
        t = settings.telemetry
        meter = (meter_provider or NoOpMeterProvider()).get_meter(
            "llmtap", __version__, schema_url=sc.schema_url(t.semconv_latest)
        )
        #: The meter, for what others observe on it (the record journal's gauges).
        self.meter = meter
        self.instruments: Instruments = create(
            meter, latest=t.semconv_latest, fine=t.histogram_buckets == "fine", server=t.server_metrics
        )
        self._offline = t.offline_token_usage
        self._role = t.span_role
        # The attribute sets requests repeat, cleaned and hashed once for this provider's views (``bulk.Kept``).
        self._kept = Kept()
        # A request's group of attribute sets by the values that make them (``emit.sets``).
        self._sets = SetsCache()
        self._models = self._guard(
            sc.REQUEST_MODEL, 64, trial=8, candidates=256, pinned=settings.telemetry.metric_models
        )
        # Versions are a handful at a time: the ones being compared.
        self._versions = self._guard(sc.PROMPT_VERSION, 8, trial=4, candidates=64)
        # llmtap's own error types are a few; an upstream's error.type or code may be anything.
        self._errors = self._guard(sc.ERROR_TYPE, 32, trial=16, candidates=64)
        # Attribution dimensions the operator allows on metrics, each with a bounded number of values.
        values = settings.attribution.metric_values
        self._dimensions = {
            name: self._guard(sc.dimension_attribute(name), values, trial=values, candidates=4 * values)
            for name in settings.attribution.metric_dimensions
        }
        observed = objective_series(settings)
        objective_gauge(meter, lambda: observed)
        # Every route's admission refusals, ignored server timings (by phase) and unparsable events: their panels
        # show a line at 0, not "No data", until the first one.
        ins = self.instruments
        for route in settings.routes:
            ins.malformed.add(0, {sc.ROUTE: route.name})
            for error in QUEUE_REFUSALS:
                ins.queue_rejected.add(0, {sc.ROUTE: route.name, sc.ERROR_TYPE: error})
            for phase in PHASES:
                ins.timing_rejected.add(0, {sc.ROUTE: route.name, sc.TIMING_FIELD: phase})

    def _guard(self, attribute: str, slots: int, *, trial: int, candidates: int, pinned: Any = ()) -> LabelGuard:
        evicted = self.instruments.labels_evicted
        # Every guarded attribute's count reads 0 from the start: "none evicted" is a value, not an absence.
        evicted.add(0, {sc.TELEMETRY_ATTRIBUTE: attribute})
        return LabelGuard(
            attribute,
            slots,
            trial=trial,
            candidates=candidates,
            replacements=slots,
            pinned=pinned,
            on_evict=lambda _: evicted.add(1, {sc.TELEMETRY_ATTRIBUTE: attribute}),
        )

    def model_label(self, model: str) -> str:
        """The label metrics gave ``model`` (read, not counted as a use): itself, or ``_OTHER``."""
        return self._models.label(model)

    def version_label(self, version: str) -> str:
        """The label metrics gave a prompt version (read, not counted as a use): itself, or ``_OTHER``."""
        return self._versions.label(version)

    def metric_attributes(self, tl: Timeline, s: Summary) -> Labels:
        """A request's attribute sets, bounded subsets of its span's; counts one use of each guarded value."""
        sets = self.sets(tl)
        return Labels(sets.attrs, sets.outcome, sets.own)

    def sets(self, tl: Timeline) -> Sets:
        """A request's group of attribute sets (``emit.sets``): the one kept for the same values, or made; counts
        one use of each guarded value."""
        req = tl.request
        model = req.model if req is not None else None
        model_label = self._models(model) if model else None
        response_label = None
        if tl.response_model:
            # The same name in request and response is one use of it, not two.
            same = tl.response_model == model
            response_label = model_label if same else self._models(tl.response_model)
        error_label = None
        if tl.outcome != OK:
            error_label = self._errors(tl.error_type) if tl.error_type else OTHER
        stream = req is not None and req.stream
        version_label = self._versions(tl.prompt_version) if tl.prompt_version else None
        operation = req.operation if req else sc.OP_CHAT
        values = (
            operation,
            tl.provider_name,
            tl.server_address,
            tl.server_port,
            model_label,
            response_label,
            error_label,
            tl.outcome != OK,
            tl.route,
            bool(stream),
            version_label,
        )
        group = self._sets.get(values)
        if group is not None:
            return group
        attrs: dict[str, Any] = {
            sc.OPERATION_NAME: operation,
            sc.PROVIDER_NAME: tl.provider_name,
            sc.SERVER_ADDRESS: tl.server_address,
            sc.SERVER_PORT: tl.server_port,
        }
        if model_label is not None:
            attrs[sc.REQUEST_MODEL] = model_label
        if response_label is not None:
            attrs[sc.RESPONSE_MODEL] = response_label
        outcome = dict(attrs)
        if tl.outcome != OK:
            outcome[sc.ERROR_TYPE] = error_label
        own = {**outcome, sc.ROUTE: tl.route}
        if stream:
            # As on the span: set if and only if the request streams (gen-ai-spans.md).
            own[sc.REQUEST_STREAM] = True
        if version_label is not None:
            own[sc.PROMPT_VERSION] = version_label
        made = Sets(Fixed(attrs), Fixed(outcome), Fixed(own), self._sets.limit)
        return self._sets.keep(values, made)

    def dimension_labels(self, tl: Timeline) -> dict[str, str]:
        """The allowed attribution dimensions of a request as labels (counts one use of each value)."""
        if not self._dimensions or not tl.attribution:
            return {}
        return {
            sc.dimension_attribute(name): guard(tl.attribution[name])
            for name, guard in self._dimensions.items()
            if name in tl.attribution
        }

    def batch(self) -> Batched:
        """A sink for many finished requests' metrics, each given to it as to ``emit``, recorded when it is
        closed: each instrument's values with one attribute set go to their aggregation at once (``bulk.Batch``'s
        ``defer``), with the figures recording them one by one gives. For one thread."""
        return Batched(self)

    def emit(self, request: Finished) -> None:
        """Every metric of a finished request: admission refusals, ignored server timings, the request's own
        metrics (a request of a known protocol) and its cache class."""
        self.emit_into(request, Batch(self._kept), None)

    def emit_into(self, request: Finished, batch: Batch, last: Batch | None) -> None:
        """``emit``, its request's own metrics into ``batch``, its overhead into ``last`` (None: ``batch``)."""
        tl, s, diag = request.tl, request.summary, request.diagnosis
        ins = self.instruments
        if tl.error_type in QUEUE_REFUSALS:
            ins.queue_rejected.add(1, {sc.ROUTE: tl.route, sc.ERROR_TYPE: tl.error_type})
        for name in s.rejected_timings:
            log.debug("ignored server timing %s of %s %s", name, tl.method, tl.path)
            ins.timing_rejected.add(1, {sc.ROUTE: tl.route, sc.TIMING_FIELD: name})
        if tl.protocol is not None:
            self.record(tl, s, batch, last)
            if diag is not None:
                batch.add(ins.cache_requests, 1, self.cache_attributes(tl, diag))

    def record(self, tl: Timeline, s: Summary, batch: Batch | None = None, last: Batch | None = None) -> None:
        """Record one finished request's latency, token and outcome metrics (into ``batch``, its overhead into
        ``last``, when given: recorded when they are flushed)."""
        ins = self.instruments
        if batch is None:
            batch = Batch(self._kept)  # the request's attribute sets cleaned and hashed once, or kept from before
        sets = self.sets(tl)
        attrs, outcome, own = sets.attrs, sets.outcome, sets.own
        # llmtap's counters (requests, tokens, cost) carry the allowed attribution dimensions; histograms do not.
        dimensions = self.dimension_labels(tl)
        counted = sets.plus(own, *[item for pair in dimensions.items() for item in pair]) if dimensions else own
        self._cost_metrics(batch, sets, tl, s, counted)
        # A hop's generation is its client's to report (``attributes.is_hop``): the client's instrumentation
        # records it in the gen_ai.client.* metrics, so llmtap's own (llmtap.*) alone count this request.
        client = not is_hop(tl, self._role)
        # Recorded in the request's span context: the SDK's exemplar reservoirs keep its trace id beside the
        # bucket the value fell in (the default trace-based filter: only for sampled traces).
        ctx = request_context(tl)
        shaped = sets.plus(own, sc.INPUT_SIZE, s.input_size, sc.SHAPE, s.shape)
        ok = tl.outcome == OK
        stream = bool(tl.request and tl.request.stream)
        if s.e2e is not None:
            if client:
                batch.record(ins.operation_duration, s.e2e, outcome, ctx)
            if ins.server_duration is not None:
                batch.record(ins.server_duration, s.e2e, outcome, ctx)
        requests = sets.plus(counted, sc.OUTCOME, tl.outcome, sc.SLO_OUTCOME, s.slo, sc.SHAPE, s.shape)
        batch.add(ins.requests, 1, requests)
        route = sets.plus(NONE, sc.ROUTE, tl.route)
        if tl.malformed_events:
            batch.add(ins.malformed, tl.malformed_events, route)
        if s.ttfb is not None:
            batch.record(ins.ttfb, s.ttfb, own, ctx)
        if stream and s.ttft is not None:
            self._stream_metrics(batch, s, s.ttft, attrs, shaped, ctx, client=client)
        self._phase_metrics(batch, sets, s, shaped, ctx, ok=ok, stream=stream)
        self._token_metrics(batch, sets, s, counted, client=client)
        if tl.request_objective is not None:
            self._objective_metrics(batch, tl, s)
        if tl.relay_delays:
            # One per read: at a bucket lookup each (``bulk``), none an exemplar.
            batch.many(ins.relay_chunk_delay, s.relay_delay_samples, route, _NO_SPAN)
        if s.proxy_added is not None:
            # The request's last instrument (tests wait for it): in a batch, flushed after the others.
            (last or batch).record(ins.overhead, s.proxy_added, route)

    def _stream_metrics(
        self,
        batch: Batch,
        s: Summary,
        ttft: float,
        attrs: dict[str, Any],
        shaped: dict[str, Any],
        ctx: Context | None,
        *,
        client: bool,
    ) -> None:
        """A stream's time to its first chunk and tokens, and its per-chunk and per-token gaps."""
        ins = self.instruments
        if client:
            batch.record(ins.time_to_first_chunk, ttft, attrs, ctx)
        batch.record(ins.ttft, ttft, shaped, ctx)
        self._first_tokens(batch, s, shaped, ctx)
        # Per chunk and per token, only the request's slowest sample carries its span context: an exemplar
        # costs about a third of a sample again (10 against 14 us a sample here), and a stream has thousands;
        # the bucket of its worst stall still leads to it.
        if client:
            _record_samples(batch, ins.time_per_output_chunk, s.gap_samples, attrs, ctx)
        _record_samples(batch, ins.itl, s.itl_per_token, shaped, ctx)

    def _phase_metrics(
        self,
        batch: Batch,
        sets: Sets,
        s: Summary,
        shaped: dict[str, Any],
        ctx: Context | None,
        *,
        ok: bool,
        stream: bool,
    ) -> None:
        """Where the request's time went: upstream and server TTFT, TPOT, queue, prefill, decode, the rest."""
        ins = self.instruments
        attrs, own = sets.attrs, sets.own
        if s.upstream_ttft is not None and stream:
            batch.record(ins.upstream_ttft, s.upstream_ttft, own, ctx)
        if ok and s.ttft is not None and stream and ins.server_ttft is not None:
            batch.record(ins.server_ttft, s.ttft, attrs, ctx)
        if ok and s.tpot is not None:
            batch.record(ins.tpot, s.tpot, shaped, ctx)
            if ins.server_tpot is not None:
                batch.record(ins.server_tpot, s.tpot, attrs, ctx)
        if s.queue is not None:
            batch.record(ins.queue, s.queue, sets.plus(own, sc.QUEUE_SOURCE, s.queue_source), ctx)
        if s.prefill is not None and stream:
            batch.record(ins.prefill, s.prefill, sets.plus(own, sc.PREFILL_SOURCE, s.prefill_source), ctx)
        if s.decode is not None and stream:
            batch.record(ins.decode, s.decode, own, ctx)
        if s.upstream_unattributed is not None:
            batch.record(ins.unattributed, s.upstream_unattributed, own, ctx)

    def _first_tokens(self, batch: Batch, s: Summary, shaped: dict[str, Any], ctx: Context | None) -> None:
        """A stream's time to its first output token and to its second token, beside its TTFT."""
        if s.ttfot is not None:
            batch.record(self.instruments.ttfot, s.ttfot, shaped, ctx)
        if s.ttst is not None:
            batch.record(self.instruments.ttst, s.ttst, shaped, ctx)

    def _objective_metrics(self, batch: Batch, tl: Timeline, s: Summary) -> None:
        """The request's own objectives, judged (by route and shape: both bounded by the configuration), and the
        headers ignored as invalid."""
        ins = self.instruments
        for figure, verdict in s.request_outcomes.items():
            labels = {sc.ROUTE: tl.route, sc.SHAPE: s.shape, sc.OBJECTIVE_FIGURE: figure, sc.OBJECTIVE_OUTCOME: verdict}
            batch.add(ins.objective_requests, 1, labels)
        for figure in tl.request_objective.invalid if tl.request_objective is not None else ():
            batch.add(ins.objective_ignored, 1, {sc.ROUTE: tl.route, sc.OBJECTIVE_FIGURE: figure})

    def _cost_metrics(self, batch: Batch, sets: Sets, tl: Timeline, s: Summary, counted: dict[str, Any]) -> None:
        """The request's cost on ``llmtap.cost``, or its status on ``llmtap.cost.unpriced``."""
        ins = self.instruments
        if tl.attribution_dropped:
            batch.add(ins.attribution_dropped, tl.attribution_dropped, sets.plus(NONE, sc.ROUTE, tl.route))
        cost = s.cost
        if cost is None:
            return
        if cost.amount is not None:
            batch.add(ins.cost, cost.amount, counted)
        else:
            batch.add(ins.cost_unpriced, 1, sets.plus(counted, sc.COST_STATUS, cost.status))

    def _token_metrics(
        self,
        batch: Batch,
        sets: Sets,
        s: Summary,
        own: dict[str, Any],
        *,
        client: bool,
    ) -> None:
        """The token metrics: llmtap's own always (``own``: the counted set), the gen_ai.client.* ones when
        ``client`` (not a hop)."""
        ins = self.instruments
        for kind, value, source, drift in (
            ("input", s.input_tokens, s.input_source, s.input_drift),
            ("output", s.output_tokens, s.output_source, s.output_drift),
        ):
            if client:
                self._client_tokens(batch, sets, kind, usage_value(value, source, self._offline), source)
            if value is None:
                continue
            mine = ins.input_tokens if kind == "input" else ins.output_tokens
            source_key = sc.INPUT_TOKENS_SOURCE if kind == "input" else sc.OUTPUT_TOKENS_SOURCE
            batch.add(mine, value, sets.plus(own, source_key, source))
            if drift is not None:
                # OTel histograms take no negative values: the size goes in the value, the sign in an attribute.
                direction = "over" if drift > 0 else "under" if drift < 0 else "exact"
                drifted = sets.plus(NONE, sc.TOKEN_TYPE, kind, sc.ROUTE, own[sc.ROUTE], sc.DRIFT_DIRECTION, direction)
                batch.record(ins.drift, abs(drift), drifted)
        # Providers report no breakdown by modality that llmtap reads: reported counts are ``unknown``
        # (gen-ai-token-metrics.md), as is the 0 of a response without usage.
        unknown = sets.plus(sets.attrs, sc.TOKEN_MODALITY, "unknown")
        if s.cache_read_tokens is not None:
            batch.add(ins.cache_read, s.cache_read_tokens, own)
            if client and ins.cache_read_counter is not None:
                batch.add(ins.cache_read_counter, s.cache_read_tokens, unknown)
        if s.cache_write_tokens is not None:
            batch.add(ins.cache_write, s.cache_write_tokens, own)
            if client and ins.cache_write_counter is not None:
                batch.add(ins.cache_write_counter, s.cache_write_tokens, unknown)
        if client and ins.reasoning_counter is not None:
            # Recorded for every generation, 0 when the usage names no reasoning tokens.
            batch.add(ins.reasoning_counter, s.reasoning_tokens or 0, unknown)

    def _client_tokens(self, batch: Batch, sets: Sets, kind: str, usage: int | None, source: str) -> None:
        """One token type's ``gen_ai.client.*`` token metrics (``usage``: as ``gen_ai.usage.*`` shows it)."""
        ins = self.instruments
        attrs = sets.attrs
        counter = ins.input_tokens_counter if kind == "input" else ins.output_tokens_counter
        if usage is None:
            # gen-ai-token-metrics.md: a response without usage records 0, with modality unknown.
            if counter is not None:
                batch.add(counter, 0, sets.plus(attrs, sc.TOKEN_MODALITY, "unknown"))
            return
        if ins.token_usage is not None:
            batch.record(ins.token_usage, usage, sets.plus(attrs, sc.TOKEN_TYPE, kind))
        hist = ins.input_tokens_histogram if kind == "input" else ins.output_tokens_histogram
        if hist is not None:
            batch.record(hist, usage, sets.outcome)
        if counter is not None:
            # Counted by llmtap's tokenizer (offline usage): text it read; reported: no breakdown, ``unknown``.
            modality = "unknown" if source == USAGE else "text"
            batch.add(counter, usage, sets.plus(attrs, sc.TOKEN_MODALITY, modality))

    def cache_attributes(self, tl: Timeline, diag: Diagnosis) -> dict[str, Any]:
        """The attributes of ``llmtap.cache.requests``."""
        # After ``metric_attributes`` counted this request's values: read their labels, do not count again.
        req = tl.request
        attrs: dict[str, Any] = {sc.CACHE_CLASS: diag.cache_class, sc.ROUTE: tl.route}
        if req is not None and req.model:
            attrs[sc.REQUEST_MODEL] = self._models.label(req.model)
        if tl.prompt_version:
            attrs[sc.PROMPT_VERSION] = self._versions.label(tl.prompt_version)
        if diag.cache_class == MISS_CHANGED and diag.changed_region:
            attrs[sc.CACHE_CHANGED_REGION] = diag.changed_region
        return attrs


class Batched:
    """Many finished requests' metrics, recorded at ``close`` (``MetricWriter.batch``): the overhead last, as each
    request records it last."""

    __slots__ = ("_batch", "_last", "_writer")

    def __init__(self, writer: MetricWriter) -> None:
        self._writer = writer
        self._batch = Batch(writer._kept, defer=True)
        self._last = Batch(writer._kept, defer=True)

    def emit(self, request: Finished) -> None:
        """``MetricWriter.emit``, recorded at ``close``."""
        self._writer.emit_into(request, self._batch, self._last)

    def close(self) -> None:
        """Record what was given."""
        try:
            self._batch.flush()
        finally:
            self._last.flush()


def _record_samples(
    batch: Batch, hist: Histogram, samples: list[float], attrs: dict[str, Any], ctx: Context | None
) -> None:
    """Record every sample; the largest one in ``ctx`` (its exemplar), the others with no span context."""
    if not samples:
        return
    slowest = max(range(len(samples)), key=samples.__getitem__)
    batch.record(hist, samples[slowest], attrs, ctx)
    # The others at a bucket lookup each (``bulk``): a stream has one per chunk or token.
    batch.many(hist, samples[:slowest] + samples[slowest + 1 :], attrs, _NO_SPAN)


def request_context(tl: Timeline) -> Context | None:
    """A context whose current span is the request's root span (by the ids the relay made), or None."""
    if tl.trace_id is None or tl.span_id is None:
        return None
    try:
        span = SpanContext(
            int(tl.trace_id, 16),
            int(tl.span_id, 16),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED if tl.sampled else TraceFlags.DEFAULT),
        )
    except ValueError:
        return None
    return trace.set_span_in_context(NonRecordingSpan(span)) if span.is_valid else None
