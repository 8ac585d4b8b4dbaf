"""Running the proxy: bind both listeners, serve them with uvicorn in one event loop, stop cleanly.

``run`` is the entry point: one process on uvloop (when installed), or with ``workers`` above one a
supervisor (``proxy.workers``) whose worker processes each run ``serve`` on a port they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any

import uvicorn

from proxy.app import AdminApp, create_app
from proxy.protocol import BoundedHeadProtocol
from proxy.settings import ConfigError, Settings
from proxy.telemetry import setup

log = logging.getLogger("llmtap")

#: Seconds a thread may hold the GIL while another waits for it (Python's default is 0.005).
SWITCH_INTERVAL = 0.001


class _QuietTruncation(logging.Filter):
    """The relay drops a client connection on purpose when the upstream broke mid-stream; it logs that itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing response" not in record.getMessage()


class _Server(uvicorn.Server):
    """A uvicorn server whose signals are handled by the caller, so two servers share one shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """After the app's start-up (which loads the tokenizer's 200,000-entry table), freeze what it made too."""
        await super().startup(sockets)
        gc.collect()
        gc.freeze()


def bind(host: str, port: int, what: str, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A listening socket, or ``ConfigError`` naming the address when it is taken.

    ``reuse_port``: several processes bind the same port and the kernel spreads new connections over
    them (SO_REUSEPORT; only sockets of the same user can join).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then; without it Nagle
    # can hold a small SSE write until the client's delayed ACK, up to 40 ms later.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{what} {host}:{port}: {exc.strerror or exc}") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (a worker's private admin endpoint), readable by its owner only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


@dataclass(frozen=True, slots=True)
class Worker:
    """What makes a process one of several workers: its number and its private admin socket."""

    index: int
    admin_path: str


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


def run(settings: Settings) -> None:
    """``llmtap serve``: one process, or a supervisor of ``settings.workers`` worker processes."""
    if settings.workers > 1:
        from proxy.workers import supervise

        supervise(settings)
    else:
        run_loop(serve(settings))


def uvicorn_config(app: object, settings: Settings, *, access_log: bool = False) -> uvicorn.Config:
    """uvicorn settings shared by every listener: no Server or Date header of its own (the upstream's pass through).

    A request head is bounded by ``max_header_bytes`` (``BoundedHeadProtocol``); on SIGTERM, requests in
    flight get ``timeouts.drain`` seconds (whole seconds, rounded up) before uvicorn cancels them.
    """
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level=settings.log_level,
        access_log=access_log,
        server_header=False,
        date_header=False,
        lifespan="on",
        http=BoundedHeadProtocol,
        timeout_graceful_shutdown=math.ceil(settings.timeouts.drain),
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )


async def serve(settings: Settings, *, worker: Worker | None = None) -> None:
    """Serve the proxy and the admin listener until SIGINT or SIGTERM.

    As a ``worker``, the proxy port is shared with the other workers and the admin listener is the
    worker's private Unix socket, which the supervisor reads and merges.
    """
    if worker is None:
        proxy_sock = bind(settings.host, settings.port, "proxy listener")
        admin_sock = bind(settings.admin_host, settings.admin_port, "admin listener")
    else:
        proxy_sock = bind(settings.host, settings.port, "proxy listener", reuse_port=True)
        admin_sock = bind_unix(worker.admin_path)
    # The recorder and exporter threads share the GIL with the event loop: holding it for the default
    # 5 ms at a time delays relayed chunks by as much; 1 ms bounds that (bench/RESULTS.md, the steps).
    sys.setswitchinterval(SWITCH_INTERVAL)
    providers = setup.build(settings.telemetry)
    app = create_app(settings, tracer_provider=providers.tracer_provider, meter_provider=providers.meter_provider)
    providers.give_way_to(app.recorder.gate.give_way)
    admin = AdminApp(app, providers.prometheus)
    logging.getLogger("uvicorn.error").addFilter(_QuietTruncation())
    # Objects made at start-up live for the whole run: freeze them so the cyclic collector never
    # scans them again, keeping its pauses (and so added chunk gaps) short.
    gc.collect()
    gc.freeze()
    servers = [_Server(uvicorn_config(app, settings)), _Server(uvicorn_config(admin, settings))]
    loop = asyncio.get_running_loop()

    def stop() -> None:
        app.begin_drain()
        admin.live.close()  # an open browser tab's event stream must not hold shutdown
        for server in servers:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    if worker is None:
        routes = ", ".join(f"{r.prefix} -> {r.upstream}" for r in settings.routes)
        log.info(
            "llmtap proxy on http://%s:%d (%s); admin on http://%s:%d",
            settings.host,
            proxy_sock.getsockname()[1],
            routes,
            settings.admin_host,
            admin_sock.getsockname()[1],
        )
    try:
        await asyncio.gather(servers[0].serve(sockets=[proxy_sock]), servers[1].serve(sockets=[admin_sock]))
    finally:
        # Bounded: a dead or slow collector delays the exit by at most this long.
        await asyncio.to_thread(providers.shutdown, settings.timeouts.flush)
