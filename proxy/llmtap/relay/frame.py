"""The proxy listener's frame: every HTTP request straight to the relay, raw ASGI; the lifespan through Starlette.

Every method and every path goes to the relay, which answers its own errors (a target that is not a path,
``*`` or an absolute form included: its guard refuses it with its own 400), so there is nothing to route: an HTTP
scope goes to the relay at once, without Starlette's error and exception middleware, its router's match of a
catch-all pattern and the two ``send`` wrappers those put around every message (5 µs a request and 0.4 µs a
relayed message, ``python -m bench.probes.frame``). An exception that escapes the relay meets uvicorn, which logs it
and answers 500 when no head was sent, as Starlette's error middleware did. Starlette still runs the relay's
lifespan (start-up and shutdown), and anything else (a WebSocket scope, should a server hand one over) goes
through its router to the relay too.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["Frame", "relay_frame"]

Hook = Callable[[], Awaitable[None]]


class Endpoint:
    """``relay`` as an ASGI object: Starlette serves an object raw, where it wraps a function or a bound
    method as a ``Request`` handler."""

    __slots__ = ("_relay",)

    def __init__(self, relay: ASGIApp) -> None:
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._relay(scope, receive, send)


class Frame:
    """The listener's application: HTTP to the relay directly, everything else (the lifespan) to Starlette."""

    __slots__ = ("_relay", "starlette")

    def __init__(self, relay: ASGIApp, starlette: Starlette) -> None:
        self._relay = relay
        #: The Starlette application that runs the lifespan and takes any scope that is not HTTP.
        self.starlette = starlette

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._relay(scope, receive, send)
        else:
            await self.starlette(scope, receive, send)


def relay_frame(relay: ASGIApp, *, startup: Hook | None = None, shutdown: Hook | None = None) -> Frame:
    """The frame around ``relay``, with its start-up and shutdown as the lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if startup is not None:
            await startup()
        try:
            yield
        finally:
            if shutdown is not None:
                await shutdown()

    endpoint = Endpoint(relay)
    app = Starlette(routes=[Route("/{path:path}", endpoint)], lifespan=lifespan)
    # Whatever the route does not take (a target that is not a path, a WebSocket) is the relay's too,
    # and never a redirect of Starlette's: a proxy answers for the upstream's paths, not its own.
    app.router.default = endpoint
    app.router.redirect_slashes = False
    return Frame(relay, app)
