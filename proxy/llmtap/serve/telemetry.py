"""The telemetry processes: started with their sockets, watched, started again when one dies; and their entry.

``TelemetryProcess`` binds the admin listener and the channels' Unix sockets, starts each process
(``start``: the ``Launch`` goes down on stdin, the process says ``ready`` or why not on a pipe) and restarts
any that died, on the same sockets. ``main`` is the child's entry point: it names the process, ends it with
its parent, and serves the admin listener under uvicorn while ``llmtap.telemetry.process`` takes the tapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys

from llmtap import logs
from llmtap.config.types import ConfigError, Settings
from llmtap.serve.server import Server, die_with_parent, label_uvicorn, run_loop, set_name, uvicorn_config
from llmtap.serve.sockets import ADMIN_LISTENER, bind, bind_unix, channel_paths, facts_paths
from llmtap.telemetry import process
from llmtap.telemetry.process import Launch

__all__ = ["TelemetryProcess"]

log = logging.getLogger("llmtap")

#: How long ``llmtap serve`` waits for the telemetry process to start (it loads the tokenizer first).
START_WAIT = 60.0
#: The process name ``ps`` and ``/proc/PID/comm`` show (Linux keeps 15 bytes of it).
NAME = "llmtap-telemetry"


class TelemetryProcess:
    """The telemetry processes, their sockets, and their restart when one dies (the relays reconnect by themselves).

    Process 0 serves the public admin listener; with ``settings.telemetry_workers`` above one, each other
    process serves its own on a private Unix socket, whose ``/metrics`` process 0 adds to its own.
    """

    def __init__(self, settings: Settings, channel_path: str, *, relays: int) -> None:
        self.settings = settings
        self.relays = relays
        count = settings.telemetry_workers
        self.admin_sock = bind(settings.admin_host, settings.admin_port, "admin listener", options=ADMIN_LISTENER)
        self.channel_socks = [bind_unix(path) for path in channel_paths(channel_path, count)]
        # With several processes, each request goes to one of them, and each takes the others' lessons on a
        # socket of its own (``llmtap.telemetry.fleet.siblings``).
        self.facts_paths = facts_paths(channel_path, count)
        self.facts_socks = [bind_unix(path) for path in self.facts_paths]
        self.peer_paths = tuple(f"{channel_path}.admin.{i}" for i in range(1, count))
        self.admin_socks = [self.admin_sock, *(bind_unix(path) for path in self.peer_paths)]
        self.procs = [self._start(i, wait=START_WAIT) for i in range(count)]
        self.stopping = False

    def _start(self, index: int, *, wait: float | None = None) -> subprocess.Popen[bytes]:
        return start(
            self.settings,
            self.channel_socks[index],
            self.admin_socks[index],
            self.relays,
            wait=wait,
            index=index,
            peers=self.peer_paths if index == 0 else (),
            facts=self.facts_socks[index] if self.facts_socks else None,
            siblings=self.facts_paths,
        )

    @property
    def admin_port(self) -> int:
        """The admin listener's port (resolved when 0 was asked for)."""
        return int(self.admin_sock.getsockname()[1])

    async def watch(self) -> None:
        """Twice a second, start again any telemetry process that died."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            self.restart_dead()

    def restart_dead(self) -> None:
        """Start again, on the same sockets, each telemetry process that died; relays drop (and count) meanwhile."""
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and not self.stopping:
                log.warning("telemetry process %d exited with code %s; starting it again", i, code)
                self.procs[i] = self._start(i)

    def __enter__(self) -> TelemetryProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """After the relays closed their channels: SIGTERM, then wait for the flush (bounded)."""
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(self.settings.timeouts.flush + 10)
            except subprocess.TimeoutExpired:
                log.warning("a telemetry process did not exit in time; killed")
                proc.kill()
                proc.wait()
        for sock in (*self.channel_socks, *self.admin_socks, *self.facts_socks):
            sock.close()


def start(
    settings: Settings,
    channel: socket.socket,
    admin: socket.socket,
    relays: int,
    *,
    wait: float | None = None,
    index: int = 0,
    peers: tuple[str, ...] = (),
    facts: socket.socket | None = None,
    siblings: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start a telemetry process with the two listening sockets (which stay open here too, for a restart).

    With ``wait``, block until it says it started: a setting only it can check (the record file) fails
    here as a ``ConfigError``, before any relay takes a request.
    """
    argv = [sys.executable, "-c", "from llmtap.serve.telemetry import main; main()"]
    read_end, write_end = os.pipe()
    facts_fd = facts.fileno() if facts is not None else -1
    fds = (channel.fileno(), admin.fileno(), write_end, *((facts_fd,) if facts is not None else ()))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=fds)
    finally:
        os.close(write_end)
    assert proc.stdin is not None
    launch = Launch(settings, fds[0], fds[1], relays, write_end, index, peers, facts_fd, siblings)
    pickle.dump(launch, proc.stdin)
    proc.stdin.close()
    with os.fdopen(read_end, "rb") as said:
        if wait is None:
            return proc
        ready, _, _ = select.select([said], [], [], wait)
        line = said.readline().decode(errors="replace").strip() if ready else ""
    if line == "ready":
        return proc
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()
    if line.startswith("error: "):
        raise ConfigError(line.removeprefix("error: "))
    raise ConfigError(f"the telemetry process did not start (exit code {proc.returncode})")


def main() -> None:
    """The telemetry process's entry point: read its ``Launch`` from stdin, serve until SIGTERM."""
    launch: Launch = pickle.load(sys.stdin.buffer)
    set_name(NAME)
    die_with_parent()
    logs.setup(launch.settings.log_level)
    process.prepare(launch)
    run_loop(serve(launch))
    # Everything is written and closed by now: the records, the journal, the loss counters, the exporters flushed
    # within their bound. What the interpreter's own teardown would add (a large heap freed object by object on a
    # busy core, an exporter's threads still retrying a dead collector) is time past that bound and nothing else.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def serve(launch: Launch) -> None:
    """Take the relays' tapes and serve the admin listener until SIGTERM; then drain and flush."""
    from llmtap.telemetry.admin.connections import AdminProtocol

    async with process.running(launch) as running:
        label_uvicorn("admin" if launch.index == 0 else f"admin.{launch.index}")
        config = uvicorn_config(
            running.admin, launch.settings, limits=running.limits, protocol=AdminProtocol, forwarded=True
        )
        server = Server(config)

        def stop() -> None:
            running.admin.live.close()  # an open browser tab's event stream must not hold shutdown
            server.should_exit = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        # Said once, beside the start and never delaying it: an upstream that takes no connection now.
        checked = asyncio.create_task(running.admin.reach.warn()) if launch.index == 0 else None
        try:
            await server.serve(sockets=[running.admin_sock])
        finally:
            if checked is not None:
                checked.cancel()
