"""The benchmark's upstream: a lean, scripted OpenAI-compatible stream on raw asyncio, recording its own send times.

Per request: headers and the role-only chunk at once, the first content chunk ``ttft`` after the request
arrived, then one content chunk every ``gap`` (deadlines absolute from arrival, so lateness never adds
up), then the finish, usage and ``[DONE]`` events. Each content chunk is its own HTTP chunk and its own
``write``. The moment each write returned is recorded on ``time.perf_counter()`` (CLOCK_MONOTONIC, the
clock every process on the machine shares), so the harness can subtract what the upstream really did
from what a client saw, request by request, chunk by chunk.

``GET /bench/probes/records`` returns (and forgets) every finished request's record. Run
``python -m bench.upstream --port 0``: it prints its port on stdout. With ``--tls-cert`` and ``--tls-key``
the same process also listens with TLS (``--tls-port``, 0 for any) and prints that port on a second line;
both listeners share the script and the records, so one upstream serves plain and HTTPS paths of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import ssl
import time
from typing import Any, cast

from tests.support.chunks import chat_chunk, usage_chunk

WORDS = (" alpha", " beta", " gamma", " delta", " river", " sigma", " omega", " theta")  # one o200k token each
#: The client puts ``bench-id:<id>`` in its prompt; proxies relay the prompt, so the id survives any path.
BENCH_ID = re.compile(rb"bench-id:([A-Za-z0-9_.+-]+)")


class Script:
    """What every stream does: ``chunks`` content chunks, ``gap`` apart, the first one ``ttft`` after arrival.

    With ``ttft_max`` above ``ttft``, each request's TTFT is spread log-uniformly between the two by a
    fixed sequence (a spread of values is what a histogram's percentiles need to be tested on).
    """

    def __init__(self, chunks: int, gap: float, ttft: float, ttft_max: float | None = None) -> None:
        self.chunks = chunks
        self.gap = gap
        self.ttft = ttft
        self.ttft_max = ttft_max if ttft_max is not None and ttft_max > ttft else None
        self._n = 0

    def next_ttft(self) -> float:
        """The TTFT of the next request."""
        if self.ttft_max is None:
            return self.ttft
        self._n += 1
        # The golden-ratio sequence fills [0, 1) evenly without repeating.
        u = (self._n * 0.6180339887498949) % 1.0
        return self.ttft * math.exp(u * math.log(self.ttft_max / self.ttft))


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    return chat_chunk(delta, finish, model=model, ident="chatcmpl-bench")


def _usage(model: str, prompt: int, completion: int) -> bytes:
    return usage_chunk(prompt, completion, model=model, ident="chatcmpl-bench")


class Upstream:
    """Shared state: the script and the records of finished requests."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.records: list[dict[str, Any]] = []
        self.connections = 0
        self._content: dict[str, list[bytes]] = {}

    def content_events(self, model: str) -> list[bytes]:
        """The pre-rendered content events of a model (rendering once keeps per-chunk work to one write)."""
        events = self._content.get(model)
        if events is None:
            events = [_chunk(_event(model, {"content": WORDS[i % len(WORDS)]})) for i in range(self.script.chunks)]
            self._content[model] = events
        return events


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered one at a time, as clients send them."""

    def __init__(self, up: Upstream) -> None:
        self.up = up
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.handles: list[asyncio.TimerHandle] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.up.connections += 1
        self.serial = self.up.connections
        self.tls = transport.get_extra_info("sslcontext") is not None

    def connection_lost(self, exc: Exception | None) -> None:
        for handle in self.handles:
            handle.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        arrived = time.perf_counter()
        self.buf += data
        if self.busy:
            return
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        end = head_end + 4 + length
        if len(self.buf) < end:
            return
        body, self.buf = self.buf[head_end + 4 : end], self.buf[end:]
        method, target = head.split(" ", 2)[:2]
        if method == "GET" and target.startswith("/bench/probes/records"):
            records, self.up.records = self.up.records, []
            self._respond(200, "application/json", json.dumps(records).encode())
        elif method == "POST" and target.endswith("/chat/completions"):
            self._chat(body, arrived)
        else:
            self._respond(404, "application/json", b'{"error":{"message":"not found"}}')

    def _respond(self, status: int, content_type: str, body: bytes) -> None:
        assert self.transport is not None
        head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
        self.transport.write(head.encode() + body)

    def _chat(self, body: bytes, arrived: float) -> None:
        try:
            request = json.loads(body)
        except ValueError:
            self._respond(400, "application/json", b'{"error":{"message":"bad json"}}')
            return
        model = str(request.get("model") or "bench")
        found = BENCH_ID.search(body)
        prompt_tokens = max(1, len(body) // 4)
        script = self.up.script
        record: dict[str, Any] = {
            "id": found.group(1).decode() if found else None,
            "arrived": arrived,
            "ttft": script.next_ttft(),
            "conn": self.serial,
            "tls": self.tls,
            "sent": [],
        }
        if not request.get("stream"):
            text = "".join(WORDS[i % len(WORDS)] for i in range(script.chunks))
            answer = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": 1700000000,
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": script.chunks},
            }
            self._respond(200, "application/json", json.dumps(answer).encode())
            return
        usage = bool((request.get("stream_options") or {}).get("include_usage"))
        assert self.transport is not None
        self.busy = True
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        self.transport.write(head + _chunk(_event(model, {"role": "assistant", "content": ""})))
        events = self.up.content_events(model)
        tail = _chunk(_event(model, {}, "stop"))
        if usage:
            tail += _chunk(_usage(model, prompt_tokens, script.chunks))
        tail += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        loop = asyncio.get_running_loop()
        # loop.time() and perf_counter() are both CLOCK_MONOTONIC here; schedule on the loop's own clock.
        base = loop.time() - (time.perf_counter() - arrived) + record["ttft"]
        sent: list[float] = record["sent"]

        def send(i: int) -> None:
            transport = self.transport
            if transport is None:
                return
            transport.write(events[i])
            sent.append(time.perf_counter())
            if i + 1 < len(events):
                self.handles[0] = loop.call_at(base + (i + 1) * script.gap, send, i + 1)
                return
            transport.write(tail)
            self.up.records.append(record)
            self.busy = False
            self.handles.clear()
            if self.buf:
                self.data_received(b"")

        self.handles = [loop.call_at(base, send, 0)]


async def serve(host: str, port: int, script: Script, *, tls: ssl.SSLContext | None = None, tls_port: int = 0) -> None:
    """Serve until cancelled; print the bound port on stdout once listening (and the TLS port, with ``tls``)."""
    loop = asyncio.get_running_loop()
    up = Upstream(script)
    servers = [await loop.create_server(lambda: _Conn(up), host, port, backlog=4096)]
    if tls is not None:
        servers.append(await loop.create_server(lambda: _Conn(up), host, tls_port, backlog=4096, ssl=tls))
    for server in servers:
        print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.upstream``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--chunks", type=int, default=50)
    p.add_argument("--gap", type=float, default=0.020)
    p.add_argument("--ttft", type=float, default=0.020)
    p.add_argument("--ttft-max", dest="ttft_max", type=float)
    p.add_argument("--tls-cert", dest="tls_cert", help="PEM certificate chain: also listen with TLS")
    p.add_argument("--tls-key", dest="tls_key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-port", dest="tls_port", type=int, default=0, help="port of the TLS listener (0: any)")
    args = p.parse_args(argv)
    import uvloop

    tls = None
    if args.tls_cert:
        from pathlib import Path

        from bench.tlsca import server_context

        tls = server_context(Path(args.tls_cert), Path(args.tls_key or args.tls_cert))
    script = Script(args.chunks, args.gap, args.ttft, args.ttft_max)
    uvloop.run(serve(args.host, args.port, script, tls=tls, tls_port=args.tls_port))


if __name__ == "__main__":
    main()
