"""Decompressing a response the relay must read: a stream whose usage event it removes came compressed.

llmtap asks for ``accept-encoding: identity`` when it will remove the usage event it asked for, so this runs
only for an upstream that compresses anyway. The client then gets the decompressed events (identity is
acceptable to every client) without the usage event.

A small compressed read can inflate to gigabytes (deflate reaches about 1032:1), and inflating costs CPU on
the event loop every other stream shares. So the work is bounded three ways (issue 28):

* per step: each step produces at most ``PIECE`` bytes (zlib's ``max_length``), and the relay lets the
  event loop turn between two steps, so no other stream waits behind more than one piece;
* in memory: a piece is sent (at the client's pace) before the next is made, never held whole;
* in total: past ``limit`` decompressed bytes ``InflateLimit`` is raised and the relay cuts the stream.

Why cut rather than pass the rest through compressed: by then the client has decompressed bytes under
headers without Content-Encoding; compressed bytes after them would be garbage to it. Deciding up front
from the headers is not possible either (a stream has no length). A cut is a defined end the client sees as
a truncated response, and it is counted (``llmtap.responses.cut``). No ratio bound is kept apart from the
total: deflate's own ceiling bounds the ratio, and a repetitive but real stream must not be cut for it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

#: The most one decompression step produces.
PIECE = 16 << 10
_WBITS = {b"gzip": 47, b"x-gzip": 47, b"deflate": 15}


class InflateLimit(Exception):
    """The response decompressed past the relay's limit."""


def decodable(encoding: bytes) -> bool:
    """True when the relay can decompress a body of this Content-Encoding (gzip or deflate, one coding)."""
    return encoding.strip().lower() in _WBITS


class Inflater:
    """Incremental gzip or deflate decompression in bounded pieces; gzip members one after another too."""

    def __init__(self, encoding: bytes, limit: int | None = None) -> None:
        self._wbits = _WBITS[encoding.strip().lower()]
        self._inflate = zlib.decompressobj(wbits=self._wbits)
        self.limit = limit
        #: Decompressed bytes produced so far.
        self.produced = 0

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decompressed bytes of ``data``, in pieces of at most ``PIECE``; ``zlib.error`` on a corrupt body,
        ``InflateLimit`` once the pieces pass ``limit`` bytes in all (the piece past it is not yielded)."""
        while data:
            piece = self._inflate.decompress(data, PIECE)
            if piece:
                yield self._count(piece)
            if self._inflate.eof:
                # A gzip body may hold several members (RFC 1952 section 2.2): the next one starts with what
                # followed this one's end. Only ``unused_data``: at the end of a member zlib may leave the same
                # bytes in ``unconsumed_tail`` too, and feeding both would inflate them again, without end.
                data = self._inflate.unused_data
                self._inflate = zlib.decompressobj(wbits=self._wbits)
            else:
                data = self._inflate.unconsumed_tail

    def flush(self) -> bytes:
        """What the decompressor still holds at the end of the body."""
        return self._count(self._inflate.flush())

    def _count(self, piece: bytes) -> bytes:
        self.produced += len(piece)
        if self.limit is not None and self.produced > self.limit:
            raise InflateLimit(f"the response decompressed past {self.limit} bytes")
        return piece
