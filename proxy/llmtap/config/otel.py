"""Telemetry settings: the standard ``OTEL_*`` variables, and llmtap's own telemetry options.

The SDK's OTLP exporters read the ``OTEL_EXPORTER_OTLP_*`` variables themselves; llmtap reads of them only
what it must know at start, and checks the rest so that a typo stops the start (the SDK would warn and go on):

* the endpoints: whether a signal is exported at all (not until a backend is named), the start-up line, and
  the server-span forwarder (``llmtap.telemetry.fleet.forward``); given to the exporters so that the endpoint printed
  is the one used;
* the protocols: they pick the exporter (the SDK has one per protocol);
* the traces' headers and timeout: the forwarder sends with them. Every signal's headers are checked here,
  but the exporters read theirs themselves, by the same rule (the signal's own variable, else the general one);
* ``OTEL_METRIC_EXPORT_INTERVAL``: llmtap's default (10 s) is not the SDK's (60 s);
* ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``: checked, and given to the exporters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtap.config import options
from llmtap.config.options import Invalid
from llmtap.config.sources import Sources, boolean, check_url, quote
from llmtap.config.types import EXPLICIT, EXPONENTIAL, SEMCONV_LATEST, ConfigError, TelemetrySettings

__all__ = ["telemetry_from_env"]


def _interval(value: Any) -> int:
    try:
        return int(options.integer(1).parse(value))
    except Invalid as exc:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL={quote(value)}: {exc}") from None


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
        raise ConfigError(f"{key}={quote(raw)}: {exc}") from None


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
) -> TelemetrySettings:
    """The telemetry settings from ``OTEL_*``, and llmtap's own from ``sources`` (by default: ``LLMTAP_*`` in
    ``env`` over the file's ``telemetry:`` section ``file_section``)."""
    if sources is None:
        sources = Sources({}, env, {"telemetry": dict(file_section or {})})
    disabled = boolean(env.get("OTEL_SDK_DISABLED", "false"), "OTEL_SDK_DISABLED")
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
        general = _headers(env.get("OTEL_EXPORTER_OTLP_HEADERS"))
        headers_key = f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS"
        specific = _headers(env.get(headers_key), headers_key)
        if signal == "traces":
            # The SDK's rule: the signal's own variable, when set, replaces the general one whole.
            values["traces_headers"] = specific if env.get(headers_key) else general
        values[f"{signal}_exporter"] = "none" if disabled else exporter
        values[f"{signal}_endpoint"] = endpoint
        values[f"{signal}_endpoint_specific"] = bool(env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"))
        values[f"{signal}_protocol"] = protocol
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
    return TelemetrySettings(**values)


#: ``TelemetrySettings`` fields that are llmtap's own options, and their names in the table.
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
