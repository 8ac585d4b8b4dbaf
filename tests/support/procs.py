"""Child processes for the end-to-end tests: ``llmtap serve``, the simulator, the fault upstream, and how they stop.

The proxy runs as users run it (``python -m llmtap serve``, uvicorn with its own protocol and signal
handling), so its resident memory, open files and exit can be read from ``/proc`` and the process table.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from tests.conftest import PATIENCE
from tests.support.net import free_port
from tests.support.proctree import TELEMETRY_COMM, descendants, rss_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultUpstream]:
    """The fault upstream, one per test module that imports this fixture."""
    up = FaultUpstream()
    yield up
    up.close()


class FaultUpstream:
    """``tests/support/fault_upstream.py`` in a child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fault_upstream"], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self._client = httpx.Client(base_url=self.url, timeout=5)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sent(self, request_id: str) -> dict[str, Any]:
        """What the upstream wrote for the request named ``request_id`` (see ``fault_upstream.Sent``)."""
        with self._lock:
            info: dict[str, Any] = self._client.get(f"/sent/{request_id}").json()
        return info

    def stats(self) -> dict[str, int]:
        """Open connections and responses being written now."""
        with self._lock:
            info: dict[str, int] = self._client.get("/stats").json()
        return info

    def close(self) -> None:
        self._client.close()
        stop(self.proc)


def stop(proc: subprocess.Popen[Any], grace: float = 10.0) -> int | None:
    """End ``proc`` whatever state it is in: SIGTERM and ``grace`` seconds to exit, then SIGKILL (at once when
    ``grace`` is 0); its pipes closed. Its exit code (None if even SIGKILL left it running)."""
    if proc.poll() is None:
        if grace > 0:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return proc.returncode


def stop_clean(proc: subprocess.Popen[str], timeout: float = PATIENCE) -> str:
    """SIGTERM, as an orchestrator stops a pod: ``proc`` exits 0 within ``timeout`` and its stderr (a pipe) holds
    no traceback; returns that stderr. The caller's ``finally`` still calls :func:`stop` for a failed path."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    return err


def _listening(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` at any address of this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table, encoding="ascii") as f:
            next(f)  # the heading
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    return inodes


def listens(pid: int, port: int) -> bool:
    """Whether ``pid`` or a process below it holds a socket listening on ``port``."""
    inodes = _listening(port)
    for p in descendants(pid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{p}/fd/{fd}") in inodes:
                        return True
    return False


def wait_ready(proc: subprocess.Popen[Any], admin_url: str, logs: Callable[[], str] = str) -> str:
    """Poll the admin listener's ``/readyz`` until ``proc``'s own answers 200 (within PATIENCE); its text. Fails
    at once if ``proc`` exits, with the end of ``logs()``.

    A 200 counts only while ``proc``'s tree holds the listening socket: a free port can be taken before llmtap
    binds it, and another test's llmtap on that port answers ``/readyz`` too (a CI run saw a start that lost
    its admin port reported ready, and the test's requests then refused)."""
    port = urllib.parse.urlsplit(admin_url).port
    assert port is not None, admin_url
    # A deadline, not a bound on start-up: two busy loops on two cores made a start take over 20 s.
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        assert proc.poll() is None, "llmtap exited before it was ready\n" + logs()[-3000:]
        try:
            ready = httpx.get(admin_url + "/readyz", timeout=2)
            if ready.status_code == 200 and listens(proc.pid, port):
                return ready.text
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("llmtap never became ready\n" + logs()[-3000:])


class Simulator:
    """``llmtap simulate --profile PROFILE`` in a child process: its own count of running requests."""

    def __init__(self, profile: str = "fast") -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmtap", "simulate", "--port", str(self.port), "--profile", profile],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        # One kept-alive client: polling must cost far less than the 100 ms a test may measure with it.
        self.client = httpx.Client(base_url=self.url, timeout=2)
        deadline = time.monotonic() + PATIENCE
        while True:
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/health").status_code == 200:
                    break
            assert time.monotonic() < deadline and self.proc.poll() is None, "simulator did not start"
            time.sleep(0.05)

    def state(self) -> dict[str, Any]:
        """The simulator's ``/debug/requests`` with the last request: ``running`` and ``requests``."""
        info: dict[str, Any] = self.client.get("/debug/requests?limit=1").json()
        return info

    def close(self) -> None:
        self.client.close()
        stop(self.proc)


#: Starts of ``Llmtap`` tried when the ports it drew were taken before it bound them.
ADDRESS_TRIES = 3


class Llmtap:
    """``python -m llmtap serve`` on free ports; its log goes to a file (a full pipe could block it)."""

    def __init__(
        self,
        upstream: str,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
        admin_host: str = "127.0.0.1",
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.admin_host = admin_host
        self.log_path = log
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
        # A free port can be taken before llmtap binds it (another test's listener, or any connection's own
        # port, drawn from the same range): a start refused for that alone is tried again on new ports.
        for attempt in range(ADDRESS_TRIES):
            self.port = free_port()
            self.admin_port = free_port()
            while self.admin_port == self.port:
                self.admin_port = free_port()
            self._log: IO[str] = log.open("w", encoding="utf-8")
            self.client = httpx.Client(base_url=self.url, timeout=10)
            argv = ["serve", "--upstream", upstream, "--port", str(self.port), "--admin-port", str(self.admin_port)]
            argv += ["--admin-host", admin_host]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmtap", *argv, *args],
                cwd=ROOT,
                env={**base, "OTEL_TRACES_EXPORTER": "none", **(env or {})},
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                preexec_fn=preexec_fn,
            )
            try:
                self.wait_ready()
                return
            except BaseException:
                self.close()  # a start that failed its deadline must not outlive the test
                if attempt + 1 < ADDRESS_TRIES and "Address already in use" in self.logs():
                    continue
                raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_host}:{self.admin_port}"

    def logs(self) -> str:
        return self.log_path.read_text(encoding="utf-8")

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.admin_url, self.logs)

    def metrics(self) -> str:
        """The admin listener's ``/metrics`` text."""
        return httpx.get(self.admin_url + "/metrics", timeout=5).text

    def rss(self) -> int:
        """Resident bytes now."""
        return rss_bytes([self.proc.pid])

    def telemetry_pid(self) -> int:
        """The telemetry process ``llmtap serve`` started: its child named ``llmtap-telemetry``."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            if Path(f"/proc/{pid}/comm").read_text().strip() == TELEMETRY_COMM:
                return int(pid)
        raise AssertionError(f"no telemetry process among the children {children}")

    def telemetry_rss(self) -> int:
        """Resident bytes of the telemetry process now."""
        return rss_bytes([self.telemetry_pid()])

    def fds(self) -> int:
        """Open file descriptors now."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def terminate(self) -> None:
        """SIGTERM, as an orchestrator stops a pod."""
        self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        self.client.close()
        stop(self.proc, grace=0)
        self._log.close()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``, from Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


#: ``serve(*flags, env=...)``: an ``llmtap serve`` started with ``flags`` and ``env`` over the defaults.
Serve = Callable[..., "Llmtap"]


@contextlib.contextmanager
def serving(upstream: str, logs: Path, env: dict[str, str] | None = None) -> Iterator[Serve]:
    """``serve(*flags, env=...)`` starts an ``llmtap serve`` in front of ``upstream`` with ``env`` (then the call's
    own) in its environment, its log in ``logs``; every one started is closed on the way out."""
    started: list[Llmtap] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Llmtap:
        proxy = Llmtap(upstream, logs / f"llmtap-{len(started)}.log", *flags, env={**defaults, **(env or {})})
        started.append(proxy)
        return proxy

    defaults = dict(env or {})
    try:
        yield start
    finally:
        for proxy in started:
            proxy.close()


@pytest.fixture
def serve(upstream: FaultUpstream, tmp_path: Path) -> Iterator[Serve]:
    """``serve(*flags, env=...)`` starts an ``llmtap serve`` in front of the fault upstream; all are closed after."""
    with serving(upstream.url, tmp_path) as start:
        yield start


def _tcp_rows(net: str = "/proc/net") -> Iterator[list[str]]:
    """The fields of every TCP socket's row in ``net``'s ``tcp`` and ``tcp6`` tables (a table that cannot be read
    gives none)."""
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"{net}/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield line.split()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)


def tcp_queues(ports: set[int]) -> int:
    """Bytes sitting in kernel socket queues (send and receive) of loopback TCP sockets touching ``ports``."""
    total = 0
    for fields in _tcp_rows():
        local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
        if state == "0A":
            continue  # LISTEN: its "queues" are the accept backlog, not bytes
        if _port(local) in ports or _port(remote) in ports:
            tx, rx = queues.split(":")
            total += int(tx, 16) + int(rx, 16)
    return total


def clients_of(pid: int, port: int) -> int:
    """Client connections process ``pid`` holds on its listening ``port`` (established TCP sockets, from ``/proc``)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    # 01: ESTABLISHED; field 9 is the socket's inode.
    return sum(1 for f in _tcp_rows(f"/proc/{pid}/net") if _port(f[1]) == port and f[3] == "01" and f[9] in inodes)
