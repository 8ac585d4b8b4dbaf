"""A short answer written at once (``llmtap.relay.oneshot``) against uvicorn's own ``send`` of its head and end.

The same cycle is driven both ways, with a transport that keeps what is written: the bytes the client gets, and
the state the server reads afterwards (started, complete, kept or closed, the next request's turn), must be the
same. What uvicorn frames another way (a HEAD, a 204 or 304, chunked framing, a length that is not the body's) is
left to the ordinary path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from llmtap.relay.oneshot import MIRRORED, _mirrored, head_of, write_whole

BODY = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"m"}'
DEFAULTS = [(b"server", b"uvicorn"), (b"date", b"Mon, 07 Dec 2026 08:00:00 GMT")]


class Transport:
    """What a cycle writes, and whether it closed the connection."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.written.extend(bytes(p) for p in parts)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Cycle:
    """One request's uvicorn cycle over a ``Transport``, and how often it told the server its response ended."""

    def __init__(self, *, method: str = "POST", keep_alive: bool = True, access_log: bool = False) -> None:
        self.transport = Transport()
        self.responses = 0
        scope: Any = {
            "type": "http",
            "method": method,
            "http_version": "1.1" if keep_alive else "1.0",
            "path": "/v1/embeddings",
            "raw_path": b"/v1/embeddings",
            "query_string": b"",
            "headers": [],
            "client": ("127.0.0.1", 5000),
        }
        self.cycle = RequestResponseCycle(
            scope=scope,
            transport=self.transport,  # type: ignore[arg-type]
            flow=FlowControl(self.transport),  # type: ignore[arg-type]
            logger=logging.getLogger("test.oneshot"),
            access_logger=logging.getLogger("test.oneshot.access"),
            access_log=access_log,
            default_headers=list(DEFAULTS),
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=keep_alive,
            on_response=self._responded,
        )

    def _responded(self) -> None:
        self.responses += 1

    def state(self) -> tuple[Any, ...]:
        c = self.cycle
        return (
            b"".join(self.transport.written),
            self.transport.closed,
            self.responses,
            c.response_started,
            c.response_complete,
            c.keep_alive,
            c.chunked_encoding,
            c.expected_content_length,
            c.waiting_for_100_continue,
            c.message_event.is_set(),
        )


def _through_uvicorn(cycle: Cycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[Any, ...]:
    async def run() -> None:
        await cycle.cycle.send({"type": "http.response.start", "status": status, "headers": headers})
        if body:
            await cycle.cycle.send({"type": "http.response.body", "body": body, "more_body": True})
        await cycle.cycle.send({"type": "http.response.body", "body": b"", "more_body": False})

    asyncio.run(run())
    return cycle.state()


def _at_once(cycle: Cycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[Any, ...]:
    whole = head_of(cycle.cycle, status, headers, len(body))
    if not MIRRORED:  # an older uvicorn frames the head its own way: every answer takes the ordinary path
        assert whole is None
        return _through_uvicorn(cycle, status, headers, body)
    assert whole is not None
    write_whole(cycle.cycle, whole, status, body)
    return cycle.state()


def _length(body: bytes) -> tuple[bytes, bytes]:
    return (b"Content-Length", str(len(body)).encode())


@pytest.mark.parametrize(
    ("status", "headers", "body", "keep_alive"),
    [
        (200, [(b"Content-Type", b"application/json"), _length(BODY)], BODY, True),
        (200, [(b"content-type", b"application/json"), _length(BODY)], BODY, False),  # an HTTP/1.0 client
        (200, [_length(BODY), (b"Connection", b"keep-alive, Close")], BODY, True),
        pytest.param(
            200,
            [_length(BODY), (b"content-encoding", b"gzip"), (b"x-Trace", b"a b\tc")],
            BODY,
            True,
            marks=pytest.mark.skipif(not MIRRORED, reason="an older uvicorn refuses a tab in a header value itself"),
        ),
        (404, [(b"content-length", b"0")], b"", True),
        (418, [_length(BODY)], BODY, True),
        (599, [_length(BODY)], BODY, True),  # no reason phrase
        (200, [_length(BODY * 400)], BODY * 400, True),  # past the joined size: head and body written apart
        (200, [_length(BODY), (b"content-length", b"7")], BODY, True),  # the first length counts, as uvicorn reads
    ],
)
def test_the_answer_written_at_once_is_uvicorns_byte_for_byte_and_leaves_the_cycle_as_uvicorn_does(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool
) -> None:
    expected = _through_uvicorn(Cycle(keep_alive=keep_alive), status, headers, body)
    assert _at_once(Cycle(keep_alive=keep_alive), status, headers, body) == expected
    assert expected[0].endswith(b"\r\n\r\n" + body)
    assert expected[1] is not keep_alive or any(v.lower().endswith(b"close") for _, v in headers)


def test_the_access_line_is_logged_as_uvicorn_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    headers = [_length(BODY)]
    with caplog.at_level(logging.INFO, logger="test.oneshot.access"):
        _through_uvicorn(Cycle(access_log=True), 201, headers, BODY)
        _at_once(Cycle(access_log=True), 201, headers, BODY)
    lines = [r.getMessage() for r in caplog.records if r.name == "test.oneshot.access"]
    assert lines == ['127.0.0.1:5000 - "POST /v1/embeddings HTTP/1.1" 201'] * 2


@pytest.mark.parametrize(
    ("why", "method", "status", "headers", "size"),
    [
        ("a HEAD request", "HEAD", 200, [(b"content-length", b"5")], 5),
        ("a 204", "POST", 204, [], 0),
        ("a 304", "POST", 304, [(b"content-length", b"5")], 0),
        ("no length: chunked framing", "POST", 200, [(b"content-type", b"text/plain")], 5),
        ("chunked", "POST", 200, [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")], 5),
        ("a length that is not the body's", "POST", 200, [(b"content-length", b"6")], 5),
        ("a length that is no number", "POST", 200, [(b"content-length", b"five")], 5),
        ("a header uvicorn refuses", "POST", 200, [(b"content-length", b"5"), (b"x-a", b"b\nc")], 5),
    ],
)
def test_what_uvicorn_frames_another_way_takes_the_ordinary_path(
    why: str, method: str, status: int, headers: list[tuple[bytes, bytes]], size: int
) -> None:
    cycle = Cycle(method=method)
    assert head_of(cycle.cycle, status, headers, size) is None, why
    assert cycle.state()[0] == b"" and not cycle.cycle.response_started


@pytest.mark.parametrize("state", ["disconnected", "write_paused", "response_started"])
def test_a_client_gone_or_not_reading_takes_the_ordinary_path(state: str) -> None:
    cycle = Cycle()
    if state == "write_paused":
        cycle.cycle.flow.pause_writing()
    else:
        setattr(cycle.cycle, state, True)
    assert head_of(cycle.cycle, 200, [_length(BODY)], len(BODY)) is None


@pytest.mark.parametrize(
    ("version", "mirrored"),
    [("0.55.0", True), ("0.53.1", True), ("1.0", True), ("0.52.0", False), ("0.30.6", False), ("dev", False)],
)
def test_answers_go_at_once_only_under_a_uvicorn_whose_head_is_the_one_built(version: str, mirrored: bool) -> None:
    """uvicorn before 0.53 copies a client's ``Connection: close`` and never says ``close`` to an HTTP/1.0 client."""
    assert _mirrored(version) is mirrored


def test_uvicorn_writes_every_field_unrelayable_passes() -> None:
    """``Exchange._whole`` vouches (``head_of(writable=True)``) for an answer ``heads.unrelayable`` passed: every
    byte uvicorn refuses in a name or a value, ``unrelayable`` refuses too."""
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

    from llmtap.relay.heads import unrelayable

    for byte in range(256):
        one = bytes([byte])
        if HEADER_RE.search(one):
            assert unrelayable(200, [(b"x" + one, b"v")]) is not None, one
        if HEADER_VALUE_RE.search(one):
            assert unrelayable(200, [(b"x", b"v" + one)]) is not None, one


@pytest.mark.skipif(not MIRRORED, reason="an older uvicorn frames the head its own way: no answer goes at once")
@pytest.mark.parametrize("defaults", [[], DEFAULTS, [(b"x-bad", b"a\nb")]])
def test_a_head_vouched_for_is_the_head_checked(defaults: list[tuple[bytes, bytes]]) -> None:
    """With ``writable`` only the server's default headers are searched: the same head, or the same refusal when a
    default header is one uvicorn refuses."""
    headers = [(b"Content-Type", b"application/json"), _length(BODY), (b"server-timing", b'llmtap;dur=0.1;desc="p"')]
    checked, vouched = Cycle(), Cycle()
    checked.cycle.default_headers = vouched.cycle.default_headers = defaults
    plain = head_of(checked.cycle, 200, headers, len(BODY))
    fast = head_of(vouched.cycle, 200, headers, len(BODY), writable=True)
    if plain is None:
        assert fast is None and defaults[0][0] == b"x-bad"
    else:
        assert fast is not None and (fast.head, fast.keep_alive) == (plain.head, plain.keep_alive)


@pytest.mark.skipif(not MIRRORED, reason="an older uvicorn frames the head its own way: no answer goes at once")
def test_the_default_headers_are_looked_at_again_whenever_the_server_makes_new_ones() -> None:
    """uvicorn makes its default headers again each second; ``head_of`` remembers its look at the last list only:
    a new list is looked at, a refused one refuses whichever list came before it."""
    headers = [(b"content-type", b"application/json"), _length(BODY)]
    good, bad = list(DEFAULTS), [(b"x-bad", b"a\nb")]
    for defaults, goes in ((good, True), (bad, False), (list(DEFAULTS), True), (bad, False), (good, True)):
        cycle = Cycle()
        cycle.cycle.default_headers = defaults
        assert (head_of(cycle.cycle, 200, headers, len(BODY), writable=True) is not None) is goes
