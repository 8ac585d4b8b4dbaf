"""A process and its tree: the processes below it, their roles, CPU time and memory from ``/proc``, pinning to
cores, and ``Service``, a named child process with a log.

CPU seconds and resident memory come from ``/proc`` for a process and all its descendants (nginx's
workers, a proxy's worker processes), so each is charged for everything it runs. Each process of a
tree has a role by its ``/proc/PID/comm``: llmtap's telemetry process names itself ``llmtap-telemetry``
(``llmtap-telemetr`` after the kernel's 15-character cut), its relays ``llmtap-relay``; every other
process of the tree (the supervisor, nginx's master and worker) counts as relay.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

T = TypeVar("T")


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
