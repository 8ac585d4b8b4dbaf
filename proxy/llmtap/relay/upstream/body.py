"""A response as the relay takes it: its head, and its body read part by part or piped to a sink."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from llmtap.relay.upstream.connection import Connection, Timeouts
from llmtap.relay.upstream.http11 import Sink

__all__ = ["Answer", "Body"]


class Body(httpx.AsyncByteStream):
    """A response body: what each socket read carried, in order; the connection is released exactly once."""

    def __init__(self, conn: Connection, timeouts: Timeouts) -> None:
        self._timeouts = timeouts
        self._released = False
        self._surplus = 0
        self._exchange = conn.exchanges
        #: The connection this body arrives on (a sink holds and releases it, the relay waits on it).
        self.connection = conn

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.connection
        timeouts = self._timeouts
        while not self._released:
            if conn.parts:
                yield conn.take()
            elif conn.done:
                return  # httpx closes the response at the end of the body: the connection is released then
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait_readable(timeouts.get("read"))

    async def aclose(self) -> None:
        self._release()

    def pipe(self, sink: Sink) -> Connection:
        """From now on each body part goes to ``sink`` in the read callback (those queued already, at once);
        the relay then waits on the returned connection's ``until_moved`` and ``hold``/``release``."""
        self.connection.attach(sink)
        return self.connection

    def surplus(self) -> int:
        """Bytes the upstream sent past this response's end (its connection was closed for them)."""
        return self._surplus if self._released or self._settled() else self.connection.surplus

    def close(self) -> int:
        """Release the connection (``aclose`` without the wait): exactly once, whoever asks; back to the pool when
        the exchange ended cleanly, else closed. Never waits. Returns the bytes the upstream sent past the response's
        end (its connection is closed for them): the relay takes both at the response's end in one call."""
        self._release()
        return self._surplus

    def _settled(self) -> bool:
        """The connection went back to the pool at this body's clean end (``Connection.carry``, ``take_whole``):
        parked, or serving another exchange by now."""
        return self.connection.parked or self.connection.exchanges != self._exchange

    def _release(self) -> None:
        if self._released:
            return  # a second close must not touch a connection that may serve another response by now
        self._released = True
        conn = self.connection
        if self._settled():
            return  # in the pool already, nothing past its end
        self._surplus = conn.surplus
        conn.settle()


class Answer(Body):
    """A response as the relay takes it from ``LeanTransport.send``: status, head, and the body it is (read part by
    part, ``aiter_raw``, or taken from its ``connection`` by a sink in the read callback), nothing else."""

    def __init__(self, conn: Connection, timeouts: Timeouts) -> None:
        """The response whose head ``conn`` has read; its body arrives on ``conn``, read under ``timeouts``."""
        super().__init__(conn, timeouts)
        self.status_code = conn.status
        self.headers = conn.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body parts as they arrive, the connection released at the body's end (as ``httpx.Response.aiter_raw``
        yields them over this client, and closes the response)."""
        async for part in self.__aiter__():
            yield part
        self._release()

    def abandon(self) -> None:
        """Release the connection closed, however cleanly the exchange ended: the relay refused this response."""
        self.connection.keep_alive = False
        self._release()
