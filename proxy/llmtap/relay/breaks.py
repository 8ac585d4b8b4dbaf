"""The log line of a stream the upstream broke off after its headers.

The client sees its response end without a clean end and the span says ``upstream_closed`` or ``idle_timeout``;
the operator reading the proxy's log sees one line: which route and upstream, how many bytes had been relayed
and how long the request had run. Only a failure comes here, never a chunk. A route's lines are at most one per
``every`` seconds, each saying how many breaks the ones left out stood for, so an upstream that fails every
stream cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from llmtap.listener import LOG_EVERY
from llmtap.wire.tape import Tape, now

__all__ = ["StreamBreaks"]

log = logging.getLogger("llmtap.proxy")


class StreamBreaks:
    """Counts broken streams per route and logs them, each route at most once per ``every`` seconds."""

    def __init__(self, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        #: Per route: when its last line was logged, and the breaks since then that no line said.
        self._logged_at: dict[str, float] = {}
        self._unsaid: dict[str, int] = {}
        #: Every break seen, per route (the routes are the configuration's: a bounded set).
        self.count: dict[str, int] = {}

    def broke(self, route: str, upstream: str, tape: Tape, why: str) -> None:
        """The upstream of ``route`` ended ``tape``'s stream early, for the reason ``why``."""
        self.count[route] = self.count.get(route, 0) + 1
        clock = self.clock()
        last = self._logged_at.get(route)
        if last is not None and clock - last < self.every:
            self._unsaid[route] = self._unsaid.get(route, 0) + 1
            return
        self._logged_at[route] = clock
        unsaid = self._unsaid.pop(route, 0)
        more = f" ({unsaid} more on this route since its last such line)" if unsaid else ""
        log.warning(
            "upstream %s broke off a stream of route %s after %d bytes relayed, %.3f s into the request: %s%s",
            upstream,
            route,
            tape.response_bytes,
            now() - tape.received,
            why,
            more,
        )
