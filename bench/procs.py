"""What the benchmark reads of a running service beyond ``tests.support.proctree``: its peak memory sampled in a
thread, and the wait until its CPU time stops growing."""

from __future__ import annotations

import threading
import time

from tests.support.proctree import ROLES, Service, by_role, rss_bytes


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
