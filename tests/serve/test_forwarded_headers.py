"""Which client address a listener's application sees: the relay's is the connection's peer, whatever
``X-Forwarded-For`` says (the relay passes the header on as sent); the admin listener's is the one a proxy on
loopback forwards, as uvicorn's rewrite gives it."""

from __future__ import annotations

import asyncio
from typing import Any

from llmtap.config.types import Route, Settings
from llmtap.serve.server import uvicorn_config
from tests.support.net import uvicorn_serving

SETTINGS = Settings(routes=(Route(prefix="/", upstream="http://127.0.0.1:9", name="r"),))


async def _seen(forwarded: bool | None) -> tuple[dict[str, Any], bytes]:
    """The scope's client and scheme an application sees for a request from loopback with forwarded headers."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.update(client=scope["client"], scheme=scope["scheme"], headers=dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn_config(app, SETTINGS) if forwarded is None else uvicorn_config(app, SETTINGS, forwarded=forwarded)
    config.lifespan = "off"
    async with uvicorn_serving(config) as address:
        reader, writer = await asyncio.open_connection(*address)
        writer.write(
            b"GET / HTTP/1.1\r\nhost: llmtap\r\nx-forwarded-for: 203.0.113.7\r\nx-forwarded-proto: https\r\n\r\n"
        )
        head = await reader.readuntil(b"\r\n\r\n")
        seen["peer"] = writer.get_extra_info("sockname")
        writer.close()
    return seen, head


def test_the_relay_listener_reports_the_peer_and_passes_the_forwarded_headers_on() -> None:
    seen, head = asyncio.run(_seen(None))
    assert head.startswith(b"HTTP/1.1 204")
    assert seen["client"] == tuple(seen["peer"][:2]) and seen["scheme"] == "http"
    # What the relay sends upstream is built from the headers as sent: they are still there.
    assert seen["headers"][b"x-forwarded-for"] == b"203.0.113.7"
    assert seen["headers"][b"x-forwarded-proto"] == b"https"


def test_the_admin_listener_sees_the_address_a_local_proxy_forwards() -> None:
    seen, head = asyncio.run(_seen(True))
    assert head.startswith(b"HTTP/1.1 204")
    assert seen["client"][0] == "203.0.113.7" and seen["scheme"] == "https"
