"""Finished spans written straight to OTLP's protobuf bytes (``ExportTraceServiceRequest``), without a message object.

The SDK's OTLP encoder builds a protobuf message per span, per attribute and per value through the message
classes' Python constructors: the telemetry process's profile put that at a fifth of its CPU, most of it the
attributes of the few spans every request has. Here each field is written as its wire bytes (tag, length,
value), an attribute's key and tag are encoded once and remembered, and the resource and scope once per batch.
The bytes parse to the message the SDK's encoder builds for the same spans (``tests/telemetry/test_otlp_spans.py``
compares them span by span, every value type included); ``exporter`` gives the SDK's OTLP exporters this
encoder and leaves them everything else (transport, retries, headers, compression, limits).

Field numbers are those of ``opentelemetry/proto/trace/v1/trace.proto`` and ``common/v1/common.proto``.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any, cast

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext

from llmtap.telemetry.sched import checkpoint

__all__ = ["encode_request", "exporter"]

log = logging.getLogger(__name__)

_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_FIXED32 = struct.Struct("<I")
_INT64 = 1 << 63
_UINT64 = (1 << 64) - 1
# SpanFlags: the context's remoteness is known (0x100), and it is remote (0x200).
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_VARINTS = [bytes((n,)) for n in range(128)]


def _varint(n: int) -> bytes:
    if n < 128:
        return _VARINTS[n]
    out = bytearray()
    while n > 127:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    n = len(payload)
    return tag + (_VARINTS[n] if n < 128 else _varint(n)) + payload


def _text(value: str) -> bytes:
    return value.encode("utf-8", "replace")


# AnyValue: string_value 1, bool_value 2, int_value 3, double_value 4, array_value 5, kvlist_value 6, bytes_value 7.
_ANY_TRUE, _ANY_FALSE = b"\x10\x01", b"\x10\x00"


def _value(value: Any) -> bytes:
    """An AnyValue's payload; ValueError/TypeError for what OTLP cannot carry (the attribute is then left out)."""
    if isinstance(value, str):
        return _field(b"\x0a", _text(value))
    if isinstance(value, bool):
        return _ANY_TRUE if value else _ANY_FALSE
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"{value} is outside int64")
        return b"\x18" + _varint(value & _UINT64)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if value is None:
        return b""
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join([_field(b"\x0a", _value(v)) for v in value]))
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join([_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items()]))
    raise TypeError(f"invalid type {type(value).__name__} of value {value!r}")


#: KeyValue's key field (1) of each attribute key seen, written once; bounded.
_KEYS: dict[str, bytes] = {}
_KEYS_KEPT = 4096


def _key(key: str) -> bytes:
    done = _KEYS.get(key)
    if done is None:
        if len(_KEYS) >= _KEYS_KEPT:
            _KEYS.clear()
        done = _KEYS[key] = _field(b"\x0a", _text(key))
    return done


def _key_value(key: str, value: Any) -> bytes:
    return _key(key) + _field(b"\x12", _value(value))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> list[bytes]:
    """Each attribute as a repeated KeyValue field ``tag``; one OTLP cannot carry is left out, and said."""
    if not attributes:
        return []
    out = []
    for key, value in attributes.items():
        try:
            out.append(_field(tag, _key_value(key, value)))
        except (TypeError, ValueError) as error:
            log.warning("span attribute %s left out of the export: %s", key, error)
    return out


def _flags(context: Any) -> bytes:
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0)
    return _FIXED32.pack(flags)


def _span(span: ReadableSpan) -> bytes:
    """A Span message's payload."""
    ctx = cast(SpanContext, span.get_span_context())  # the SDK's finished spans always have one
    parts = [b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"), b"\x12\x08" + ctx.span_id.to_bytes(8, "big")]
    state = ctx.trace_state
    if state:
        parts.append(_field(b"\x1a", _text(",".join(f"{k}={v}" for k, v in state.items()))))
    parent = span.parent
    if parent is not None:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    if span.name:
        parts.append(_field(b"\x2a", _text(span.name)))
    parts.append(b"\x30" + _VARINTS[span.kind.value + 1])  # SpanKind: the API's value + 1 (0 is UNSPECIFIED)
    if span.start_time:
        parts.append(b"\x39" + _FIXED64.pack(span.start_time))
    if span.end_time:
        parts.append(b"\x41" + _FIXED64.pack(span.end_time))
    parts += _attributes(b"\x4a", span.attributes)
    if span.dropped_attributes:
        parts.append(b"\x50" + _varint(span.dropped_attributes))
    for event in span.events:
        body = [b"\x09" + _FIXED64.pack(event.timestamp)] if event.timestamp else []
        if event.name:
            body.append(_field(b"\x12", _text(event.name)))
        body += _attributes(b"\x1a", event.attributes)
        if event.dropped_attributes:
            body.append(b"\x20" + _varint(event.dropped_attributes))
        parts.append(_field(b"\x5a", b"".join(body)))
    if span.dropped_events:
        parts.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        body = [
            b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + link.context.span_id.to_bytes(8, "big"),
        ]
        body += _attributes(b"\x22", link.attributes)
        if link.dropped_attributes:
            body.append(b"\x28" + _varint(link.dropped_attributes))
        body.append(b"\x35" + _flags(link.context))
        parts.append(_field(b"\x6a", b"".join(body)))
    if span.dropped_links:
        parts.append(b"\x70" + _varint(span.dropped_links))
    status = span.status
    code = status.status_code.value
    payload = (_field(b"\x12", _text(status.description)) if status.description else b"") + (
        b"\x18" + _VARINTS[code] if code else b""
    )
    parts.append(_field(b"\x7a", payload))
    parts.append(b"\x85\x01" + _flags(parent))  # flags: field 16, fixed32
    return b"".join(parts)


def _resource(resource: Any) -> bytes:
    """A Resource message's payload."""
    return b"".join(_attributes(b"\x0a", resource.attributes))


def _scope(scope: Any) -> bytes:
    """An InstrumentationScope message's payload (empty for no scope, as the SDK's encoder writes it)."""
    if scope is None:
        return b""
    parts = []
    if scope.name:
        parts.append(_field(b"\x0a", _text(scope.name)))
    if scope.version:
        parts.append(_field(b"\x12", _text(scope.version)))
    parts += _attributes(b"\x1a", scope.attributes)
    return b"".join(parts)


def encode_request(spans: Sequence[ReadableSpan]) -> bytes:
    """An ``ExportTraceServiceRequest`` of ``spans``, grouped by resource and then scope as the SDK groups them."""
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        checkpoint()
        resource = span.resource
        group = groups.get(id(resource))
        if group is None:
            group = groups[id(resource)] = (resource, {})
        scope = span.instrumentation_scope or None
        scopes = group[1]
        held = scopes.get(id(scope))
        if held is None:
            held = scopes[id(scope)] = (scope, [])
        held[1].append(_field(b"\x12", _span(span)))
    out = []
    for resource, scopes in groups.values():
        parts = [_field(b"\x0a", _resource(resource))]
        for scope, encoded in scopes.values():
            body = [_field(b"\x0a", _scope(scope)), *encoded]
            if scope is not None and scope.schema_url:
                body.append(_field(b"\x1a", _text(scope.schema_url)))
            parts.append(_field(b"\x12", b"".join(body)))
        if resource.schema_url:
            parts.append(_field(b"\x1a", _text(resource.schema_url)))
        out.append(_field(b"\x0a", b"".join(parts)))
    return b"".join(out)


def exporter(inner: SpanExporter) -> SpanExporter:
    """``inner`` (an SDK OTLP span exporter) with this encoder in place of the SDK's; any other exporter as is."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCSpanExporter

    if isinstance(inner, GRPCSpanExporter) and hasattr(inner, "_translate_data"):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        parse = ExportTraceServiceRequest.FromString

        def translate(data: Sequence[ReadableSpan]) -> Any:
            # The gRPC stub serializes a message: the bytes are parsed back in C (upb), far below their writing.
            return parse(encode_request(data))

        inner._translate_data = translate  # type: ignore[method-assign]
        return inner
    return _HTTP.wrap(inner) or inner


class _HTTP(SpanExporter):
    """An SDK OTLP/HTTP span exporter sending this encoder's bytes through its own client (retries, limits)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @classmethod
    def wrap(cls, inner: SpanExporter) -> _HTTP | None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter
        except ImportError:  # pragma: no cover - the HTTP exporter is a dependency
            return None
        if not isinstance(inner, HTTPSpanExporter):
            return None
        needed = ("_client", "_shutdown", "_max_request_size")
        return cls(inner) if all(hasattr(inner, name) for name in needed) else None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Encode here, then send as the SDK's exporter sends; what it refuses is refused the same way."""
        inner = self.inner
        if inner._shutdown:
            return SpanExportResult.FAILURE
        data = encode_request(spans)
        limit = inner._max_request_size
        if limit is not None and 0 < limit < len(data):
            log.warning("span batch of %d bytes left out: above the exporter's limit of %d", len(data), limit)
            return SpanExportResult.FAILURE
        result = inner._client.export(data)
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        """Shut the SDK's exporter down."""
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Flush the SDK's exporter."""
        return bool(self.inner.force_flush(timeout_millis))
