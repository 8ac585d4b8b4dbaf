"""What ``llmtap serve`` says once it listens: where everything listens, and where everything goes."""

from __future__ import annotations

import ipaddress

from llmtap import __version__
from llmtap.config.options import binary
from llmtap.config.types import Settings, TelemetrySettings

__all__ = ["startup_lines"]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _otlp(t: TelemetrySettings, signal: str) -> str:
    """Where one signal goes: ``OTLP grpc to URL``, ``the console`` or ``off``."""
    exporter = getattr(t, f"{signal}_exporter")
    if exporter == "console":
        return "the console"
    if exporter != "otlp":
        return "off"
    endpoint, protocol = getattr(t, f"{signal}_endpoint"), getattr(t, f"{signal}_protocol")
    if protocol == "http/protobuf" and not getattr(t, f"{signal}_endpoint_specific"):
        endpoint = f"{endpoint}/v1/{signal}"  # where the exporter posts, as the OTLP spec joins a base endpoint
    return f"OTLP {protocol} to {endpoint}"


def startup_lines(settings: Settings, port: int, admin_port: int) -> list[str]:
    """What ``llmtap serve`` says once it listens: where the proxy, admin listener and live view are, where
    each route goes, where telemetry goes, and where records and the access log are written."""
    admin = _url(settings.admin_host, admin_port)
    relays = "1 relay process" if settings.workers == 1 else f"{settings.workers} relay processes"
    lines = [f"llmtap {__version__}: proxy on {_url(settings.host, port)} ({relays})"]
    scrape = "/metrics, " if settings.telemetry.prometheus else ""
    guard = ""
    if settings.admin.loopback_token or not _is_loopback(settings.admin_host):
        guard = (
            "; /v1/traces and /events ask the admin token"
            if settings.admin.token
            else "; /v1/traces and /events refuse peers beyond loopback (no admin token)"
        )
    lines.append(f"admin on {admin}: {scrape}/healthz, /readyz; live view {admin}/{guard}")
    for r in sorted(settings.routes, key=lambda r: r.prefix):
        provider = r.provider or "provider from the API it speaks"
        insecure = ", TLS not verified" if r.upstream.startswith("https://") and not r.tls_verify else ""
        lines.append(f"route {r.prefix} -> {r.upstream} ({provider}{insecure})")
    t = settings.telemetry
    traces, metrics = _otlp(t, "traces"), _otlp(t, "metrics")
    if traces == metrics == "off":
        why = "OTEL_SDK_DISABLED is set" if t.sdk_disabled else "set OTEL_EXPORTER_OTLP_ENDPOINT"
        lines.append(f"telemetry: OTLP off: {why}" + (f"; Prometheus can scrape {admin}/metrics" if scrape else ""))
    elif traces == metrics:
        lines.append(f"telemetry: traces and metrics to {traces}")
    else:
        lines.append(f"telemetry: traces to {traces}; metrics to {metrics}")
    rec = settings.record
    records = (
        f"records: {rec.path}/ (a new file past {binary(rec.max_bytes)} or {rec.rotate_s / 60:g} min, "
        f"{binary(rec.keep_bytes)} and {rec.keep_s / 3600:g} h kept)"
        if rec.path
        else "records: off (--record DIR)"
    )
    if rec.logs:
        records += ", as OTLP log records too"
    if rec.clickhouse is not None:
        # The URL as the sink uses it: any password it carried is left out.
        from llmtap.store.clickhouse import Server

        records += f"; ClickHouse {Server.parse(rec.clickhouse.url).url} table {rec.clickhouse.table}"
    if rec.on:
        # What a kill or a restart with a sink down does to them.
        records += (
            f"; journal {rec.journal}/ ({binary(rec.journal_bytes)} per telemetry process)"
            if rec.journal
            else "; not journaled: a restart loses what waits for a sink (--record-journal DIR)"
        )
    where = "stderr" if settings.access_log == "-" else settings.access_log
    access = f"access log: {where}" if where else "access log: off (--access-log PATH, - for stderr)"
    lines.append(f"{records}; {access}")
    return lines
