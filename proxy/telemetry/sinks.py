"""Where request records go: one small interface (``write``, ``flush``, ``close``), the sinks built in one place.

Every sink is called on the recorder's worker thread only, after the request's stream ended; a sink never
raises from ``write`` (a record it loses is counted by reason through ``on_drop``) and never blocks on I/O
beyond its own bounded buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from proxy.settings import Settings
from proxy.telemetry.identity import Identity


class Sink(Protocol):
    """A place records go."""

    def write(self, record: dict[str, Any]) -> None:
        """Take one record; never raises."""

    def flush(self) -> None:
        """Push out what is buffered (the worker went idle, or a flush was asked for)."""

    def close(self, timeout: float = 5.0) -> None:
        """Flush and release, within ``timeout`` seconds."""


def build_sinks(
    settings: Settings, identity: Identity, on_drop: Callable[[str, int], None], **providers: Any
) -> list[Sink]:
    """The record sinks the settings ask for (none: records are not made at all)."""
    rec = settings.record
    sinks: list[Sink] = []
    if rec.path:
        from proxy.telemetry.dataset import DatasetWriter

        sinks.append(
            DatasetWriter(
                rec.path,
                identity,
                max_bytes=rec.max_bytes,
                rotate_s=rec.rotate_s,
                keep_bytes=rec.keep_bytes,
                keep_s=rec.keep_s,
                on_drop=on_drop,
            )
        )
    return sinks
