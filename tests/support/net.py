"""Ports and loopback servers: a free port no other test or benchmark process is handed meanwhile, an HTTP
server on 127.0.0.1 in a thread of its own, and the wait for a URL to answer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import uvicorn

#: The lowest port handed out: the ports from here to the kernel's ephemeral range are shared out among the
#: processes that call ``free_port`` (each pytest-xdist worker its own part).
_FIRST_PORT = 16384


def _ephemeral_low() -> int:
    """The first port the kernel picks for outgoing connections and ``bind(0)`` (32768 unless set otherwise)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _own_ports() -> list[int]:
    """The ports this process hands out, in the order it tries them: its pytest-xdist worker's share of those below
    the ephemeral range, begun at an offset of its own (the worker's children, a benchmark run by a test, call
    ``free_port`` too). Empty when the ephemeral range leaves too few below it."""
    low = _ephemeral_low()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (low - _FIRST_PORT) // max(workers, 1)
    if size < 256 or not 0 <= worker < workers:
        return []
    base = _FIRST_PORT + worker * size
    offset = os.getpid() * 101 % size
    return [base + (offset + i) % size for i in range(size)]


_ports: list[int] | None = None
_next = 0
_ports_pid = 0  # the process ``_ports`` was made for: a forked child makes its own
_ports_lock = threading.Lock()


def free_port() -> int:
    """A port nobody listens on right now, and that no other test or benchmark process is handed meanwhile.

    A port the kernel picked (``bind(0)``) and let go may be picked again for another process before the one it was
    for binds it, or taken by an outgoing connection: a CI run's llmtap lost its admin port so. So the ports come
    from below the kernel's ephemeral range, which neither touches, each pytest-xdist worker its own part, each
    process in turn through it; one still bound or lingering (a bind without ``SO_REUSEADDR`` fails) is passed over.
    """
    global _ports, _next, _ports_pid
    with _ports_lock:
        if _ports is None or _ports_pid != os.getpid():
            _ports, _next, _ports_pid = _own_ports(), 0, os.getpid()
        for _ in range(len(_ports)):
            port = _ports[_next]
            _next = (_next + 1) % len(_ports)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackHTTPServer(ThreadingHTTPServer):
    """An HTTP server on a free port of 127.0.0.1, serving from a daemon thread from the start until ``close``."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], *, poll: float = 0.05) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": poll}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


def answer(handler: BaseHTTPRequestHandler, body: bytes, content_type: str) -> None:
    """A whole 200 response to ``handler``'s request: ``body`` with its type and length."""
    handler.send_response(200)
    handler.send_header("content-type", content_type)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def wait_http(
    url: str, timeout: float, *, alive: Callable[[], bool] | None = None, headers: Mapping[str, str] | None = None
) -> None:
    """Wait until ``url`` answers 200."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"process for {url} exited")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            exc.close()  # a "not ready yet" answer (Prometheus's 503) holds its socket until closed
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s: {last}")


@contextlib.asynccontextmanager
async def uvicorn_serving(config: uvicorn.Config) -> AsyncIterator[tuple[str, int]]:
    """A uvicorn server in this event loop on a loopback port of its own: its address once it has started; told
    to exit and awaited afterwards."""
    server = uvicorn.Server(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # noqa: ASYNC110 - uvicorn's flag, set by its start-up, has no event
            await asyncio.sleep(0.01)
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        await serving
        sock.close()
