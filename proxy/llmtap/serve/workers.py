"""``llmtap serve --workers N``: N relay processes share the proxy port and feed one telemetry process.

Python runs one event loop per core at best, so past one core the relay scales out in processes:

* the supervisor (this module, in the ``llmtap`` process) reserves the proxy port with SO_REUSEPORT
  (bound, never listening: it takes no connections, but the port stays ours while relays restart),
  starts the telemetry process (``llmtap.serve.telemetry.TelemetryProcess``: the admin listener, OTLP export)
  and the relays, and restarts any that dies;
* each relay is ``llmtap.serve.relay.serve``: it binds the same port with SO_REUSEPORT, so the kernel spreads
  new connections over the relays, and sends its tapes to the telemetry process over its own channel.
  All requests are recorded in one place, so ``/metrics`` and the live view see the whole server.

A relay that dies is started again; one that dies before it said it listens stops the whole server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import select
import signal
import subprocess
import sys

from llmtap.config.types import ConfigError, Settings
from llmtap.deadline import Deadline
from llmtap.relay.shared import Table, table_columns
from llmtap.serve.lines import startup_lines
from llmtap.serve.server import run_loop
from llmtap.serve.sockets import PROXY_LISTENER, bind
from llmtap.serve.telemetry import TelemetryProcess

__all__ = ["supervise"]

log = logging.getLogger("llmtap")


class _Proc:
    """One relay process and when it started."""

    def __init__(self, settings: Settings, index: int, channel_path: str, table_fd: int) -> None:
        self.index = index
        self.ready = False
        argv = [sys.executable, "-c", "from llmtap.serve.relay import main; main()"]
        self._said, write_end = os.pipe()
        try:
            self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=(write_end, table_fd))
        finally:
            os.close(write_end)
        assert self.popen.stdin is not None
        pickle.dump((settings, channel_path, write_end, table_fd, index), self.popen.stdin)
        self.popen.stdin.close()

    def check_started(self) -> bool:
        """True once the relay said it listens (read without waiting)."""
        if not self.ready and self._said >= 0:
            readable, _, _ = select.select([self._said], [], [], 0)
            if readable:
                self.ready = os.read(self._said, 16).startswith(b"ready")
                os.close(self._said)
                self._said = -1
        return self.ready


class Supervisor:
    """Starts the relays, restarts those that die, and stops them all on SIGINT or SIGTERM."""

    def __init__(self, settings: Settings, channel_path: str) -> None:
        self.settings = settings
        self.channel_path = channel_path
        # The table the relays share, a row each (``llmtap.relay.shared``): requests in flight to each upstream (the
        # estimator's slot replay counts every relay's), each admission line's counts (its limit is the server's).
        self.table_fd = Table.create(table_columns(settings), settings.workers)
        self.procs = [self._start(i) for i in range(settings.workers)]
        self.stopping = False
        self.failure: str | None = None
        self.stopped = asyncio.Event()

    async def watch(self, telemetry: TelemetryProcess) -> None:
        """Twice a second: restart the dead, give up on a relay that cannot start."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            if not self.stopping:
                telemetry.restart_dead()
            for i, proc in enumerate(self.procs):
                started = proc.check_started()
                code = proc.popen.poll()
                if code is None or self.stopping:
                    continue
                if not started:
                    self.failure = f"relay {i} exited with code {code} while starting"
                    self.stop()
                    return
                log.warning("relay %d exited with code %s; starting it again", i, code)
                self.procs[i] = self._start(i)

    def _start(self, index: int) -> _Proc:
        # A relay that died leaves its counts in its row: cleared now, not once its successor has started, so the
        # other relays do not wait that long for slots the dead one held (the successor clears it again).
        Table.attach(table_columns(self.settings), self.table_fd, index)
        return _Proc(self.settings, index, self.channel_path, self.table_fd)

    def stop(self) -> None:
        """SIGTERM every relay (each drains its streams and hands over its tapes)."""
        self.stopping = True
        self.stopped.set()
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)

    def join(self, timeout: float) -> None:
        """Wait for the relays; kill what is left after ``timeout``."""
        deadline = Deadline(timeout)
        for proc in self.procs:
            try:
                proc.popen.wait(max(deadline.left(), 0.1))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        os.close(self.table_fd)


def supervise(settings: Settings, channel_path: str) -> None:
    """Run the telemetry process and ``settings.workers`` relays until SIGINT or SIGTERM."""
    # Reserve the port (and resolve port 0) before any relay binds it; a taken port fails here, once.
    reservation = bind(
        settings.host,
        settings.port,
        "proxy listener",
        reuse_port=True,
        listen=False,
        options=PROXY_LISTENER,
        alone=True,
    )
    port = reservation.getsockname()[1]
    shared = dataclasses.replace(settings, port=port)
    try:
        with TelemetryProcess(shared, channel_path, relays=settings.workers) as telemetry:
            supervisor = Supervisor(shared, channel_path)
            try:
                run_loop(_supervise(shared, supervisor, telemetry, port))
            finally:
                supervisor.stop()
                supervisor.join(settings.timeouts.drain + 10)
    finally:
        reservation.close()
    if supervisor.failure:
        raise ConfigError(supervisor.failure)


async def _supervise(settings: Settings, supervisor: Supervisor, telemetry: TelemetryProcess, port: int) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, supervisor.stop)
    for line in startup_lines(settings, port, telemetry.admin_port):
        log.info("%s", line)
    watcher = asyncio.create_task(supervisor.watch(telemetry))
    try:
        await supervisor.stopped.wait()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
