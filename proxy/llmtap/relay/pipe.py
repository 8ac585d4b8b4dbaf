"""The relay's body path: each upstream body part goes to the client's socket in the upstream's read callback.

Before this, a relayed chunk went from the upstream protocol's queue to a waiting task (a future woken, a
task step), through httpx's body iterator, then through ASGI ``send`` into uvicorn, which awaited its flow
control before writing: about three quarters of the relay's CPU per chunk. Here the lean
upstream client hands each part to ``Pipe`` while it is still in ``data_received`` (``Connection.carry``): one
timestamp of the read, the tape's append, the usage filter when it runs, one ``transport.write`` in the
framing uvicorn chose for the response (chunked, or counted against its Content-Length), one timestamp of
the write. The relay's task sleeps until the response ends, fails, or the client stops taking bytes.

Backpressure both ways: when the client's write buffer passes its high-water mark (uvicorn's flow control
says ``write_paused``), the upstream socket stops being read (``hold``) and the relay's task waits for the
client to drain before reading it again (``release``); so the kernel's buffers, not the relay, hold what
the client has not taken, and the client send timeout (``llmtap.listener``) runs as before. Starlette
still routes the request and uvicorn still writes the head and the response's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from llmtap.errors import ClientGone
from llmtap.providers.usage_filter import UsageEventFilter
from llmtap.relay.strip import strip_part
from llmtap.wire.tape import Tape, now

__all__ = ["Pipe"]

#: How long the relay waits for the disconnect watch's cancellation once it saw the client gone itself.
GONE_WAIT = 1.0


class Pipe:
    """The sink of one response: stamps, appends to the tape, writes to the client; never raises into the
    upstream's callback (a failure is kept in ``error`` and ends the relay from its task)."""

    __slots__ = ("_chunked", "_conn", "_cycle", "_flow", "_segment", "_tape", "_transport", "error", "strip")

    def __init__(self, tape: Tape, cycle: Any, strip: UsageEventFilter | None, segment: Callable[[Tape], None]) -> None:
        self._tape = tape
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow
        self._chunked = bool(cycle.chunked_encoding)
        self._segment = segment
        self._conn: Any = None
        self.strip = strip
        self.error: BaseException | None = None

    def __call__(self, t: float, part: bytes) -> None:
        tape = self._tape
        full = tape.read(t, part)
        try:
            out = part
            if self.strip is not None:
                out, self.strip = strip_part(self.strip, part)
            cycle = self._cycle
            if cycle.disconnected:
                # Gone: nothing more is read, and the part was never delivered (no delivery time).
                self._conn.hold()
                return
            if out:
                if self._chunked:
                    self._transport.write(b"%x\r\n%b\r\n" % (len(out), out))
                else:
                    # Counted as uvicorn counts its own writes, so the response's end checks the same length.
                    cycle.expected_content_length -= len(out)
                    self._transport.write(out)
            tape.delivered(now())
            if full:
                self._segment(tape)
            if self._flow.write_paused:
                self._conn.hold()
        except Exception as exc:
            self.error = exc
            self._conn.hold()

    async def run(self, conn: Any, timeouts: Mapping[str, float | None]) -> UsageEventFilter | None:
        """Relay the whole body; returns the usage filter as it stands at the end (None once it failed).

        Raises what the upstream's read raised (``UpstreamError``), ``ClientGone``, or a failure of the sink.
        """
        self._conn = conn  # known before the first part comes: parts queued already go to the sink in ``carry``
        try:
            return await self._relay(conn, timeouts)
        except BaseException:
            # Failed, cut or cancelled: what the upstream still sends is no longer the client's (it queues on the
            # connection, bounded, until the relay closes it).
            conn.sink = None
            raise

    async def _relay(self, conn: Any, timeouts: Mapping[str, float | None]) -> UsageEventFilter | None:
        cycle = self._cycle
        # Read at every wait: the relay switches to its idle timeout once the head is in.
        await conn.carry(self, timeouts.get("read"))
        while True:
            if self.error is not None:
                raise self.error
            if conn.done:
                return self.strip
            if conn.error is not None:
                raise conn.error
            # Held: the client's buffer is full (or the client is gone); wait for it, not for the upstream.
            if not cycle.disconnected:
                await self._flow.drain()
            if cycle.disconnected:
                # The disconnect watch cancels this task in a moment; in case it does not, say so ourselves.
                await asyncio.sleep(GONE_WAIT)
                raise ClientGone
            conn.release()
            await conn.until_moved(timeouts.get("read"))
