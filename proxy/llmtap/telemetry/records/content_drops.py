"""Content events lost (``--content-event``): counted by reason and said once, without the logs SDK.

This module loads no OpenTelemetry, so it serves when the SDK installed is too old for the content event
(``llmtap.telemetry.records.content`` cannot be imported): each request's event is then counted as lost
(``sdk_too_old``) rather than vanish. The reasons are ``semconv.CONTENT_DROP_REASONS``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtap.analysis.finish import Finished

__all__ = ["ContentUnavailable", "DropLog"]

log = logging.getLogger("llmtap.telemetry")


class DropLog:
    """Content events lost: counted through ``on_drop``, and each reason said once in the log with its cause."""

    def __init__(self, on_drop: Callable[[str, int], None] | None) -> None:
        self._on_drop = on_drop
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, reason: str, n: int, cause: str) -> None:
        with self._lock:
            first = reason not in self._said
            self._said.add(reason)
        if first:
            log.warning(
                "telemetry: content events lost (%s): %s; each is counted on "
                "llmtap_telemetry_content_events_dropped_total, said here once",
                reason,
                cause,
            )
        if self._on_drop is not None:
            try:
                self._on_drop(reason, n)
            except Exception:
                log.debug("telemetry: could not count a lost content event", exc_info=True)


class ContentUnavailable:
    """``--content-event`` asked for with a logs SDK llmtap cannot use: each request's event is lost, counted."""

    def __init__(self, cause: str, on_drop: Callable[[str, int], None] | None = None) -> None:
        self.dropped = DropLog(on_drop)
        self.cause = cause

    def emit(self, request: Finished) -> None:
        """Count the request's event as lost (a request no protocol names has none)."""
        if request.tl.protocol is not None:
            self.dropped("sdk_too_old", 1, self.cause)

    def close(self) -> None:
        """Nothing waits."""
