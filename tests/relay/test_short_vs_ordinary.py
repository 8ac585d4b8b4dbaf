"""A short answer relayed on the short path (llmtap's listener: the answer written at once) and on the ordinary path
(ASGI ``send``s, no listener's cycle) brings the same bytes upstream, the same answer to the client and the same
tape to the telemetry side, but for the moments and ids each request gets anew."""

from __future__ import annotations

import asyncio
import math
import re
import socket
from array import array
from collections.abc import MutableMapping
from typing import Any

import pytest
import uvicorn

from llmtap.cli import parser
from llmtap.config.load import build
from llmtap.relay import exchange
from llmtap.relay.app import create_app
from llmtap.relay.oneshot import write_whole
from llmtap.serve.server import uvicorn_config
from llmtap.wire.messages import End, decode
from tests.support.tapes import KeptChannel

BODY = b'{"model":"m","input":"the quick brown fox"}'
ANSWER = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}],"model":"m"}'
#: The client's fields (names as uvicorn gives them): its own, llmtap's, a trace to continue, one hop-by-hop.
FIELDS = [
    (b"host", b"llmtap.test"),
    (b"content-type", b"application/json"),
    (b"x-llmtap-tenant", b"acme"),
    (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    (b"connection", b"keep-alive"),
    (b"authorization", b"Bearer sk-test"),
    (b"content-length", b"%d" % len(BODY)),
]


class _Upstream:
    """Keeps each request's bytes and answers it with ``ANSWER``, its head and body in one write."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                self.requests.append(head + await reader.readexactly(size))
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-up: 1\r\n\r\n%s"
                    % (len(ANSWER), ANSWER)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _settings(port: int) -> Any:
    return build(vars(parser().parse_args(["serve", "--upstream", f"http://127.0.0.1:{port}"])))


async def _short(port: int, channel: KeptChannel) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Through llmtap's listener: the answer read whole goes out at once."""
    server = uvicorn.Server(uvicorn_config(create_app(_settings(port), channel=channel), _settings(port)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn's flag, no event to wait on
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection(*sock.getsockname())
    fields = b"".join(name + b": " + value + b"\r\n" for name, value in FIELDS)
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\n" + fields + b"\r\n" + BODY)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = [(n.lower(), v) for n, v in (line.split(b": ", 1) for line in lines[1:])]
    size = int(dict(headers)[b"content-length"])
    body = await reader.readexactly(size)
    writer.close()
    await writer.wait_closed()
    server.should_exit = True
    await serving
    return int(lines[0].split()[1]), headers, body


async def _ordinary(port: int, channel: KeptChannel) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Straight into the application, as another server would call it: no listener's cycle, ASGI ``send``s."""
    app = create_app(_settings(port), channel=channel)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "query_string": b"",
        "root_path": "",
        "headers": list(FIELDS),
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "extensions": {},
    }
    sent = asyncio.Event()
    bodies = [{"type": "http.request", "body": BODY, "more_body": False}]
    out: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if bodies:
            return bodies.pop()
        await sent.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        out.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            sent.set()

    await app(scope, receive, send)
    await app.aclose()  # its upstream connection closed, as the listener's shutdown closes the other's
    start = out[0]
    body = b"".join(m.get("body", b"") for m in out[1:])
    return start["status"], [(n.lower(), v) for n, v in start["headers"]], body


def _masked(request: bytes) -> bytes:
    """The request as sent upstream, the span id the relay makes for each request masked."""
    return re.sub(rb"(traceparent: 00-[0-9a-f]{32}-)[0-9a-f]{16}", rb"\1" + b"s" * 16, request)


def _tape(end: End) -> tuple[Any, ...]:
    """The tape's content but for the moments, the ids made per request, the key and the hand-over's count."""
    head, reads, tail = end.head, end.reads, end.tail
    assert head is not None
    moments = ("received", "received_wall_ns", "body_read", "admitted", "sent", "written", "headers_at")
    assert all(getattr(head, name) is not None for name in moments)
    kept = head._replace(
        received=0.0,
        received_wall_ns=0,
        body_read=None,
        admitted=None,
        sent=None,
        written=None,
        headers_at=None,
        span_id=b"",
        record_id=b"",
    )
    delivered = array("d", reads.delivered)
    assert len(delivered) == 1 and not math.isnan(delivered[0])
    assert tail.end is not None
    return kept, reads.sizes, reads.data, tail._replace(end=None)


def test_the_short_path_and_the_ordinary_path_relay_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    wholes: list[int] = []

    def counted(*args: Any) -> None:
        wholes.append(1)
        write_whole(*args)

    monkeypatch.setattr(exchange, "write_whole", counted)

    async def run() -> tuple[Any, ...]:
        upstream = _Upstream()
        server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        short, ordinary = KeptChannel(), KeptChannel()
        answers = [await _short(port, short)]
        taken = len(wholes)
        answers.append(await _ordinary(port, ordinary))
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.05)  # the upstream's handlers see their connections closed
        return taken, answers, upstream.requests, short.messages, ordinary.messages

    taken, answers, requests, short, ordinary = asyncio.run(run())
    assert taken == 1 and len(wholes) == 1  # the first went at once, the second the ordinary way
    assert answers[0] == answers[1]
    status, headers, body = answers[0]
    assert (status, body) == (200, ANSWER) and (b"x-up", b"1") in headers
    assert len(requests) == 2 and _masked(requests[0]) == _masked(requests[1])
    assert b"x-llmtap-tenant" not in requests[0] and b"connection:" not in requests[0].lower()
    ends = [[m for m in map(decode, messages) if isinstance(m, End)] for messages in (short, ordinary)]
    assert [len(e) for e in ends] == [1, 1]
    assert _tape(ends[0][0]) == _tape(ends[1][0])
    assert ends[0][0].head is not None and ends[0][0].head.attribution == ((b"x-llmtap-tenant", b"acme"),)
