"""Whether each route's upstream takes a TCP connection: said once after start-up, and on ``/readyz?verbose``.

What readiness means: ``/readyz`` answers for llmtap itself, its relays connected and ready to relay.
An upstream that is down does not make a replica unready. Every replica shares that upstream, so every replica
would leave the Service at once: clients would meet refused connections instead of a 502 that names the upstream,
no span or metric would record the outage, and on a server of several routes one dead upstream would take the
others down with it. What is down is said instead: a warning per unreachable upstream shortly after start
(checked off the start's path, never delaying it) and a line per upstream on ``/readyz?verbose``.

A check is a TCP connect, closed at once without a byte sent: it tells that the address takes connections, not
that the server behind it answers well (TLS is not begun, and no request is made). Checks run side by side, each
bounded by ``TIMEOUT``; an answer at most ``FRESH`` seconds old is reused, so a flood of ``/readyz?verbose``
costs the upstreams at most one connection each per ``FRESH`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmtap.config.types import Route

__all__ = ["FRESH", "TIMEOUT", "Reach", "Reachability", "verbose"]

log = logging.getLogger("llmtap.telemetry")

#: Seconds a connect may take before the upstream counts as unreachable.
TIMEOUT = 2.0
#: Seconds an answer is reused for.
FRESH = 2.0


@dataclass(frozen=True, slots=True)
class Reachability:
    """One upstream address: the routes that send there, and whether it took a connection (``error`` None)."""

    upstream: str
    routes: tuple[str, ...]
    error: str | None
    #: How long the connect took, or how long until it failed.
    seconds: float


def address(url: str) -> tuple[str, int]:
    """The host and port a URL's requests connect to."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class Reach:
    """The routes' upstreams, checked on demand (one check at a time, its answer reused for ``fresh`` seconds)."""

    def __init__(
        self,
        routes: Sequence[Route],
        *,
        timeout: float = TIMEOUT,
        fresh: float = FRESH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.fresh = fresh
        self.clock = clock
        #: Each address once, with the first route's URL for it and every route that sends there.
        self._targets: dict[tuple[str, int], tuple[str, list[str]]] = {}
        for route in sorted(routes, key=lambda r: r.prefix):
            self._targets.setdefault(address(route.upstream), (route.upstream, []))[1].append(route.name)
        self._lock = asyncio.Lock()
        self._last: tuple[float, list[Reachability]] | None = None

    async def check(self) -> list[Reachability]:
        """Every upstream's state, at most ``fresh`` seconds old."""
        async with self._lock:
            if self._last is not None and self.clock() - self._last[0] < self.fresh:
                return self._last[1]
            found = await asyncio.gather(*(self._connect(where) for where in self._targets))
            self._last = (self.clock(), list(found))
            return self._last[1]

    async def _connect(self, where: tuple[str, int]) -> Reachability:
        upstream, routes = self._targets[where]
        started = time.perf_counter()
        error: str | None = None
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*where), self.timeout)
        except TimeoutError:
            error = f"no connection to {where[0]}:{where[1]} within {self.timeout:g} s"
        except socket.gaierror as exc:  # a name that does not resolve
            error = f"{where[0]}: {exc.strerror or exc}"
        except OSError as exc:  # refused, unreachable: the system's words (asyncio's own hide them on some loops)
            error = f"{where[0]}:{where[1]}: {os.strerror(exc.errno) if exc.errno else exc}"
        else:
            writer.transport.abort()
        return Reachability(upstream, tuple(routes), error, time.perf_counter() - started)

    async def warn(self) -> None:
        """Log each upstream that takes no connection now (once, after start-up)."""
        for found in await self.check():
            if found.error is not None:
                log.warning(
                    "upstream %s (route %s) cannot be reached: %s. llmtap serves anyway: its requests get 502 or 504 "
                    "naming it until it can; /readyz?verbose on the admin listener says when it can",
                    found.upstream,
                    ", ".join(found.routes),
                    found.error,
                )


def verbose(ready: bool, detail: str, found: Sequence[Reachability]) -> str:
    """``/readyz?verbose``: a line per check in the Kubernetes form (``[+]name ok``), then the verdict.

    Only the relays' line decides it; the upstreams' lines say what llmtap can reach, not whether it is ready.
    """
    own = "ok" if ready else "not ready"
    lines = [f"[{'+' if ready else '-'}]relays {own}" + (f" ({detail})" if detail else "")]
    for r in found:
        state = f"reachable ({r.seconds * 1000:.1f} ms)" if r.error is None else f"unreachable: {r.error}"
        mark = "+" if r.error is None else "-"
        lines.append(f"[{mark}]upstream {r.upstream} (route {', '.join(r.routes)}) {state}")
    if any(r.error is not None for r in found):
        lines.append("an unreachable upstream does not make llmtap unready: its requests get 502 or 504 naming it")
    lines.append("readyz check passed" if ready else "readyz check failed")
    return "\n".join(lines) + "\n"
