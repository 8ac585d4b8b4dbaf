"""The requests-per-second benchmark's upstream: every POST answered at once with one fixed, small JSON body.

``python -m bench.fixed_upstream --bytes 160`` prints its port on stdout and answers each request (keep-alive,
pipelined or not) with the same ``application/json`` body of exactly ``--bytes`` bytes, an embeddings answer
(``object: list``, one short vector, usage). Nothing is recorded and nothing is parsed beyond the head's end and
``content-length``: on one core it serves a hundred thousand requests a second, so a proxy's own cost is what a
client measures in front of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import cast

#: The answer's fields before its vector is padded to the size asked for.
_SHAPE = {"object": "list", "model": "bench", "usage": {"prompt_tokens": 4, "total_tokens": 4}}


def answer_body(size: int) -> bytes:
    """An embeddings answer of exactly ``size`` bytes (its vector's last number padded with digits)."""
    base = {**_SHAPE, "data": [{"object": "embedding", "index": 0, "embedding": [0.0]}]}
    short = len(json.dumps(base, separators=(",", ":")))
    if size < short + 1:
        raise ValueError(f"an answer needs at least {short + 1} bytes")
    # 0.0 grows to 0.0125125...: each added digit is one byte.
    digits = ("125" * size)[: size - short]
    text = json.dumps(base, separators=(",", ":")).replace("[0.0]", f"[0.0{digits}]")
    body = text.encode()
    assert len(body) == size, (len(body), size)
    return body


def answer(size: int) -> bytes:
    """The whole HTTP/1.1 answer, head and body."""
    body = answer_body(size)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    return head + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection: each complete request in the buffer gets the fixed answer."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        answers = 0
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                break
            end = head_end + 4 + _content_length(buf[:head_end])
            if len(buf) < end:
                break
            buf = buf[end:]
            answers += 1
        self.buf = buf
        if answers and self.transport is not None:
            self.transport.write(self.reply * answers)


def _content_length(head: bytes) -> int:
    """The head's ``content-length`` (0 when it has none)."""
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    line_end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : line_end if line_end >= 0 else len(head)].strip())


async def serve(host: str, port: int, size: int) -> None:
    """Serve until cancelled; print the bound port once listening."""
    loop = asyncio.get_running_loop()
    reply = answer(size)
    server = await loop.create_server(lambda: _Conn(reply), host, port, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.fixed_upstream``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bytes", type=int, default=160, help="the answer body's size")
    args = p.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.host, args.port, args.bytes))


if __name__ == "__main__":
    main()
