"""Processes of the benchmark: start them pinned to a core, wait for them, and read their CPU time and memory.

CPU seconds and resident memory come from ``/proc`` for a process and all its descendants (nginx's
workers, a proxy's worker processes), so each path is charged for everything it runs. Each process of a
tree has a role by its ``/proc/PID/comm``: llmtap's telemetry process names itself ``llmtap-telemetry``
(``llmtap-telemetr`` after the kernel's 15-character cut), its relays ``llmtap-relay``; every other
process of the tree (the supervisor, nginx's master and worker) counts as relay.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, TypeVar

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

T = TypeVar("T")


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


def pinned(argv: Sequence[str], cpu: str | None) -> list[str]:
    """``argv`` run on the given CPU list (``taskset -c``), or as is when taskset is missing or no CPU is named."""
    if cpu is None or shutil.which("taskset") is None:
        return list(argv)
    return ["taskset", "-c", cpu, *argv]


def pin_threads(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` to ``cores``: ``sched_setaffinity`` on a PID moves its main thread only, and the
    threads it started already (a recorder, an exporter) would stay where they were."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:  # the thread ended meanwhile
            continue


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


#: ``/proc/PID/comm`` of llmtap's telemetry process (``llmtap-telemetry`` cut to 15 characters).
TELEMETRY_COMM = "llmtap-telemetr"
ROLES = ("relay", "telemetry")


def role(pid: int) -> str:
    """``telemetry`` for llmtap's telemetry process, ``relay`` for any other (``llmtap-relay`` or not)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "relay"
    return "telemetry" if comm == TELEMETRY_COMM else "relay"


def by_role(pids: Sequence[int]) -> dict[str, list[int]]:
    """The processes of a tree by role (every role present, maybe empty)."""
    out: dict[str, list[int]] = {r: [] for r in ROLES}
    for pid in pids:
        out[role(pid)].append(pid)
    return out


def cpu_split(pids: Sequence[int]) -> tuple[float, float]:
    """User and system CPU seconds of the processes (all their threads)."""
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11])
        system += int(fields[12])
    return user / _TICK, system / _TICK


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU seconds of the processes (all their threads)."""
    return sum(cpu_split(pids))


def rss_bytes(pids: Sequence[int]) -> int:
    """Resident memory of the processes, summed."""
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        except OSError:
            continue
    return total


class Service:
    """A child process with a name, a log file and a pid tree to measure."""

    def __init__(
        self, name: str, argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None, cpu: str | None
    ) -> None:
        self.name = name
        self.log_path = log
        # Appended: a path started again (its bursts, after its phases) keeps what it logged before.
        self._log: IO[bytes] = log.open("ab")
        self.proc = subprocess.Popen(
            pinned(argv, cpu),
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def read_line(self, timeout: float = 30.0) -> str:
        """The first line the process prints (a port), or an error naming its log."""
        assert self.proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline().decode()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not result or not result[0].strip():
            raise RuntimeError(f"{self.name} printed nothing; see {self.log_path}")
        return result[0].strip()

    def pids(self) -> list[int]:
        """The process and its descendants."""
        return descendants(self.proc.pid)

    def cpu(self) -> float:
        """CPU seconds used so far by the whole tree."""
        return cpu_seconds(self.pids())

    def cpu_system(self) -> float:
        """The part of ``cpu()`` spent in the kernel (for a proxy on loopback: mostly TCP)."""
        return cpu_split(self.pids())[1]

    def rss(self) -> int:
        """Resident bytes of the whole tree now."""
        return rss_bytes(self.pids())

    def roles(self) -> dict[str, list[int]]:
        """The tree's processes by role."""
        return by_role(self.pids())

    def cpu_roles(self) -> dict[str, float]:
        """CPU seconds used so far by the processes of each role."""
        return {r: cpu_seconds(pids) for r, pids in self.roles().items()}

    def rss_relay(self) -> int:
        """Resident bytes of the relay processes now."""
        return rss_bytes(self.roles()["relay"])

    def ready(self, check: Callable[[], T]) -> T:
        """``check()``, a wait until the service answers; should it fail, the service stops before the error goes on."""
        try:
            return check()
        except BaseException:
            self.stop()
            raise

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Signal the process group, wait, and kill what is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


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


class Sampler:
    """Samples a service's resident memory in a thread; ``peak`` is the largest seen since ``start``.

    ``samples`` holds (``perf_counter()``, relay processes' resident bytes) of every sample, so a phase can
    take the memory of the moments when all its streams were open. The tree is read anew every second (a
    telemetry process or a worker may start late).
    """

    def __init__(self, service: Service, interval: float = 0.05) -> None:
        self.service = service
        self.interval = interval
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self.roles: dict[str, set[int]] = {r: set() for r in ROLES}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pids: list[int] = []
        relay: list[int] = []
        looked = -1.0
        while not self._stop.is_set():
            now = time.perf_counter()
            if now - looked >= 1.0:
                pids, looked = self.service.pids(), now
                roles = by_role(pids)
                relay = roles["relay"]
                for r, found in roles.items():
                    self.roles[r].update(found)
            self.peak = max(self.peak, rss_bytes(pids))
            self.samples.append((now, rss_bytes(relay)))
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def quiesce(service: Service, *, settle: float = 1.0, timeout: float = 15.0) -> float:
    """Wait until the service's CPU time stops growing (telemetry drained); return its CPU seconds then."""
    deadline = time.monotonic() + timeout
    last = service.cpu()
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = service.cpu()
        if now - last < 0.02 * settle:
            return now
        last = now
    return last
