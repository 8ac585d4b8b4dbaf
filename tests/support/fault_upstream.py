"""A fault-injecting LLM upstream on raw asyncio streams: every way an upstream can break, chosen per request.

``python -m tests.support.fault_upstream`` prints its port on stdout. ``POST .../chat/completions`` answers with
an OpenAI chat stream (``"stream": true``) or body in vLLM's shape; the request header ``x-fault`` picks a
fault (``FAULTS``) and ``x-fault-arg`` its size. ``x-chunks`` and ``x-gap-ms`` shape a normal stream;
``x-say`` makes the answer that text, one character per chunk; ``x-ignore-body`` answers a stream without
parsing the request. ``GET /echo`` returns the target and headers
as they arrived here.
Each request named by ``x-request-id`` leaves a record at ``GET /sent/<id>``: the sha256 of the body bytes
it wrote (and of the same bytes without the usage event, which the proxy removes when it asked for usage
on the client's behalf; with ``x-keep: 1``, ``?prefix=N`` gives the sha256 of the first N), how many bytes
reached the kernel, and when it saw the client leave, on
``time.monotonic()`` (CLOCK_MONOTONIC, shared by every process on the machine). ``GET /stats`` counts open
connections and running responses. Every response is deterministic, so a direct call and a call through
the proxy can be compared byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import socket
import struct
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.support import chunks
from tests.support.rawhttp import parse_head, read_body

WORDS = (" alpha", " beta", " gamma", " delta", " river", " sigma", " omega", " theta")  # one o200k token each
#: What ``x-fault`` can ask for; anything else (or nothing) is a normal answer.
FAULTS = (
    "reset-before-headers",
    "close-before-headers",
    "stall-headers",
    "stall-body",
    "reset-mid-stream",
    "close-mid-stream",
    "cl-long",
    "cl-short",
    "status-500",
    "big-line",
    "tiny-events",
    "deep-json",
    "overflow",
    "dup-usage",
    "cumulative-usage",
    "flood",
    "one-letter",
    "gzip-bomb",
    "gzip-members",
)
#: The response a ``cl-short`` upstream hides after its declared body; it must never reach a client.
SMUGGLED = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 8\r\n\r\nSMUGGLED"
_KEEP = 4096  # records kept for /sent


def chat_chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    """One ``data:`` event of a chat stream, compact as vLLM writes it."""
    return chunks.chat_chunk(delta, finish, model="fault", ident="chatcmpl-fault", usage=usage)


def usage_event(prompt: int, completion: int) -> bytes:
    """The extra usage event ``include_usage`` asks for (``choices: []``)."""
    return chunks.usage_chunk(prompt, completion, model="fault", ident="chatcmpl-fault")


@dataclass
class Sent:
    """What one named request received from this upstream."""

    sha: Any = field(default_factory=hashlib.sha256)
    sha_without_usage: Any = field(default_factory=hashlib.sha256)
    written: int = 0  # body bytes handed to the kernel
    done: bool = False
    gone_at: float | None = None  # when the client (the proxy) was seen to leave
    transport: asyncio.WriteTransport | None = None
    kept: bytearray | None = None  # the body itself, when the request said ``x-keep: 1``

    def add(self, data: bytes, *, usage: bool = False) -> None:
        """Body bytes written: hash them (apart from a usage event, in the second hash) and count them."""
        self.sha.update(data)
        if not usage:
            self.sha_without_usage.update(data)
        self.written += len(data)
        if self.kept is not None:
            self.kept += data

    def as_json(self, prefix: int | None = None) -> dict[str, Any]:
        buffered = self.transport.get_write_buffer_size() if self.transport is not None else 0
        info = {
            "sha256": self.sha.hexdigest(),
            "sha256_without_usage": self.sha_without_usage.hexdigest(),
            "written": self.written - buffered,
            "done": self.done,
            "gone_at": self.gone_at,
        }
        if prefix is not None and self.kept is not None:
            # A client cut off by a reset holds a prefix of what was written (the kernel drops the rest).
            info["prefix_sha256"] = hashlib.sha256(self.kept[:prefix]).hexdigest()
        return info


class Exchange:
    """One request being answered: the writer, the record, and a watch for the client leaving."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent: Sent) -> None:
        self.writer = writer
        self.sent = sent
        sent.transport = writer.transport
        self.gone = asyncio.Event()
        self._watch = asyncio.ensure_future(self._wait_eof(reader))

    async def _wait_eof(self, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.sent.gone_at = time.monotonic()
        self.gone.set()

    async def stop(self) -> None:
        """Stop watching; the next request on the connection reads the stream again."""
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch

    def head(self, status: str = "200 OK", headers: bytes = b"content-type: text/event-stream\r\n") -> None:
        self.writer.write(b"HTTP/1.1 " + status.encode() + b"\r\n" + headers + b"transfer-encoding: chunked\r\n\r\n")

    def event(self, data: bytes, *, usage: bool = False) -> None:
        """One body piece as its own HTTP chunk."""
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.sent.add(data, usage=usage)

    def end(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        self.sent.done = True

    async def drain(self) -> None:
        await self.writer.drain()

    async def hold(self) -> None:
        """Say nothing more until the client leaves."""
        await self.gone.wait()

    def reset(self) -> None:
        """Abort with a TCP RST (SO_LINGER 0), as a crashed server's kernel does."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


class Upstream:
    """Serves normal and broken answers; keeps a bounded record of what each named request got."""

    def __init__(self) -> None:
        self.sent: OrderedDict[str, Sent] = OrderedDict()
        self.open = 0
        self.active = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while True:
                method, target, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
                body = await read_body(reader, headers)
                if not await self.respond(reader, writer, method, target, headers, body):
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    def record(self, headers: dict[str, str]) -> Sent:
        sent = Sent(kept=bytearray() if headers.get("x-keep") == "1" else None)
        rid = headers.get("x-request-id")
        if rid:
            self.sent[rid] = sent
            while len(self.sent) > _KEEP:
                self.sent.popitem(last=False)
        return sent

    async def respond(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
    ) -> bool:
        """Answer one request; False when the connection must not be used again."""
        path = target.split("?", 1)[0]
        if method == "GET" and (path in ("/stats", "/echo") or path.startswith("/sent/")):
            if path == "/stats":
                info: dict[str, Any] = {"open": self.open, "active": self.active}
            elif path == "/echo":
                info = {"target": target, "headers": headers}
            else:
                found = self.sent.get(path[len("/sent/") :])
                query = target.partition("?")[2]
                prefix = int(query[len("prefix=") :]) if query.startswith("prefix=") else None
                info = found.as_json(prefix) if found is not None else {}
            payload = json.dumps(info).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload)
            )
            writer.write(payload)
            await writer.drain()
            return True
        try:
            # ``x-ignore-body``: a stream is answered unread (``bench.probes.body_flood``: the upstream's own parse of a
            # flood's bodies would take the cores the relay is measured on).
            request = {"stream": True} if "x-ignore-body" in headers else json.loads(body or b"{}")
        except ValueError:
            request = {}
        fault = headers.get("x-fault", "")
        arg = int(headers.get("x-fault-arg", "0") or 0)
        ex = Exchange(reader, writer, self.record(headers))
        self.active += 1
        try:
            return await self._answer(ex, fault, arg, request, headers)
        except ConnectionError:
            ex.sent.gone_at = ex.sent.gone_at or time.monotonic()
            return False
        finally:
            self.active -= 1
            await ex.stop()

    async def _answer(
        self, ex: Exchange, fault: str, arg: int, request: dict[str, Any], headers: dict[str, str]
    ) -> bool:
        if fault == "reset-before-headers":
            ex.reset()
            return False
        if fault == "close-before-headers":
            return False
        if fault == "stall-headers":
            await ex.hold()
            return False
        if fault == "status-500":
            payload = b'{"error":{"message":"boom","type":"InternalServerError","code":500}}'
            ex.writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            await ex.drain()
            return True
        if fault in ("cl-long", "cl-short"):
            return await _wrong_length(ex, fault)
        if fault == "flood":
            await _flood(ex, arg)
            return True
        if fault in ("gzip-bomb", "gzip-members"):
            ex.head(headers=b"content-type: text/event-stream\r\ncontent-encoding: gzip\r\n")
            await (_gzip_bomb if fault == "gzip-bomb" else _gzip_members)(ex, arg)
            ex.end()
            await ex.drain()
            return True
        if fault in _HOSTILE:
            ex.head()
            await _HOSTILE[fault](ex, arg)
            ex.end()
            await ex.drain()
            return True
        say = headers.get("x-say", "")
        chunks = len(say) if say else int(headers.get("x-chunks", "20"))
        words = [say[i] for i in range(len(say))] if say else [WORDS[i % len(WORDS)] for i in range(chunks)]
        gap = float(headers.get("x-gap-ms", "0")) / 1000
        if not request.get("stream"):
            await _whole(ex, "".join(words), chunks)
            return True
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        ex.head()
        return await _stream(ex, words, gap, include_usage, fault, arg)


async def _stream(ex: Exchange, words: list[str], gap: float, include_usage: bool, fault: str, arg: int) -> bool:
    """A chat stream of ``words``, or one that breaks after ``arg`` chunks (stall, reset or close mid-stream)."""
    chunks = len(words)
    start = time.monotonic()
    ex.event(chat_chunk({"role": "assistant", "content": ""}))
    await ex.drain()
    broken = fault in ("stall-body", "reset-mid-stream", "close-mid-stream")
    for i in range(chunks):
        if broken and i == (arg or 3):
            if fault == "stall-body":
                await ex.hold()
            elif fault == "reset-mid-stream":
                ex.reset()
            return False
        if gap:
            delay = start + (i + 1) * gap - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(ex.gone.wait(), delay)
                    return False  # the client left: stop generating
                except TimeoutError:
                    pass
        last = i == chunks - 1
        ex.event(chat_chunk({"content": words[i]}, "stop" if last else None))
        await ex.drain()
    if include_usage:
        ex.event(usage_event(12, chunks), usage=True)
    ex.event(b"data: [DONE]\n\n")
    ex.end()
    await ex.drain()
    return True


async def _whole(ex: Exchange, text: str, chunks: int) -> None:
    payload = json.dumps(
        {
            "id": "chatcmpl-fault",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "fault",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks},
        }
    ).encode()
    ex.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload))
    ex.writer.write(payload)
    ex.sent.add(payload)
    ex.sent.done = True
    await ex.drain()


async def _wrong_length(ex: Exchange, fault: str) -> bool:
    """A body shorter than its Content-Length (then close), or longer (a second response hidden behind it)."""
    body = b'{"id":"chatcmpl-fault","object":"chat.completion","choices":[]}'
    declared = len(body) + 100 if fault == "cl-long" else len(body)
    extra = SMUGGLED if fault == "cl-short" else b""
    ex.writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s%s" % (declared, body, extra)
    )
    ex.sent.add(body)
    await ex.drain()
    if fault == "cl-long":
        await asyncio.sleep(0.05)
        return False
    return True


async def _flood(ex: Exchange, size: int) -> None:
    """``size`` bytes of one SSE comment as fast as the reader takes them: what backpressure must hold back."""
    block = b":" + b"x" * (65536 - 2) + b"\n"
    ex.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % size)
    left = size
    while left > 0:
        piece = block[:left]
        ex.writer.write(piece)
        ex.sent.add(piece)
        left -= len(piece)
        await ex.drain()
    ex.sent.done = True


async def _big_line(ex: Exchange, size: int) -> None:
    """One ``data:`` line of ``size`` bytes with no newline for all of it, then a normal ending."""
    block = b"x" * (1 << 20)
    ex.event(b'data: {"pad":"')
    left = size
    while left > 0:
        ex.event(block[:left])
        left -= min(left, len(block))
        await ex.drain()
    ex.event(b'"}\n\n')
    await _finish(ex, 1)


async def _tiny_events(ex: Exchange, count: int) -> None:
    """``count`` one-token content events, packed 1000 to a write."""
    one = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    for start in range(0, count, 1000):
        ex.event(one * min(1000, count - start))
        await ex.drain()
    await _finish(ex, count, content=False)


def _letter_events(size: int) -> Iterator[bytes]:
    """``size`` bytes of content, one letter repeated, in events of 64 KiB of it: a run tiktoken cannot split."""
    left = size
    while left > 0:
        n = min(left, 65536)
        yield b'data: {"choices":[{"index":0,"delta":{"content":"' + b"a" * n + b'"}}]}\n\n'
        left -= n


async def _one_letter(ex: Exchange, size: int) -> None:
    """``size`` bytes of content of one letter, as fast as the reader takes them, then usage."""
    for event in _letter_events(size):
        ex.event(event)
        await ex.drain()
    await _finish(ex, size // 8)


_bombs: dict[int, list[bytes]] = {}


async def _gzip_bomb(ex: Exchange, size: int) -> None:
    """A gzip-encoded stream of ``size`` bytes of SSE (one-letter content events and usage): about a
    thousandth of that on the wire. Compressed once per size and kept, so repeated requests cost nothing."""
    if size not in _bombs:
        pack = zlib.compressobj(9, zlib.DEFLATED, 31)
        wire = bytearray()
        for event in _letter_events(size):
            wire += pack.compress(event)
        wire += pack.compress(chat_chunk({}, "stop") + usage_event(12, size // 8) + b"data: [DONE]\n\n")
        wire += pack.flush()
        _bombs.clear()
        _bombs[size] = [bytes(wire[i : i + 16384]) for i in range(0, len(wire), 16384)]
    for piece in _bombs[size]:
        ex.event(piece)
        await ex.drain()


async def _gzip_members(ex: Exchange, size: int) -> None:
    """The same ``size`` bytes of letter events as ``gzip-bomb``, as one gzip member of 1 MiB repeated (RFC 1952
    section 2.2 lets members follow one another): compressed in milliseconds whatever ``size`` is."""
    member = gzip.compress(b"".join(_letter_events(1 << 20)), 9)
    for _ in range(size >> 20):
        ex.event(member)
        await ex.drain()
    ex.event(gzip.compress(chat_chunk({}, "stop") + usage_event(12, size // 8) + b"data: [DONE]\n\n"))
    await ex.drain()


async def _deep_json(ex: Exchange, depth: int) -> None:
    """An event nested ``depth`` arrays deep (past any recursion limit), then a normal stream."""
    ex.event(b"data: " + b"[" * depth + b"]" * depth + b"\n\n")
    ex.event(b'data: {"choices":[{"index":0,"delta":{"content":' + b"[" * depth + b"]" * depth + b"}}]}\n\n")
    await _finish(ex, 3)


async def _overflow(ex: Exchange, _: int) -> None:
    """Numbers no counter can hold: 1e400 (inf), 10**30, negative and non-integer token counts."""
    huge = b'{"prompt_tokens":1e400,"completion_tokens":100000000000000000000000000000,"total_tokens":-5}'
    ex.event(b'data: {"choices":[{"index":0,"delta":{"content":" alpha"}}],"usage":' + huge + b"}\n\n")
    ex.event(b'data: {"choices":[],"usage":{"prompt_tokens":12.5,"completion_tokens":-3}}\n\n')
    ex.event(b'data: {"choices":[{"index":0,"delta":{"content":" beta"},"finish_reason":"stop"}]}\n\n')
    ex.event(b"data: [DONE]\n\n")


async def _dup_usage(ex: Exchange, chunks: int) -> None:
    """A normal stream whose usage event comes three times."""
    chunks = chunks or 5
    for i in range(chunks):
        ex.event(chat_chunk({"content": WORDS[i % len(WORDS)]}, "stop" if i == chunks - 1 else None))
    for _ in range(3):
        ex.event(usage_event(12, chunks), usage=True)
    ex.event(b"data: [DONE]\n\n")


async def _cumulative_usage(ex: Exchange, chunks: int) -> None:
    """vLLM's ``continuous_usage_stats``: usage so far on every chunk, then the final usage event."""
    chunks = chunks or 5
    for i in range(chunks):
        usage = {"prompt_tokens": 12, "completion_tokens": i + 1, "total_tokens": 13 + i}
        ex.event(chat_chunk({"content": WORDS[i % len(WORDS)]}, "stop" if i == chunks - 1 else None, usage))
        await ex.drain()
    ex.event(usage_event(12, chunks), usage=True)
    ex.event(b"data: [DONE]\n\n")


async def _finish(ex: Exchange, tokens: int, *, content: bool = True) -> None:
    if content:
        ex.event(chat_chunk({"content": " alpha"}))
    ex.event(chat_chunk({}, "stop"))
    ex.event(usage_event(12, tokens), usage=True)
    ex.event(b"data: [DONE]\n\n")


_HOSTILE: dict[str, Callable[[Exchange, int], Awaitable[None]]] = {
    "big-line": _big_line,
    "one-letter": _one_letter,
    "tiny-events": _tiny_events,
    "deep-json": _deep_json,
    "overflow": _overflow,
    "dup-usage": _dup_usage,
    "cumulative-usage": _cumulative_usage,
}


async def main() -> None:
    up = Upstream()
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0, limit=1 << 20, backlog=1024)
    sys.stdout.write(f"{server.sockets[0].getsockname()[1]}\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
