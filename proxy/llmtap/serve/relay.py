"""The relay process: its channel to the telemetry processes, its app, and uvicorn serving the proxy port.

In ``llmtap serve`` the relay runs in the parent process (one relay), or in each of ``--workers`` child
processes (``main``, started by ``llmtap.serve.workers``). On SIGTERM it drains its streams and hands over
its last tapes before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmtap import logs
from llmtap.config.types import Settings
from llmtap.listener import ClientLimits
from llmtap.relay.app import create_app
from llmtap.relay.channel import ShardedChannel, SocketChannel
from llmtap.relay.shared import Table, table_columns
from llmtap.serve.heap import fix_mmap_threshold
from llmtap.serve.lines import startup_lines
from llmtap.serve.server import Server, die_with_parent, label_uvicorn, run_loop, set_name, uvicorn_config
from llmtap.serve.sockets import PROXY_LISTENER, bind, channel_paths
from llmtap.wire.ledger import Ledger

if TYPE_CHECKING:
    from llmtap.serve.telemetry import TelemetryProcess

__all__ = ["serve", "tape_gather"]

log = logging.getLogger("llmtap")

#: The relay's process name for ``ps`` and ``/proc/PID/comm``.
RELAY_NAME = "llmtap-relay"


class _QuietTruncation(logging.Filter):
    """The relay drops a client connection on purpose when the upstream broke mid-stream; it logs that itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing response" not in record.getMessage()


def main() -> None:
    """A relay process of ``--workers``: read (settings, channel path, started pipe, the relays' shared table and this
    relay's row in it) from stdin, relay until SIGTERM."""
    settings, channel_path, started_fd, table_fd, index = pickle.load(sys.stdin.buffer)
    die_with_parent()
    logs.setup(settings.log_level, pid=True)
    shared = Table.attach(table_columns(settings), table_fd, index)
    proxy_sock = bind(settings.host, settings.port, "proxy listener", reuse_port=True, options=PROXY_LISTENER)
    run_loop(serve(settings, proxy_sock, channel_path, shared=shared, on_started=lambda: _say_started(started_fd)))


def _say_started(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, b"ready\n")
        os.close(fd)


def open_ledger(settings: Settings, relay_id: int, shards: int) -> Ledger | None:
    """This relay's ledger in the record journal's folder (``llmtap.wire.ledger``), when records are journaled."""
    if not settings.record.journal or not settings.record.on:
        return None
    try:
        return Ledger(settings.record.journal, relay_id, shards)
    except OSError as exc:
        log.warning(
            "relay: no ledger in %s (%s): a kill of the whole tree will not say what it took",
            settings.record.journal,
            exc.strerror or exc,
        )
        return None


def tape_gather(settings: Settings) -> float:
    """Seconds a relay gathers its tapes before writing them (``telemetry_gather``); 0 with several relays.

    The slot replay (``llmtap.analysis.estimator``) needs the ends of every relay's requests before a request's own
    tape: two relays' gathers would put up to a gather between them.
    """
    return settings.telemetry_gather / 1000 if settings.workers == 1 else 0.0


async def serve(
    settings: Settings,
    proxy_sock: socket.socket,
    channel_path: str,
    *,
    telemetry: TelemetryProcess | None = None,
    shared: Table | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Relay on ``proxy_sock`` until SIGINT or SIGTERM, sending tapes to the telemetry process at ``channel_path``.

    ``telemetry``: the telemetry process this relay watches (one relay); None when a supervisor does.
    ``shared``: this relay's row of the table the relays share (``--workers``; ``llmtap.relay.shared``); None: its own.
    ``on_started``: called once the relay listens.
    """
    set_name(RELAY_NAME)
    fix_mmap_threshold()  # each upstream TLS connection's read buffer a mapping of its own (llmtap.serve.heap)
    paths = channel_paths(channel_path, settings.telemetry_workers)
    channels = [SocketChannel(path, gather=tape_gather(settings)) for path in paths]
    channel: SocketChannel | ShardedChannel = channels[0] if len(channels) == 1 else ShardedChannel(channels)
    await channel.start()
    app = create_app(settings, channel=channel, shared=shared)
    app.ledger = open_ledger(settings, app.relay_id, channel.shards)
    limits = ClientLimits.from_settings(settings)
    app.connections = limits
    logging.getLogger("uvicorn.error").addFilter(_QuietTruncation())
    label_uvicorn("relay")  # with --workers, each relay's lines begin with its process id
    # Objects made at start-up live for the whole run: freeze them so the cyclic collector never
    # scans them again, keeping its pauses (and so added chunk gaps) short.
    gc.collect()
    gc.freeze()
    server = Server(uvicorn_config(app, settings, limits=limits))
    server.on_started = on_started
    loop = asyncio.get_running_loop()

    def stop() -> None:
        app.begin_drain()
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    watcher = asyncio.create_task(telemetry.watch()) if telemetry is not None else None
    if telemetry is not None:
        for line in startup_lines(settings, proxy_sock.getsockname()[1], telemetry.admin_port):
            log.info("%s", line)
    try:
        await server.serve(sockets=[proxy_sock])
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if app.ledger is not None:
            app.ledger.close()
