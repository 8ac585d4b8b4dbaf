"""Building the one frozen ``Settings`` at the edge, from flags, ``LLMTAP_*`` variables, a YAML file and ``OTEL_*``.

Precedence: flags, then environment, then the file, then defaults (``llmtap.config.sources``). Anything
wrong raises ``ConfigError`` with a one-line message; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmtap.config import prices as price_tables
from llmtap.config.options import OPTIONS
from llmtap.config.otel import telemetry_from_env
from llmtap.config.routes import check_objective_shapes, routes, shapes
from llmtap.config.sources import Sources, load_file
from llmtap.config.types import (
    MIB,
    SLO,
    Admin,
    Attribution,
    ClickHouseRecords,
    ConfigError,
    ContentEvent,
    Records,
    Settings,
    Timeouts,
)

__all__ = ["build"]


def _admin_token(values: Mapping[str, Any]) -> str | None:
    """The token from its file (one line; surrounding white space dropped) or its variable; a file wins."""
    name = values["admin_token_file"]
    if name is not None:
        try:
            token = Path(name).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"admin_token_file {name}: cannot read it: {exc}") from None
        if not token:
            raise ConfigError(f"admin_token_file {name}: the file is empty")
    else:
        token = (values["admin_token"] or "").strip()
    if token and (len(token) < 16 or any(c.isspace() or not c.isprintable() for c in token)):
        raise ConfigError("the admin token must be at least 16 printable characters, without white space")
    return token or None


def _attribution(values: Mapping[str, Any]) -> Attribution:
    """The attribution settings; the key from its file, else its variable; the price file checked now."""
    key: str | None = values["attribution_key"]
    key_file = values["attribution_key_file"]
    if key_file is not None:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--attribution-key-file {key_file}: cannot read it: {exc}") from None
    if key is not None and len(key.strip()) < 16:
        raise ConfigError("the attribution key must be at least 16 characters")
    prices = values["prices"]
    if prices is not None:
        try:
            price_tables.load(prices)
        except price_tables.PriceError as exc:
            raise ConfigError(str(exc)) from None
    return Attribution(
        metric_dimensions=values["metric_dimensions"],
        metric_values=values["metric_dimension_values"],
        forward_headers=values["forward_llmtap_headers"],
        key=key.strip().encode() if key is not None else None,
        prices=prices,
    )


def build(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from parsed CLI flags (by option name; ``None``: not given), the environment and the config file.

    Every option is checked first, in the table's order (the ports before any upstream), then the routes.
    """
    env = os.environ if env is None else env
    config = Sources(flags, env).get("config")
    data = load_file(config) if config else {}
    sources = Sources(flags, env, data, str(config))
    values = {name: sources.get(name) for name, o in OPTIONS.items() if o.group != "route"}

    route_list = routes(sources, values)
    shape_classes = shapes(values["shapes"], f"{sources.file}: shapes")
    check_objective_shapes(route_list, shape_classes, sources.file)

    def ms(name: str) -> float | None:
        value = values[name]
        return None if value is None else value / 1000.0

    return Settings(
        routes=tuple(route_list),
        host=values["host"],
        port=values["port"],
        admin_host=values["admin_host"],
        admin_port=values["admin_port"],
        admin=Admin(
            token=_admin_token(values),
            loopback_token=values["admin_loopback_token"],
            max_body_bytes=values["admin_max_body_bytes"],
            max_inflated_bytes=values["admin_max_inflated_bytes"],
            max_inflate_ratio=values["admin_max_inflate_ratio"],
            max_connections=values["admin_max_connections"],
            max_event_streams=values["admin_max_event_streams"],
        ),
        timeouts=Timeouts(
            connect=values["connect_timeout"],
            read=values["read_timeout"],
            write=values["write_timeout"],
            pool=values["pool_timeout"],
            idle=values["idle_timeout"],
            drain=values["drain_timeout"],
            flush=values["flush_timeout"],
            client_header=values["client_header_timeout"],
            client_body=values["client_body_timeout"],
            client_send=values["client_send_timeout"],
            client_upload=values["client_upload_timeout"],
            keep_alive=values["keep_alive_timeout"],
        ),
        telemetry=telemetry_from_env(env, sources=sources),
        slo=SLO(
            ttft=ms("slo_ttft_ms"),
            tpot=ms("slo_tpot_ms"),
            e2e=ms("slo_e2e_ms"),
            ttfot=ms("slo_ttfot_ms"),
            ttst=ms("slo_ttst_ms"),
            percentile=values["slo_percentile"],
        ),
        shapes=shape_classes,
        inject_usage=values["inject_usage"],
        forward_slo_headers=values["forward_slo_headers"],
        server_timing=values["server_timing"],
        max_inspect_bytes=values["max_inspect_bytes"],
        max_request_bytes=values["max_request_bytes"],
        max_header_bytes=values["max_header_bytes"],
        stream_buffer_bytes=values["stream_buffer_bytes"],
        max_connections=values["max_connections"],
        max_client_connections=values["max_client_connections"],
        max_connections_per_client=values["max_connections_per_client"],
        max_inflate_bytes=values["max_inflate_bytes"],
        log_level=values["log_level"],
        access_log=values["access_log"],
        record=Records(
            path=values["record"],
            max_bytes=max(int(values["record_max_mb"] * MIB), 1024),
            rotate_s=max(values["record_rotate_minutes"] * 60.0, 1.0),
            keep_bytes=int(values["record_keep_mb"] * MIB),
            keep_s=values["record_keep_hours"] * 3600.0,
            format=values["record_format"],
            logs=values["record_logs"],
            clickhouse=_clickhouse_records(values),
            journal=_journal(values),
            journal_bytes=max(int(values["record_journal_mb"] * MIB), 1 << 20),
        ),
        workers=values["workers"],
        telemetry_workers=values["telemetry_workers"],
        telemetry_scheduling=values["telemetry_scheduling"],
        telemetry_yield=values["telemetry_yield"],
        telemetry_gather=values["telemetry_gather"],
        attribution=_attribution(values),
        content=ContentEvent(rules=values["content_event"] or (), max_bytes=values["content_event_max_bytes"]),
    )


def _journal(values: Mapping[str, Any]) -> str | None:
    """The record journal's folder: ``--record-journal``, else inside ``--record``'s folder; ``off``: none."""
    journal = values["record_journal"]
    if journal == "off":
        return None
    if journal is None and values["record"]:
        return str(Path(values["record"]) / ".journal")
    return str(journal) if journal is not None else None


def _clickhouse_records(values: Mapping[str, Any]) -> ClickHouseRecords | None:
    """``--record-clickhouse`` and its settings; the password from its variable, else its file."""
    if not values["record_clickhouse"]:
        return None
    password = values["record_clickhouse_password"]
    password_file = values["record_clickhouse_password_file"]
    if password is None and password_file:
        try:
            password = Path(password_file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"record_clickhouse_password_file {password_file!r}: {exc.strerror or exc}") from None
    table = values["record_clickhouse_table"]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?", table):
        raise ConfigError(f"record_clickhouse_table {table!r}: expected a name like llmtap_records or db.records")
    return ClickHouseRecords(
        url=values["record_clickhouse"],
        table=table,
        user=values["record_clickhouse_user"],
        password=password,
        ttl_days=values["record_clickhouse_ttl_days"],
        max_records=values["record_clickhouse_queue"],
        max_bytes=max(int(values["record_clickhouse_queue_mb"] * MIB), 1024),
    )
