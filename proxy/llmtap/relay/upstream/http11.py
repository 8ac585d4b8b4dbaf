"""HTTP/1.1 on the wire, both ways: the request's head as bytes, and the response parsed as it arrives.

``Http11`` is the parsing half of an upstream connection (``llmtap.relay.upstream.connection``): httptools' callbacks
and the state of one response (status, head, body parts, its end), fed up to the points where a message may end, so
bytes past a response's end never reach the parser (RFC 9112 section 6.3). Whole chunks of a chunked body, a
stream's usual read, are taken without the parser (``_whole``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterable, Callable

import httptools
import httpx

from llmtap.relay.upstream.errors import BadHead, BadRequestHead, UpstreamError, UpstreamProtocolError

__all__ = ["MAX_HEAD_BYTES", "Http11", "Pieces", "Sink", "chunked_of", "head_of", "request_head"]

#: The largest response head (interim responses included); a longer one is a protocol error.
MAX_HEAD_BYTES = 256 * 1024
#: The digits of a chunk's size (RFC 9112 section 7.1).
_HEX_DIGITS = b"0123456789abcdefABCDEF"
# A response head, a chunked body (last chunk and trailers) and so every message whose length is not
# counted in advance ends with this; the parser only ever sees input up to such a point or a counted end.
_END = b"\r\n\r\n"
#: The methods whose empty body httpx announces with ``Content-Length: 0`` (and so ``request_head`` does).
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: A sink: called with the moment a socket read arrived and one body part it carried.
Sink = Callable[[float, bytes], None]
#: A request body in memory, in pieces (the relay's spliced body of megabytes: its parts and the bytes it adds),
#: sent with a Content-Length a slice of ``WRITE_SLICE`` bytes at a time, the loop getting a turn between slices.
Pieces = tuple[bytes | memoryview, ...]


class Http11:
    """The response side of one HTTP/1.1 connection: httptools' callbacks and one response's state.

    The connection (``Connection``) owns the socket; it calls ``_reset`` at each exchange and feeds what it reads.
    """

    _parser: httptools.HttpResponseParser

    def _reset(self, *, head_only: bool) -> None:
        self.head_only = head_only
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.sent_all = False
        self.error: UpstreamError | None = None
        self.surplus = 0
        self.parts: deque[bytes] = deque()
        self._pending: list[bytes] = []
        self._queued = 0
        self._interim = False
        self._chunked = False
        #: Body bytes still due under Content-Length; None when the length is not counted in advance.
        self._remaining: int | None = None
        self._head_bytes = 0
        self._tail = b""
        #: A chunked body's parser stands between two chunks: the next bytes are a chunk's size line.
        self._boundary = False

    def _whole(self, sink: Sink, t: float, data: bytes) -> int:
        """Hand each whole chunk at the start of ``data`` to ``sink``, the parser standing between two chunks;
        returns where the rest begins (the parser's to read: a chunk split across reads, the last chunk, a
        size line with an extension, anything malformed).

        Only what the parser would read the same way is taken (RFC 9112 section 7.1: hex digits, CRLF, that
        many bytes, CRLF), and the parser is left where it would stand after it: between two chunks. So the
        parts are those the parser would give, with no callback per chunk.
        """
        at = 0
        size = len(data)
        while at < size:
            line = data.find(b"\r\n", at, at + 18)
            if line <= at:
                break
            digits = data[at:line]
            if digits.lstrip(_HEX_DIGITS):
                break
            count = int(digits, 16)
            end = line + 2 + count
            if count == 0 or end + 2 > size or data[end : end + 2] != b"\r\n":
                break
            sink(t, data[line + 2 : end])
            at = end + 2
        return at

    def _piece_end(self, data: bytes, start: int) -> int:
        """Where the input may next end a message: the parser is fed up to there, and no further at once."""
        if self.head_done and not self._chunked:
            if self._remaining is None:
                return len(data)
            return min(len(data), start + self._remaining)
        if start == 0 and self._tail:
            # A head or a chunked body's end that began in the previous read.
            found = (self._tail + data[:3]).find(_END)
            if found >= 0:
                return found + 4 - len(self._tail)
        found = data.find(_END, max(start - 3, 0))
        while 0 <= found and found + 4 <= start:
            found = data.find(_END, found + 1)
        return len(data) if found < 0 else found + 4

    def _feed(self, piece: bytes | memoryview) -> None:
        if not self.head_done:
            self._head_bytes += len(piece)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(BadHead(f"response head longer than {MAX_HEAD_BYTES} bytes"))
                return
        try:
            self._parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self._fail(BadHead("upstream switched protocols unasked"))
        except httptools.HttpParserError as exc:
            # In the head, what the relay cannot pass on (``llmtap.relay.heads``); in the body, a stream broken.
            error = BadHead if not self.head_done else UpstreamProtocolError
            self._fail(error(f"malformed response from upstream: {exc}"))
        self._tail = bytes(piece[-3:]) if len(piece) >= 3 else (self._tail + bytes(piece))[-3:]
        if self._boundary and not self._tail.endswith(b"\r\n"):
            self._boundary = False  # the next chunk's size line began: the parser holds part of it

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interim = True  # 1xx: skipped, the final response follows (101 stops the parser: refused)
            self.headers = []
            self.reason = b""
            return
        self.status = status
        self.head_done = True
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                self._chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
            elif lowered == b"content-length":
                self._remaining = int(value)  # the parser refuses malformed or conflicting lengths
        if self._chunked:
            self._remaining = None
            self._boundary = not self.head_only
        if status in (204, 304):
            self._remaining = 0  # never a body, whatever Content-Length says (RFC 9112 section 6.3)
        if self.head_only:
            # The parser cannot be told the request was HEAD: the message ends here, and the connection
            # is closed after it rather than trusted with a parser expecting a body.
            self.done = True

    def on_body(self, body: bytes) -> None:
        self._pending.append(body)
        if self._remaining is not None:
            self._remaining -= len(body)

    def on_chunk_header(self) -> None:
        self._boundary = False

    def on_chunk_complete(self) -> None:
        # After the CRLF that ends the chunk's data: the parser stands between two chunks unless more follows.
        self._boundary = True
        if self._pending:
            self._flush()

    def _flush(self) -> None:
        """Queue what the parser gave of one HTTP chunk (or one read of a counted body) as one part."""
        pending = self._pending
        part = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        self.parts.append(part)
        self._queued += len(part)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.keep_alive = self._parser.should_keep_alive() and not self.head_only
        self.done = True

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.abort()

    def _past_end(self, count: int) -> None:
        """Bytes after the response's end (or on an idle connection): never parsed, the connection is closed."""
        self.surplus += count
        self.keep_alive = False
        self.abort()

    def version(self) -> bytes:
        """The response's HTTP version as the parser read it (``1.1``)."""
        return self._parser.get_http_version().encode("ascii")

    def abort(self) -> None:
        """Close the connection at once (``Connection.abort``)."""
        raise NotImplementedError


def request_head(
    method: str,
    target: bytes,
    host: bytes,
    headers: list[tuple[bytes, bytes]],
    content: bytes | Pieces | AsyncIterable[bytes],
) -> tuple[bytes, bool]:
    """The request line and headers, and whether the body goes chunked, as ``httpx.Request`` builds them from
    the same method, target, headers and content (and ``head_of`` writes them): ``Host`` first, then
    ``Content-Length: 0`` for an empty POST, PUT or PATCH that names no length, then ``headers``, then the
    body's ``Content-Length`` (bytes, or ``Pieces``: their total) or ``Transfer-Encoding: chunked`` (a stream)
    unless a length is named.
    """
    method = method.upper()
    names = {name.lower() for name, _ in headers}
    extra: list[tuple[bytes, bytes]] = []
    if isinstance(content, (bytes, tuple)):
        length = len(content) if isinstance(content, bytes) else sum(map(len, content))
        if length and b"content-length" not in names:
            extra.append((b"Content-Length", b"%d" % length))
            names.add(b"content-length")
    elif b"content-length" not in names and b"transfer-encoding" not in names:
        extra.append((b"Transfer-Encoding", b"chunked"))
        names.add(b"transfer-encoding")
    auto: list[tuple[bytes, bytes]] = []
    if b"host" not in names:
        auto.append((b"Host", host))
    if b"content-length" not in names and b"transfer-encoding" not in names and method in _BODY_METHODS:
        auto.append((b"Content-Length", b"0"))
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), target)]
    lines.extend(name + b": " + value for name, value in (*auto, *headers, *extra))
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    # One CR and one LF per line and no more: a header cannot smuggle a line of its own.
    if head.count(b"\n") != len(lines) + 1 or head.count(b"\r") != len(lines) + 1:
        raise BadRequestHead("CR or LF inside a request header")
    codings = b", ".join(value for name, value in (*headers, *extra) if name.lower() == b"transfer-encoding")
    return head, codings.rsplit(b",", 1)[-1].strip().lower() == b"chunked"


def head_of(request: httpx.Request) -> bytes:
    """Request line and headers exactly as httpx built them (Host included)."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    lines.extend(name + b": " + value for name, value in request.headers.raw)
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    # One CR and one LF per line and no more: a header cannot smuggle a line of its own.
    if head.count(b"\n") != len(lines) + 1 or head.count(b"\r") != len(lines) + 1:
        raise BadRequestHead("CR or LF inside a request header")
    return head


def chunked_of(request: httpx.Request) -> bool:
    codings: str = request.headers.get("transfer-encoding", "")
    return codings.rsplit(",", 1)[-1].strip().lower() == "chunked"
