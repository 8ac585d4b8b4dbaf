"""The watch on a client's connection while its request is relayed: the client leaves, the relay stops at once."""

from __future__ import annotations

import asyncio
from typing import Any

from llmtap.listener import LOST_HOOK
from llmtap.types import Message, Receive

__all__ = ["DisconnectWatch"]


class DisconnectWatch:
    """Cancels the relay the moment the client disconnects, so the upstream request stops at once.

    uvicorn drops writes to a closed connection silently, so a failing ``send`` cannot be relied on. Under
    llmtap's listener the request's cycle carries a hook its ``connection_lost`` calls (``LOST_HOOK``): no task
    per request. Under another server a task waits on ``receive`` for the disconnect.
    """

    def __init__(self, receive: Receive, task: asyncio.Task[Any], cycle: Any = None) -> None:
        self.fired = False
        self._stopped = False
        self._task = task
        self._cycle = cycle
        self._watcher: asyncio.Task[None] | None = None
        if cycle is not None:
            setattr(cycle, LOST_HOOK, self._lost)
            if cycle.disconnected:
                self._lost()
        else:
            self._watcher = asyncio.create_task(self._run(receive))

    def _lost(self) -> None:
        # After the last byte went out, the server also reports a disconnect: not a cancellation.
        if not self._stopped and not self.fired:
            self.fired = True
            self._task.cancel()

    async def _run(self, receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self._lost()
                return

    def stop(self) -> None:
        """The response is complete (or failed); stop watching."""
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._cycle is not None:
            setattr(self._cycle, LOST_HOOK, None)
