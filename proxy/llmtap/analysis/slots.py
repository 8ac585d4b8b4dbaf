"""How many requests the upstream runs at once, learned from its own load gauges.

The slot replay (``estimator``) needs the server's batch capacity (vLLM's ``--max-num-seqs``). A
vLLM-compatible server says how many requests it runs and how many wait (``vllm:num_requests_running``,
``vllm:num_requests_waiting``; SGLang's ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``). The
running count never exceeds the capacity, so the peak of every sample is a floor under it; while some
wait, the running count is at the limit, but often below it too: a request that arrived during a model
step waits for the next step in ``waiting`` with a slot free, and a long prompt can hold a step's token
budget so that one request runs while others wait (measured on vLLM's CPU build: two slots, a burst of
ten, most samples read one running and several waiting, the two-running windows about 100 ms each). So
the count is the peak of all samples, given once any sample had requests waiting (until then no queue
has formed and the count does not matter); each sample at that peak while some wait confirms it, and
``confidence`` is ``1 - 2**-n`` after ``n`` of them (0 before any). A server whose memory, not its
sequence limit, caps the batch shows that lower count, which is what the replay needs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["CONFIGURED", "FROM_METRICS", "SlotLearner", "Slots", "load"]

#: Gauge names of the running and the waiting requests, by server family.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
#: How a slot count was learned: from the server's gauges, or given in the route's ``server_slots``.
FROM_METRICS = "server_metrics"
CONFIGURED = "configured"

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?[ \t]+(\S+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Slots:
    """A slot count, how it was learned and how sure that is (1.0 when configured)."""

    slots: int
    source: str
    confidence: float


def load(text: str) -> tuple[int, int] | None:
    """``(running, waiting)`` summed over the page's label sets, or None when it has neither gauge."""
    running = waiting = 0.0
    seen = False
    for match in _SAMPLE.finditer(text):
        name = match.group(1)
        if name in RUNNING or name in WAITING:
            try:
                value = float(match.group(2))
            except ValueError:
                continue
            if not math.isfinite(value) or value < 0:
                continue
            seen = True
            if name in RUNNING:
                running += value
            else:
                waiting += value
    return (int(running), int(waiting)) if seen else None


class SlotLearner:
    """The peak running count over successive samples of one upstream, and how often it was seen saturated."""

    def __init__(self) -> None:
        self.peak = 0
        self.confirmed = 0
        self.queued = False

    def observe(self, running: int, waiting: int) -> None:
        """One sample of the server's gauges."""
        if running <= 0:
            return
        self.queued = self.queued or waiting > 0
        if running > self.peak:
            self.peak, self.confirmed = running, 0
        if running == self.peak and waiting > 0:
            self.confirmed += 1

    @property
    def slots(self) -> Slots | None:
        """The learned count, or None before any sample had requests waiting."""
        if not self.queued:
            return None
        return Slots(self.peak, FROM_METRICS, round(1.0 - 0.5**self.confirmed, 3))
