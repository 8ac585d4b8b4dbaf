"""The servers' own loop (``llmtap.serve.server.Server``): one look a second while idle, a stop seen at once."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn

from llmtap.serve import server as server_module
from llmtap.serve.server import Server


async def _app(scope: dict[str, Any], receive: object, send: object) -> None:  # never called: no request is made
    raise AssertionError(scope)


async def test_a_stop_is_seen_at_once_not_at_the_next_look(monkeypatch: pytest.MonkeyPatch) -> None:
    # A look an hour apart: only the stop's own wake-up can end the server within the test.
    monkeypatch.setattr(server_module, "TICK", 3600.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(_app, log_level="warning", lifespan="off"))
    listening = asyncio.Event()
    server.on_started = listening.set
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(30):
        await listening.wait()
    await asyncio.sleep(0.2)  # the loop is in its wait now
    server.should_exit = True
    async with asyncio.timeout(30):
        await serving
    assert server.should_exit


async def test_a_stop_before_the_loop_runs_is_kept() -> None:
    server = Server(uvicorn.Config(_app, log_level="warning", lifespan="off"))
    assert not server.should_exit
    server.should_exit = True
    async with asyncio.timeout(30):
        await server.main_loop()  # returns at its first look
