"""Decompressing a response the relay must read: a stream whose usage event it removes came compressed.

llmtap asks for ``accept-encoding: identity`` when it will remove the usage event it asked for, so this runs
only for an upstream that compresses anyway. The client then gets the decompressed events (identity is
acceptable to every client) without the usage event. Each step yields at most ``PIECE`` bytes, so a small
compressed read that inflates to gigabytes is sent piece by piece, at the client's pace, never held whole.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

#: The most one decompression step produces.
PIECE = 64 << 10
_WBITS = {b"gzip": 47, b"x-gzip": 47, b"deflate": 15}


def decodable(encoding: bytes) -> bool:
    """True when the relay can decompress a body of this Content-Encoding (gzip or deflate, one coding)."""
    return encoding.strip().lower() in _WBITS


class Inflater:
    """Incremental gzip or deflate decompression in bounded pieces; gzip members one after another too."""

    def __init__(self, encoding: bytes) -> None:
        self._wbits = _WBITS[encoding.strip().lower()]
        self._inflate = zlib.decompressobj(wbits=self._wbits)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decompressed bytes of ``data``, in pieces of at most ``PIECE``; ``zlib.error`` on a corrupt body."""
        while data:
            piece = self._inflate.decompress(data, PIECE)
            if piece:
                yield piece
            data = self._inflate.unconsumed_tail
            if self._inflate.eof:
                # A gzip body may hold several members (RFC 1952 section 2.2): the next one starts here.
                data = self._inflate.unused_data + data
                self._inflate = zlib.decompressobj(wbits=self._wbits)

    def flush(self) -> bytes:
        """What the decompressor still holds at the end of the body."""
        return self._inflate.flush()
