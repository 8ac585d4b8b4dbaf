"""Running the proxy: a telemetry process, and one relay (this process) or several (``--workers``).

``run`` binds every listener first (so a taken port fails at once, with its address), starts the
telemetry process (``llmtap.telemetry.process``) with the admin listener and the channel's socket, then
relays in this process, on uvloop when installed; with ``workers`` above one a supervisor
(``llmtap.relay.workers``) runs the relays as processes sharing the proxy port. On SIGTERM the relays drain
their streams and hand over their last tapes; then the telemetry process records them and flushes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import ipaddress
import logging
import math
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import uvicorn

from llmtap import __version__
from llmtap.config.options import binary
from llmtap.config.types import ConfigError, Settings, TelemetrySettings
from llmtap.relay.app import create_app
from llmtap.relay.channel import ShardedChannel, SocketChannel
from llmtap.relay.protocol import BoundedHeadProtocol, ClientLimits
from llmtap.telemetry import process

log = logging.getLogger("llmtap")

#: How long ``llmtap serve`` waits for the telemetry process to start (it loads the tokenizer first).
START_WAIT = 60.0
#: The relay's process name for ``ps`` and ``/proc/PID/comm``.
RELAY_NAME = "llmtap-relay"


class _QuietTruncation(logging.Filter):
    """The relay drops a client connection on purpose when the upstream broke mid-stream; it logs that itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing response" not in record.getMessage()


class _Server(uvicorn.Server):
    """A uvicorn server whose signals are handled by the caller, so two servers share one shutdown.

    ``on_started`` runs once it listens (a relay tells its supervisor so).
    """

    on_started: Callable[[], None] | None = None

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
    """``llmtap serve``: the telemetry process, and one relay here or a supervisor of ``workers`` relays."""
    # A Unix socket's path holds at most 107 bytes: under a deep TMPDIR, fall back to /tmp.
    base = None if len(tempfile.gettempdir()) <= 68 else "/tmp"
    with tempfile.TemporaryDirectory(prefix="llmtap-", dir=base) as folder:
        os.chmod(folder, 0o700)
        channel_path = os.path.join(folder, "telemetry.sock")
        if settings.workers > 1:
            from llmtap.relay.workers import supervise

            supervise(settings, channel_path)
            return
        proxy_sock = bind(settings.host, settings.port, "proxy listener")
        with Telemetry(settings, channel_path, relays=1) as telemetry:
            run_loop(serve(settings, proxy_sock, channel_path, telemetry=telemetry))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _otlp(t: TelemetrySettings, signal: str) -> str:
    """Where one signal goes: ``OTLP grpc to URL``, ``the console`` or ``off``."""
    exporter = getattr(t, f"{signal}_exporter")
    if exporter == "console":
        return "the console"
    if exporter != "otlp":
        return "off"
    endpoint, protocol = getattr(t, f"{signal}_endpoint"), getattr(t, f"{signal}_protocol")
    if protocol == "http/protobuf" and not getattr(t, f"{signal}_endpoint_specific"):
        endpoint = f"{endpoint}/v1/{signal}"  # where the exporter posts, as the OTLP spec joins a base endpoint
    return f"OTLP {protocol} to {endpoint}"


def startup_lines(settings: Settings, port: int, admin_port: int) -> list[str]:
    """What ``llmtap serve`` says once it listens: where the proxy, admin listener and live view are, where
    each route goes, where telemetry goes, and where records and the access log are written."""
    admin = _url(settings.admin_host, admin_port)
    relays = "1 relay process" if settings.workers == 1 else f"{settings.workers} relay processes"
    lines = [f"llmtap {__version__}: proxy on {_url(settings.host, port)} ({relays})"]
    scrape = "/metrics, " if settings.telemetry.prometheus else ""
    guard = ""
    if settings.admin.loopback_token or not _is_loopback(settings.admin_host):
        guard = (
            "; /v1/traces and /events ask the admin token"
            if settings.admin.token
            else "; /v1/traces and /events refuse peers beyond loopback (no admin token)"
        )
    lines.append(f"admin on {admin}: {scrape}/healthz, /readyz; live view {admin}/{guard}")
    for r in sorted(settings.routes, key=lambda r: r.prefix):
        provider = r.provider or "provider from the API it speaks"
        insecure = ", TLS not verified" if r.upstream.startswith("https://") and not r.tls_verify else ""
        lines.append(f"route {r.prefix} -> {r.upstream} ({provider}{insecure})")
    t = settings.telemetry
    traces, metrics = _otlp(t, "traces"), _otlp(t, "metrics")
    if traces == metrics == "off":
        why = "OTEL_SDK_DISABLED is set" if t.sdk_disabled else "set OTEL_EXPORTER_OTLP_ENDPOINT"
        lines.append(f"telemetry: OTLP off: {why}" + (f"; Prometheus can scrape {admin}/metrics" if scrape else ""))
    elif traces == metrics:
        lines.append(f"telemetry: traces and metrics to {traces}")
    else:
        lines.append(f"telemetry: traces to {traces}; metrics to {metrics}")
    rec = settings.record
    records = (
        f"records: {rec.path}/ (a new file past {binary(rec.max_bytes)} or {rec.rotate_s / 60:g} min, "
        f"{binary(rec.keep_bytes)} and {rec.keep_s / 3600:g} h kept)"
        if rec.path
        else "records: off (--record DIR)"
    )
    if rec.logs:
        records += ", as OTLP log records too"
    if rec.clickhouse is not None:
        # The URL as the sink uses it: any password it carried is left out.
        from llmtap.store.clickhouse import Server

        records += f"; ClickHouse {Server.parse(rec.clickhouse.url).url} table {rec.clickhouse.table}"
    where = "stderr" if settings.access_log == "-" else settings.access_log
    access = f"access log: {where}" if where else "access log: off (--access-log PATH, - for stderr)"
    lines.append(f"{records}; {access}")
    return lines


def channel_paths(base: str, count: int) -> list[str]:
    """The channel sockets of ``count`` telemetry processes: ``base`` itself for one."""
    return [base] if count == 1 else [f"{base}.{i}" for i in range(count)]


class Telemetry:
    """The telemetry processes, their sockets, and their restart when one dies (the relays reconnect by themselves).

    Process 0 serves the public admin listener; with ``settings.telemetry_workers`` above one, each other
    process serves its own on a private Unix socket, whose ``/metrics`` process 0 adds to its own.
    """

    def __init__(self, settings: Settings, channel_path: str, *, relays: int) -> None:
        self.settings = settings
        self.relays = relays
        count = settings.telemetry_workers
        self.admin_sock = bind(settings.admin_host, settings.admin_port, "admin listener")
        self.channel_socks = [bind_unix(path) for path in channel_paths(channel_path, count)]
        self.peer_paths = tuple(f"{channel_path}.admin.{i}" for i in range(1, count))
        self.admin_socks = [self.admin_sock, *(bind_unix(path) for path in self.peer_paths)]
        self.procs = [self._start(i, wait=START_WAIT) for i in range(count)]
        self.stopping = False

    def _start(self, index: int, *, wait: float | None = None) -> subprocess.Popen[bytes]:
        return process.start(
            self.settings,
            self.channel_socks[index],
            self.admin_socks[index],
            self.relays,
            wait=wait,
            index=index,
            peers=self.peer_paths if index == 0 else (),
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

    def __enter__(self) -> Telemetry:
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
        for sock in (*self.channel_socks, *self.admin_socks):
            sock.close()


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
) -> uvicorn.Config:
    """uvicorn settings shared by every listener: no Server or Date header of its own (the upstream's pass through).

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
        timeout_keep_alive=settings.timeouts.keep_alive,  # type: ignore[arg-type]
        timeout_graceful_shutdown=math.ceil(settings.timeouts.drain),
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )


async def serve(
    settings: Settings,
    proxy_sock: socket.socket,
    channel_path: str,
    *,
    telemetry: Telemetry | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Relay on ``proxy_sock`` until SIGINT or SIGTERM, sending tapes to the telemetry process at ``channel_path``.

    ``telemetry``: the telemetry process this relay watches (one relay); None when a supervisor does.
    ``on_started``: called once the relay listens.
    """
    process.set_name(RELAY_NAME)
    paths = channel_paths(channel_path, settings.telemetry_workers)
    channel: SocketChannel | ShardedChannel = (
        SocketChannel(paths[0]) if len(paths) == 1 else ShardedChannel([SocketChannel(p) for p in paths])
    )
    await channel.start()
    app = create_app(settings, channel=channel)
    limits = ClientLimits.from_settings(settings)
    app.connections = limits
    logging.getLogger("uvicorn.error").addFilter(_QuietTruncation())
    label_uvicorn("relay")  # with --workers, each relay's lines begin with its process id
    # Objects made at start-up live for the whole run: freeze them so the cyclic collector never
    # scans them again, keeping its pauses (and so added chunk gaps) short.
    gc.collect()
    gc.freeze()
    server = _Server(uvicorn_config(app, settings, limits=limits))
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
