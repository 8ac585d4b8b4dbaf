"""The upstreams' own load gauges, read from their ``/metrics`` by one thread of the telemetry side.

Started for an upstream once llmtap has two requests in flight to it (only then do its slots matter), or,
on a route declared ``vllm`` or ``sglang``, when its first request is recorded (``compatible(wait=...)``:
whether to wait for the server's span of it).
The first read tells whether it is a vLLM-compatible server (``llmtap.analysis.slots``: its gauges of
running and waiting requests); such a server is read again every ``BUSY`` seconds while it has work
and every ``IDLE`` seconds otherwise, and its slot count is learned from what it shows. Any other
server is asked again only every ``RECHECK`` seconds (one that did not answer, every ``RETRY``).
Plain ``http://`` upstreams only: a hosted API has no such page, and a self-hosted server inside the
cluster is read without TLS. Nothing here is on a request's path; a slow page costs this thread alone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from llmtap.analysis.slots import SlotLearner, Slots, load
from llmtap.telemetry import sched

__all__ = ["UpstreamWatch"]

log = logging.getLogger("llmtap.telemetry")

BUSY = 0.25
IDLE = 2.0
RECHECK = 300.0
RETRY = 10.0
TIMEOUT = 1.0
#: Bytes of a ``/metrics`` page read at most (vLLM's is about 100 KB).
MAX_PAGE = 4 << 20
#: Upstreams watched at most.
MAX_UPSTREAMS = 64


@dataclass(slots=True)
class _Watched:
    url: str
    compatible: bool | None = None
    learner: SlotLearner = field(default_factory=SlotLearner)
    busy: bool = False
    next_at: float = 0.0
    read: threading.Event = field(default_factory=threading.Event)


class UpstreamWatch:
    """Reads the ``/metrics`` of the upstreams it is asked to watch; ``slots`` and ``compatible`` say what it
    learned."""

    def __init__(self, client: httpx.Client | None = None) -> None:
        self._client = client
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, upstream: str) -> None:
        """Start watching ``upstream`` (a route's URL), or read it now if it is watched (it got busy)."""
        with self._lock:
            known = self._watched.get(upstream)
            if known is not None:
                if known.compatible and not known.busy:
                    known.busy, known.next_at = True, 0.0
                    self._wake.set()
                return
            parts = urlsplit(upstream)
            if parts.scheme != "http" or not parts.netloc or len(self._watched) >= MAX_UPSTREAMS:
                return
            self._watched[upstream] = _Watched(f"http://{parts.netloc}/metrics", busy=True)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="llmtap-upstreams", daemon=True)
                self._thread.start()
        self._wake.set()

    def compatible(self, upstream: str, wait: float = 0.0) -> bool:
        """True once ``upstream``'s ``/metrics`` showed the gauges of a vLLM-compatible server.

        ``wait``: an upstream not read yet is watched from now, and its first read waited for, at most that
        long (so the first requests to a fresh proxy, which may end before anything else starts the watch, are
        judged as the later ones are).
        """
        known = self._watched.get(upstream)
        if wait > 0 and (known is None or not known.read.is_set()):
            self.watch(upstream)
            known = self._watched.get(upstream)
            if known is not None:
                known.read.wait(wait)
        return known is not None and bool(known.compatible)

    def slots(self, upstream: str) -> Slots | None:
        """The slot count learned for ``upstream``, or None."""
        known = self._watched.get(upstream)
        return None if known is None else known.learner.slots

    def close(self) -> None:
        """Stop the thread (within its read timeout)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(TIMEOUT + 0.5)

    def _run(self) -> None:
        sched.idle_here()
        client = self._client or httpx.Client(timeout=TIMEOUT, follow_redirects=False)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self._lock:
                    due = [w for w in self._watched.values() if w.next_at <= now]
                for watched in due:
                    self._read(client, watched)
                with self._lock:
                    soonest = min((w.next_at for w in self._watched.values()), default=now + IDLE)
                self._wake.wait(max(soonest - time.monotonic(), 0.0))
                self._wake.clear()
        finally:
            if self._client is None:
                client.close()

    def _read(self, client: httpx.Client, watched: _Watched) -> None:
        found: tuple[int, int] | None = None
        failed = False
        try:
            with client.stream("GET", watched.url) as answer:
                if answer.status_code == 200:
                    page = bytearray()
                    for part in answer.iter_bytes():
                        page += part
                        if len(page) > MAX_PAGE:
                            break
                    found = load(page.decode("utf-8", errors="replace"))
        except httpx.HTTPError as exc:
            log.debug("telemetry: could not read %s: %s", watched.url, exc)
            failed = True
        now = time.monotonic()
        if found is None:
            # Down or starting: asked again soon. Up without the gauges: another kind of server.
            if not failed and watched.compatible is None:
                watched.compatible = False
            watched.next_at = now + (RETRY if failed or watched.compatible else RECHECK)
            watched.read.set()
            return
        if not watched.compatible:
            log.info("telemetry: %s shows a vLLM-compatible server; learning its slots from it", watched.url)
        watched.compatible = True
        running, waiting = found
        watched.learner.observe(running, waiting)
        watched.busy = running + waiting > 0
        watched.next_at = now + (BUSY if watched.busy else IDLE)
        watched.read.set()
