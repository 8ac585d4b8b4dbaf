"""The recorder: spans, events and metrics from hand-built timelines, with in-memory providers injected."""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Metric, NumberDataPoint
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from llmtap.analysis.finish import Finished
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.load import build
from llmtap.config.types import SLO, Route, Settings, TelemetrySettings
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.recorder import Recorder
from llmtap.types import Facts, RequestInfo, Usage
from llmtap.wire.messages import STATS, Stats, encode_stats
from tests.conftest import PATIENCE, Running, Scripted, Telemetry
from tests.support.tapes import chat_tape

WALL = 1_700_000_000_000_000_000
T0 = 5000.0  # offsets are multiples of 1/128 s: exact in binary and in whole nanoseconds
GAP = 1 / 16
FIRST = 0.5
WORDS = [" alpha", " beta gamma", " delta river sigma"]  # 1, 2 and 3 o200k tokens
ROUTES = (Route(prefix="/", upstream="http://upstream:8000", name="default"),)
# Metric attributes that spans do not carry (or carry under the same key only on the root), and why a tape was lost.
METRIC_ONLY = {
    sc.TOKEN_TYPE,
    sc.OUTCOME,
    sc.SLO_OUTCOME,
    sc.DRIFT_DIRECTION,
    sc.TOKEN_MODALITY,
    sc.TELEMETRY_REASON,
    sc.TELEMETRY_ATTRIBUTE,
}
# Counts of client connections, not of requests: no span carries them.
METRIC_ONLY |= {sc.TIMEOUT_KIND, sc.REFUSAL_REASON}


def tape_end(key: int) -> tuple[Any, ...]:
    """The channel's last message of a small finished request, as the relay sends it."""
    return chat_tape(key, [b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'])[1][-1]


def ns(offset: float) -> int:
    """Epoch nanoseconds of ``T0 + offset``."""
    return WALL + round(offset * 1e9)


def chunk_tokens(n: int) -> int:
    return sum(i % 3 + 1 for i in range(n))


def timeline(
    n: int = 6,
    *,
    stream: bool = True,
    model: str | None = "gpt-4o",
    response_model: str | None = "gpt-4o-2024-08-06",
    usage: Usage | None = None,
    finish: list[str] | None = None,
    prompt: str = "",
    texts: list[str] | None = None,
    reported: bool = True,
) -> Timeline:
    """A chat request received at T0: admitted +1/64, sent +1/32, first byte +1/8, n chunks from +0.5 every 1/16.

    Usage is ``usage``, or the chunks' own count; none at all when not ``reported``.
    """
    tl = Timeline(
        method="POST",
        path="/v1/chat/completions",
        route="default",
        upstream="http://upstream:8000",
        server_address="upstream",
        server_port=8000,
        protocol="openai_chat",
        provider_name="openai",
        received=T0,
        received_wall_ns=WALL,
        request=RequestInfo(
            operation="chat",
            model=model,
            stream=stream,
            params={"max_tokens": 256, "temperature": 0.5},
            prompt_text=prompt,
        ),
        body_read=T0 + 1 / 128,
        admitted=T0 + 1 / 64,
        sent=T0 + 1 / 32,
        headers=T0 + 1 / 16,
        first_byte=T0 + 1 / 8,
        status_code=200,
    )
    texts = texts if texts is not None else [WORDS[i % 3] for i in range(n)]
    for i, text in enumerate(texts):
        tl.add_chunk(T0 + FIRST + i * GAP, 30 + i, text)
    tl.end = T0 + FIRST + (len(texts) - 1) * GAP + 0.25
    tl.response_bytes = sum(tl.chunk_bytes)
    tl.apply(
        Facts(
            usage=(usage or Usage(input_tokens=40, output_tokens=chunk_tokens(len(texts)))) if reported else None,
            finish_reasons=["stop"] if finish is None else finish,
            response_id="chatcmpl-1",
            response_model=response_model,
        )
    )
    return tl


class StartAttributes(SpanProcessor):
    """Records the attributes each span has when it starts (what a sampler or on_start hook sees)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.seen.append((span.name, dict(span.attributes or {})))


class Raising(SpanProcessor):
    """A broken span processor."""

    def __init__(self, *, on_start: bool = False, on_end: bool = False) -> None:
        self.start, self.end = on_start, on_end

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if self.start:
            raise RuntimeError("processor on_start failed")

    def on_end(self, span: ReadableSpan) -> None:
        if self.end:
            raise RuntimeError("processor on_end failed")


class Blocking(SpanProcessor):
    """Blocks the first span end on the recorder's worker thread until released (a stuck exporter)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def on_end(self, span: ReadableSpan) -> None:
        if threading.current_thread().name == "llmtap-recorder" and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(PATIENCE)


class Harness:
    """A recorder with in-memory span and metric readers (no global providers)."""

    def __init__(self, telemetry: TelemetrySettings, slo: SLO, processors: tuple[SpanProcessor, ...]) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        for p in processors:
            self.tracer_provider.add_span_processor(p)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.recorder = Recorder(
            Settings(routes=ROUTES, telemetry=telemetry, slo=slo),
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
        )

    def run(self, tl: Timeline, incoming: dict[str, str] | None = None) -> Summary:
        """Record one request synchronously; ``incoming`` are the client's trace headers, as the relay keeps them."""
        if incoming and "traceparent" in incoming:
            tl.parent = (incoming["traceparent"], incoming.get("tracestate", ""))
        return self.recorder.record(tl)

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def root(self) -> ReadableSpan:
        roots = [s for s in self.spans() if s.kind in (SpanKind.CLIENT, SpanKind.SERVER)]
        assert len(roots) == 1, [s.name for s in self.spans()]
        return roots[0]

    def metrics(self) -> dict[str, Metric]:
        data = self.reader.get_metrics_data()
        out: dict[str, Metric] = {}
        if data is not None:
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out[m.name] = m
        return out

    def close(self) -> None:
        self.recorder.close()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


HarnessFactory = Callable[..., Harness]


@pytest.fixture
def harness() -> Iterator[HarnessFactory]:
    made: list[Harness] = []

    def make(*processors: SpanProcessor, slo: SLO | None = None, **telemetry: Any) -> Harness:
        # These tests read chunk spans: every request keeps them unless a test says otherwise (``chunkdetail``).
        telemetry.setdefault("chunk_detail_sample", 1.0)
        h = Harness(TelemetrySettings(**telemetry), slo or SLO(), processors)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def children(h: Harness, parent: ReadableSpan, name: str) -> list[ReadableSpan]:
    pid = parent.context.span_id
    found = [s for s in h.spans(name) if s.parent is not None and s.parent.span_id == pid]
    return sorted(found, key=lambda s: s.start_time or 0)


def points(m: Metric) -> list[Any]:
    return list(m.data.data_points)


def point(metrics: dict[str, Metric], name: str, **match: Any) -> Any:
    """The one data point of ``name`` whose attributes include ``match``."""
    found = [p for p in points(metrics[name]) if all(p.attributes.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (name, match, [dict(p.attributes) for p in points(metrics[name])])
    return found[0]


# --- spans --------------------------------------------------------------------------------------


def test_span_tree_links_and_times(harness: HarnessFactory) -> None:
    h = harness()
    tl = timeline(6)
    # The relay made the ids and sent them upstream as traceparent: the root span carries exactly those.
    tl.trace_id, tl.span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    h.recorder.record(tl)
    root = h.root()
    assert root.name == "chat gpt-4o" and root.kind == SpanKind.CLIENT
    assert root.parent is None
    assert (root.start_time, root.end_time) == (WALL, ns(FIRST + 5 * GAP + 0.25))
    assert root.status.status_code == StatusCode.UNSET
    assert (f"{root.context.trace_id:032x}", f"{root.context.span_id:016x}") == (tl.trace_id, tl.span_id)
    # Every other span gets ids of its own.
    assert len({s.context.span_id for s in h.spans()}) == len(h.spans())

    (queue,) = children(h, root, sc.SPAN_QUEUE)
    (prefill,) = children(h, root, sc.SPAN_PREFILL)
    (decode,) = children(h, root, sc.SPAN_DECODE)
    assert (queue.start_time, queue.end_time) == (ns(0), ns(1 / 64))
    assert (prefill.start_time, prefill.end_time) == (ns(1 / 32), ns(FIRST))
    assert (decode.start_time, decode.end_time) == (ns(FIRST), ns(FIRST + 5 * GAP))
    assert attrs(queue)[sc.QUEUE_DURATION] == 1 / 128 and attrs(queue)[sc.QUEUE_SOURCE] == "proxy"
    assert attrs(prefill)[sc.INPUT_TOKENS] == 40 and attrs(prefill)[sc.PREFILL_DURATION] == FIRST - 1 / 32
    assert attrs(decode)[sc.CHUNK_COUNT] == 6 and attrs(decode)[sc.OUTPUT_TOKENS] == 12
    assert attrs(decode)[sc.TPOT] == 5 * GAP / 11

    chunks = children(h, decode, sc.SPAN_CHUNK)
    assert len(chunks) == 6
    assert {s.context.trace_id for s in [*chunks, queue, prefill, decode]} == {root.context.trace_id}
    for i, span in enumerate(chunks):
        a = attrs(span)
        assert a[sc.CHUNK_INDEX] == i and a[sc.CHUNK_TOKENS] == i % 3 + 1 and a[sc.CHUNK_BYTES] == 30 + i
        assert a[sc.CHUNK_GAP] == (GAP if i else 0.0)
        assert span.end_time == ns(FIRST + i * GAP)
        assert span.start_time == ns(FIRST + (i - 1) * GAP if i else FIRST)

    a = attrs(root)
    assert a[sc.RESPONSE_FINISH_REASONS] == ("stop",)
    assert a[sc.RESPONSE_ID] == "chatcmpl-1" and a[sc.RESPONSE_MODEL] == "gpt-4o-2024-08-06"
    assert a[sc.USAGE_INPUT_TOKENS] == 40 and a[sc.USAGE_OUTPUT_TOKENS] == 12
    assert a[sc.RESPONSE_TIME_TO_FIRST_CHUNK] == FIRST and a[sc.TTFB] == 1 / 8
    assert a[sc.E2E] == FIRST + 5 * GAP + 0.25
    assert a[sc.OUTCOME] == "ok" and a[sc.HTTP_STATUS] == 200 and sc.ERROR_TYPE not in a


def test_root_is_child_of_client_traceparent(harness: HarnessFactory) -> None:
    h = harness()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    h.run(timeline(2), {"traceparent": f"00-{trace_id}-{parent_id}-01"})
    root = h.root()
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent_id
    assert all(s.context.trace_id == root.context.trace_id for s in h.spans())


def _gen_ai(span: ReadableSpan) -> dict[str, Any]:
    return {k: v for k, v in attrs(span).items() if k.startswith("gen_ai.")}


@pytest.mark.parametrize("role", ["auto", "hop"])
def test_under_a_traced_client_the_root_is_the_hop_not_a_second_generation(harness: HarnessFactory, role: str) -> None:
    """The client's span is the generation: llmtap's repeats no gen_ai.* (backends would count it again)."""
    h = harness(span_role=role)
    tl = timeline(3, usage=Usage(input_tokens=40, output_tokens=6))
    h.run(tl, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    root = h.root()
    assert root.name == "POST /v1/chat/completions" and root.kind == SpanKind.SERVER
    assert all(not _gen_ai(span) for span in h.spans()), {s.name: _gen_ai(s) for s in h.spans()}
    a = attrs(root)
    assert a[sc.SPAN_ROLE] == "hop" and a[sc.HOP_REQUEST_MODEL] == "gpt-4o" and a[sc.HOP_OPERATION] == "chat"
    assert (a[sc.INPUT_TOKENS], a[sc.OUTPUT_TOKENS], a[sc.INPUT_TOKENS_SOURCE]) == (40, 6, "usage")
    assert a[sc.HOP_FINISH_REASONS] == ("stop",) and sc.HOP_TIME_TO_FIRST_CHUNK in a


VALID_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("role", "traceparent"),
    # An invalid traceparent is treated as none: the client's span is not the request's parent, so llmtap's is
    # the generation.
    [("generation", VALID_TRACEPARENT), ("auto", None), ("auto", "00-zzzz-bad-01"), ("hop", None)],
)
def test_the_root_is_the_generation_when_asked_or_when_the_client_does_not_trace(
    harness: HarnessFactory, role: str, traceparent: str | None
) -> None:
    h = harness(span_role=role)
    incoming = {"traceparent": traceparent} if traceparent else None
    h.run(timeline(3, usage=Usage(input_tokens=40, output_tokens=6)), incoming)
    root = h.root()
    if role == "hop":
        assert root.kind == SpanKind.SERVER  # asked for: a hop, traced client or not
        return
    assert root.name == "chat gpt-4o" and root.kind == SpanKind.CLIENT
    assert attrs(root)[sc.USAGE_INPUT_TOKENS] == 40 and attrs(root)[sc.USAGE_OUTPUT_TOKENS] == 6
    # Usage once per trace: on the generation, never again on its children.
    children_usage = [k for s in h.spans() if s is not root for k in attrs(s) if k.startswith("gen_ai.usage.")]
    assert children_usage == []


@pytest.mark.parametrize("latest", [False, True], ids=["v1.41.1", "latest"])
def test_a_hop_is_counted_in_llmtaps_own_metrics_only(harness: HarnessFactory, latest: bool) -> None:
    """A hop's generation is its client's to report, in the gen_ai.client.* metrics too: llmtap's own count it."""
    h = harness(semconv_latest=latest)

    def totals() -> tuple[list[str], int, int]:
        m = h.metrics()
        requests = sum(p.value for p in points(m[sc.METRIC_REQUESTS]))
        return sorted(n for n in m if n.startswith("gen_ai.")), requests, point(m, sc.METRIC_INPUT_TOKENS).value

    h.run(timeline(3, usage=Usage(input_tokens=40, output_tokens=6)), {"traceparent": VALID_TRACEPARENT})
    assert totals() == ([], 1, 40)
    h.run(timeline(3, usage=Usage(input_tokens=40, output_tokens=6)))  # no traceparent: the generation
    genai, requests, tokens = totals()
    assert (requests, tokens) == (2, 80)
    names = sc.LATEST if latest else sc.RELEASED
    assert {names.operation_duration, names.time_to_first_chunk, names.time_per_output_chunk} <= set(genai)
    usage = names.token_usage or names.input_tokens_counter
    assert usage is not None and usage in genai


def test_without_usage_tiktoken_counts_stay_llmtaps_own(harness: HarnessFactory) -> None:
    """Offline token counting is not usage (gen-ai-metrics.md): under llmtap.* only, unless enabled."""
    h = harness(semconv_latest=True)
    h.run(timeline(3, reported=False))
    a = attrs(h.root())
    assert sc.USAGE_INPUT_TOKENS not in a and sc.USAGE_OUTPUT_TOKENS not in a
    assert a[sc.OUTPUT_TOKENS] == 6 and a[sc.OUTPUT_TOKENS_SOURCE] == "tiktoken:o200k_base"
    points = {
        (name, tuple(sorted((p.attributes or {}).items()))): p.value
        for name, m in h.metrics().items()
        if name.startswith("gen_ai.client.inference.usage.")
        for p in m.data.data_points
        if isinstance(p, NumberDataPoint)
    }
    assert points and all(v == 0 for v in points.values()), points
    assert all(dict(k)[sc.TOKEN_MODALITY] == "unknown" for _, k in points), points
    enabled = harness(offline_token_usage=True)
    enabled.run(timeline(3, reported=False))
    assert attrs(enabled.root())[sc.USAGE_OUTPUT_TOKENS] == 6


def test_gen_ai_attributes_present_at_span_start(harness: HarnessFactory) -> None:
    seen = StartAttributes()
    h = harness(seen)
    h.run(timeline(3))
    name, at_start = seen.seen[0]
    assert name == "chat gpt-4o"
    assert at_start[sc.OPERATION_NAME] == "chat"
    assert at_start[sc.PROVIDER_NAME] == "openai"
    assert at_start[sc.REQUEST_MODEL] == "gpt-4o"
    assert at_start[sc.SERVER_ADDRESS] == "upstream" and at_start[sc.SERVER_PORT] == 8000
    assert at_start[sc.REQUEST_STREAM] is True
    assert at_start[sc.REQUEST_MAX_TOKENS] == 256 and at_start[sc.REQUEST_TEMPERATURE] == 0.5
    # What only the end can know is not there yet, and is there at the end.
    assert sc.USAGE_OUTPUT_TOKENS not in at_start and sc.RESPONSE_ID not in at_start
    assert attrs(h.root())[sc.USAGE_OUTPUT_TOKENS] == 6


def test_drift_is_measured_once_a_second_per_route(harness: HarnessFactory) -> None:
    """Usage reports the input and the output: the prompt and the whole output are counted for the drift only on a
    request a second per route; the token figures never depend on it."""
    h = harness()
    prompt = "Summarize the refund policy for order 12345, in three short sentences."
    seen: list[tuple[str, bool, bool]] = []
    # Requests end in the order they arrived; each is received this long before T0 (the script's times stay positive).
    # The first has no prompt to count, but an output: it takes its route's turn.
    for route, before, text in (
        ("default", 3.2, ""),
        ("default", 3.0, prompt),
        ("default", 2.5, prompt),
        ("other", 2.4, prompt),
        ("default", 1.75, prompt),
        ("other", 1.5, prompt),
    ):
        tl = timeline(3, prompt=text, usage=Usage(input_tokens=15, output_tokens=6))
        tl.route, tl.received = route, T0 - before
        s = h.run(tl)
        assert s.input_tokens == 15 and s.input_source == "usage"
        assert s.output_tokens == 6 and s.output_source == "usage"
        seen.append((route, s.input_drift is not None, s.output_drift is not None))
    assert seen == [
        ("default", False, True),
        ("default", False, False),
        ("default", False, False),
        ("other", True, True),
        ("default", True, True),
        ("other", False, False),
    ]
    metrics = h.metrics()
    assert point(metrics, sc.METRIC_TOKEN_DRIFT, **{sc.TOKEN_TYPE: "input", sc.ROUTE: "default"}).count == 1
    assert point(metrics, sc.METRIC_TOKEN_DRIFT, **{sc.TOKEN_TYPE: "output", sc.ROUTE: "default"}).count == 2
    # Without usage the prompt and the output are counted for the figures themselves, whatever the drift's schedule.
    s = h.run(timeline(3, prompt=prompt, reported=False))
    assert s.input_source == "tiktoken:o200k_base" and s.input_tokens and s.input_drift is None
    assert s.output_source == "tiktoken:o200k_base" and s.output_tokens and s.output_drift is None


def test_chunk_cap_folds_the_tail(harness: HarnessFactory) -> None:
    h = harness(chunk_span_cap=200)
    tl = timeline(500, usage=Usage(input_tokens=40, output_tokens=1100))
    s = h.run(tl)
    (decode,) = h.spans(sc.SPAN_DECODE)
    chunks = children(h, decode, sc.SPAN_CHUNK)
    assert len(chunks) == 200
    plain, folded = chunks[:199], chunks[199]
    assert all(sc.CHUNK_FOLDED not in attrs(c) for c in plain)
    assert [attrs(c)[sc.CHUNK_INDEX] for c in plain] == list(range(199))
    f = attrs(folded)
    assert f[sc.CHUNK_FOLDED] == 301 and f[sc.CHUNK_INDEX] == 199
    assert f[sc.CHUNK_BYTES] == sum(30 + i for i in range(199, 500))
    assert f[sc.CHUNK_TOKENS] == sum(s.chunk_tokens[199:])
    assert f[sc.CHUNK_GAP] == 301 * GAP
    assert (folded.start_time, folded.end_time) == (ns(FIRST + 198 * GAP), ns(FIRST + 499 * GAP))
    # Nothing is lost by folding: bytes and tokens add up to the whole stream.
    assert sum(attrs(c)[sc.CHUNK_TOKENS] for c in chunks) == 1100
    assert sum(attrs(c)[sc.CHUNK_BYTES] for c in chunks) == tl.response_bytes
    assert attrs(decode)[sc.CHUNK_COUNT] == 500


def test_chunk_cap_not_reached(harness: HarnessFactory) -> None:
    h = harness(chunk_span_cap=200)
    h.run(timeline(200))
    chunks = h.spans(sc.SPAN_CHUNK)
    assert len(chunks) == 200 and all(sc.CHUNK_FOLDED not in attrs(c) for c in chunks)


def test_chunk_spans_written_directly_equal_those_through_the_tracer(harness: HarnessFactory) -> None:
    """The SDK provider's chunk spans skip ``start_span``; what reaches the exporter is the same."""

    def chunk_view(h: Harness) -> list[tuple[Any, ...]]:
        (decode,) = h.spans(sc.SPAN_DECODE)
        out = []
        for c in h.spans(sc.SPAN_CHUNK):
            assert c.parent is not None and c.parent.span_id == decode.context.span_id
            assert c.context.trace_id == decode.context.trace_id and c.context.trace_flags.sampled
            assert c.context.span_id not in (0, decode.context.span_id) and not c.context.is_remote
            scope = c.instrumentation_scope
            out.append((c.name, c.kind, c.start_time, c.end_time, attrs(c), c.resource, scope and scope.name))
        return sorted(out, key=lambda row: row[4][sc.CHUNK_INDEX])

    direct = harness(chunk_span_cap=8)
    assert direct.recorder.spans.chunk_writer is not None
    direct.run(timeline(12))
    tracer = harness(chunk_span_cap=8)
    tracer.recorder.spans.chunk_writer = None
    tracer.run(timeline(12))
    assert len(chunk_view(direct)) == 8
    assert chunk_view(direct) == chunk_view(tracer)
    ids = [c.context.span_id for c in direct.spans(sc.SPAN_CHUNK)]
    assert len(set(ids)) == len(ids)


def test_phase_spans_born_finished_equal_those_through_the_tracer(harness: HarnessFactory) -> None:
    """With the SDK provider and a sampled root, queue, prefill and decode spans skip ``start_span`` too."""

    def phase_view(h: Harness) -> list[tuple[Any, ...]]:
        roots = [sp for sp in h.exporter.get_finished_spans() if sp.parent is None]
        assert len(roots) == 1
        root = roots[0]
        out = []
        for name in (sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE):
            (span,) = h.spans(name)
            assert span.parent is not None and span.parent.span_id == root.context.span_id
            assert span.context.trace_id == root.context.trace_id and span.context.trace_flags.sampled
            assert span.context.span_id != root.context.span_id and not span.context.is_remote
            scope = span.instrumentation_scope
            out.append(
                (span.name, span.kind, span.start_time, span.end_time, attrs(span), span.resource, scope and scope.name)
            )
        # Chunk spans are children of the decode span, whichever way it was written.
        (decode,) = h.spans(sc.SPAN_DECODE)
        assert all(c.parent is not None and c.parent.span_id == decode.context.span_id for c in h.spans(sc.SPAN_CHUNK))
        return out

    direct = harness(chunk_detail_sample=1.0)
    direct.run(timeline(6))
    tracer = harness(chunk_detail_sample=1.0)
    tracer.recorder.spans.chunk_writer = None
    tracer.run(timeline(6))
    assert len(direct.spans(sc.SPAN_CHUNK)) == 6
    assert phase_view(direct) == phase_view(tracer)


def test_events_mode(harness: HarnessFactory) -> None:
    h = harness(chunk_spans="events")
    h.run(timeline(5))
    assert h.spans(sc.SPAN_CHUNK) == []
    (decode,) = h.spans(sc.SPAN_DECODE)
    events = list(decode.events)
    assert [e.name for e in events] == [sc.EVENT_CHUNK] * 5
    assert [e.timestamp for e in events] == [ns(FIRST + i * GAP) for i in range(5)]
    assert [dict(e.attributes or {})[sc.CHUNK_TOKENS] for e in events] == [1, 2, 3, 1, 2]
    assert [dict(e.attributes or {})[sc.CHUNK_INDEX] for e in events] == [0, 1, 2, 3, 4]


def test_events_mode_folds_too(harness: HarnessFactory) -> None:
    h = harness(chunk_spans="events", chunk_span_cap=10)
    h.run(timeline(25))
    (decode,) = h.spans(sc.SPAN_DECODE)
    events = list(decode.events)
    assert len(events) == 10
    last = dict(events[-1].attributes or {})
    assert last[sc.CHUNK_FOLDED] == 16 and last[sc.CHUNK_INDEX] == 9
    counted: list[Any] = [dict(e.attributes or {})[sc.CHUNK_TOKENS] for e in events]
    assert sum(counted) == chunk_tokens(25)


def test_off_mode(harness: HarnessFactory) -> None:
    h = harness(chunk_spans="off")
    h.run(timeline(5))
    assert h.spans(sc.SPAN_CHUNK) == []
    (decode,) = h.spans(sc.SPAN_DECODE)
    assert list(decode.events) == []
    assert attrs(decode)[sc.CHUNK_COUNT] == 5
    assert {s.name for s in h.spans()} == {"chat gpt-4o", sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE}


def test_error_outcome(harness: HarnessFactory) -> None:
    h = harness(slo=SLO(e2e=100.0), server_metrics=True)
    tl = timeline(3, finish=[])
    tl.fail("upstream_closed", "connection reset by peer")
    h.run(tl)
    root = h.root()
    a = attrs(root)
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description == "connection reset by peer"
    assert a[sc.ERROR_TYPE] == "upstream_closed" and a[sc.OUTCOME] == "error"
    assert a[sc.RESPONSE_FINISH_REASONS] == ("error",)
    assert a[sc.SLO_OUTCOME] == "missed"
    m = h.metrics()
    duration = point(m, sc.RELEASED.operation_duration)
    assert duration.attributes[sc.ERROR_TYPE] == "upstream_closed"
    requests = point(m, sc.METRIC_REQUESTS)
    assert requests.attributes[sc.OUTCOME] == "error" and requests.attributes[sc.SLO_OUTCOME] == "missed"
    # gen_ai.server.* latency metrics count successful requests only; the request duration counts them all.
    assert sc.SERVER_TIME_TO_FIRST_TOKEN not in m and sc.SERVER_TIME_PER_OUTPUT_TOKEN not in m
    assert point(m, sc.SERVER_REQUEST_DURATION).attributes == duration.attributes
    assert sc.METRIC_TPOT not in m
    # The conventions name error.type on the durations only: the chunk metrics of a failed stream go without.
    ttfc = point(m, sc.RELEASED.time_to_first_chunk).attributes
    assert ttfc == {k: v for k, v in duration.attributes.items() if k != sc.ERROR_TYPE}
    assert point(m, sc.METRIC_TTFT).attributes[sc.ERROR_TYPE] == "upstream_closed"


def test_error_keeps_reported_finish_reasons(harness: HarnessFactory) -> None:
    h = harness()
    tl = timeline(3, finish=["length"])
    tl.fail("upstream_closed")
    h.run(tl)
    assert attrs(h.root())[sc.RESPONSE_FINISH_REASONS] == ("length",)
    assert h.root().status.description == "upstream_closed"


def test_cancelled_outcome(harness: HarnessFactory) -> None:
    h = harness()
    tl = timeline(3, finish=[])
    tl.fail("cancelled", cancelled=True)
    h.run(tl)
    root = h.root()
    a = attrs(root)
    assert root.status.status_code == StatusCode.ERROR
    assert a[sc.ERROR_TYPE] == "cancelled" and a[sc.OUTCOME] == "cancelled"
    assert a[sc.RESPONSE_FINISH_REASONS] == ("error",)
    requests = point(h.metrics(), sc.METRIC_REQUESTS)
    assert requests.attributes[sc.OUTCOME] == "cancelled" and requests.attributes[sc.ERROR_TYPE] == "cancelled"
    assert requests.attributes[sc.SLO_OUTCOME] == "none"


def test_plain_relay_gets_a_root_span_only(harness: HarnessFactory) -> None:
    h = harness()
    tl = Timeline(
        method="GET",
        path="/v1/models",
        route="default",
        upstream="http://upstream:8000",
        server_address="upstream",
        server_port=8000,
        protocol=None,
        provider_name="_OTHER",
        received=T0,
        received_wall_ns=WALL,
        end=T0 + 0.25,
        status_code=200,
    )
    h.run(tl)
    (root,) = h.spans()
    assert root.name == "GET" and (root.start_time, root.end_time) == (WALL, ns(0.25))
    assert sc.OPERATION_NAME not in attrs(root)
    assert sc.METRIC_REQUESTS not in h.metrics()


# --- metrics ------------------------------------------------------------------------------------


def test_metrics_values_units_and_attributes(harness: HarnessFactory) -> None:
    h = harness(slo=SLO(ttft=1.0, tpot=0.5))
    prompt = "The quick brown fox jumps over the lazy dog."  # 10 tiktoken tokens
    tl = timeline(6, prompt=prompt, usage=Usage(input_tokens=8, output_tokens=15, cache_read_tokens=4))
    s = h.run(tl)
    m = h.metrics()
    units = {name: metric.unit for name, metric in m.items()}
    assert units[sc.RELEASED.operation_duration] == "s"
    assert units[sc.RELEASED.time_to_first_chunk] == "s"
    assert units[sc.RELEASED.time_per_output_chunk] == "s"
    assert units[sc.RELEASED.token_usage or ""] == "{token}"
    assert units[sc.METRIC_REQUESTS] == "{request}"
    assert units[sc.METRIC_ITL] == "s" and units[sc.METRIC_CACHE_READ] == "{token}"
    assert units[sc.METRIC_TOKEN_DRIFT] == "1"

    e2e = FIRST + 5 * GAP + 0.25
    duration = point(m, sc.RELEASED.operation_duration)
    assert (duration.count, duration.sum) == (1, e2e)
    a = duration.attributes
    assert a[sc.OPERATION_NAME] == "chat" and a[sc.PROVIDER_NAME] == "openai"
    assert a[sc.REQUEST_MODEL] == "gpt-4o" and a[sc.RESPONSE_MODEL] == "gpt-4o-2024-08-06"
    assert a[sc.SERVER_ADDRESS] == "upstream" and a[sc.SERVER_PORT] == 8000
    # The gen_ai.* metrics carry the conventions' attributes only; llmtap's own add route, stream and shape.
    assert set(a) == {
        sc.OPERATION_NAME,
        sc.PROVIDER_NAME,
        sc.REQUEST_MODEL,
        sc.RESPONSE_MODEL,
        sc.SERVER_ADDRESS,
        sc.SERVER_PORT,
    }
    ttft = point(m, sc.METRIC_TTFT)
    assert (ttft.count, ttft.sum) == (1, FIRST)
    assert ttft.attributes == {
        **a,
        sc.ROUTE: "default",
        sc.REQUEST_STREAM: True,
        sc.INPUT_SIZE: "le_256",
        sc.SHAPE: "short_prompt",
    }
    assert point(m, sc.METRIC_DECODE).attributes == {**a, sc.ROUTE: "default", sc.REQUEST_STREAM: True}

    assert point(m, sc.RELEASED.time_to_first_chunk).sum == FIRST
    chunk = point(m, sc.RELEASED.time_per_output_chunk)
    assert (chunk.count, chunk.sum) == (5, 5 * GAP)
    itl = point(m, sc.METRIC_ITL)
    assert itl.count == sum(s.chunk_tokens[1:]) and itl.sum == pytest.approx(5 * GAP)
    assert point(m, sc.METRIC_TPOT).sum == pytest.approx(5 * GAP / 14)
    # gen_ai.server.* are the model server's names: not emitted unless asked for.
    assert not [name for name in m if name.startswith("gen_ai.server.")]
    assert point(m, sc.METRIC_UPSTREAM_TTFT).sum == FIRST - 1 / 32
    assert point(m, sc.METRIC_TTFB).sum == 1 / 8
    assert point(m, sc.METRIC_QUEUE, **{sc.QUEUE_SOURCE: "proxy"}).sum == 1 / 128
    assert point(m, sc.METRIC_PREFILL, **{sc.PREFILL_SOURCE: "upstream_ttft"}).sum == FIRST - 1 / 32
    assert point(m, sc.METRIC_DECODE).sum == 5 * GAP
    # The proxy's own time: reading the request (received to body read) and admitted to sent; the line is not.
    assert point(m, sc.METRIC_OVERHEAD).sum == 1 / 128 + 1 / 32 - 1 / 64

    token_usage = sc.RELEASED.token_usage or ""
    assert point(m, token_usage, **{sc.TOKEN_TYPE: "input"}).sum == 8
    assert point(m, token_usage, **{sc.TOKEN_TYPE: "output"}).sum == 15
    assert point(m, sc.METRIC_INPUT_TOKENS, **{sc.INPUT_TOKENS_SOURCE: "usage"}).value == 8
    assert point(m, sc.METRIC_OUTPUT_TOKENS, **{sc.OUTPUT_TOKENS_SOURCE: "usage"}).value == 15
    assert point(m, sc.METRIC_CACHE_READ).value == 4
    # Drift: tiktoken says 10 input (25% over 8) and 12 output (20% under 15).
    assert point(m, sc.METRIC_TOKEN_DRIFT, **{sc.TOKEN_TYPE: "input", sc.DRIFT_DIRECTION: "over"}).sum == 0.25
    assert point(m, sc.METRIC_TOKEN_DRIFT, **{sc.TOKEN_TYPE: "output", sc.DRIFT_DIRECTION: "under"}).sum == 0.2

    requests = point(m, sc.METRIC_REQUESTS)
    assert requests.value == 1
    assert requests.attributes[sc.OUTCOME] == "ok" and requests.attributes[sc.SLO_OUTCOME] == "met"
    # No latest-convention names by default.
    assert not [name for name in m if name.startswith("gen_ai.client.inference.")]


def test_time_to_first_chunk_only_for_streams(harness: HarnessFactory) -> None:
    h = harness()
    # A non-streamed answer arrives as one piece of content.
    h.run(timeline(texts=[" alpha beta gamma"], stream=False))
    m = h.metrics()
    assert point(m, sc.RELEASED.operation_duration).count == 1
    for name in (
        sc.RELEASED.time_to_first_chunk,
        sc.RELEASED.time_per_output_chunk,
        sc.METRIC_ITL,
        sc.METRIC_TTFT,
        sc.METRIC_UPSTREAM_TTFT,
        sc.METRIC_DECODE,
    ):
        assert name not in m, name
    assert sc.RESPONSE_TIME_TO_FIRST_CHUNK not in attrs(h.root())
    assert sc.REQUEST_STREAM not in attrs(h.root())


def test_server_metrics_when_asked_for(harness: HarnessFactory) -> None:
    h = harness(server_metrics=True)
    h.run(timeline(6, usage=Usage(input_tokens=8, output_tokens=15)))
    m = h.metrics()
    conventions = point(m, sc.RELEASED.operation_duration).attributes
    assert point(m, sc.SERVER_TIME_TO_FIRST_TOKEN).sum == FIRST
    assert point(m, sc.SERVER_TIME_PER_OUTPUT_TOKEN).sum == pytest.approx(5 * GAP / 14)
    assert point(m, sc.SERVER_REQUEST_DURATION).sum == FIRST + 5 * GAP + 0.25
    for name in (sc.SERVER_TIME_TO_FIRST_TOKEN, sc.SERVER_TIME_PER_OUTPUT_TOKEN, sc.SERVER_REQUEST_DURATION):
        assert point(m, name).attributes == conventions, name


@pytest.mark.parametrize("latest", [False, True])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("outcome", ["ok", "error", "cancelled"])
def test_metric_attributes_are_a_subset_of_span_attributes(
    harness: HarnessFactory, latest: bool, stream: bool, outcome: str
) -> None:
    h = harness(semconv_latest=latest, slo=SLO(ttft=1.0), server_metrics=True)
    usage = Usage(input_tokens=8, output_tokens=15, cache_read_tokens=4, cache_write_tokens=2)
    tl = timeline(6, stream=stream, prompt="The quick brown fox jumps over the lazy dog.", usage=usage)
    if outcome == "error":
        tl.fail("upstream_closed", "reset")
    elif outcome == "cancelled":
        tl.fail("cancelled", cancelled=True)
    h.run(tl)
    allowed = set(attrs(h.root())) | METRIC_ONLY
    m = h.metrics()
    assert len(m) > 10
    for name, metric in m.items():
        # Counters every route reads 0 on from the start (refusals, ignored timings) carry no request's values.
        for p in (p for p in points(metric) if getattr(p, "value", None) != 0):
            extra = {
                k for k in p.attributes if k not in allowed and not (k.startswith("llmtap.") and k.endswith(".source"))
            }
            assert not extra, (name, extra)


def test_latest_semconv_names(harness: HarnessFactory) -> None:
    h = harness(semconv_latest=True)
    usage = Usage(input_tokens=40, output_tokens=12, cache_read_tokens=16, cache_write_tokens=8, reasoning_tokens=5)
    h.run(timeline(6, usage=usage))
    m = h.metrics()
    for name in (
        "gen_ai.client.inference.duration",
        "gen_ai.client.inference.time_to_first_chunk",
        "gen_ai.client.inference.time_per_output_chunk",
        "gen_ai.client.inference.operation.input_tokens",
        "gen_ai.client.inference.operation.output_tokens",
    ):
        assert name in m, name
    assert point(m, "gen_ai.client.inference.duration").sum == FIRST + 5 * GAP + 0.25
    for name, value in (
        ("gen_ai.client.inference.usage.input_tokens", 40),
        ("gen_ai.client.inference.usage.output_tokens", 12),
        ("gen_ai.client.inference.usage.cache_read.input_tokens", 16),
        ("gen_ai.client.inference.usage.cache_write.input_tokens", 8),
        ("gen_ai.client.inference.usage.reasoning.output_tokens", 5),
    ):
        assert m[name].unit == "{token}"
        # The provider's usage names no modality: unknown, as gen-ai-token-metrics.md asks, never a guessed text.
        assert [p.attributes[sc.TOKEN_MODALITY] for p in points(m[name])] == ["unknown"], name
        assert point(m, name, **{sc.TOKEN_MODALITY: "unknown"}).value == value
    assert point(m, "gen_ai.client.inference.operation.output_tokens").sum == 12
    for old in (
        "gen_ai.client.operation.duration",
        "gen_ai.client.operation.time_to_first_chunk",
        "gen_ai.client.operation.time_per_output_chunk",
        "gen_ai.client.token.usage",
    ):
        assert old not in m, old
    # gen_ai.token.type went with gen_ai.client.token.usage; only llmtap's own drift histogram keeps it.
    typed = {metric.name for metric in m.values() for p in points(metric) if sc.TOKEN_TYPE in p.attributes}
    assert typed <= {sc.METRIC_TOKEN_DRIFT}
    # The span attribute renamed with them (migration.md): cache_creation -> cache_write.
    a = attrs(h.root())
    assert a[sc.USAGE_CACHE_WRITE] == 8 and sc.USAGE_CACHE_CREATION not in a


def test_released_names_use_cache_creation(harness: HarnessFactory) -> None:
    h = harness()
    h.run(timeline(2, usage=Usage(input_tokens=40, output_tokens=3, cache_write_tokens=8)))
    a = attrs(h.root())
    assert a[sc.USAGE_CACHE_CREATION] == 8 and sc.USAGE_CACHE_WRITE not in a


def test_content_not_captured_by_default(harness: HarnessFactory) -> None:
    h = harness()
    h.run(timeline(3, prompt="secret prompt text"))
    everything = json.dumps([attrs(s) for s in h.spans()], default=str)
    assert sc.OUTPUT_MESSAGES not in everything and sc.INPUT_MESSAGES not in everything
    assert "alpha" not in everything and "secret prompt text" not in everything


def test_content_captured_when_opted_in(harness: HarnessFactory) -> None:
    h = harness(capture_content=True)
    h.run(timeline(3))
    messages = json.loads(attrs(h.root())[sc.OUTPUT_MESSAGES])
    assert messages == [{"role": "assistant", "parts": [{"type": "text", "content": "".join(WORDS)}]}]


def test_captured_content_is_capped_at_16_kib(harness: HarnessFactory) -> None:
    h = harness(capture_content=True)
    texts = ["x" * 1000 + f"{i:04d}" for i in range(20)]  # 20,080 characters
    h.run(timeline(texts=texts))
    content = json.loads(attrs(h.root())[sc.OUTPUT_MESSAGES])[0]["parts"][0]["content"]
    assert content == "".join(texts)[: 16 * 1024]


class RootEnds(SpanProcessor):
    """Notes each root span's end (its trace id) in a shared log."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def on_end(self, span: ReadableSpan) -> None:
        if span.parent is None:
            self.log.append(("span", span.context.trace_id))


def test_what_one_wake_up_brings_goes_emitter_by_emitter_each_in_order() -> None:
    """Tapes that waited together in the queue: every request's spans, then every request's listeners, each
    emitter seeing the requests in the order they came; a request alone is emitted at once."""
    log: list[tuple[str, int]] = []
    provider = TracerProvider()
    provider.add_span_processor(RootEnds(log))
    recorder = Recorder(Settings(routes=ROUTES), tracer_provider=provider)
    entered, gate = threading.Event(), threading.Event()

    def listener(tl: Timeline, s: Summary) -> None:
        trace_id = int(tl.trace_id or "0", 16)
        log.append(("listener", trace_id))
        if trace_id == 1:  # the first request holds the worker until the others wait in the queue
            entered.set()
            assert gate.wait(PATIENCE)

    recorder.listeners.append(listener)
    try:
        assert recorder.submit(tape_end(0))
        assert entered.wait(PATIENCE)
        assert all(recorder.submit(tape_end(key)) for key in range(1, 6))
        gate.set()
        assert recorder.flush(PATIENCE)
    finally:
        gate.set()
        recorder.close()
    assert log[:2] == [("span", 1), ("listener", 1)]  # alone: at once
    assert log[2:] == [("span", k) for k in range(2, 7)] + [("listener", k) for k in range(2, 7)]


# --- failure isolation ---------------------------------------------------------------------------


def test_span_processor_failing_at_end_never_reaches_the_caller(harness: HarnessFactory) -> None:
    h = harness(Raising(on_end=True))
    h.recorder.record_timeline(timeline(3))
    assert h.recorder.flush(5)
    # Called directly too: the broken trace pipeline does not cost the metrics.
    h.recorder.record(timeline(3))
    m = h.metrics()
    assert point(m, sc.METRIC_REQUESTS).value == 2


def test_span_processor_failing_at_start_never_reaches_the_caller(harness: HarnessFactory) -> None:
    h = harness(Raising(on_start=True))
    tl = timeline(3)
    tl.parent = ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "")
    h.recorder.record_timeline(tl)
    assert h.recorder.flush(5)
    assert h.recorder.failed == 0 and h.recorder.recorded == 1
    assert point(h.metrics(), sc.METRIC_REQUESTS).value == 1


def test_queue_full_drops_are_counted(harness: HarnessFactory) -> None:
    blocking = Blocking()
    h = harness(blocking, queue_size=1)
    rec = h.recorder
    assert rec.submit(tape_end(1))
    assert blocking.entered.wait(PATIENCE)  # the worker is stuck inside the first record
    try:
        taken = [rec.submit(tape_end(key)) for key in range(2, 6)]  # one fits in the queue, three do not
        assert taken == [True, False, False, False]
        assert rec.dropped == 3
        dropped = point(h.metrics(), sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "queue_full"})
        assert dropped.value == 3
    finally:
        blocking.release.set()
    assert rec.flush(5)
    assert rec.recorded == 2 and rec.failed == 0
    assert point(h.metrics(), sc.METRIC_REQUESTS).value == 2


def test_one_reads_messages_are_queued_together_and_turned_away_as_one_by_one(harness: HarnessFactory) -> None:
    blocking = Blocking()
    h = harness(blocking, queue_size=2)
    rec = h.recorder
    assert rec.submit(tape_end(1))
    assert blocking.entered.wait(PATIENCE)  # the worker is stuck inside the first record
    try:
        rec.submit_all([tape_end(key) for key in range(2, 6)])  # two fit in the queue, two do not
        assert rec.dropped == 2
        assert rec.inbox.queue.qsize() == 2
        dropped = point(h.metrics(), sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "queue_full"})
        assert dropped.value == 2
    finally:
        blocking.release.set()
    assert rec.flush(5)
    assert rec.recorded == 3
    rec.submit_all([tape_end(6)])  # a read of one message: as ``submit``
    assert rec.flush(5)
    rec.submit_all([tape_end(7), tape_end(8)])  # the worker waits for them: woken once, it takes both
    assert rec.flush(5)
    assert (rec.recorded, rec.dropped, rec.failed) == (6, 2, 0)
    assert point(h.metrics(), sc.METRIC_REQUESTS).value == 6


def test_requests_still_queued_when_the_flush_bound_runs_out_are_counted_lost(
    harness: HarnessFactory, caplog: pytest.LogCaptureFixture
) -> None:
    blocking = Blocking()
    h = harness(blocking, queue_size=8)
    rec = h.recorder
    assert rec.submit(tape_end(1))
    assert blocking.entered.wait(PATIENCE)  # the worker is stuck inside the first record (a hung exporter)
    try:
        rec.submit_all([tape_end(key) for key in range(2, 6)])  # four requests wait behind it
        with caplog.at_level(logging.WARNING, logger="llmtap.telemetry"):
            rec.close(0.2)
        dropped = point(h.metrics(), sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "shutdown"})
        assert dropped.value == 4
        assert rec.dropped == 4
        assert "4 requests not recorded within the flush bound" in caplog.text
        assert rec.inbox.queue.qsize() == 0  # taken off: the worker, once free, records none of them twice
    finally:
        blocking.release.set()
    assert rec.recorded <= 1


def test_a_worker_done_within_the_bound_loses_nothing_at_close(harness: HarnessFactory) -> None:
    h = harness()
    rec = h.recorder
    rec.submit_all([tape_end(key) for key in range(1, 6)])
    rec.close(PATIENCE)
    assert (rec.recorded, rec.dropped) == (5, 0)
    assert point(h.metrics(), sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "shutdown"}).value == 0


class _Seen:
    """An emitter that notes what it was given, and the summary's cache class at that moment."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.got: list[tuple[Finished, str | None]] = []

    def emit(self, request: Finished) -> None:
        self.got.append((request, request.summary.cache_class))
        if self.fail:
            raise RuntimeError("emitter down")


def test_each_emitter_gets_one_finished_request_its_summary_final(harness: HarnessFactory) -> None:
    h = harness()
    rec = h.recorder
    first, broken, last = _Seen(), _Seen(fail=True), _Seen()
    rec.emitters = (first, *rec.emitters[:2], broken, *rec.emitters[2:], last)
    s = h.run(timeline(3, prompt="You are a careful assistant. " * 40))
    assert len(first.got) == len(broken.got) == len(last.got) == 1
    request, cache_class = first.got[0]
    # The same object for everyone, the diagnosis made and the summary completed before the first emitter.
    assert broken.got[0][0] is request and last.got[0][0] is request and request.summary is s
    assert request.diagnosis is not None and cache_class == request.diagnosis.cache_class == s.cache_class
    # What the span and metric emitters wrote says the same class; a failing emitter costs only its own output.
    assert attrs(h.root())[sc.CACHE_CLASS] == cache_class
    cached = point(h.metrics(), sc.METRIC_CACHE_REQUESTS, **{sc.CACHE_CLASS: cache_class})
    assert cached.value == 1 and rec.failed == 1


def test_relay_gauges_become_additions_and_vanish_with_the_relay(harness: HarnessFactory) -> None:
    h = harness()
    rec = h.recorder
    rec.take(0, encode_stats(Stats(True, 0, (("default", 3),), (("default", 2),), (), (), ())))
    rec.take(1, encode_stats(Stats(True, 4, (("default", 1),), (), (), (), ())))
    m = h.metrics()
    assert point(m, sc.METRIC_ACTIVE_STREAMS).value == 4 and point(m, sc.METRIC_QUEUE_WAITING).value == 2
    dropped = point(m, sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "channel_full"})
    assert dropped.value == 4
    # Every other reason reads 0 from the start.
    assert {p.attributes[sc.TELEMETRY_REASON]: p.value for p in points(m[sc.METRIC_TELEMETRY_DROPPED])} == {
        "channel_full": 4,
        "queue_full": 0,
        "evicted": 0,
        "partial": 0,
        "inflate_limit": 0,
        "body_limit": 0,
        "split": 0,
        "in_transit": 0,
        "in_flight": 0,
        "shutdown": 0,
    }
    assert rec.relays_ready == {0: True, 1: True}
    rec.take(0, encode_stats(Stats(False, 0, (("default", 1),), (("default", 0),), (), (), ())))
    rec.relay_gone(1)
    assert rec.flush(5)
    m = h.metrics()
    assert point(m, sc.METRIC_ACTIVE_STREAMS).value == 1 and point(m, sc.METRIC_QUEUE_WAITING).value == 0
    assert rec.relays_ready == {0: False, 1: False}


def test_relays_that_come_and_go_leave_a_bounded_trace(harness: HarnessFactory) -> None:
    """Each relay connection is a source of its own: one that restarts again and again leaves no gauges behind, and
    the readiness (not ready) of the last ``GONE_KEPT`` only. Its streams still open are dropped, counted."""
    from llmtap.telemetry.intake.relays import GONE_KEPT

    h = harness()
    rec = h.recorder
    for source in range(3 * GONE_KEPT):
        rec.take(source, encode_stats(Stats(True, 1, (("default", 1),), (), (("idle", 2),), (), ())))
        rec.take(source, chat_tape(7, [b"data: " + b"x" * 40_000 + b"\n\n", b"data: [DONE]\n\n"])[1][0])
        rec.relay_gone(source)
    assert rec.flush(5)
    assert len(rec.relays.ready) == GONE_KEPT and not any(rec.relays.ready.values())
    assert rec.relays._gauges == {} and rec.relays._counts == {} and rec.streams.open == 0
    m = h.metrics()
    assert point(m, sc.METRIC_ACTIVE_STREAMS).value == 0
    assert point(m, sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "evicted"}).value == 3 * GONE_KEPT
    assert point(m, sc.METRIC_TELEMETRY_DROPPED, **{sc.TELEMETRY_REASON: "channel_full"}).value == 3 * GONE_KEPT


def test_relay_connection_counts_are_absolute_and_read_0_from_the_start(harness: HarnessFactory) -> None:
    h = harness()
    rec = h.recorder

    def counts() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        m = h.metrics()
        timeouts = {p.attributes[sc.TIMEOUT_KIND]: p.value for p in points(m[sc.METRIC_CLIENT_TIMEOUTS])}
        refused = {p.attributes[sc.REFUSAL_REASON]: p.value for p in points(m[sc.METRIC_CONNECTIONS_REFUSED])}
        cut = {p.attributes[sc.CUT_REASON]: p.value for p in points(m[sc.METRIC_RESPONSES_CUT])}
        return timeouts, refused, cut

    zero = {"header": 0, "body": 0, "idle": 0, "send": 0, "upload": 0}
    assert counts() == (zero, {"limit": 0, "per_client": 0}, {"inflate_limit": 0})
    gauges = (STATS, True, 0, (("default", 0),), ())
    rec.take(0, (*gauges, (("header", 2), ("body", 0), ("idle", 5)), (("limit", 1),), (("inflate_limit", 1),), 0))
    # A report that never arrived changes nothing: the next one carries the total.
    rec.take(
        0,
        (*gauges, (("header", 3), ("body", 1), ("idle", 9), ("send", 2)), (("limit", 4), ("per_client", 7)), (), 0),
    )
    rec.take(1, (*gauges, (("header", 1), ("body", 0), ("idle", 0)), (("limit", 0),), (), 0))
    assert counts() == (
        {**zero, "header": 4, "body": 1, "idle": 9, "send": 2},
        {"limit": 4, "per_client": 7},
        {"inflate_limit": 1},
    )
    # Relay 1 goes; a new process in its place counts from 0 again: its counts add, none are lost.
    rec.relay_gone(1)
    rec.take(1, (*gauges, (("header", 0), ("body", 2), ("upload", 1)), (("limit", 0),), (("inflate_limit", 2),), 0))
    assert rec.flush(5)
    assert counts() == (
        {**zero, "header": 4, "body": 3, "idle": 9, "send": 2, "upload": 1},
        {"limit": 4, "per_client": 7},
        {"inflate_limit": 3},
    )


# --- secrets -------------------------------------------------------------------------------------

SECRETS = {
    "authorization": "Bearer sk-LLMTAP-SECRET-0001",
    "x-api-key": "sk-ant-LLMTAP-SECRET-0002",
    "api-key": "LLMTAP-SECRET-0003",
    "cookie": "session=LLMTAP-SECRET-0004",
    "proxy-authorization": "Basic LLMTAP-SECRET-0005",
}


@pytest.mark.e2e
def test_no_secret_from_request_headers_in_telemetry(
    proxy_factory: Any, scripted: Scripted, telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    running: Running = proxy_factory(build({"upstream": scripted.url, "read_timeout": 5}, env={}))
    seen: list[Timeline] = []
    recorder = running.recorder
    assert recorder is not None
    record = recorder.record

    def spy(tl: Timeline) -> Summary:
        seen.append(tl)
        return record(tl)

    monkeypatch.setattr(recorder, "record", spy)
    body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
    with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, headers=SECRETS, timeout=10) as r:
        assert r.status_code == 200
        r.read()
    echoed = httpx.get(running.url + "/echo-headers", headers=SECRETS, timeout=10).json()["headers"]
    # The relay forwards the credentials upstream unchanged ...
    assert echoed["authorization"] == SECRETS["authorization"] and echoed["x-api-key"] == SECRETS["x-api-key"]
    running.flush()
    # ... and nothing the telemetry sees or writes holds them.
    assert len(seen) == 2
    spans = telemetry.finished()
    assert any(s.name == "chat scripted" for s in spans) and any(s.name == "GET" for s in spans)
    dumped = [repr(tl) for tl in seen]
    for span in spans:
        dumped.append(span.name)
        dumped.append(repr(dict(span.attributes or {})))
        dumped.extend(repr(dict(e.attributes or {})) for e in span.events)
    dumped.append(repr(telemetry.metrics()))
    dumped.append(telemetry.prometheus.render())
    text = "\n".join(dumped)
    assert "chat scripted" in text and "gen_ai_client_operation_duration_seconds" in text
    assert "LLMTAP-SECRET" not in text


def test_with_a_logs_sdk_too_old_each_content_event_is_counted_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--content-event`` where the content event's module cannot be imported (the SDK lacks what it needs): the
    requests still get their telemetry, and each one's event is counted as lost, ``sdk_too_old``."""
    monkeypatch.setitem(sys.modules, "llmtap.telemetry.records.content", None)  # its import raises ImportError
    settings = build(
        {"upstream": "http://127.0.0.1:1", "content_event": "input=keep"},
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
    )
    reader = InMemoryMetricReader()
    recorder = Recorder(settings, meter_provider=MeterProvider(metric_readers=[reader], shutdown_on_exit=False))
    try:
        recorder.counts.start(settings, forwarding=False, routing=False)
        for _ in range(2):
            recorder.record_timeline(timeline(3))
        assert recorder.flush(PATIENCE)
    finally:
        recorder.close()
    found = {
        m.name: m
        for rm in reader.get_metrics_data().resource_metrics  # type: ignore[union-attr]
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert point(found, sc.METRIC_REQUESTS).value == 2
    lost = {p.attributes[sc.TELEMETRY_REASON]: p.value for p in points(found[sc.METRIC_CONTENT_EVENTS_DROPPED])}
    assert lost == {"sdk_too_old": 2, "otlp_queue_full": 0, "otlp_export_failed": 0, "unmade": 0}
