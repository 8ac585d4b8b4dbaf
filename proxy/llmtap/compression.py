"""Decompressing HTTP bodies: one set of rules for the relay and the telemetry side, which both import it.

Codings (RFC 9110 section 8.4.1), one per body:

* ``gzip`` and its alias ``x-gzip``: several members one after another are one body (RFC 1952 section 2.2),
  as ``gzip -d`` reads them;
* ``deflate``: the zlib format the RFC names, and the raw deflate some servers send instead (told apart by
  the zlib header's check bits, as browsers do).

Brotli and zstd are not read: a body in either is relayed as it came and its telemetry is not parsed.

Inflating is bounded, since a small compressed read can inflate to gigabytes (deflate reaches
about 1032:1) and inflating costs CPU on a loop other streams share:

* per step: each step produces at most ``piece`` bytes (zlib's ``max_length``), and the caller may let its
  event loop turn between two steps, or decode each piece before the next is made, never holding a body whole;
* in total: past ``limit`` decompressed bytes, or with ``ratio`` past ``allowance`` plus ``ratio`` times the
  compressed bytes read so far, ``InflateLimit`` is raised, and the piece that crossed the bound is not handed out.

A body that is not in its coding raises ``zlib.error``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from llmtap.errors import LlmtapError

__all__ = ["CODINGS", "PIECE", "InflateLimit", "Inflater", "decodable"]

#: The most one decompression step produces, unless the caller asks for other pieces.
PIECE = 16 << 10
#: The codings read, each with zlib's ``wbits`` (None: deflate, zlib or raw, decided by its first two bytes).
CODINGS: dict[str, int | None] = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": None}


class InflateLimit(LlmtapError):
    """The body decompressed past its bound."""


def _coding(encoding: bytes | str) -> str:
    text = encoding.decode("latin-1") if isinstance(encoding, bytes) else encoding
    return text.strip().lower()


def decodable(encoding: bytes | str) -> bool:
    """True when a body of this Content-Encoding can be decompressed here (one coding of ``CODINGS``)."""
    return _coding(encoding) in CODINGS


def _zlib_header(first: bytes) -> bool:
    """Whether two bytes open a zlib stream (RFC 1950 section 2.2: method 8, and the check bits)."""
    return first[0] & 0x0F == 8 and first[0] >> 4 <= 7 and (first[0] << 8 | first[1]) % 31 == 0


class Inflater:
    """Incremental decompression of one body, fed as it arrives, handed out in pieces of at most ``piece``."""

    def __init__(
        self,
        encoding: bytes | str,
        limit: int | None = None,
        *,
        piece: int = PIECE,
        ratio: int | None = None,
        allowance: int = 0,
    ) -> None:
        coding = _coding(encoding)
        if coding not in CODINGS:
            raise ValueError(f"content-encoding {coding!r} is not one of {', '.join(CODINGS)}")
        self._wbits = CODINGS[coding]
        self._inflate: zlib._Decompress | None = None
        self._head = b""  # deflate's first byte, until the second says zlib or raw
        self.limit = limit
        self.ratio = ratio
        self.allowance = allowance
        self._piece = piece
        #: Decompressed bytes produced so far, and the compressed bytes they came from.
        self.produced = 0
        self.consumed = 0

    @property
    def complete(self) -> bool:
        """True when what was fed so far ends where a member (or the deflate stream) ends."""
        return self._inflate is not None and self._inflate.eof and not self._inflate.unused_data

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decompressed bytes of ``data``, in pieces of at most ``piece``: ``zlib.error`` on a corrupt body,
        ``InflateLimit`` once past the bound."""
        if self._inflate is None:
            data = self._start(data)
        while data:
            inflate = self._inflate
            assert inflate is not None
            piece = inflate.decompress(data, self._piece)
            # At the end of a member, only ``unused_data``: zlib may leave the same bytes in
            # ``unconsumed_tail`` too, and feeding both would inflate them again, without end.
            rest = inflate.unused_data if inflate.eof else inflate.unconsumed_tail
            self.consumed += len(data) - len(rest)
            if piece:
                yield self._count(piece)
            if inflate.eof and rest:
                # A gzip body may hold several members: the next one starts with what followed this one's end.
                self._inflate = self._decompressor(rest)
            elif not rest and len(piece) == self._piece:
                # A full piece may leave output inside zlib with all the input consumed: ask for it.
                while len(piece) == self._piece and not inflate.eof:
                    piece = inflate.decompress(b"", self._piece)
                    if piece:
                        yield self._count(piece)
            data = rest

    def flush(self) -> bytes:
        """What the decompressor still holds at the end of the body."""
        if self._inflate is None:
            if not self._head:
                return b""
            inflate, head, self._head = self._decompressor(self._head), self._head, b""  # a one-byte deflate body
            self._inflate = inflate
            return self._count(inflate.decompress(head) + inflate.flush())
        return self._count(self._inflate.flush())

    def _start(self, data: bytes) -> bytes:
        """Make the first decompressor once the body's start says which (deflate: zlib or raw); what is left."""
        if self._wbits is not None:
            self._inflate = zlib.decompressobj(wbits=self._wbits)
            return data
        head = self._head + data
        if len(head) < 2:
            self._head = head
            return b""
        self._head = b""
        self._inflate = self._decompressor(head)
        return head

    def _decompressor(self, start: bytes) -> zlib._Decompress:
        wbits = self._wbits
        if wbits is None:
            wbits = zlib.MAX_WBITS if len(start) >= 2 and _zlib_header(start) else -zlib.MAX_WBITS
        return zlib.decompressobj(wbits=wbits)

    def _count(self, piece: bytes) -> bytes:
        self.produced += len(piece)
        if self.limit is not None and self.produced > self.limit:
            raise InflateLimit(f"the response decompressed past {self.limit} bytes")
        if self.ratio is not None and self.produced > self.allowance + self.ratio * self.consumed:
            raise InflateLimit(
                f"the response decompressed past {self.ratio} times its {self.consumed} compressed bytes"
            )
        return piece
