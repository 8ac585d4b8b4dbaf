"""``llmtap.relay.bodyread``: a large body stays the pieces it came in, and the splice goes between them."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import MutableMapping
from typing import Any

import pytest

from llmtap.config.load import build
from llmtap.providers.bodyscan import BodyScan
from llmtap.providers.splice import prepare_usage
from llmtap.relay import bodyread
from llmtap.relay.app import create_app
from llmtap.relay.bodyread import SCAN_FROM, body_of, prepend, read_body, spliced
from llmtap.relay.oneshot import MIRRORED
from tests.conftest import PATIENCE
from tests.relay.test_oneshot import BODY, Cycle


def test_the_splice_goes_between_the_pieces_without_joining_them() -> None:
    parts = (b"abc", b"", b"defgh", b"ij")
    whole = b"".join(parts)
    for at in range(len(whole) + 1):
        out = spliced(parts, at, b"XY")
        assert b"".join(out) == whole[:at] + b"XY" + whole[at:]
        assert all(len(p) for p in out)
    assert b"".join(spliced(whole, 2, b"-")) == b"ab-cdefghij"
    with pytest.raises(ValueError):
        spliced(parts, len(whole) + 1, b"X")


def _receive(pieces: list[bytes]) -> Any:
    messages = [{"type": "http.request", "body": p, "more_body": i + 1 < len(pieces)} for i, p in enumerate(pieces)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


def test_a_large_body_is_read_as_it_comes_and_kept_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodyread, "SCAN_SLICE", 1000)
    body = b'{"stream":true,"messages":[{"role":"user","content":"' + b"word " * (SCAN_FROM // 4) + b'"}]}'
    pieces = [body[i : i + 65536] for i in range(0, len(body), 65536)]
    scan = BodyScan()
    got, more = asyncio.run(read_body(_receive(pieces), len(body), len(body), scan=scan))
    assert more is None and isinstance(got, tuple) and got == tuple(pieces)
    found = scan.insertion()
    assert found is not None and scan.fed == len(body) > SCAN_FROM
    assert b"".join(spliced(got, *found)) == prepare_usage(body, inject_usage=True).body
    # A small one is read whole, and not by the reader (json.loads is quicker for it).
    small, scan = b'{"stream":true}', BodyScan()
    got, more = asyncio.run(read_body(_receive([small[:5], small[5:]]), 100, 100, scan=scan))
    assert got == small and more is None and scan.fed == 0


def test_past_the_inspect_limit_the_rest_streams_after_the_pieces() -> None:
    pieces = [b"a" * SCAN_FROM, b"b" * 10, b"c" * 10]

    async def run() -> bytes:
        got, more = await read_body(_receive(pieces), SCAN_FROM + 5, 10 * SCAN_FROM)
        assert more is not None and isinstance(got, tuple)
        return b"".join([part async for part in prepend(got, more)])

    assert asyncio.run(run()) == b"".join(pieces)


# --- the relay's loop while a body of megabytes comes in ----------------------------------------


class _Upstream(threading.Thread):
    """One exchange on a socket of its own thread: reads the request whole, keeps its body, answers a short stream."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.body = b""

    def run(self) -> None:
        conn, _ = self.sock.accept()
        with conn, self.sock:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(1 << 16)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(
                next(
                    v for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
                )
            )
            got = bytearray(rest)
            while len(got) < length:
                got += conn.recv(1 << 20)
            self.body = bytes(got)
            event = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                % (len(event), event)
            )


class _Channel:
    shards = 1
    dropped = 0

    def send(self, message: tuple[Any, ...], *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def test_a_body_of_megabytes_never_holds_the_relays_loop_for_long() -> None:
    """Each turn of the relay's loop while a 32 MiB chat body comes in, is spliced and goes upstream takes under a
    quarter of the CPU one ``json.loads`` of that body takes (measured here, in CPU time: a busy machine that
    preempts the test does not count). The stepwise parse it replaced read the body's one long string in one call."""
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "word " * (32 << 18)}]})
    raw = body.encode()
    began = time.thread_time()
    json.loads(raw)
    loads = time.thread_time() - began
    upstream = _Upstream()
    upstream.start()
    flags = {"upstream": upstream.url, "max_inspect_bytes": 64 << 20, "max_request_bytes": 64 << 20}
    app = create_app(build(flags, env={}), channel=_Channel())
    sent: list[dict[str, Any]] = []
    turns: list[float] = []

    async def receive_pieces() -> Any:
        pieces = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)  # each piece comes with a turn of its own, as from a socket
            yield {"type": "http.request", "body": piece, "more_body": i + 1 < len(pieces)}
        await asyncio.Event().wait()  # no disconnect

    async def run() -> None:
        incoming = receive_pieces()

        async def receive() -> Any:
            return await anext(incoming)

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        done = False

        async def ticker() -> None:
            last = time.thread_time()
            while not done:
                await asyncio.sleep(0)
                now = time.thread_time()
                turns.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        headers = [(b"host", b"llmtap.test"), (b"content-length", str(len(raw)).encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "headers": headers, "http_version": "1.1", "extensions": {}}  # fmt: skip
        await app.handle(scope, receive, send)
        done = True
        await tick
        await app.aclose()

    asyncio.run(run())
    upstream.join(PATIENCE)
    assert sent[0]["status"] == 200 and upstream.body == prepare_usage(raw, inject_usage=True).body
    print(f"\nlongest turn {max(turns) * 1e3:.2f} ms of CPU; json.loads of the body {loads * 1e3:.1f} ms")
    assert max(turns) < loads / 4, (max(turns), loads)


@pytest.mark.skipif(not MIRRORED, reason="an older uvicorn's cycle is not the one body_of reads")
async def test_a_body_that_came_whole_is_taken_as_receive_would_take_it() -> None:
    """``body_of``: the body, and the cycle left as after uvicorn's ``receive`` of it; the next ``receive`` (the
    disconnect's) sees the same cycle either way."""
    taken, received = Cycle(), Cycle()
    for one in (taken, received):
        one.cycle.body, one.cycle.more_body = bytearray(BODY), False
        one.cycle.message_event.set()
    assert body_of(taken.cycle, len(BODY)) == BODY
    message: Any = await received.cycle.receive()
    assert message == {"type": "http.request", "body": BODY, "more_body": False}
    assert taken.state() == received.state() and taken.cycle.body == received.cycle.body == bytearray()


@pytest.mark.parametrize("case", ["more", "larger", "disconnected", "continue", "complete"])
def test_a_body_not_whole_or_not_to_take_is_left_to_receive(case: str) -> None:
    """Still arriving, past the bound, a client gone, a ``100-continue`` to answer first, a response already over:
    ``body_of`` takes nothing and changes nothing."""
    one = Cycle()
    c = one.cycle
    c.body, c.more_body = bytearray(BODY), case == "more"
    c.message_event.set()
    most = len(BODY) - 1 if case == "larger" else len(BODY)
    c.disconnected = case == "disconnected"
    c.waiting_for_100_continue = case == "continue"
    c.response_complete = case == "complete"
    before = (one.state(), bytes(c.body))
    assert body_of(c, most) is None
    assert (one.state(), bytes(c.body)) == before
