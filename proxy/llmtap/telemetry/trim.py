"""Giving the C allocator's free memory back to the system while the telemetry process is idle.

Much of what the telemetry process allocates is larger than Python's own small-object allocator takes (tables of
the caches, the tapes' bytes, protobuf messages) and comes from the C allocator. glibc returns freed memory to the
system only from the top of its heaps: what a backlog took (a queue of 4,096 tapes after a stall, their
decoded bodies) stays resident as free space inside the heaps once it is freed, and each larger backlog adds to
it. In the memory soak (``bench.probes.soak_memory``) that free space rose from 7 to 56 MB over 45 minutes, in steps at
each overload phase, while what was in use stayed flat. ``malloc_trim(0)`` releases the free pages of every heap;
``Trimmer.idle`` calls it when the recorder's worker finds its queue empty, at most once per ``TRIM_EVERY`` seconds.
Where the C library has no ``malloc_trim`` (musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

__all__ = ["TRIM_EVERY", "Trimmer", "malloc_trim"]

log = logging.getLogger("llmtap.telemetry")

#: Seconds between two trims at least: one walks every heap (milliseconds for a few hundred MB).
TRIM_EVERY = 30.0


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class Trimmer:
    """Calls ``trim(0)`` when told the process is idle, once per ``every`` seconds at most; used by one thread."""

    def __init__(
        self,
        every: float = TRIM_EVERY,
        *,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._every = every
        self._trim = trim if trim is not None else malloc_trim()
        self._clock = clock
        self._last = clock()
        #: Trims done so far.
        self.trims = 0

    def idle(self) -> None:
        """The caller has nothing to do: trim, unless the last trim was less than ``every`` seconds ago."""
        if self._trim is None:
            return
        now = self._clock()
        if now - self._last < self._every:
            return
        self._last = now
        try:
            self._trim(0)
            self.trims += 1
        except Exception:  # never worth failing the worker over
            log.debug("telemetry: malloc_trim failed", exc_info=True)
            self._trim = None
