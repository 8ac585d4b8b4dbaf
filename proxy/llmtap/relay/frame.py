"""The proxy listener's frame: a Starlette application whose catch-all route is the relay, raw ASGI.

Starlette routes the request and runs the relay's lifespan; nothing of Starlette's sits on the response
path: no ``Request`` object, no ``StreamingResponse``, no ``BaseHTTPMiddleware``. Every method and every
path goes to the relay, which answers its own errors (a target that is not a path, ``*`` or an absolute
form included, reaches it through the router's default, so its guard refuses it with its own 400).
``bench/frame.py`` measures what the frame costs per request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["relay_frame"]

Hook = Callable[[], Awaitable[None]]


class Endpoint:
    """``relay`` as an ASGI object: Starlette serves an object raw, where it wraps a function or a bound
    method as a ``Request`` handler."""

    __slots__ = ("_relay",)

    def __init__(self, relay: ASGIApp) -> None:
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._relay(scope, receive, send)


def relay_frame(relay: ASGIApp, *, startup: Hook | None = None, shutdown: Hook | None = None) -> Starlette:
    """The Starlette application around ``relay``, with its start-up and shutdown as the lifespan."""

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
    return app
