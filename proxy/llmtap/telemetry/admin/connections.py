"""The admin listener's connections: at most ``admin_max_connections``, and a new one always gets a place.

The relay refuses a connection past its cap with 503 (``llmtap.listener``). On the admin listener that
would let anyone who opens enough idle connections starve ``/healthz`` and ``/readyz``, and a liveness
probe that fails restarts the pod. So here a connection past the cap closes the one that has waited longest
without a request in progress (idle between requests, or a request head still arriving), as nginx reuses
its idle keep-alive connections when it runs out: a probe's connection is served, and whoever holds idle
connections loses the oldest. Only when every connection has a request in progress (at most
``admin_max_event_streams`` of them are long event streams) is the new one refused with 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from llmtap.config.types import Settings
from llmtap.listener import LOG_EVERY, BoundedHeadProtocol, ClientLimits, connection_cap

__all__ = ["AdminLimits", "AdminProtocol"]

log = logging.getLogger("llmtap.telemetry")


class AdminLimits(ClientLimits):
    """The admin listener's bounds: the client timeouts of the settings and ``admin_max_connections``;
    ``count(reason)`` counts a connection evicted (``connection_evicted``) or refused (``connection_limit``)."""

    def __init__(self, settings: Settings, count: Callable[[str], None]) -> None:
        super().__init__(
            header_timeout=settings.timeouts.client_header,
            body_timeout=settings.timeouts.client_body,
            # Never more than the descriptors allow: past that, accept() itself fails and nothing is answered.
            max_connections=min(settings.admin.max_connections, connection_cap(None)),
        )
        self.count = count
        self.evicted = 0

    def evict(self, client: Any) -> None:
        """Count a waiting connection closed to make room; logged at most once per ``LOG_EVERY`` seconds."""
        self.evicted += 1
        self.count("connection_evicted")
        clock = time.monotonic()
        if clock - self._logged.get("evicted", -LOG_EVERY) >= LOG_EVERY:
            self._logged["evicted"] = clock
            log.warning(
                "admin listener: closed a waiting connection from %s to make room for a new one "
                "(admin_max_connections is %d; %d closed so far)",
                _peer(client),
                self.max_connections,
                self.evicted,
            )

    def refuse(self, reason: str, client: Any, open_now: int) -> None:
        """Count and log a connection refused with 503: every open one has a request in progress."""
        self.refused[reason] += 1
        self.count("connection_limit")
        self._log(
            reason,
            "admin listener: refused a connection from %s with 503: %d open, each with a request in progress "
            "(admin_max_connections is %d; %d refused so far)",
            _peer(client),
            open_now,
            self.max_connections,
        )


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "a local socket"


class AdminProtocol(BoundedHeadProtocol):
    """The admin listener's HTTP protocol: the relay's bounds, and a full listener makes room (see the module)."""

    limits: AdminLimits
    _opened_at = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Past the cap, close the connection waiting longest first; then take this one as the relay would."""
        self._opened_at = time.perf_counter()
        if len(self.connections) >= self.limits.max_connections:
            self._make_room()
        super().connection_made(transport)

    def _waiting(self) -> bool:
        """No request in progress: idle, or a head still arriving (no application call runs for it)."""
        if self._detached or self.transport is None or self.transport.is_closing() or self._in_body:
            return False
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def _make_room(self) -> None:
        victim: AdminProtocol | None = None
        for conn in self.connections:
            if isinstance(conn, AdminProtocol) and conn is not self and conn._waiting():
                if victim is None or conn._last_heard() < victim._last_heard():
                    victim = conn
        if victim is not None:
            self.limits.evict(victim.client)
            victim._evict()

    def _last_heard(self) -> float:
        return max(self._heard_at, self._opened_at)

    def _evict(self) -> None:
        self._detached = True
        self._disarm()
        self._unset_keepalive_if_required()
        # Out of the count now: the transport's connection_lost, which also removes it, comes a loop turn later.
        self.connections.discard(self)
        self.transport.close()
