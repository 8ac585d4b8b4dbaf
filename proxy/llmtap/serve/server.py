"""uvicorn and the event loop, as every llmtap process runs them; and the process's own name and parent.

The relay and the telemetry process each serve one listener under uvicorn (``Server``, ``uvicorn_config``),
log its lines under the listener's name (``label_uvicorn``) and run on uvloop when it is installed
(``run_loop``). A child process names itself for ``ps`` (``set_name``) and ends with its parent
(``die_with_parent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import uvicorn

from llmtap.config.types import Settings
from llmtap.listener import BoundedHeadProtocol, ClientLimits

__all__ = ["Server", "die_with_parent", "label_uvicorn", "run_loop", "set_name", "uvicorn_config"]


#: Seconds between two of the server's own looks at itself (uvicorn's: 0.1). Each look refreshes the responses'
#: ``Date`` (uvicorn does so once a second too); a stop is seen at once, not at the next look.
TICK = 1.0


class Server(uvicorn.Server):
    """A uvicorn server whose signals are handled by the caller, so two servers share one shutdown.

    ``on_started`` runs once it listens (a relay tells its supervisor so). Idle, it wakes once a second, where
    uvicorn wakes ten times: on this machine each wake of an idle process cost about 180 µs of CPU, 1.8 to 2.2 ms
    a second in each of the relay and the telemetry process (``/proc/PID/task/TID/schedstat``, 5 s idle).
    """

    on_started: Callable[[], None] | None = None
    _exit_soon: asyncio.Event | None = None

    @property
    def should_exit(self) -> bool:
        """Set (on the event loop's thread) to stop the server: its loop wakes for it at once."""
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit_soon is not None:
            self._exit_soon.set()

    async def main_loop(self) -> None:
        """uvicorn's loop, one look a second instead of ten (``TICK``), and at once when told to stop."""
        self._exit_soon = asyncio.Event()
        if self.should_exit:
            self._exit_soon.set()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            # ``on_tick`` refreshes the date on every tenth count: every look, here.
            counter = (counter + 10) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_soon.wait(), TICK)
            should_exit = await self.on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """After the app's start-up (which loads the tokenizer's 200,000-entry table), freeze what it made too."""
        await super().startup(sockets)
        gc.collect()
        gc.freeze()
        if self.on_started is not None and self.started:
            self.on_started()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when it is installed (uvicorn[standard] brings it), else on asyncio's own loop.

    uvloop's loop costs less per relayed chunk and per timer than asyncio's pure-Python one.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


#: uvicorn's own lines about the application's lifespan: said at ``debug`` only (llmtap says when it is ready).
_LIFESPAN_LINES = frozenset(
    {
        "Waiting for application startup.",
        "Application startup complete.",
        "Waiting for application shutdown.",
        "Application shutdown complete.",
    }
)


class _UvicornLabel(logging.Filter):
    """uvicorn's lines under the name of the listener they belong to (``uvicorn.relay``, ``uvicorn.admin``).

    Two kinds of process run uvicorn, each with its own listener: without the name their lines read alike.
    """

    def __init__(self, listener: str) -> None:
        super().__init__()
        self.listener = listener

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.INFO and record.getMessage() in _LIFESPAN_LINES:
            return logging.getLogger("llmtap").isEnabledFor(logging.DEBUG)
        record.name = f"uvicorn.{self.listener}"
        return True


def label_uvicorn(listener: str) -> None:
    """Name this process's uvicorn lines after ``listener`` (once per process; a second call replaces it)."""
    logger = logging.getLogger("uvicorn.error")
    for old in [f for f in logger.filters if isinstance(f, _UvicornLabel)]:
        logger.removeFilter(old)
    logger.addFilter(_UvicornLabel(listener))


def uvicorn_config(
    app: object,
    settings: Settings,
    *,
    access_log: bool = False,
    limits: ClientLimits | None = None,
    protocol: type[BoundedHeadProtocol] = BoundedHeadProtocol,
    forwarded: bool = False,
) -> uvicorn.Config:
    """uvicorn settings shared by every listener: no Server or Date header of its own (the upstream's pass through).

    A request's client address is its connection's peer (behind a load balancer, the balancer's), in everything
    the relay logs or counts, as the listener's bounds read it: uvicorn's rewrite of the scope's client and scheme
    from ``X-Forwarded-For`` and ``X-Forwarded-Proto`` (a coroutine and a search of the headers per request) runs
    only with ``forwarded``, for the admin listener, whose loopback check then sees the address a local proxy
    forwards. The relay reads neither and relays those headers as sent.

    A request head is bounded by ``max_header_bytes``, and clients by ``limits`` (``BoundedHeadProtocol``;
    by default the settings' own, counted where nobody reads them); on SIGTERM, requests in flight get
    ``timeouts.drain`` seconds (whole seconds, rounded up) before uvicorn cancels them. WebSocket support is
    off whatever is installed: an Upgrade request reaches the application as plain HTTP, and the relay
    answers it (``llmtap.relay.guard``).
    """
    http = functools.partial(protocol, limits=limits or ClientLimits.from_settings(settings))
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level=settings.log_level,
        # llmtap's own logging (one format, the listener's name: ``label_uvicorn``), not uvicorn's dictConfig.
        log_config=None,
        access_log=access_log,
        server_header=False,
        date_header=False,
        lifespan="on",
        http=http,  # type: ignore[arg-type]
        ws="none",
        proxy_headers=forwarded,
        timeout_keep_alive=settings.timeouts.keep_alive,  # type: ignore[arg-type]
        timeout_graceful_shutdown=math.ceil(settings.timeouts.drain),
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )


def set_name(name: str) -> None:
    """Name this process for ``ps`` and ``/proc/PID/comm`` (Linux ``PR_SET_NAME``); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the parent dies, however it dies (``PR_SET_PDEATHSIG``)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
