"""A request's walk through llmtap's modules: how many times control enters each one from another.

``Walk`` is a ``sys.setprofile`` hook: a call whose frame is in one llmtap module and whose caller's frame is in
another llmtap module is one entry into the first. What is counted is the request's walk, the calls its tasks
make: a coroutine or generator resumed is the same entry going on, not a new one; calls from outside llmtap (the
server calling the application) are where the walk starts; calls within a module are not entries. The upstream's
read callbacks run outside any task, once per socket read, and are counted apart (``reads``): the path of a
chunk, not of a request; so are calls of a body's sink (``PART_SINKS``) and all they call, which the client also
makes from the request's task for the parts that came before the sink was attached.

``relay_walk`` serves the relay in this thread's event loop (llmtap's listener over uvicorn, a loopback upstream,
a raw client), warms it with one request of each kind, then walks one non-streamed and one streamed request
under the hook: the counts of each, per module and per (caller, callee) pair.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from llmtap.config.types import Route, Settings
from llmtap.relay.app import create_app
from llmtap.relay.channel import LocalChannel
from llmtap.serve.server import uvicorn_config
from tests.support.net import uvicorn_serving

__all__ = ["PART_SINKS", "Walk", "Walks", "relay_walk"]

#: Functions called once per body part (``module:qualname``): counted apart, in ``parts``.
PART_SINKS = frozenset({"llmtap.relay.pipe:Pipe.__call__"})
_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE

_ANSWER = b'{"id":"x","object":"chat.completion","choices":[{"message":{"role":"assistant","content":"hi"}}]}'
_CHUNKS = [
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"delta":{"content":"%d"}}]}\n\n' % i
    for i in range(5)
] + [b"data: [DONE]\n\n"]
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Walk:
    """Entries into each llmtap module from another llmtap module, while installed (``with Walk() as walk``)."""

    def __init__(self) -> None:
        #: Entries into each module in the request's tasks, and per (caller, callee) pair.
        self.entries: Counter[str] = Counter()
        self.pairs: Counter[tuple[str, str]] = Counter()
        #: Entries made in callbacks outside any task (the upstream's socket reads), per (caller, callee) pair.
        self.reads: Counter[tuple[str, str]] = Counter()
        #: Calls of a body part's sink made in the request's tasks.
        self.parts = 0
        self._part: FrameType | None = None
        self._started: set[FrameType] = set()

    def __enter__(self) -> Walk:
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        self._started.clear()

    def relay(self) -> dict[str, int]:
        """The entries into each of the relay's modules (``llmtap.relay.*``)."""
        return {name: count for name, count in sorted(self.entries.items()) if name.startswith("llmtap.relay.")}

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        if self._part is not None:
            if event == "return" and frame is self._part:
                self._part = None
            return
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("llmtap."):
            return
        if frame.f_code.co_flags & _RESUMABLE:
            if frame in self._started:
                return  # resumed
            self._started.add(frame)
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if caller == callee or not caller.startswith("llmtap."):
            return
        if asyncio.current_task() is None:
            self.reads[(caller, callee)] += 1
            return
        if f"{callee}:{frame.f_code.co_qualname}" in PART_SINKS:
            self.parts += 1
            self._part = frame
            return
        self.entries[callee] += 1
        self.pairs[(caller, callee)] += 1


@dataclass
class Walks:
    """The walk of one non-streamed request and of one streamed request."""

    plain: Walk = field(default_factory=Walk)
    streamed: Walk = field(default_factory=Walk)


class _NoTelemetry:
    """The telemetry side, reduced to taking each message (the walk is the relay's)."""

    def submit(self, message: object, source: int = 0) -> bool:
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        return None


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request: a JSON body, or a chunked event stream when the request asks for one."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(_length(head))
            if b'"stream":true' in body:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for chunk in _CHUNKS:
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(_ANSWER), _ANSWER)
                )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _request(stream: bool) -> bytes:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":%s}' % (b"true" if stream else b"false")
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: llmtap\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: bool) -> bytes:
    """One request on the client's keep-alive connection; its response, read to its end."""
    writer.write(_request(stream))
    head = await reader.readuntil(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                return head + body
    return head + await reader.readexactly(_length(head))


def _length(head: bytes) -> int:
    """A head's Content-Length (0 when it names none)."""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


async def _walks(inject_usage: bool) -> Walks:
    up = await asyncio.start_server(_upstream, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    route = Route(prefix="/", upstream=f"http://127.0.0.1:{up_port}", name="walk", provider="openai")
    settings = Settings(routes=(route,), inject_usage=inject_usage)
    app = create_app(settings, channel=LocalChannel(_NoTelemetry()))
    walks = Walks()
    try:
        async with uvicorn_serving(uvicorn_config(app, settings)) as address:
            reader, writer = await asyncio.open_connection(*address)
            for stream in (False, True):  # warm: the upstream's connection, its origin, every module loaded
                await _exchange(reader, writer, stream)
            with walks.plain:
                plain = await _exchange(reader, writer, False)
            with walks.streamed:
                streamed = await _exchange(reader, writer, True)
            if not plain.startswith(b"HTTP/1.1 200") or not streamed.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the relay did not answer 200: {plain[:40]!r} {streamed[:40]!r}")
            writer.close()
    finally:
        up.close()
        await up.wait_closed()
    return walks


def relay_walk(*, inject_usage: bool = False) -> Walks:
    """The walks of one non-streamed and one streamed request through a relay served in this thread."""
    return asyncio.run(_walks(inject_usage))
