"""``llmtap serve --workers N``: N worker processes share the proxy port; one admin listener merges their metrics.

Python runs one event loop per core at best, so past one core llmtap scales out in processes:

* the supervisor (this module, in the ``llmtap`` process) reserves the proxy port with SO_REUSEPORT
  (bound, never listening: it takes no connections, but the port stays ours while workers restart),
  binds the public admin listener, and starts the workers;
* each worker is a full proxy (``proxy.server.serve``) with its own telemetry: it binds the same port
  with SO_REUSEPORT, so the kernel spreads new connections over the workers, and serves its own admin
  app on a private Unix socket. Its OTLP resource gets a ``service.instance.id`` of its own, so a backend
  never folds two workers' cumulative series into one;
* ``/metrics`` on the public listener asks every worker for its exposition and adds them up, series by
  series. Every llmtap metric is additive (counters, up-down counters, histogram buckets, sums and
  counts), so the sum is what one process would have counted: nothing twice, nothing missing.
  ``/readyz`` is ready when every worker is; the live view is worker 0's (it sees 1/N of the traffic).

A worker that dies is started again; one that dies before it was ever ready stops the whole server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx

from proxy.server import Worker, _Server, bind, run_loop, serve, uvicorn_config
from proxy.settings import ConfigError, Settings
from proxy.telemetry.prometheus import CONTENT_TYPE
from proxy.types import Receive, Scope, Send

log = logging.getLogger("llmtap")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: A worker that exits this soon after its start, never ready, is taken for a start-up failure.
START_GRACE = 30.0


# -- merging expositions ------------------------------------------------------------------------


def _value(text: str) -> float:
    return float(text.replace("+Inf", "inf").replace("-Inf", "-inf"))


def _render(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def merge_metrics(texts: Sequence[str]) -> str:
    """One Prometheus exposition from several: the same series (name and labels) summed, families kept whole.

    Samples belong to the family of the ``# TYPE`` line above them; a series only some workers have is
    added at the end of its family, so a histogram's buckets, sum and count stay together.
    """
    families: dict[str, tuple[list[str], dict[str, float]]] = {}
    for text in texts:
        samples: dict[str, float] | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split(" ", 3)[2]
                meta, samples = families.setdefault(name, ([], {}))
                if not any(m.startswith(line[:7]) for m in meta):
                    meta.append(line)
                continue
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if samples is None:
                samples = families.setdefault(key.split("{", 1)[0], ([], {}))[1]
            samples[key] = samples.get(key, 0.0) + _value(value)
    out: list[str] = []
    for meta, samples in families.values():
        out += sorted(meta, key=lambda m: m.startswith("# TYPE"))
        out += [f"{key} {_render(value)}" for key, value in samples.items()]
    return "\n".join(out) + "\n" if out else "# no metrics\n"


# -- the supervisor's admin listener --------------------------------------------------------------


class MergedAdmin:
    """The public admin listener of a multi-worker server: ``/metrics`` merged, ``/readyz`` of all workers."""

    def __init__(self, sockets: Sequence[str]) -> None:
        self.clients = [
            httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://worker", timeout=10.0)
            for path in sockets
        ]

    async def get(self, client: httpx.AsyncClient, path: str) -> httpx.Response | None:
        """A worker's answer, or None when it does not answer."""
        try:
            return await client.get(path)
        except httpx.HTTPError:
            return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].replace("lifespan.", "")
                if kind == "shutdown":
                    for client in self.clients:
                        await client.aclose()
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            answers = await asyncio.gather(*(self.get(c, "/metrics") for c in self.clients))
            texts = [a.text for a in answers if a is not None and a.status_code == 200]
            await _plain(send, 200, merge_metrics(texts).encode(), CONTENT_TYPE)
        elif path == "/healthz":
            await _plain(send, 200, b"ok\n")
        elif path == "/readyz":
            answers = await asyncio.gather(*(self.get(c, "/readyz") for c in self.clients))
            ready = sum(1 for a in answers if a is not None and a.status_code == 200)
            body = f"{'ready' if ready == len(answers) else 'not ready'} ({ready}/{len(answers)} workers)\n"
            await _plain(send, 200 if ready == len(answers) else 503, body.encode())
        else:
            await self._forward(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Anything else (the live view and its event stream) is worker 0's, relayed as it streams."""
        query = scope.get("query_string", b"").decode("latin-1")
        url = scope["path"] + (f"?{query}" if query else "")
        client = self.clients[0]
        try:
            request = client.build_request(scope["method"], url, timeout=httpx.Timeout(10.0, read=None))
            response = await client.send(request, stream=True)
        except httpx.HTTPError:
            await _plain(send, 503, b"worker 0 is not answering\n")
            return
        try:
            headers = [
                (k, v) for k, v in response.headers.raw if k.lower() not in (b"transfer-encoding", b"connection")
            ]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError:
            pass
        finally:
            await response.aclose()


async def _plain(send: Send, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- worker processes ---------------------------------------------------------------------------


def worker_main() -> None:
    """A worker process: read (settings, worker) from stdin and serve until SIGTERM."""
    settings, worker = pickle.load(sys.stdin.buffer)
    _die_with_parent()
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(process)d {LOG_FORMAT}")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # One OTLP identity per process: cumulative series of two workers must not look like one.
    extra = f"service.instance.id={uuid.uuid4()},llmtap.worker={worker.index}"
    attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = f"{attrs},{extra}" if attrs else extra
    run_loop(serve(settings, worker=worker))


def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the supervisor dies, however it dies (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class _Proc:
    """One worker process and when it started."""

    def __init__(self, settings: Settings, worker: Worker) -> None:
        self.worker = worker
        self.started = time.monotonic()
        self.ready = False
        argv = [sys.executable, "-c", "from proxy.workers import worker_main; worker_main()"]
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE)
        assert self.popen.stdin is not None
        pickle.dump((settings, worker), self.popen.stdin)
        self.popen.stdin.close()


class Supervisor:
    """Starts the workers, restarts those that die, and stops them all on SIGINT or SIGTERM."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        self.settings = settings
        self.procs = [_Proc(settings, Worker(i, str(folder / f"worker-{i}.sock"))) for i in range(settings.workers)]
        self.stopping = False
        self.failure: str | None = None

    async def watch(self, admin: MergedAdmin, server: _Server) -> None:
        """Every half second: note readiness, restart the dead, give up on a worker that cannot start."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for i, proc in enumerate(self.procs):
                code = proc.popen.poll()
                if code is None:
                    if not proc.ready:
                        answer = await admin.get(admin.clients[i], "/readyz")
                        proc.ready = answer is not None and answer.status_code == 200
                    continue
                if self.stopping:
                    return
                if not proc.ready and time.monotonic() - proc.started < START_GRACE:
                    self.failure = f"worker {i} exited with code {code} while starting"
                    server.should_exit = True
                    return
                log.warning("worker %d exited with code %s; starting it again", i, code)
                self.procs[i] = _Proc(self.settings, proc.worker)

    def stop(self) -> None:
        """SIGTERM every worker (each drains its streams and flushes its telemetry)."""
        self.stopping = True
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)

    def join(self, timeout: float) -> None:
        """Wait for the workers; kill what is left after ``timeout``."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()


def supervise(settings: Settings) -> None:
    """Run ``settings.workers`` workers and the merged admin listener until SIGINT or SIGTERM."""
    # Reserve the port (and resolve port 0) before any worker binds it; a taken port fails here, once.
    reservation = bind(settings.host, settings.port, "proxy listener", reuse_port=True, listen=False)
    admin_sock = bind(settings.admin_host, settings.admin_port, "admin listener")
    port = reservation.getsockname()[1]
    shared = dataclasses.replace(settings, port=port)
    # A Unix socket's path holds at most 107 bytes: under a deep TMPDIR, fall back to /tmp.
    base = None if len(tempfile.gettempdir()) <= 68 else "/tmp"
    with tempfile.TemporaryDirectory(prefix="llmtap-workers-", dir=base) as folder:
        os.chmod(folder, 0o700)
        supervisor = Supervisor(shared, Path(folder))
        try:
            run_loop(_supervise(shared, supervisor, admin_sock, port))
        finally:
            supervisor.stop()
            supervisor.join(settings.timeouts.drain + settings.timeouts.flush + 5)
            reservation.close()
    if supervisor.failure:
        raise ConfigError(supervisor.failure)


async def _supervise(settings: Settings, supervisor: Supervisor, admin_sock: socket.socket, port: int) -> None:
    admin = MergedAdmin([p.worker.admin_path for p in supervisor.procs])
    server = _Server(uvicorn_config(admin, settings))
    loop = asyncio.get_running_loop()

    def stop() -> None:
        supervisor.stop()
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    routes = ", ".join(f"{r.prefix} -> {r.upstream}" for r in settings.routes)
    log.info(
        "llmtap proxy on http://%s:%d (%s) in %d workers; admin on http://%s:%d",
        settings.host,
        port,
        routes,
        settings.workers,
        settings.admin_host,
        admin_sock.getsockname()[1],
    )
    watcher = asyncio.create_task(supervisor.watch(admin, server))
    try:
        await server.serve(sockets=[admin_sock])
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
