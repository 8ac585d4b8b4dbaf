"""HTTP edge cases a hostile client or an unusual upstream brings, through ``llmtap serve`` on real sockets.

What the upstream receives is what the client sent (plus what a proxy must add); the usage event llmtap
asked for never reaches the client, compressed or not; bodiless statuses (1xx, 204, 304) keep the client's
connection; an Upgrade request and an HTTP/1.1 request without Host get a clear 4xx, and none of these
leaves a traceback in the log.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import pytest

from llmtap.store.files import ReadStats, read_records
from tests.conftest import PATIENCE
from tests.support.chunks import chat_chunk, usage_chunk
from tests.support.procs import Llmtap

pytestmark = pytest.mark.e2e


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    return chat_chunk(delta, finish, model="raw", ident="chatcmpl-raw")


USAGE_EVENT = usage_chunk(9, 3, model="raw", ident="chatcmpl-raw")


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


#: Response heads llmtap cannot relay faithfully (``llmtap.relay.heads``), by name: each answered 502.
_GZ = gzip.compress(USAGE_EVENT)
BAD_HEADS = {
    "status-999": b"HTTP/1.1 999 Odd\r\ncontent-length: 2\r\n\r\n{}",
    "status-600": b"HTTP/1.1 600 Odd\r\ncontent-length: 2\r\n\r\n{}",
    "status-099": b"HTTP/1.1 099 Odd\r\ncontent-length: 2\r\n\r\n{}",
    "status-0": b"HTTP/1.1 0 Odd\r\ncontent-length: 2\r\n\r\n{}",
    "status-text": b"HTTP/1.1 abc Odd\r\ncontent-length: 2\r\n\r\n{}",
    "switch-101": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: foo\r\nconnection: upgrade\r\n\r\nxx",
    "gzip-chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n" + _chunked(_GZ),
    "gzip-then-chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n"
    + _chunked(_GZ),
    "chunked-gzip": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n" + _GZ,
    "identity": b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\n" + USAGE_EVENT,
    "te-and-length": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n" + _chunked(b"{}"),
    "no-colon": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nnot a header\r\n\r\n{}",
    "control-in-value": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-odd: a\x01b\r\n\r\n{}",
}


def sse_body(include_usage: bool) -> bytes:
    """An OpenAI chat stream of three words; the usage event only when the request asked for it."""
    events = [_chunk({"role": "assistant", "content": ""})]
    events += [_chunk({"content": w}) for w in (" alpha", " beta")]
    events.append(_chunk({"content": " gamma"}, "stop"))
    if include_usage:
        events.append(USAGE_EVENT)
    return b"".join(events) + b"data: [DONE]\n\n"


class RawUpstream:
    """A threaded HTTP/1.1 upstream that keeps every request head it read and answers by path.

    ``/v1/chat/completions`` streams chat chunks, gzip-compressed when the request allows gzip (or always,
    with ``x-force-gzip``); ``/status/N`` answers status N with a Content-Length of 42, and 42 bytes
    unless N is 204 or 304;
    ``/early-hints`` sends a 103 before its 200; a request with ``x-raw: NAME`` gets ``BAD_HEADS[NAME]`` as it is.
    """

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the relay closes (resets) a connection it refused an answer of
            self._exchanges(conn)

    def _exchanges(self, conn: socket.socket) -> None:
        buffered = b""
        while True:
            while b"\r\n\r\n" not in buffered:
                data = conn.recv(65536)
                if not data:
                    return
                buffered += data
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            self.heads.append(head)
            fields = _fields(head)
            length = int(fields.get(b"content-length", b"0"))
            while len(buffered) < length:
                data = conn.recv(65536)
                if not data:
                    return
                buffered += data
            body, buffered = buffered[:length], buffered[length:]
            self.bodies.append(body)
            conn.sendall(self._answer(head.split(b" ")[1], fields, body))

    def _answer(self, target: bytes, fields: dict[bytes, bytes], body: bytes) -> bytes:
        if target.startswith(b"/status/"):
            status = int(target[len(b"/status/") :])
            body = b"" if status in (204, 304) else b"x" * 42
            return b'HTTP/1.1 %d Whatever\r\ncontent-length: 42\r\netag: "v1"\r\n\r\n%s' % (status, body)
        if b"x-raw" in fields:
            return BAD_HEADS[fields[b"x-raw"].decode()]
        if target == b"/early-hints":
            return (
                b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
            )
        request = json.loads(body or b"{}")
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        payload = sse_body(include_usage)
        extra = b""
        accepted = [c.split(b";")[0].strip() for c in fields.get(b"accept-encoding", b"").split(b",")]
        if b"x-force-gzip" in fields or b"gzip" in accepted:
            payload = gzip.compress(payload)
            extra = b"content-encoding: gzip\r\n"
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n%scontent-length: %d\r\n\r\n%s" % (
            extra,
            len(payload),
            payload,
        )

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def _fields(head: bytes) -> dict[bytes, bytes]:
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    return fields


@pytest.fixture(scope="module")
def raw_upstream() -> Iterator[RawUpstream]:
    up = RawUpstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def proxy(raw_upstream: RawUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llmtap]:
    home = tmp_path_factory.mktemp("hostile-http")
    p = Llmtap(
        raw_upstream.url,
        home / "llmtap.log",
        "--log-level",
        "info",
        "--record",
        str(home / "records"),
    )
    p.records = home / "records"  # type: ignore[attr-defined]
    yield p
    p.close()


def exchange(port: int, data: bytes, *, responses: int = 1, timeout: float = 10.0) -> bytes:
    """Send raw bytes; read until ``responses`` whole final responses arrived, or the connection closed."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        while len([r for r in parse(out) if r[0] >= 200]) < responses:
            try:
                part = sock.recv(65536)
            except TimeoutError:
                break
            if not part:
                break
            out += part
    return out


def parse(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The whole responses in ``data``, interim ones too: status, fields, body (de-chunked)."""
    found = []
    rest = data
    while b"\r\n\r\n" in rest:
        head, _, rest = rest.partition(b"\r\n\r\n")
        status, fields = int(head.split(b" ", 2)[1]), _fields(head)
        if 100 <= status < 200 or status in (204, 304):
            found.append((status, fields, b""))
            continue
        if fields.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size, sep, after = rest.partition(b"\r\n")
                if not sep or len(after) < int(size, 16) + 2:
                    return found
                n = int(size, 16)
                body, rest = body + after[:n], after[n + 2 :]
                if n == 0:
                    break
        else:
            length = int(fields.get(b"content-length", b"0"))
            if len(rest) < length:
                return found
            body, rest = rest[:length], rest[length:]
        found.append((status, fields, body))
    return found


def statuses(data: bytes) -> list[int]:
    """The status of every whole response in ``data``, interim ones included."""
    return [status for status, _, _ in parse(data)]


def no_traceback(proxy: Llmtap) -> None:
    log = proxy.logs()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def request(path: bytes, body: bytes = b"", *, extra: bytes = b"", method: bytes = b"POST") -> bytes:
    length = b"content-length: %d\r\n" % len(body) if body or method == b"POST" else b""
    return b"%s %s HTTP/1.1\r\nhost: llmtap.test\r\n%s%s\r\n%s" % (method, path, extra, length, body)


CHAT = json.dumps({"model": "raw", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}).encode()


# --- what reaches the upstream ---------------------------------------------------------------------------


def test_short_answers_written_at_once_keep_the_connection_framed_and_close_it_when_asked(proxy: Llmtap) -> None:
    """A short answer read whole goes to the client in one write (``llmtap.relay.oneshot``): pipelined on one
    connection, each answer is framed by its length and the next one follows; ``connection: close`` ends the
    connection after its answer (the request behind it is not served), and an HTTP/1.0 client is told so."""
    asked = request(b"/status/200") + request(b"/status/404") + request(b"/status/201", extra=b"connection: close\r\n")
    got = exchange(proxy.port, asked + request(b"/status/200"), responses=4)
    answers = parse(got)
    assert [status for status, _, _ in answers] == [200, 404, 201], got[:600]
    assert [body for _, _, body in answers] == [b"x" * 42] * 3
    assert [fields.get(b"connection") for _, fields, _ in answers] == [None, None, b"close"]
    assert all(fields[b"etag"] == b'"v1"' for _, fields, _ in answers)
    assert got.endswith(b"\r\n\r\n" + b"x" * 42)  # the connection closed after the third answer
    old = exchange(proxy.port, b"POST /status/200 HTTP/1.0\r\ncontent-length: 0\r\n\r\n")
    [(status, fields, body)] = parse(old)
    assert (status, fields.get(b"connection"), body) == (200, b"close", b"x" * 42), old
    no_traceback(proxy)


def test_upstream_receives_only_the_headers_the_client_sent(proxy: Llmtap, raw_upstream: RawUpstream) -> None:
    before = len(raw_upstream.heads)
    got = exchange(proxy.port, request(b"/v1/chat/completions", CHAT, extra=b"x-client-thing: 1\r\n"))
    assert statuses(got) == [200], got[:300]
    head = raw_upstream.heads[before]
    names = sorted(_fields(head))
    # host is the upstream's own, content-length is recomputed (llmtap asked for usage), traceparent is
    # llmtap's span, accept-encoding: identity lets it remove the usage event it asked for.
    assert names == [b"accept-encoding", b"content-length", b"host", b"traceparent", b"x-client-thing"], head
    assert _fields(head)[b"accept-encoding"] == b"identity"


def test_a_request_llmtap_does_not_change_goes_up_with_the_clients_headers_alone(
    proxy: Llmtap, raw_upstream: RawUpstream
) -> None:
    before = len(raw_upstream.heads)
    extra = b"accept-encoding: br\r\nuser-agent: my-app/1.0\r\n"
    got = exchange(proxy.port, request(b"/status/200", b"", extra=extra, method=b"GET"))
    assert statuses(got) == [200], got[:300]
    fields = _fields(raw_upstream.heads[before])
    assert sorted(fields) == [b"accept-encoding", b"host", b"traceparent", b"user-agent"], fields
    assert fields[b"accept-encoding"] == b"br" and fields[b"user-agent"] == b"my-app/1.0"


@pytest.mark.parametrize("force", [False, True], ids=["gzip-if-asked", "gzip-always"])
def test_the_usage_event_llmtap_asked_for_never_reaches_a_client_that_accepts_gzip(proxy: Llmtap, force: bool) -> None:
    extra = b"accept-encoding: gzip\r\n" + (b"x-force-gzip: 1\r\n" if force else b"")
    got = exchange(proxy.port, request(b"/v1/chat/completions", CHAT, extra=extra))
    [(status, fields, body)] = parse(got)
    assert status == 200, got[:300]
    if fields.get(b"content-encoding") == b"gzip":
        body = zlib.decompress(body, wbits=47)
    assert body == sse_body(include_usage=False)
    no_traceback(proxy)


# --- bodiless answers and what the client may not send ----------------------------------------------------


@pytest.mark.parametrize("status", [204, 304])
def test_a_bodiless_status_with_content_length_keeps_the_connection(proxy: Llmtap, status: int) -> None:
    pipelined = request(b"/status/%d" % status, method=b"GET") + request(b"/status/200", method=b"GET")
    got = exchange(proxy.port, pipelined, responses=2)
    assert statuses(got) == [status, 200], got
    first = got.partition(b"\r\n\r\n")[0]
    assert b'etag: "v1"' in first
    if status == 204:
        assert b"content-length" not in first.lower()  # RFC 9110 section 8.6: never on a 204
    no_traceback(proxy)


def test_interim_responses_are_skipped_and_the_final_one_relayed(proxy: Llmtap) -> None:
    got = exchange(
        proxy.port, request(b"/early-hints", method=b"GET") + request(b"/status/200", method=b"GET"), responses=2
    )
    assert statuses(got)[-2:] == [200, 200], got
    no_traceback(proxy)


@pytest.mark.parametrize("upgrade", [b"websocket", b"WebSocket", b"foo/2, websocket", b"tls/1.3"])
def test_an_upgrade_request_gets_a_clear_refusal(proxy: Llmtap, raw_upstream: RawUpstream, upgrade: bytes) -> None:
    before = len(raw_upstream.heads)
    extra = b"connection: keep-alive, Upgrade\r\nupgrade: %s\r\nsec-websocket-version: 13\r\n" % upgrade
    extra += b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    got = exchange(proxy.port, request(b"/v1/chat/completions", method=b"GET", extra=extra))
    [(status, fields, body)] = parse(got)
    assert status == 400 and json.loads(body)["error"]["type"] == "upgrade_not_supported", got
    assert fields[b"connection"] == b"close"
    assert len(raw_upstream.heads) == before  # nothing went upstream
    no_traceback(proxy)


def test_an_h2c_offer_is_ignored_and_answered_in_http11(proxy: Llmtap, raw_upstream: RawUpstream) -> None:
    """curl --http2 offers h2c with plain-HTTP requests; a server may ignore it (RFC 9110 section 7.8)."""
    before = len(raw_upstream.heads)
    extra = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    got = exchange(proxy.port, request(b"/status/200", method=b"GET", extra=extra))
    [(status, fields, body)] = parse(got)
    assert status == 200 and body == b"x" * 42, got[:300]
    assert fields[b"connection"] == b"close"  # the server reads nothing more after an upgrade offer
    upstream = _fields(raw_upstream.heads[before])
    assert not {b"upgrade", b"http2-settings", b"connection"} & set(upstream), upstream
    # With a body, the bytes after the head would be taken for the new protocol: refused, nothing lost upstream.
    got = exchange(proxy.port, request(b"/v1/chat/completions", CHAT, extra=extra))
    [(status, fields, body)] = parse(got)
    assert status == 400 and json.loads(body)["error"]["type"] == "upgrade_not_supported", got
    assert len(raw_upstream.heads) == before + 1
    no_traceback(proxy)


def test_http11_without_host_is_a_400(proxy: Llmtap, raw_upstream: RawUpstream) -> None:
    before = len(raw_upstream.heads)
    got = exchange(proxy.port, b"GET /status/200 HTTP/1.1\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400"), got
    assert b"host" in got.partition(b"\r\n\r\n")[2].lower()
    assert len(raw_upstream.heads) == before
    # HTTP/1.0 has no Host requirement, and two Host fields are as bad as none
    assert exchange(proxy.port, b"GET /status/200 HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200")
    twice = exchange(proxy.port, b"GET /status/200 HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n")
    assert twice.startswith(b"HTTP/1.1 400"), twice
    no_traceback(proxy)


@pytest.mark.parametrize("expect", [b"something-else", b"100-continue, x-more", b"100-continue; x=1"])
def test_an_expectation_other_than_100_continue_gets_417(
    proxy: Llmtap, raw_upstream: RawUpstream, expect: bytes
) -> None:
    """RFC 9110 section 10.1.1: an expectation nobody on the path meets is refused, never forwarded."""
    before = len(raw_upstream.heads)
    got = exchange(proxy.port, request(b"/v1/chat/completions", CHAT, extra=b"expect: %s\r\n" % expect))
    [(status, fields, body)] = parse(got)
    assert status == 417 and json.loads(body)["error"]["type"] == "expectation_failed", got[:300]
    assert fields[b"connection"] == b"close"
    assert len(raw_upstream.heads) == before  # nothing went upstream
    no_traceback(proxy)


def test_100_continue_is_met_before_the_body_is_sent(proxy: Llmtap, raw_upstream: RawUpstream) -> None:
    head = request(b"/v1/chat/completions", extra=b"Expect: 100-Continue\r\ncontent-length: %d\r\n" % len(CHAT))
    head = head.replace(b"content-length: 0\r\n", b"")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head)
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n"), interim
        sock.sendall(CHAT)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):
            part = sock.recv(65536)
            assert part, got
            got += part
    [(status, _, body)] = parse(got)
    assert status == 200 and body == sse_body(include_usage=False)
    no_traceback(proxy)


# --- response heads llmtap cannot relay faithfully ----------------------------------------------


def record_of(proxy: Llmtap, model: str) -> dict[str, object]:
    """The record of the one request that named ``model``, once it is written."""
    deadline = time.monotonic() + PATIENCE
    while True:
        found = [r for r in read_records(proxy.records, ReadStats()) if r.get("model") == model]  # type: ignore[attr-defined]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no record of {model}"
        time.sleep(0.05)


@pytest.mark.parametrize("name", sorted(BAD_HEADS))
def test_a_response_head_that_cannot_be_relayed_faithfully_is_a_502_and_recorded(proxy: Llmtap, name: str) -> None:
    """A status outside 100-599 or a final 1xx, a transfer coding other than chunked, ambiguous framing, a malformed
    or unwritable header: the client gets a 502 that says why (never a dropped connection, nor bytes it cannot
    read), the log says it (no traceback), and the record carries ``upstream_protocol_error``."""
    model = f"bad-{name}-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}).encode()
    got = exchange(proxy.port, request(b"/v1/chat/completions", body, extra=b"x-raw: %s\r\n" % name.encode()))
    [(status, _, answer)] = parse(got)
    error = json.loads(answer)["error"]
    assert (status, error["type"]) == (502, "upstream_protocol_error"), got[:400]
    assert "cannot relay faithfully" in error["message"]
    record = record_of(proxy, model)
    assert (record["error_type"], record["outcome"]) == ("upstream_protocol_error", "error"), record
    assert "a response head llmtap cannot relay" in proxy.logs()
    no_traceback(proxy)


def test_a_final_answer_after_interim_ones_is_still_relayed(proxy: Llmtap) -> None:
    got = exchange(proxy.port, request(b"/early-hints", method=b"GET"))
    assert statuses(got) == [200], got


@pytest.mark.parametrize("options", [b"", b',"stream_options":{"continuous_usage_stats":true}'])
def test_a_body_of_megabytes_is_read_as_it_arrives_and_spliced_as_a_small_one_is(
    proxy: Llmtap, raw_upstream: RawUpstream, options: bytes
) -> None:
    """Past ``SCAN_FROM`` the relay reads the body piece by piece (``llmtap.providers.bodyscan``): the
    upstream gets exactly what ``prepare_usage`` makes of it, and the client no usage event it did not ask for."""
    from llmtap.providers.splice import prepare_usage
    from llmtap.relay.bodyread import SCAN_FROM

    content = json.dumps('say "hi"\n\t' + "word " * (SCAN_FROM // 2))
    body = b'{"model":"raw","messages":[{"role":"user","content":%s}],"stream":true%s}' % (content.encode(), options)
    assert len(body) > 2 * SCAN_FROM
    want = prepare_usage(body, inject_usage=True).body
    assert want is not None
    before = len(raw_upstream.bodies)
    got = exchange(proxy.port, request(b"/v1/chat/completions", body))
    [(status, _, answer)] = parse(got)
    assert status == 200 and answer == sse_body(include_usage=False), got[:300]
    assert raw_upstream.bodies[before] == want
    no_traceback(proxy)
