"""A short answer whose body comes in a read after its head (an upstream that writes them apart, as uvicorn does):
the relay waits for the counted rest, within its bounds, and writes head and body at once; the client and the
telemetry side get what the ordinary path (the head at once, then the pipe) gives them. Past a bound, on a
failure, a late rest or a client that leaves, the answer ends as the ordinary path ends it."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from llmtap.config.types import Route, Settings
from llmtap.relay import exchange
from llmtap.relay.app import create_app
from llmtap.relay.oneshot import write_whole
from llmtap.serve.server import uvicorn_config
from llmtap.wire.messages import End
from tests.support.net import uvicorn_serving
from tests.support.tapes import KeptChannel

BODY = b'{"model":"m","input":"the quick brown fox"}'
ANSWER = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,0.25]}],"model":"m"}'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-up: 1\r\n\r\n" % len(ANSWER)
#: Where the answer's body is cut: the first part goes with the head, the rest in a later write.
CUT = 30

#: What the upstream does once it has a request: given its writer and the client's "head seen" event.
Script = Callable[[asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


class _Run:
    """One request through a relay under llmtap's listener, to an upstream that answers by ``script``."""

    def __init__(self, script: Script, *, idle: float | None = None) -> None:
        self.script = script
        self.idle = idle
        self.seen_head = asyncio.Event()
        self.upstream_closed = asyncio.Event()
        self.channel = KeptChannel()

    async def _upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            size = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(size)
            await self.script(writer, self.seen_head)
            # Until the relay closes the connection (or parks it: the test's end closes it then).
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.upstream_closed.set()
            writer.close()

    async def go(self, client: Callable[[asyncio.StreamReader, asyncio.StreamWriter, _Run], Awaitable[Any]]) -> Any:
        up = await asyncio.start_server(self._upstream, "127.0.0.1", 0)
        route = Route(prefix="/", upstream=f"http://127.0.0.1:{up.sockets[0].getsockname()[1]}", name="r")
        settings = Settings(routes=(route,))
        if self.idle is not None:
            settings = replace(settings, timeouts=replace(settings.timeouts, idle=self.idle))
        try:
            async with uvicorn_serving(uvicorn_config(create_app(settings, channel=self.channel), settings)) as address:
                reader, writer = await asyncio.open_connection(*address)
                writer.write(
                    b"POST /v1/embeddings HTTP/1.1\r\nhost: llmtap\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
                )
                try:
                    return await client(reader, writer, self)
                finally:
                    writer.close()
        finally:
            up.close()
            await up.wait_closed()


async def _read_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, run: _Run) -> bytes:
    """The whole answer, the upstream told once its head is here; what came before the connection ended if cut."""
    head = await reader.readuntil(b"\r\n\r\n")
    run.seen_head.set()
    try:
        return head + await reader.readexactly(len(ANSWER))
    except asyncio.IncompleteReadError as cut:
        return head + cut.partial


async def _in_two(writer: asyncio.StreamWriter, seen: asyncio.Event) -> None:
    """The head with the body's first part, then its rest a moment later: two reads at the relay."""
    writer.write(HEAD + ANSWER[:CUT])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(ANSWER[CUT:])
    await writer.drain()


async def _rest_after_the_head(writer: asyncio.StreamWriter, seen: asyncio.Event) -> None:
    """The head and a first part; the rest only once the client has the head (so only the ordinary path ends)."""
    writer.write(HEAD + ANSWER[:CUT])
    await writer.drain()
    await seen.wait()
    writer.write(ANSWER[CUT:])
    await writer.drain()


async def _closed_mid_body(writer: asyncio.StreamWriter, seen: asyncio.Event) -> None:
    writer.write(HEAD + ANSWER[:CUT])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


async def _head_only(writer: asyncio.StreamWriter, seen: asyncio.Event) -> None:
    """The head and a first part, then silence."""
    writer.write(HEAD + ANSWER[:CUT])
    await writer.drain()


def _wholes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the answers written at once."""
    wholes: list[int] = []

    def counted(*args: Any) -> None:
        wholes.append(1)
        write_whole(*args)

    monkeypatch.setattr(exchange, "write_whole", counted)
    return wholes


def _tape(end: End) -> tuple[Any, ...]:
    """What the tape says of the answer: its reads' sizes and bytes, whether each was delivered, and how it ended."""
    delivered = array("d", end.reads.delivered)
    sizes = tuple(array("l", end.reads.sizes))
    tail = end.tail
    outcome = (tail.error_type, tail.cancelled, tail.response_bytes, tail.surplus)
    return sizes, end.reads.data, [d == d for d in delivered], outcome


def _relayed(monkeypatch: pytest.MonkeyPatch, script: Script, **run: Any) -> tuple[bytes, End]:
    async def go() -> tuple[bytes, list[End]]:
        relay = _Run(script, **run)
        answer = await relay.go(_read_answer)
        return answer, relay.channel.ends()

    answer, ends = asyncio.run(go())
    assert len(ends) == 1
    return answer, ends[0]


def test_a_body_that_follows_its_head_goes_with_it_at_once_as_the_ordinary_path_relays_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wholes = _wholes(monkeypatch)
    at_once, tape = _relayed(monkeypatch, _in_two)
    assert len(wholes) == 1
    monkeypatch.setattr(exchange, "REST_BYTES", 0)  # nothing is waited for: the head at once, then the pipe
    ordinary, ordinary_tape = _relayed(monkeypatch, _in_two)
    assert len(wholes) == 1
    assert at_once == ordinary
    assert at_once.startswith(b"HTTP/1.1 200 OK\r\n") and at_once.endswith(b"\r\n\r\n" + ANSWER)
    assert b"x-up: 1\r\n" in at_once
    # Each upstream read is a read of its own on the tape, delivered, as through the pipe.
    assert _tape(tape) == _tape(ordinary_tape)
    assert _tape(tape)[0] == (CUT, len(ANSWER) - CUT)
    assert _tape(tape)[3] == (None, False, len(ANSWER), 0)


def test_a_rest_that_is_late_leaves_the_head_to_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    wholes = _wholes(monkeypatch)
    monkeypatch.setattr(exchange, "REST_WAIT", 0.05)
    answer, tape = _relayed(monkeypatch, _rest_after_the_head)
    assert answer.endswith(b"\r\n\r\n" + ANSWER) and answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert wholes == []
    assert _tape(tape)[3] == (None, False, len(ANSWER), 0)


def test_a_body_past_the_bound_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    wholes = _wholes(monkeypatch)
    monkeypatch.setattr(exchange, "REST_BYTES", len(ANSWER) - 1)
    answer, tape = _relayed(monkeypatch, _in_two)
    assert answer.endswith(b"\r\n\r\n" + ANSWER)
    assert wholes == []
    assert _tape(tape)[0] == (CUT, len(ANSWER) - CUT)


def test_an_upstream_that_closes_during_the_wait_is_cut_as_the_ordinary_path_cuts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wholes = _wholes(monkeypatch)
    monkeypatch.setattr(exchange, "REST_WAIT", 30.0)
    answer, tape = _relayed(monkeypatch, _closed_mid_body)
    monkeypatch.setattr(exchange, "REST_BYTES", 0)
    ordinary, ordinary_tape = _relayed(monkeypatch, _closed_mid_body)
    assert wholes == []
    # The head and the part there was, then the connection ends short of the Content-Length.
    assert answer == ordinary and answer.endswith(b"\r\n\r\n" + ANSWER[:CUT])
    assert _tape(tape) == _tape(ordinary_tape)
    assert _tape(tape)[3][0] == "upstream_closed"


def test_a_silent_upstream_is_timed_out_by_the_idle_timeout_shorter_than_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wholes = _wholes(monkeypatch)
    monkeypatch.setattr(exchange, "REST_WAIT", 30.0)
    answer, tape = _relayed(monkeypatch, _head_only, idle=0.2)
    assert wholes == []
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\n" + ANSWER[:CUT])
    assert _tape(tape)[3][0] == "idle_timeout"


def test_a_client_that_leaves_during_the_wait_stops_the_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange, "REST_WAIT", 30.0)

    async def leaves(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, run: _Run) -> bool:
        await asyncio.sleep(0.1)  # the relay has sent the request and reads the head
        writer.close()
        # The relay closes its upstream connection once the client is gone (generous: a busy machine).
        await asyncio.wait_for(run.upstream_closed.wait(), 20)
        return True

    async def go() -> list[End]:
        relay = _Run(_head_only)
        assert await relay.go(leaves)
        for _ in range(200):  # the tape is handed over as the exchange ends
            if relay.channel.ends():
                break
            await asyncio.sleep(0.05)
        return relay.channel.ends()

    ends = asyncio.run(go())
    assert len(ends) == 1
    assert ends[0].tail.cancelled and ends[0].tail.error_type == "cancelled"
