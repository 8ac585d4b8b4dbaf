"""The relay's life: ready at start-up, draining from SIGTERM, the requests in flight, and the shutdown that lets
their tapes go before the pools and the channel close."""

from __future__ import annotations

import asyncio
import contextlib
import time

from llmtap.relay.channel import LocalChannel
from llmtap.relay.forward import Upstreams
from llmtap.relay.gauges import Gauges
from llmtap.relay.handover import Handover
from llmtap.wire.tape import Tape, now

__all__ = ["SETTLE_SECONDS", "Lifecycle"]

#: At shutdown, how long requests cancelled at the drain deadline get to hand over their tapes.
SETTLE_SECONDS = 2.0


class Lifecycle:
    """Readiness, the drain, and the count of requests between arrival and the hand-over of their tape."""

    def __init__(self, gauges: Gauges, handover: Handover, upstreams: Upstreams) -> None:
        self._gauges = gauges
        self._handover = handover
        self._upstreams = upstreams
        self.ready = False
        #: Set on SIGTERM: streams still running at the drain deadline are cut and recorded as ``shutdown``.
        self.draining = False
        #: Requests between arrival and the hand-over of their tape.
        self.inflight = 0
        #: What the shutdown waits on for ``inflight`` to reach 0: made only then, so a request's count is a number.
        self._idle: asyncio.Future[None] | None = None
        #: The loop the relay serves on, from start-up (``Exchange`` asks it for its task without a lookup of the
        #: running loop, which costs a system call a request); None until then.
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self) -> None:
        """Ready to relay; the gauges' values go to the telemetry side from now on."""
        self.loop = asyncio.get_running_loop()
        self.ready = self._gauges.ready = True
        self._gauges.start()

    async def shutdown(self) -> None:
        """Let the last tapes go, close the upstream pools and the channel (which drains a local recorder)."""
        self.ready = self._gauges.ready = False
        with contextlib.suppress(TimeoutError):
            # Requests the server just cancelled (drain deadline) hand over their tapes first.
            async with asyncio.timeout(SETTLE_SECONDS):
                if self.inflight:
                    self._idle = asyncio.get_running_loop().create_future()
                    await self._idle
        await self._gauges.stop()
        await self.aclose()

    async def aclose(self) -> None:
        """Close the upstream pools and the channel (which drains a local recorder)."""
        await self._upstreams.aclose()
        await self._handover.channel.aclose()

    def begin_drain(self) -> None:
        """SIGTERM: report not ready; streams in flight may finish until the server's drain deadline."""
        self.ready = self._gauges.ready = False
        self.draining = True
        self._gauges.changed = True
        # Now, not at the next report (up to STATS_EVERY later): /readyz must say so from the drain's start.
        self._gauges.send()

    def begin(self, route: str) -> None:
        """A request is relayed from now on: counted in flight and among its route's active streams."""
        self._count(+1)
        self._gauges.active[route] += 1
        self._gauges.changed = True

    def end(self, route: str, tape: Tape) -> None:
        """The request is over: its tape is handed over, then it no longer counts."""
        if tape.end is None:
            tape.end = now()
        self._gauges.active[route] -= 1
        self._handover.hand_over(tape)
        self._count(-1)
        if not self.inflight and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _count(self, step: int) -> None:
        self.inflight += step
        ledger = self._handover.ledger
        if ledger is not None:
            ledger.in_flight(self.inflight)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (from another thread) until every request so far is recorded; True when done in time."""
        deadline = time.monotonic() + timeout
        while self.inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        channel = self._handover.channel
        if not isinstance(channel, LocalChannel):
            return True
        return channel.flush(max(deadline - time.monotonic(), 0.1))
