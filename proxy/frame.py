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
from starlette.types import ASGIApp

Hook = Callable[[], Awaitable[None]]


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

    app = Starlette(routes=[Route("/{path:path}", relay)], lifespan=lifespan)
    app.router.default = relay
    return app
