"""What the telemetry side shows of this relay: its readiness, gauges and counts, reported as absolute values.

Absolute values, so a report the channel drops loses nothing: the next one says it all. Reports go at most every
``STATS_EVERY`` seconds while something changed, and soon after a request ends (``STATS_SOON``), so a burst of
ends costs one report. They go to telemetry process 0: one started again hears the counts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from llmtap.relay.answers import LogLimit
from llmtap.relay.breaks import StreamBreaks
from llmtap.relay.channel import Channel, ShardedChannel, SocketChannel
from llmtap.wire.messages import RESPONSE_CUT_REASONS, Stats, encode_stats

if TYPE_CHECKING:
    from llmtap.listener import ClientLimits

__all__ = ["STATS_EVERY", "STATS_SOON", "Gauges"]

#: Seconds between two reports of the relay's gauges (active streams, admission line) when they changed.
STATS_EVERY = 0.5
#: At a request's end the gauges are reported at once, unless a report left less than this long ago: then once,
#: this long after it (a burst of ends costs one report, not one each; the gauges still settle within it).
STATS_SOON = 0.02


class Gauges:
    """The relay's gauges and counts, and their reports to the telemetry side.

    Whoever changes a gauge sets ``changed``; the report loop (``start``) and the ends of requests (``ended``) send
    them when they changed, or when the counts did.
    """

    def __init__(self, routes: tuple[str, ...], channel: Channel, relay_id: int) -> None:
        self._channel = channel
        self._relay_id = relay_id
        #: Ready to relay and not draining: what ``/readyz`` of the telemetry side follows.
        self.ready = False
        #: Streams relayed and requests waiting in an admission line, per route.
        self.active = dict.fromkeys(routes, 0)
        self.waiting = dict.fromkeys(routes, 0)
        #: Tapes that did not reach the telemetry side, in whole or in part.
        self.tapes_dropped = 0
        #: Responses the relay itself cut short, by reason (``RESPONSE_CUT_REASONS``).
        self.cuts = dict.fromkeys(RESPONSE_CUT_REASONS, 0)
        #: Streams the upstream broke off after their headers, logged within a bound (``llmtap.relay.breaks``).
        self.breaks = StreamBreaks()
        #: Responses answered 502 for a head that cannot be relayed faithfully (``llmtap.relay.heads``).
        self.bad_heads = 0
        #: Warnings said at most every so often, with their counts.
        self.said = LogLimit()
        #: The server's counts of client connections cut or refused (``llmtap.serve.relay`` sets them), reported
        #: beside the gauges; None when no such server runs the relay.
        self.connections: ClientLimits | None = None
        self.changed = True
        self._counts_sent: tuple[Any, ...] = ()
        self._ready_sent: bool | None = None
        self._task: asyncio.Task[None] | None = None
        #: When the gauges were last reported (the loop's clock), and the report due soon, if one is.
        self._at = -STATS_SOON
        self._due: asyncio.TimerHandle | None = None
        first = channel.channels[0] if isinstance(channel, ShardedChannel) else channel
        if isinstance(first, SocketChannel):
            first.on_connected = self.report_again

    def start(self) -> None:
        """Report from now on, every ``STATS_EVERY`` seconds when something changed."""
        self.changed = True
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """The last report: no loop and no report due after it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._due is not None:
            self._due.cancel()
            self._due = None
        self.changed = True
        self.send()

    async def _loop(self) -> None:
        while True:
            self.send()
            await asyncio.sleep(STATS_EVERY)

    def send(self) -> None:
        """Report the gauges and counts if they changed since the last report the channel took."""
        counts = (
            *(self.connections.counts() if self.connections is not None else ((), ())),
            tuple(self.cuts.items()),
        )
        if not self.changed and counts == self._counts_sent:
            return
        ready = self.ready
        active, waiting = tuple(self.active.items()), tuple(self.waiting.items())
        stats = Stats(ready, self.tapes_dropped, active, waiting, *counts, relay=self._relay_id)
        # A change of readiness leaves at once (``/readyz`` follows it); the gauges may wait for the tapes' gather.
        if self._channel.send(encode_stats(stats), at_once=ready != self._ready_sent):
            self._ready_sent = ready
            self.changed = False
            self._counts_sent = counts
            with contextlib.suppress(RuntimeError):  # no running loop: a report at shutdown, from a thread
                self._at = asyncio.get_running_loop().time()

    def report_again(self) -> None:
        """The channel to telemetry process 0 was made (again): the gauges and counts go with the next report."""
        self.changed = True
        self._counts_sent = ()
        self._ready_sent = None  # its readiness too, at once: /readyz of a restarted telemetry process follows it

    def ended(self) -> None:
        """A request ended: report now, or ``STATS_SOON`` after the last report if that left a moment ago."""
        self.changed = True
        if self._due is not None:
            return  # a report is due in a moment: it carries this end too
        loop = asyncio.get_running_loop()
        wait = self._at + STATS_SOON - loop.time()
        if wait > 0:
            self._due = loop.call_later(wait, self._send_due)
        else:
            self.send()

    def _send_due(self) -> None:
        self._due = None
        self.send()

    def bad_head(self, upstream: str, why: str | None) -> None:
        """An upstream's response head was answered 502 (``llmtap.relay.heads``): counted, logged at most every 10 s."""
        self.bad_heads += 1
        self.said.warn(
            "bad_head", self.bad_heads, "upstream %s: a response head llmtap cannot relay (%s)", upstream, why
        )

    def inflate_cut(self, upstream: str, limit: int) -> None:
        """A response was cut for decompressing past ``max_inflate_bytes``: counted, logged within a bound."""
        self.cuts["inflate_limit"] += 1
        self.said.warn(
            "inflate_limit",
            self.cuts["inflate_limit"],
            "cut a response from %s: it decompressed past max_inflate_bytes (%d)",
            upstream,
            limit,
        )
