"""Where request records go: one small interface (``write``, ``flush``, ``close``), the sinks built in one place.

Every sink is called on the recorder's worker thread only, after the request's stream ended; a sink never
raises from ``write`` (a record it loses is counted by reason through ``on_drop``) and never blocks on I/O
beyond its own bounded buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from llmtap.config.types import Settings
from llmtap.telemetry.identity import Identity
from llmtap.worker import Progress

__all__ = ["Sink", "build_sinks", "drop_reasons"]


class Sink(Protocol):
    """A place records go: ``kind`` names it to the record journal (``llmtap.telemetry.journal.spool``), and
    ``progress`` says which of the records given are settled (sent, or dropped and counted)."""

    kind: str
    progress: Progress

    def write(self, record: dict[str, Any]) -> None:
        """Take one record; never raises."""

    def flush(self) -> None:
        """Push out what is buffered (the worker went idle, or a flush was asked for)."""

    def close(self, timeout: float = 5.0) -> None:
        """Flush and release, within ``timeout`` seconds."""


def drop_reasons(settings: Settings) -> tuple[str, ...]:
    """Every reason the sinks the settings ask for can lose a record (each counted at 0 from the start)."""
    from llmtap.telemetry.records.dataset import RECORD_DROP_REASONS

    reasons: tuple[str, ...] = RECORD_DROP_REASONS if settings.record.path else ()
    if settings.record.logs:
        from llmtap.telemetry.records.logs import LOG_DROP_REASONS

        reasons += LOG_DROP_REASONS
    if settings.record.clickhouse is not None:
        from llmtap.telemetry.records.clickhouse import DROP_REASONS

        reasons += DROP_REASONS
    return reasons


def build_sinks(
    settings: Settings,
    identity: Identity,
    on_drop: Callable[[str, int], None],
    *,
    logger_provider: Any = None,
    on_insert: Callable[[str, int], None] | None = None,
    keep_unsent: bool = False,
) -> list[Sink]:
    """The record sinks the settings ask for (none: records are not made at all).

    ``logger_provider``: the SDK ``LoggerProvider`` log records go through (by default one of their own);
    ``on_insert``: counts each batch the ClickHouse sink sends, by outcome; ``keep_unsent``: the record journal
    keeps what a sink could not send by shutdown (not counted lost there)."""
    rec = settings.record
    sinks: list[Sink] = []
    if rec.path:
        from llmtap.telemetry.records.dataset import DatasetWriter

        sinks.append(
            DatasetWriter(
                rec.path,
                identity,
                max_bytes=rec.max_bytes,
                rotate_s=rec.rotate_s,
                keep_bytes=rec.keep_bytes,
                keep_s=rec.keep_s,
                parquet=rec.format == "parquet",
                on_drop=on_drop,
            )
        )
    if rec.logs:
        # Only then: the OTLP log exporter and the SDK's logs are loaded by those who ask for them.
        from llmtap.telemetry.records.logs import LogSink, log_exporter

        sinks.append(
            LogSink(
                log_exporter(settings.telemetry),
                capacity=settings.telemetry.queue_size,
                on_drop=on_drop,
                provider=logger_provider,
                instance_id=identity.instance_id,
            )
        )
    if rec.clickhouse is not None:
        from llmtap.telemetry import sched
        from llmtap.telemetry.records.clickhouse import clickhouse_sink

        sinks.append(
            clickhouse_sink(rec.clickhouse, on_drop, on_insert, on_thread=sched.idle_here, keep_unsent=keep_unsent)
        )
    return sinks
