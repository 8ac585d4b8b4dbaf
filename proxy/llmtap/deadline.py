"""One time bound shared by steps that run one after another: each step gets what the steps before it left.

A shutdown's flush is one bound for draining the recorder, closing each record sink and flushing the exporters
(``--flush-timeout``): given the whole bound each, three slow steps would take three times it. So the bound is taken
once, when the first step starts, and every step asks how much of it is left.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Deadline"]


class Deadline:
    """``seconds`` from now, on ``clock`` (the monotonic clock)."""

    __slots__ = ("clock", "end")

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        """Seconds until the deadline, 0 once it has passed (never less: a wait given it returns at once)."""
        return max(0.0, self.end - self.clock())

    def passed(self) -> bool:
        """Whether the deadline has come."""
        return self.clock() >= self.end
