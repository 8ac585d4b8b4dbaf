"""The lean upstream client (``llmtap.relay.upstream``) against scripted HTTP/1.1 servers on real sockets.

Every scenario runs on asyncio's own loop and on uvloop (what ``llmtap serve`` runs on). The servers are
raw asyncio streams on free ports of 127.0.0.1, so each byte on the wire is the test's choice; a few that
must not share the client's loop run in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import struct
import threading
import time
import tomllib
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from llmtap.config.types import Route, Settings
from llmtap.relay.forward import Upstreams
from llmtap.relay.pipe import Pipe
from llmtap.relay.upstream import MAX_HEAD_BYTES, PIPE, SURPLUS, LeanTransport, errors
from llmtap.relay.upstream.connection import Connection
from llmtap.relay.upstream.pool import Pool
from llmtap.wire.tape import Tape
from tests.conftest import PATIENCE, TESTS, free_port, unanswered_port

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Upstream:
    """A scripted server: each accepted connection runs ``script``; counts connections and their ends."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.peers: list[tuple[str, int]] = []
        self.gone: list[float] = []
        self._left = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.peers.append(writer.get_extra_info("peername"))
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # stopped at the end of the scenario (asyncio's callback would log a cancelled handler)
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def until_gone(self, reader: asyncio.StreamReader) -> None:
        """Read until the client closes; note when."""
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.gone.append(time.monotonic())
        self._left.set()

    async def wait_gone(self, count: int) -> None:
        """Until ``count`` clients have closed their connections (at most 2 s)."""
        async with asyncio.timeout(2):
            while len(self.gone) < count:
                self._left.clear()
                await self._left.wait()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: its head, and its body as it was framed on the wire."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        raw = b""
        while not raw.endswith(b"0\r\n\r\n") or raw.count(b"\r\n") % 2:
            raw += await reader.read(65536)
            if reader.at_eof():
                break
        return head, raw
    for line in lower.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return head, await reader.readexactly(int(line.split(b":")[1]))
    return head, b""


def answer(*responses: bytes) -> Script:
    """Answer each request on a connection with the next response, then wait for the client to close."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            await read_request(reader)
            writer.write(response)
            await writer.drain()
        while await reader.read(65536):
            pass

    return script


def client(transport: LeanTransport, **timeouts: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(**{"timeout": 5.0, **timeouts}))


def client_socket(peer: tuple[str, int]) -> socket.socket:
    """Our side of the connection the server saw coming from ``peer``, found among this process's descriptors."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(int(name)))
            try:
                if sock.type == socket.SOCK_STREAM and sock.getsockname() == peer:
                    return sock
            except OSError:
                pass
            sock.close()
    raise AssertionError(f"no socket bound to {peer}")


# --- 1, 12: the request head, HTTP/1.1 keep-alive -------------------------------------------------------


def test_request_head_is_httpx_own_and_the_connection_is_kept(run: Any) -> None:
    heads: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\n"
        for response in (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\none", chunked, OK):
            head, body = await read_request(reader)
            heads.append(head + body)
            writer.write(response)
        await reader.read()

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            first = c.build_request("GET", up.url + "/v1/a%2Fb?q=%20x", headers={"x-Thing": "1", "x-thing": "2"})
            assert (await c.send(first)).content == b"one"
            assert (await c.post(up.url + "/p", content=b"{}")).content == b"two"
            assert (await c.get(up.url + "/")).content == b"ok"
            assert up.connections == 1
            # Exactly what httpx built: request line with the raw target, every header in order, Host included.
            expected = b"GET /v1/a%2Fb?q=%20x HTTP/1.1\r\n"
            expected += b"".join(k + b": " + v + b"\r\n" for k, v in first.headers.raw) + b"\r\n"
            assert heads[0] == expected
            assert b"x-Thing: 1\r\nx-thing: 2\r\n" in heads[0]
            assert heads[0].count(b"\r\nHost: 127.0.0.1:") == 1
            assert heads[1].startswith(b"POST /p HTTP/1.1\r\n") and heads[1].endswith(b"\r\n\r\n{}")

    run(scenario())


def test_connections_on_descriptors_past_1023_are_kept(run: Any) -> None:
    """A busy proxy's sockets get numbers past select()'s limit; its idle check must still say usable."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard}: cannot open descriptors past 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = socket.socket()
    low = [os.dup(filler.fileno()) for _ in range(1100)]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            await read_request(reader)
            writer.write(OK)
        await reader.read()

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            for _ in range(3):
                assert (await c.get(up.url)).content == b"ok"
            assert up.connections == 1

    try:
        run(scenario())
    finally:
        for fd in low:
            os.close(fd)
        filler.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_httptools_is_a_declared_dependency() -> None:
    project = tomllib.loads((TESTS.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert any(d.startswith("httptools") for d in project["dependencies"])


def test_a_header_cannot_carry_a_line_of_its_own(run: Any) -> None:
    async def scenario() -> None:
        async with Upstream(answer(OK)) as up, client(LeanTransport()) as c:
            request = c.build_request("GET", up.url, headers={"x-a": "1\r\nx-smuggled: 1"})
            with pytest.raises(errors.BadRequestHead):
                await c.send(request)

    run(scenario())


# --- 2: the pool --------------------------------------------------------------------------------------


def test_pool_holds_max_connections_then_times_out(run: Any) -> None:
    gate = asyncio.Event()  # bound to the scenario's loop when first used

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await gate.wait()
            writer.write(b"0\r\n\r\n")

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport(max_connections=2), pool=0.2) as c:
            busy = [await c.send(c.build_request("GET", up.url), stream=True) for _ in range(2)]
            started = time.monotonic()
            with pytest.raises(errors.PoolTimeout):
                await c.get(up.url)
            # uvloop's timers have millisecond resolution and may fire up to a millisecond early.
            assert 0.199 <= time.monotonic() - started < 1.0
            # A third request waits for a connection to come back, then reuses it.
            third = asyncio.ensure_future(c.get(up.url, timeout=httpx.Timeout(5.0)))
            await asyncio.sleep(0.1)
            assert not third.done()
            gate.set()
            for response in busy:
                assert await response.aread() == b"first"
                await response.aclose()
            assert (await third).content == b"first"
            assert up.connections == 2

    run(scenario())


def test_idle_connection_the_server_closed_is_never_used(run: Any) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)  # keep-alive by its headers, then closed

    async def scenario() -> None:
        async with Upstream(once) as up, client(LeanTransport()) as c:
            assert (await c.get(up.url)).content == b"ok"
            # The server closes its side after one answer, in its own time: the pool forgets the connection.
            await asyncio.sleep(0.1)
            assert (await c.get(up.url)).content == b"ok"
            assert up.connections == 2

    run(scenario())


def test_idle_connection_closed_unseen_by_the_loop_is_not_used(run: Any) -> None:
    """The server's FIN is in the kernel but the event loop has not run since: the pool must still notice."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed, served = threading.Event(), []

    def serve() -> None:
        for close_after in (True, False):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                conn.sendall(OK)
                served.append(conn.getpeername())
                if close_after:
                    time.sleep(0.1)
                    conn.shutdown(socket.SHUT_RDWR)
                    closed.set()
                else:
                    conn.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def scenario() -> None:
        async with client(LeanTransport()) as c:
            assert (await c.get(url)).content == b"ok"
            assert closed.wait(PATIENCE)  # blocks the loop: it sees nothing of the close
            time.sleep(0.05)  # noqa: ASYNC251 (the point: the loop must not run before the next request)
            assert (await c.get(url)).content == b"ok"

    try:
        run(scenario())
    finally:
        thread.join(5)
        listener.close()
    assert len(served) == 2 and served[0] != served[1]


# --- 3: connecting --------------------------------------------------------------------------------------


def test_socket_options_set_before_connect(run: Any) -> None:
    scales: list[int] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        scales.append(info[6] & 0x0F)  # tcpi_snd_wscale: the window scale the client offered in its SYN
        await answer(OK)(reader, writer)

    async def scenario() -> None:
        async with Upstream(script) as up:
            for buffer in (64 * 1024, 0):
                async with client(LeanTransport(receive_buffer=buffer)) as c:
                    assert (await c.get(up.url)).content == b"ok"
                    with client_socket(up.peers[-1]) as sock:
                        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                        if buffer:
                            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * buffer  # Linux doubles
            # A small buffer set before the SYN means a small window scale; the kernel's own is far larger.
            assert scales[0] <= 2 < scales[1], scales

    run(scenario())


def test_connect_refused_and_timed_out(run: Any) -> None:
    async def scenario() -> None:
        async with client(LeanTransport(), connect=0.3) as c:
            with pytest.raises(errors.ConnectFailed):
                await c.get(f"http://127.0.0.1:{free_port()}/")
            with unanswered_port() as port:
                started = time.monotonic()
                with pytest.raises(errors.ConnectTimeout):
                    await c.get(f"http://127.0.0.1:{port}/")
                assert 0.3 <= time.monotonic() - started < 1.0

    run(scenario())


# --- 4: timeouts ----------------------------------------------------------------------------------------


def test_read_timeout_is_read_again_at_every_wait(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/slow-head" in head:
            await asyncio.sleep(2)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await reader.read()

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport(), read=0.2) as c:
            started = time.monotonic()
            with pytest.raises(errors.ReadTimeout):
                await c.get(up.url + "/slow-head")
            # The read bound, not the head's arrival 2 s later: the margin is for a busy machine.
            assert 0.2 <= time.monotonic() - started < 1.5
            request = c.build_request("GET", up.url, timeout=httpx.Timeout(5.0, read=2.0))
            response = await c.send(request, stream=True)
            request.extensions["timeout"]["read"] = 0.15  # what the relay does once the headers are in
            parts = []
            started = time.monotonic()
            with pytest.raises(errors.ReadTimeout):
                async for part in response.aiter_raw():
                    parts.append(part)
            assert parts == [b"a"]
            # The bound read again at this wait (0.15 s), not the request's 2 s.
            assert 0.15 <= time.monotonic() - started < 1.5
            await response.aclose()

    run(scenario())


def test_the_connections_read_timer_kept_from_a_wait_never_cuts_a_later_wait_short(run: Any) -> None:
    """The timer one wait armed fires during the next one's wait on the same connection: it sets itself again
    for the later deadline, and a wait whose deadline passes still times out."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b"/never" in head:
                await reader.read()
                return
            if b"/late" in head:
                await asyncio.sleep(0.5)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport(), read=1.0) as c:
            assert (await c.get(up.url + "/soon")).content == b"ok"
            await asyncio.sleep(0.8)  # the first wait's timer fires 0.2 s into the next wait
            assert (await c.get(up.url + "/late")).content == b"ok"
            assert up.connections == 1  # one connection, so one timer, served both
            started = time.monotonic()
            with pytest.raises(errors.ReadTimeout):
                await c.get(up.url + "/never")
            assert time.monotonic() - started >= 0.9

    run(scenario())


def test_body_that_the_upstream_does_not_take_times_out_without_piling_up(run: Any) -> None:
    sent = [0]

    async def body() -> AsyncIterator[bytes]:
        part = b"x" * (256 << 10)
        for _ in range(512):  # 128 MiB offered
            sent[0] += len(part)
            yield part

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(3)  # reads nothing more

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport(), write=0.3) as c:
            started = time.monotonic()
            with pytest.raises(errors.WriteTimeout):
                await c.post(up.url, content=body())
            assert time.monotonic() - started < 2.5
            # Flow control: what left the iterator is what the kernel's buffers hold, not the whole body.
            assert sent[0] < 48 << 20, sent[0]

    run(scenario())


# --- 5: request bodies ------------------------------------------------------------------------------


def test_request_bodies_bytes_chunked_and_counted(run: Any) -> None:
    bodies: list[bytes] = []
    heads: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            heads.append(head)
            bodies.append(body)
            writer.write(OK)

    async def parts() -> AsyncIterator[bytes]:
        for part in (b"ab", b"", b"cde"):
            await asyncio.sleep(0.01)
            yield part

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            assert (await c.post(up.url, content=b'{"a": 1}')).content == b"ok"
            assert (await c.post(up.url, content=parts())).content == b"ok"
            counted = await c.post(up.url, content=parts(), headers={"content-length": "5"})
            assert counted.content == b"ok"
            assert up.connections == 1
        assert bodies == [b'{"a": 1}', b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n", b"abcde"]
        assert b"Content-Length: 8\r\n" in heads[0]
        assert b"Transfer-Encoding: chunked\r\n" in heads[1]
        assert b"transfer-encoding" not in heads[2].lower()

    run(scenario())


def test_a_direct_request_is_byte_for_byte_what_httpx_request_sends(run: Any) -> None:
    """``LeanTransport.send`` (the relay's path, no ``httpx.Request``) and an ``httpx.Request`` of the same
    method, URL, headers and body through the same transport put the same bytes on the wire, and read the
    same answer."""
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            seen.append(head + body)
            if head.startswith(b"HEAD "):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 201 Made\r\nx-a: 1\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")

    async def parts() -> AsyncIterator[bytes]:
        for part in (b"ab", b"", b"cde"):
            yield part

    body = b'{"a": 1}'
    cases: list[tuple[str, str, list[tuple[bytes, bytes]], bytes | None]] = [
        ("GET", "/v1/a%2Fb?q=%20x", [(b"x-Thing", b"1"), (b"x-thing", b"2")], b""),
        ("GET", '/a b/\u00fc/./c/../d?x="1"', [], b""),
        ("POST", "/p", [(b"content-type", b"application/json")], body),
        ("POST", "/p", [(b"Content-Length", b"8")], body),
        ("POST", "/p", [], b""),
        ("PATCH", "/p", [(b"content-length", b"0")], b""),
        ("DELETE", "/p", [], b""),
        ("POST", "/s", [], None),  # a streamed body: chunked
        ("POST", "/s", [(b"content-length", b"5")], None),  # a streamed body of a counted length: as it is
        ("HEAD", "/h", [(b"accept", b"*/*")], b""),
    ]

    async def scenario() -> None:
        async with Upstream(script) as up:
            transport = LeanTransport()
            timeouts = httpx.Timeout(5.0).as_dict()
            try:
                for method, path, headers, content in cases:
                    url = up.url + path
                    via_httpx = httpx.Request(
                        method, url, headers=headers, content=parts() if content is None else content,
                        extensions={"timeout": timeouts},
                    )  # fmt: skip
                    response = await transport.handle_async_request(via_httpx)
                    expected_body = b"".join([part async for part in response.aiter_raw()])
                    await response.aclose()
                    origin = transport.origin(up.url)
                    target = httpx.URL(url).raw_path
                    answer = await transport.send(
                        origin, method, target, headers, parts() if content is None else content, timeouts
                    )
                    got_body = b"".join([part async for part in answer.aiter_raw()])
                    assert answer._released  # back to the pool at the body's end, as httpx's close does
                    answer.close()
                    assert (answer.status_code, answer.headers, got_body) == (
                        response.status_code,
                        response.headers.raw,
                        expected_body,
                    )
                    assert seen[-1] == seen[-2], (method, path, headers)
                assert len(seen) == 2 * len(cases)
                # One kept-alive connection, but a HEAD's is closed after it (``head_only``): the second HEAD opens one.
                assert up.connections == 2
            finally:
                await transport.aclose()
        assert seen[2].startswith(b"GET /a%20b/%C3%BC/d?x=%221%22 HTTP/1.1\r\nHost: 127.0.0.1:")
        assert seen[8].startswith(b"POST /p HTTP/1.1\r\nHost: 127.0.0.1:") and b"\r\nContent-Length: 0\r\n" in seen[8]
        assert b"Transfer-Encoding: chunked\r\n" in seen[14] and seen[14].endswith(b"0\r\n\r\n")

    run(scenario())


class Boom(Exception):
    """Raised by a request body's own iterator."""


def test_body_iterator_error_propagates_and_closes_the_connection(run: Any) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"part"
        await asyncio.sleep(0.01)
        raise Boom

    async def scenario() -> None:
        up = Upstream(answer(OK))
        script = up.script

        async def watched(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if up.connections == 1:
                await up.until_gone(reader)
            else:
                await script(reader, writer)

        up.script = watched
        async with up, client(LeanTransport(max_connections=1), pool=1.0) as c:
            with pytest.raises(Boom):
                await c.post(up.url, content=body())
            await asyncio.sleep(0.1)
            assert len(up.gone) == 1  # the half-sent request's connection is closed, not pooled
            assert (await c.get(up.url)).content == b"ok"  # and its pool slot is free again

    run(scenario())


# --- 6, 7: backpressure, and body parts as they arrive -----------------------------------------------------


def test_a_reader_that_stops_stops_the_upstream(run: Any) -> None:
    size = 64 << 20
    written = [0]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        block = b"x" * (64 << 10)
        while written[0] < size:
            writer.write(block)
            written[0] += len(block)
            await writer.drain()
        await reader.read()

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport(receive_buffer=64 << 10)) as c:
            response = await c.send(c.build_request("GET", up.url), stream=True)
            await asyncio.sleep(1.0)  # read nothing
            stalled = written[0]
            await asyncio.sleep(0.3)
            assert written[0] == stalled, "the upstream kept writing while nobody read"
            assert stalled < 16 << 20, stalled
            got = 0
            async for part in response.aiter_raw():
                assert len(part) <= 1 << 20
                got += len(part)
            assert got == size
            await response.aclose()

    run(scenario())


def test_body_parts_are_what_arrived_never_merged_nor_held(run: Any) -> None:
    gates = [asyncio.Event(), asyncio.Event()]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b"/counted" in head:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nfirst")
                await gates[1].wait()
                writer.write(b"end")
            else:
                # Three HTTP chunks in one write, then one chunk whose second half comes later.
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n2\r\nbb\r\n3\r\nccc\r\n")
                writer.write(b"6\r\nhal")
                await gates[0].wait()
                writer.write(b"ves\r\n0\r\n\r\n")

    async def collect(c: httpx.AsyncClient, url: str, gate: asyncio.Event) -> list[bytes]:
        parts = []
        async with c.stream("GET", url) as response:
            async for part in response.aiter_raw():
                parts.append(part)
                if part in (b"hal", b"first"):
                    gate.set()  # the server writes the rest only once this part got here
        return parts

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            assert await collect(c, up.url + "/chunked", gates[0]) == [b"a", b"bb", b"ccc", b"hal", b"ves"]
            assert await collect(c, up.url + "/counted", gates[1]) == [b"first", b"end"]

    run(scenario())


# --- 8: where a response ends -------------------------------------------------------------------------------


def test_response_framings_and_bodiless_responses(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            path = head.split(b" ")[1]
            if path == b"/until-close":
                writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
                return
            writer.write(
                {
                    b"/chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n",
                    b"/204": b"HTTP/1.1 204 No Content\r\n\r\n",
                    b"/304": b"HTTP/1.1 304 Not Modified\r\ncontent-length: 10\r\n\r\n",
                    b"/head": b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n",
                    b"/interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </s.css>\r\n\r\n"
                    + OK,
                }[path]
            )

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport(), read=2.0) as c:
            assert (await c.get(up.url + "/chunked")).content == b"abc"
            assert (await c.get(up.url + "/204")).status_code == 204
            not_modified = await c.get(up.url + "/304")
            assert not_modified.status_code == 304 and not_modified.content == b""
            interim = await c.get(up.url + "/interim")
            assert interim.status_code == 200 and interim.content == b"ok" and "link" not in interim.headers
            assert up.connections == 1
            started = time.monotonic()
            head = await c.head(up.url + "/head")
            assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "10"
            assert time.monotonic() - started < 1.0
            # The HEAD response's connection is closed, never trusted with another response.
            assert (await c.get(up.url + "/204")).status_code == 204
            assert up.connections == 2
            assert (await c.get(up.url + "/until-close")).content == b"all of it"
            assert (await c.get(up.url + "/chunked")).content == b"abc"
            assert up.connections == 3

    run(scenario())


# --- 9: bytes past the end -------------------------------------------------------------------------------


SMUGGLED = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nSMUGGLED"


def test_bytes_past_the_end_are_counted_and_never_answer_a_request(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            path = head.split(b" ")[1]
            if path == b"/same-write":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody" + SMUGGLED)
            elif path == b"/chunked-split":
                # The chunked body's last line ends in the next read, right before the surplus.
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\n\r")
                await asyncio.sleep(0.1)
                writer.write(b"\n" + SMUGGLED)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nclean")

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            response = await c.send(c.build_request("GET", up.url + "/same-write"), stream=True)
            assert await response.aread() == b"body"
            assert response.extensions[SURPLUS]() == len(SMUGGLED)
            await response.aclose()
            response = await c.send(c.build_request("GET", up.url + "/chunked-split"), stream=True)
            assert [part async for part in response.aiter_raw()] == [b"body"]
            assert response.extensions[SURPLUS]() == len(SMUGGLED)
            await response.aclose()
            for _ in range(2):
                clean = await c.get(up.url + "/clean")
                assert clean.content == b"clean"
                assert clean.extensions[SURPLUS]() == 0
            assert up.connections == 3  # each surplus closed its connection; the clean ones share one

    run(scenario())


# --- 10: closing ---------------------------------------------------------------------------------------------


def test_closing_mid_stream_closes_the_connection_at_once(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await up.until_gone(reader)

    up = Upstream(script)

    async def scenario() -> None:
        async with up, client(LeanTransport()) as c:
            response = await c.send(c.build_request("GET", up.url), stream=True)
            async for _ in response.aiter_raw():
                break
            closed = time.monotonic()
            await response.aclose()
            await up.wait_gone(1)
            assert up.gone[0] - closed < 0.1

    run(scenario())


def test_a_connection_goes_back_to_the_pool_exactly_once(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b"/slow" in head:
                await asyncio.sleep(0.2)
            writer.write(OK)

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            first = await c.send(c.build_request("GET", up.url), stream=True)
            assert await first.aread() == b"ok"
            await first.aclose()
            assert isinstance(first.stream, httpx.AsyncByteStream)
            await first.stream.aclose()  # closed twice: the connection must not be handed back twice
            second = asyncio.ensure_future(c.get(up.url + "/slow"))
            third = asyncio.ensure_future(c.get(up.url + "/slow"))
            assert [r.content for r in await asyncio.gather(second, third)] == [b"ok", b"ok"]
            assert up.connections == 2
            # A late close of a finished response must not touch the connection now serving another.
            fourth = await c.send(c.build_request("GET", up.url + "/slow"), stream=True)
            await first.stream.aclose()
            assert await fourth.aread() == b"ok"
            await fourth.aclose()

    run(scenario())


def test_transport_close_closes_every_connection(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)  # one request per connection
        if b"/busy" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        else:
            writer.write(OK)
        await up.until_gone(reader)

    up = Upstream(script)

    async def scenario() -> None:
        transport = LeanTransport()
        async with up:
            c = client(transport)
            busy = await c.send(c.build_request("GET", up.url + "/busy"), stream=True)
            assert (await c.get(up.url + "/idle")).content == b"ok"
            await c.aclose()
            await up.wait_gone(2)
            with pytest.raises(errors.UpstreamError):
                await busy.aread()
            await busy.aclose()

    run(scenario())


# --- 11: the upstream failing --------------------------------------------------------------------------------


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with a TCP RST (SO_LINGER 0), as a crashed server's kernel does."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


FAILURES: dict[str, tuple[bytes, bool, type[errors.UpstreamError]]] = {
    # what the server writes, then whether it resets (else closes); the error; in every case after the bytes
    "close-before-head": (b"", False, errors.UpstreamClosed),
    "reset-before-head": (b"", True, errors.UpstreamReset),
    "close-mid-head": (b"HTTP/1.1 200 OK\r\ncontent-le", False, errors.UpstreamClosed),
    "close-mid-body": (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", False, errors.UpstreamClosed),
    "reset-mid-body": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",
        True,
        errors.UpstreamReset,
    ),
    # A head that cannot be read is its own error (a protocol error): the relay answers it 502, saying so.
    "malformed-status": (b"HTTP/1.1 2x0 OK\r\n\r\n", False, errors.BadHead),
    "malformed-chunk": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        False,
        errors.UpstreamProtocolError,
    ),
    "switch-protocols": (
        b"HTTP/1.1 101 Switching\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n",
        False,
        errors.BadHead,
    ),
    "endless-head": (b"HTTP/1.1 200 OK\r\n" + b"x-a: b\r\n" * (MAX_HEAD_BYTES // 8), False, errors.BadHead),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_upstream_failures_are_the_errors_the_relay_maps(run: Any, failure: str) -> None:
    written, reset, error = FAILURES[failure]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(written)
        await writer.drain()
        await asyncio.sleep(0.05)
        if reset:
            _reset(writer)

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            got = b""
            with pytest.raises(errors.UpstreamError) as caught:
                async with c.stream("GET", up.url) as response:
                    async for part in response.aiter_raw():
                        got += part
            assert type(caught.value) is error
            assert got == (b"abc" if "body" in failure else b"")

    run(scenario())


def test_unsolicited_bytes_on_an_idle_connection_close_it(run: Any) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await asyncio.sleep(0.05)
        writer.write(SMUGGLED)  # nobody asked
        await reader.read()

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            assert (await c.get(up.url)).content == b"ok"
            await asyncio.sleep(0.1)
            second = await c.get(up.url)
            assert second.content == b"ok" and up.connections == 2

    run(scenario())


# --- wiring: the setting and the upstream pools ---------------------------------------------------------------


def _routes(*upstreams: str) -> tuple[Route, ...]:
    return tuple(Route(prefix=f"/{i}", upstream=u, name=str(i)) for i, u in enumerate(upstreams))


def test_upstreams_give_every_route_a_pool_of_the_lean_client(run: Any) -> None:
    """HTTP and HTTPS alike (tests/relay/test_tls.py runs the HTTPS ones); routes to one upstream share its pool."""

    async def scenario() -> None:
        async with Upstream(answer(OK, OK)) as up:
            routes = (
                *_routes(up.url, "https://api.example.com"),
                Route(prefix="/again", upstream=up.url, name="again"),
            )
            upstreams = Upstreams(Settings(routes=routes))
            try:
                assert all(isinstance(upstreams.pool(r), LeanTransport) for r in routes)
                assert upstreams.pool(routes[0]) is upstreams.pool(routes[2])
                assert upstreams.pool(routes[0]) is not upstreams.pool(routes[1])
                async with client(upstreams.pool(routes[0])) as c:
                    response = await c.get(up.url)
                assert response.content == b"ok"
                assert SURPLUS in response.extensions
            finally:
                await upstreams.aclose()

    run(scenario())


# --- the relay's body path in the read callback (llmtap.relay.pipe) ---------------------------------------------


class _Socket:
    """What a connection asks of its transport while reads are handed to it directly."""

    def __init__(self) -> None:
        self.paused = False
        self.aborted = False

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


def _piped(reads: list[bytes], *, whole: bool) -> tuple[list[tuple[int, bytes]], tuple[Any, ...]]:
    """Feed ``reads`` (a head, then a chunked body) to a connection under a sink: the parts each read gave, and
    the exchange's end state. ``whole=False`` turns the parser-free path for whole chunks off (the reference)."""
    loop = asyncio.new_event_loop()
    try:
        conn = Connection(Pool(1), loop)
        conn.connection_made(_Socket())  # type: ignore[arg-type]
        conn.begin(head_only=False)
        parts: list[tuple[int, bytes]] = []
        read = [0]  # which read the parts come from
        conn.sink = lambda t, part: parts.append((read[0], part))
        if not whole:
            conn._whole = lambda sink, t, data: 0  # type: ignore[method-assign]
        for read[0], data in enumerate(reads):
            if conn.closed or conn._transport.is_closing():  # type: ignore[union-attr]
                break
            conn.data_received(data)
        error = None if conn.error is None else (type(conn.error), str(conn.error))
        return parts, (conn.done, conn.keep_alive, error, conn.surplus, conn.status)
    finally:
        loop.close()


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_EVENTS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: x\r\n\r\n", b"\r\n", b"data: [DONE]\n\n"]
_BODIES = {
    "plain": b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in _EVENTS) + b"0\r\n\r\n",
    "upper hex, leading zeros": b"00%X\r\n%b\r\n" % (len(_EVENTS[0]), _EVENTS[0]) + b"0\r\n\r\n",
    "extension, trailer": b"%x;a=b\r\n%b\r\n" % (len(_EVENTS[1]), _EVENTS[1]) + b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n",
    "past the end": b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n",
    "bad size": b"3\r\nabc\r\nzz\r\nabc\r\n0\r\n\r\n",
    "no CRLF after the data": b"3\r\nabc\r\n3\r\nabcd\r\n0\r\n\r\n",
    "signed size": b"3\r\nabc\r\n+3\r\nabc\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("body", list(_BODIES))
def test_whole_chunks_skip_the_parser_and_give_what_it_gives(body: str) -> None:
    """The read callback hands a whole chunk over without the parser (``_Connection._whole``): split into reads
    at every one and every pair of places, the parts of each read, the end, the error and the bytes past the
    end are exactly what the parser alone gives."""
    data = _BODIES[body]
    splits: list[list[bytes]] = [[data]]
    splits += [[data[:i], data[i:]] for i in range(1, len(data))]
    splits += [[data[:i], data[i:j], data[j:]] for i in range(1, len(data), 3) for j in range(i + 1, len(data), 2)]
    # The whole chunks as one read each, as a stream's upstream writes them.
    splits.append(
        [
            data[: data.index(b"\r\n", data.index(b"\r\n") + 2) + 2],
            data[data.index(b"\r\n", data.index(b"\r\n") + 2) + 2 :],
        ]
    )
    for reads in splits:
        reads = [_HEAD, *(r for r in reads if r)]
        assert _piped(reads, whole=True) == _piped(reads, whole=False), reads
    parts, end = _piped([_HEAD, data], whole=True)
    if body == "plain":
        assert [p for _, p in parts] == _EVENTS and end[:3] == (True, True, None)
    elif body == "past the end":
        assert end[3] == len(b"HTTP/1.1 200 OK\r\n")
    elif body != "upper hex, leading zeros" and body != "extension, trailer":
        assert end[2] is not None and end[2][0] is errors.UpstreamProtocolError


def test_a_chunk_after_the_parser_read_part_of_its_size_line_goes_to_the_parser() -> None:
    """A read that ends inside a size line leaves the parser holding its digits: the next read is not taken for
    whole chunks even where it looks like some (here ``2\\r\\nab\\r\\n``, the end of the size line ``12``)."""
    rest = b"ab\r\n" + b"x" * 14
    reads = [_HEAD + b"3\r\nabc\r\n1", b"2\r\n" + rest + b"\r\n", b"2\r\nyz\r\n0\r\n\r\n"]
    parts, end = _piped(reads, whole=True)
    assert parts == [(0, b"abc"), (1, rest), (2, b"yz")]
    assert end[:3] == (True, True, None)


def test_a_piped_body_reaches_its_sink_in_the_read_callback_and_is_held_on_demand(run: Any) -> None:
    """``_Body.pipe``: parts go to the sink as they arrive, never merged, each with its read's time; the relay's
    task wakes only at the end or on ``hold`` (nothing more is read until ``release``); the connection is reused."""
    gates = [asyncio.Event(), asyncio.Event()]
    counted = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await gates[0].wait()
        writer.write(b"2\r\nbb\r\n3\r\nccc\r\n")  # two chunks in one write: two parts, one read's time
        await gates[1].wait()
        writer.write(b"4\r\ndddd\r\n0\r\n\r\n")
        await read_request(reader)
        writer.write(counted)
        while await reader.read(65536):
            pass

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            request = c.build_request("GET", up.url)
            response = await c.send(request, stream=True)
            got: list[tuple[float, bytes]] = []
            arrived = asyncio.Event()

            def sink(t: float, part: bytes) -> None:
                got.append((t, part))
                arrived.set()

            conn = response.extensions[PIPE].pipe(sink)
            await asyncio.sleep(0.05)
            assert [p for _, p in got] == [b"a"]  # before any wait: in the read callback itself
            gates[0].set()
            async with asyncio.timeout(PATIENCE):
                while len(got) < 3:
                    arrived.clear()
                    await arrived.wait()
            assert [p for _, p in got] == [b"a", b"bb", b"ccc"] and got[1][0] == got[2][0] > got[0][0]
            conn.hold()
            gates[1].set()
            await conn.until_moved(1.0)  # held: returns at once, the rest unread
            await asyncio.sleep(0.1)
            assert len(got) == 3 and not conn.done
            conn.release()
            await conn.until_moved(1.0)
            assert conn.done and [p for _, p in got][3:] == [b"dddd"]
            await response.aclose()
            again = await c.get(up.url)  # the same connection, back in the pool unpiped
            assert again.content == b"ok" and up.connections == 1

    run(scenario())


def test_a_piped_body_that_falls_silent_times_out_from_its_last_read(run: Any) -> None:
    """The idle timeout under a pipe counts from the last read (one timer per wait, not one per chunk), and not
    while the relay holds the upstream for its client."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(4):
            writer.write(b"1\r\nx\r\n")
            await asyncio.sleep(0.1)  # each read inside the timeout: the wait goes on past its first timer
        await reader.read()

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            response = await c.send(c.build_request("GET", up.url), stream=True)
            got: list[bytes] = []
            conn = response.extensions[PIPE].pipe(lambda t, part: got.append(part))
            started = time.monotonic()
            with pytest.raises(errors.ReadTimeout):
                await conn.until_moved(0.25)
            waited = time.monotonic() - started
            assert got == [b"x"] * 4
            # The last read came about 0.3 s after the first: the wait went on past its first timer (0.25 s),
            # and ended one timeout after that read.
            assert 0.2 + 0.25 <= waited < 0.3 + 0.25 + 1.0, waited
            await response.aclose()

    run(scenario())


class _Flow:
    """What the pipe reads of uvicorn's flow control: whether the client's buffer is full, and a drain."""

    def __init__(self) -> None:
        self.write_paused = True
        self.writable = asyncio.Event()

    async def drain(self) -> None:
        await self.writable.wait()


class _Client:
    """The client side of a uvicorn response cycle as the pipe uses it: a transport that keeps what it is given."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.transport = self
        self.flow = _Flow()
        self.chunked_encoding = True
        self.disconnected = False
        self.expected_content_length = 0

    def write(self, data: bytes) -> None:
        self.written.append(data)


def test_a_pipe_whose_client_is_full_from_the_first_part_holds_the_upstream_until_it_drains(run: Any) -> None:
    """Parts queued before the pipe went on (the response's first bytes) reach the client in uvicorn's chunked
    framing; a client already full holds the upstream from that first part, and the rest follows its drain."""
    gate = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await gate.wait()
        writer.write(b"4\r\nrest\r\n0\r\n\r\n")
        while await reader.read(65536):
            pass

    async def scenario() -> None:
        async with Upstream(script) as up, client(LeanTransport()) as c:
            response = await c.send(c.build_request("GET", up.url), stream=True)
            await asyncio.sleep(0.05)  # the first part is queued on the connection by now
            tape = Tape(1, method="GET", path="/", inner_path="/", route="r", protocol=None, received=0.0,
                        received_wall_ns=0)  # fmt: skip
            cycle = _Client()
            pipe = Pipe(tape, cycle, None, lambda _: None)
            relayed = asyncio.create_task(pipe.run(response.extensions[PIPE].connection, {"read": 5.0}))
            await asyncio.sleep(0.05)
            assert cycle.written == [b"5\r\nfirst\r\n"] and response.extensions[PIPE].connection.held
            gate.set()
            await asyncio.sleep(0.1)
            assert cycle.written == [b"5\r\nfirst\r\n"]  # held: not read, not written
            cycle.flow.write_paused = False
            cycle.flow.writable.set()
            async with asyncio.timeout(PATIENCE):
                await relayed
            assert cycle.written == [b"5\r\nfirst\r\n", b"4\r\nrest\r\n"]
            times, delivered, sizes, data = tape.take_reads()
            # Two reads on the tape, each with its arrival and its delivery time (8-byte doubles).
            assert data == b"firstrest" and len(times) == len(delivered) == 16 and sizes == array("l", [5, 4]).tobytes()
            await response.aclose()

    run(scenario())
