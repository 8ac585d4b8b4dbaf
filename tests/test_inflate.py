"""The relay's own decompression (``llmtap.relay.inflate``): exact, in bounded pieces, and only to its limit."""

from __future__ import annotations

import gzip
import zlib

import pytest

from llmtap.relay.inflate import PIECE, InflateLimit, Inflater

EVENTS = b"".join(b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(3000))


def inflate_all(inflater: Inflater, wire: bytes, step: int) -> bytes:
    out = bytearray()
    for start in range(0, len(wire), step):
        for piece in inflater.feed(wire[start : start + step]):
            assert 0 < len(piece) <= PIECE
            out += piece
    return bytes(out + inflater.flush())


def test_gzip_members_one_after_another_inflate_exactly_however_the_reads_split() -> None:
    # Each member inflates to more than a piece, so a member ends while zlib still holds input.
    wire = gzip.compress(EVENTS) + gzip.compress(EVENTS[:100]) + gzip.compress(EVENTS)
    expected = EVENTS + EVENTS[:100] + EVENTS
    for step in (len(wire), 16384, 1000, 97, 7, 1):
        assert inflate_all(Inflater(b"gzip"), wire, step) == expected, step


def test_a_member_ending_with_the_read_leaves_nothing_behind() -> None:
    member = gzip.compress(EVENTS)
    inflater = Inflater(b"gzip")
    first = b"".join(inflater.feed(member))
    second = b"".join(inflater.feed(member))
    assert first == second == EVENTS


def test_deflate_inflates_in_pieces() -> None:
    raw = zlib.compress(EVENTS * 4)
    assert inflate_all(Inflater(b"deflate"), raw, 4096) == EVENTS * 4


def test_past_the_limit_inflating_stops() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))
    inflater = Inflater(b"gzip", limit=1 << 20)
    produced = 0
    with pytest.raises(InflateLimit):
        for piece in inflater.feed(bomb):
            produced += len(piece)
    # The piece that crossed the limit is not handed out: what was is within the limit.
    assert (1 << 20) - PIECE < produced <= 1 << 20
