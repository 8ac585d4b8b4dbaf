"""A short answer that came whole, written to the client at once: its head and its body in one write.

An embeddings call, a classifier, a tool call: the upstream's answer, counted by its Content-Length, is often
read whole with its head. Relayed the way a stream is, it costs two ASGI ``send``s through uvicorn (the head,
then the end) and the pipe's setup and wait, about a fifth of the relay's CPU for such a request
(docs/performance.md). Here the head uvicorn would write and the body go in one ``transport.write``, and the
server's request cycle is left as uvicorn's own ``send`` leaves it after the end (started, complete, the
connection kept or closed, the next request's turn), so the server goes on exactly as after a streamed relay.
An upstream that writes its head and its body apart (uvicorn does) often brings them in two reads: the relay
then waits for the rest of a counted body of up to ``REST_BYTES`` for at most ``REST_WAIT`` seconds
(``Exchange._rest``), and writes head and body at once; a rest later than that, a larger body or a failure
takes the ordinary path, the head relayed at once, as before.

Only an answer uvicorn frames by its Content-Length goes here: a HEAD request, a 204 or 304, an answer without
Content-Length (chunked framing), a header uvicorn would refuse, a client gone or not taking bytes: ``head_of``
says None and the relay takes its ordinary path, which behaves as it always did. So does every request under a
uvicorn older than 0.53, whose ``send`` frames the head otherwise (it copies a client's ``Connection: close`` and
never says ``close`` to an HTTP/1.0 client): the head built here is 0.53's and later's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

__all__ = ["MIRRORED", "REST_BYTES", "REST_WAIT", "Whole", "head_of", "write_whole"]

#: A body up to this is joined to its head (one buffer, one write); a larger one is written beside it, not copied.
_JOINED_BYTES = 16 * 1024
#: A counted body whose head came first is waited for, to go at once with it, up to this many bytes in all...
REST_BYTES = 64 * 1024
#: ...and for at most this many seconds (the rest of a short answer follows its head within a millisecond, unless
#: the upstream is stalled); past either bound the answer takes the ordinary path, its head relayed at once.
REST_WAIT = 0.25
#: Statuses whose answer never has a body, whatever it says: uvicorn frames them apart.
_BODILESS = frozenset({204, 304})


def _mirrored(version: str) -> bool:
    """Whether this uvicorn's ``send`` writes the head ``head_of`` builds (0.53 and later)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (0, 53)


#: Whether answers go at once under the uvicorn installed; when not, every answer takes the ordinary path.
MIRRORED = _mirrored(uvicorn.__version__)


class Whole:
    """The head of an answer that goes at once, and whether the connection is kept after it."""

    __slots__ = ("head", "keep_alive")

    def __init__(self, head: bytes, keep_alive: bool) -> None:
        self.head = head
        self.keep_alive = keep_alive


def head_of(
    cycle: Any, status: int, headers: Iterable[tuple[bytes, bytes]], size: int, *, writable: bool = False
) -> Whole | None:
    """The head uvicorn's cycle would write for this answer of ``size`` bytes, as uvicorn writes it (its default
    headers first, names lower-cased, ``connection: close`` when the connection is not kept); None when the
    answer cannot go at once.

    ``writable``: the caller vouches that uvicorn writes every field of ``headers`` (the relay's answer passed
    ``llmtap.relay.heads.unrelayable``, whose checks are uvicorn's and more, and its own Server-Timing is printable
    ASCII), so only the server's default headers are looked for a field uvicorn refuses: the same answer, a search of
    each field fewer."""
    if (
        not MIRRORED
        or cycle.response_started
        or cycle.disconnected
        or cycle.flow.write_paused
        or status in _BODILESS
        or cycle.scope["method"] == "HEAD"
    ):
        return None
    defaults = cycle.default_headers
    fields = (*defaults, *headers)
    if writable:
        if defaults is not _CHECKED.fields:
            # A list uvicorn makes again each second (its Date), the same for every answer meanwhile: looked at once.
            _CHECKED.fields, _CHECKED.refused = defaults, bool(defaults) and _refused(defaults)
        if _CHECKED.refused:
            return None  # uvicorn refuses it: the ordinary path fails as it always did
    elif fields and _refused(fields):
        return None
    out = [STATUS_LINE[status]]
    length: bytes | None = None
    keep_alive = cycle.keep_alive
    closing = False
    for name, value in fields:
        name = name.lower()
        if name == b"content-length":
            if length is None:
                length = value
        elif name == b"transfer-encoding" and value.lower() == b"chunked":
            return None
        elif name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
            keep_alive = False
            closing = True
        out += (name, b": ", value, b"\r\n")
    if length is None or not _counts(length, size):
        return None
    if not keep_alive and not closing:
        out.append(b"connection: close\r\n")
    out.append(b"\r\n")
    return Whole(b"".join(out), keep_alive)


class _Checked:
    """The server's default headers last looked at by ``head_of`` (held, so that no other list takes its identity),
    and whether uvicorn refuses one of them."""

    fields: object = None
    refused = False


_CHECKED = _Checked()


def _one_class(pattern: re.Pattern[bytes]) -> bool:
    """Whether ``pattern`` is one bracketed class of bytes: then a search over several fields joined finds what a
    search over each would."""
    return re.fullmatch(rb"\[(?:\\.|[^\]\\])*\]", pattern.pattern) is not None


#: uvicorn's checks can run once over all names and once over all values (each a class of bytes, as in 0.53 to
#: 0.55); else once per field.
_JOINABLE = _one_class(HEADER_RE) and _one_class(HEADER_VALUE_RE)


def _refused(fields: Sequence[tuple[bytes, bytes]]) -> bool:
    """A field uvicorn would refuse to write (its ``send`` raises for it)."""
    if _JOINABLE:
        return (
            HEADER_RE.search(b"".join([name for name, _ in fields])) is not None
            or HEADER_VALUE_RE.search(b"".join([value for _, value in fields])) is not None
        )
    return any(HEADER_RE.search(name) or HEADER_VALUE_RE.search(value) for name, value in fields)


def _counts(length: bytes, size: int) -> bool:
    """The Content-Length names exactly the body there is."""
    try:
        return int(length.decode()) == size
    except ValueError:
        return False


def write_whole(cycle: Any, whole: Whole, status: int, body: bytes) -> None:
    """Write the answer and end the response, leaving the cycle as uvicorn's ``send`` of its head and its end
    would: the access line logged, the response complete, the connection closed unless kept, the server told."""
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = False
    cycle.expected_content_length = 0
    cycle.keep_alive = whole.keep_alive
    if cycle.access_log:
        scope = cycle.scope
        cycle.access_logger.info(
            '%s - "%s %s HTTP/%s" %d',
            get_client_addr(scope),
            scope["method"],
            get_path_with_query_string(scope),
            scope["http_version"],
            status,
        )
    transport = cycle.transport
    if len(body) <= _JOINED_BYTES:
        transport.write(whole.head + body)
    else:
        transport.writelines((whole.head, body))
    cycle.response_complete = True
    cycle.message_event.set()
    if not whole.keep_alive:
        transport.close()
    cycle.on_response()
