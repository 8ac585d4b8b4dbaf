"""Shared fixtures: in-memory OpenTelemetry providers, the scripted upstream, and a proxy on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import pytest
import uvicorn
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmtap.config.types import Settings
from llmtap.relay.app import ProxyApp
from llmtap.serve.local import in_process
from llmtap.telemetry.admin.server import AdminApp
from llmtap.telemetry.exposition.prometheus import PrometheusReader
from llmtap.telemetry.recorder import Recorder
from tests.support.net import free_port as free_port  # one definition for the tests and the benchmark

TESTS = Path(__file__).parent
#: What an install remembers (the attribution key, proxy/llmtap/relay/fingerprint.py) goes to a folder of this run's
#: own, not the home directory of whoever runs the tests; every llmtap the tests start inherits it.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="llmtap-tests-state-")

#: How long a test waits for something that must happen (a server listening, a span or record arriving, a
#: count reaching /metrics) before it calls it broken. A deadline, never a bound: what works arrives in
#: milliseconds on a quiet machine and costs nothing more here, while a niced telemetry process on a machine
#: whose every core is busy was seen to take over 20 s. Timing claims live in relative checks and bench/.
PATIENCE = 120.0


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist hands out whole files (one worker runs a module's tests, so its fixtures start once), and
    the real-vLLM files as one: one server (about 3 GB, a minute to start) serves them all. The benchmark's
    smoke runs on that worker too (before them): it pins its proxies to core 0, where vLLM's engine binds."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            name = Path(path).name
            return "core-0" if name.startswith("test_real_vllm") or path.endswith("bench/tests/test_smoke.py") else path

    return ByFile(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failed test that used the real vLLM server carries the end of vLLM's log in its report."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and "vllm_medium" in getattr(item, "fixturenames", ()):
        from tests.support.vllm_server import log_tail

        tail = log_tail()
        if tail is not None:
            report.sections.append(("vLLM log", tail))


@dataclass
class Telemetry:
    """In-memory exporters, injected into the app (no global providers)."""

    spans: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    reader: InMemoryMetricReader = field(default_factory=InMemoryMetricReader)
    prometheus: PrometheusReader = field(default_factory=PrometheusReader)

    def __post_init__(self) -> None:
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.meter_provider = MeterProvider(metric_readers=[self.reader, self.prometheus])

    def finished(self) -> list[ReadableSpan]:
        """Every span ended so far."""
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, list[Any]]:
        """Data points by metric name."""
        data: MetricsData | None = self.reader.get_metrics_data()
        out: dict[str, list[Any]] = {}
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out.setdefault(m.name, []).extend(m.data.data_points)
        return out


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()
    yield t
    t.tracer_provider.shutdown()
    t.meter_provider.shutdown()


class _Closable(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=_Closable)


@pytest.fixture
def closing() -> Iterator[Callable[[_C], _C]]:
    """``closing(client)``: the client, closed when the test ends however it ends (an SDK client left to the
    garbage collector leaves its connections to be found open, a ``ResourceWarning`` in some later test)."""
    opened: list[_Closable] = []

    def keep(client: _C) -> _C:
        opened.append(client)
        return client

    yield keep
    for client in reversed(opened):
        client.close()


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A port whose listener's accept queue is full: the kernel drops further SYNs, so a connect hangs."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        fillers = []
        try:
            for _ in range(4):
                s = socket.socket()
                fillers.append(s)
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(full.getsockname())
            time.sleep(0.1)
            yield int(full.getsockname()[1])
        finally:
            for s in fillers:
                s.close()


class ServerThread:
    """Runs an ASGI app under uvicorn on a real socket, in a thread with its own event loop."""

    def __init__(self, app: Any, *, lifespan: Literal["auto", "on", "off"] = "on") -> None:
        # IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (see llmtap.serve.sockets.bind).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", server_header=False, date_header=False, lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        # The test process holds many objects; a full collection during a timed stream would be charged
        # to the proxy. Freezing what exists now keeps collections short, as in a lean proxy process.
        gc.collect()
        gc.freeze()
        self.thread.start()
        deadline = time.monotonic() + PATIENCE
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@dataclass
class Running:
    """A proxy app served on a real socket."""

    app: ProxyApp
    recorder: Recorder
    server: ServerThread
    admin: ServerThread | None

    @property
    def url(self) -> str:
        return self.server.url

    def flush(self) -> None:
        """Wait until the recorder has written every finished request."""
        assert self.app.flush(10)


def start_proxy(settings: Settings, telemetry: Telemetry, *, admin: bool = False) -> tuple[Running, list[ServerThread]]:
    """Build the app with injected providers and serve it (and optionally the admin listener)."""
    local = in_process(settings, tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    server = ServerThread(local.app).__enter__()
    threads = [server]
    admin_server = None
    if admin:
        admin_server = ServerThread(AdminApp(local, telemetry.prometheus)).__enter__()
        threads.append(admin_server)
    return Running(local.app, local.recorder, server, admin_server), threads


@pytest.fixture
def proxy_factory(telemetry: Telemetry) -> Iterator[Any]:
    started: list[ServerThread] = []

    def make(settings: Settings, *, admin: bool = False) -> Running:
        running, threads = start_proxy(settings, telemetry, admin=admin)
        started.extend(threads)
        return running

    yield make
    for server in reversed(started):
        server.__exit__(None, None, None)


class Scripted:
    """The scripted upstream in a child process (so its timing does not share our GIL)."""

    def __init__(self, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.scripted_upstream"],
            cwd=TESTS.parent,
            stdout=subprocess.PIPE,
            env={**os.environ, **env},
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        from tests.support.procs import stop  # tests.support.procs imports this module

        stop(self.proc)


@pytest.fixture(scope="session")
def scripted() -> Iterator[Scripted]:
    up = Scripted()
    yield up
    up.close()


# --- The real-component tier ---------------------------------------------------------------------------

#: Where `.ci/install.d/*.sh` put tools that live in their own virtual environments (vLLM, Phoenix, ...).
TOOLS = Path(os.environ.get("LLMTAP_TOOLS", TESTS.parent / ".tools"))


def require_real(available: bool, what: str, how: str) -> None:
    """Skip loudly when a real component is missing; fail instead under CI (``LLMTAP_REQUIRE_REAL=1``).

    A real tier must never pass by skipping quietly: the reason names the part and how to install it.
    """
    if available:
        return
    message = f"REAL TIER NOT RUN: {what} is not installed here ({how})"
    if os.environ.get("LLMTAP_REQUIRE_REAL") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
