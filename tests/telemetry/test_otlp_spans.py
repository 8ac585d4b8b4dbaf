"""llmtap's own OTLP span encoder against the SDK's: the same message for the same spans, whatever they hold."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from llmtap.telemetry.emit import otlp_spans
from llmtap.telemetry.emit.otlp_spans import encode_request


class Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += spans
        return SpanExportResult.SUCCESS


def _values(rng: random.Random) -> list[Any]:
    return [
        "",
        "text",
        "ünïcödé ✓ 日本",
        "x" * 300,
        True,
        False,
        0,
        1,
        -1,
        127,
        128,
        300,
        (1 << 63) - 1,
        -(1 << 63),
        rng.randint(-(10**12), 10**12),
        0.0,
        -2.5,
        1e300,
        float("inf"),
        ("a", "b"),
        (1, 2, 3),
        (1.5,),
        (True, False),
        (),
    ]


def _spans(seed: int) -> list[ReadableSpan]:
    rng = random.Random(seed)
    keep = Keep()
    spans: list[ReadableSpan] = []
    for resource in (Resource.create({"service.name": "a", "k": 3}), Resource({}, schema_url="https://s/1")):
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(keep))
        for scope, version, url in (("llmtap", "1.0", None), ("other", None, "https://scope")):
            tracer = provider.get_tracer(scope, version, schema_url=url)
            values = _values(rng)
            remote = NonRecordingSpan(
                SpanContext(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1, True, TraceFlags(1))
            )
            state = TraceState([("vendor", "v1"), ("other", "x")])
            local = SpanContext(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1, False, TraceFlags(1), state)
            for i, kind in enumerate(SpanKind):
                attrs = {f"attr.{j}": v for j, v in enumerate(rng.sample(values, k=rng.randint(0, len(values))))}
                ctx = trace.set_span_in_context(remote) if i % 2 else None
                links = [Link(local, {"link.n": i})] if i % 3 == 0 else []
                span = tracer.start_span(
                    f"span {i}" if i != 2 else "",
                    context=ctx,
                    kind=kind,
                    attributes=attrs,
                    links=links,
                    start_time=1_700_000_000_000_000_000 + i,
                )
                if i % 2 == 0:
                    with trace.use_span(span, end_on_exit=False):
                        child = tracer.start_span("child", attributes={"n": i})
                        child.end(end_time=1_700_000_000_000_000_500)
                span.add_event("first", {"e": 1, "f": ("x",)}, timestamp=1_700_000_000_000_000_010)
                span.add_event("", timestamp=1_700_000_000_000_000_020)
                span.set_status(
                    [Status(StatusCode.UNSET), Status(StatusCode.OK), Status(StatusCode.ERROR, "it broke ✗")][i % 3]
                )
                span.end(end_time=1_700_000_000_000_001_000 + i)
        provider.shutdown()
    spans += keep.spans
    return spans


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_bytes_parse_to_the_message_the_sdk_builds(seed: int) -> None:
    spans = _spans(seed)
    assert len(spans) > 20
    ours = ExportTraceServiceRequest.FromString(encode_request(spans))
    theirs = encode_spans(spans)
    assert ours == theirs
    # Span by span too, so a difference names the span it is in.
    for span in spans:
        assert ExportTraceServiceRequest.FromString(encode_request([span])) == encode_spans([span]), span.name


def test_an_empty_batch_and_values_otlp_cannot_carry() -> None:
    assert encode_request([]) == encode_spans([]).SerializeToString()
    keep = Keep()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(keep))
    span = provider.get_tracer("t").start_span("s", attributes={"fine": 1})
    span._attributes._dict["huge"] = 1 << 70  # type: ignore[attr-defined]  # past int64: the SDK's encoder leaves it out too
    span.end()
    ours = ExportTraceServiceRequest.FromString(encode_request(keep.spans))
    [attribute] = ours.resource_spans[0].scope_spans[0].spans[0].attributes
    assert (attribute.key, attribute.value.int_value) == ("fine", 1)


def test_the_sdk_exporters_send_these_bytes(caplog: pytest.LogCaptureFixture) -> None:
    spans = _spans(4)
    expected = encode_spans(spans)
    grpc_exporter = otlp_spans.exporter(GRPCSpanExporter(endpoint="http://127.0.0.1:9", insecure=True))
    assert grpc_exporter._translate_data(spans) == expected  # type: ignore[attr-defined]
    grpc_exporter.shutdown()

    sent: list[bytes] = []

    class Result:
        success = True

    http = otlp_spans.exporter(HTTPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces"))
    assert http is not None
    inner = http.inner  # type: ignore[attr-defined]

    def send(data: bytes) -> Result:
        sent.append(data)
        return Result()

    inner._client.export = send
    assert http.export(spans) == SpanExportResult.SUCCESS
    assert ExportTraceServiceRequest.FromString(sent[0]) == expected
    # A batch above the exporter's request limit is refused whole, as the SDK's exporter refuses it.
    inner._max_request_size = 100
    with caplog.at_level(logging.WARNING):
        assert http.export(spans) == SpanExportResult.FAILURE
    assert len(sent) == 1 and "limit" in caplog.text
    http.shutdown()
    assert http.export(spans) == SpanExportResult.FAILURE
    # Any other exporter is left as it is.
    keep = Keep()
    assert otlp_spans.exporter(keep) is keep
