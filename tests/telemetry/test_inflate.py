"""Decompression (``llmtap.compression``), the one set of rules the relay and the telemetry tap share: exact
whatever the reads' split, in bounded pieces, and only to its bound."""

from __future__ import annotations

import gzip
import zlib

import pytest

from llmtap.analysis.timeline import Timeline
from llmtap.compression import PIECE, InflateLimit, Inflater, decodable
from llmtap.providers import provider_for
from llmtap.telemetry.fleet.serverspans import BadBody, inflate
from llmtap.telemetry.intake import tap as tap_module
from llmtap.telemetry.intake.tap import Tap
from tests.support.fault_upstream import WORDS, chat_chunk, usage_event

EVENTS = b"".join(b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(3000))
SMALL = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'


def _raw_deflate(data: bytes) -> bytes:
    pack = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return pack.compress(data) + pack.flush()


#: Each coding read, with a small body as it goes over the wire: (encoding, wire, decompressed).
CODINGS = [
    ("gzip", gzip.compress(SMALL), SMALL),
    ("x-gzip", gzip.compress(SMALL), SMALL),
    ("gzip", gzip.compress(SMALL[:40]) + gzip.compress(SMALL[40:]), SMALL),  # two members
    ("GZip ", gzip.compress(SMALL), SMALL),
    ("deflate", zlib.compress(SMALL), SMALL),  # the zlib format, as RFC 9110 names it
    ("deflate", _raw_deflate(SMALL), SMALL),  # raw deflate, as some servers send it
]


def inflate_all(inflater: Inflater, wire: bytes, step: int) -> bytes:
    out = bytearray()
    for start in range(0, len(wire), step):
        for piece in inflater.feed(wire[start : start + step]):
            assert 0 < len(piece) <= PIECE
            out += piece
    return bytes(out + inflater.flush())


@pytest.mark.parametrize(("encoding", "wire", "expected"), CODINGS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CODINGS)])
def test_every_coding_split_at_every_byte_inflates_exactly(encoding: str, wire: bytes, expected: bytes) -> None:
    assert decodable(encoding) and decodable(encoding.encode())
    for cut in range(len(wire) + 1):
        inflater = Inflater(encoding)
        out = b"".join(inflater.feed(wire[:cut])) + b"".join(inflater.feed(wire[cut:])) + inflater.flush()
        assert out == expected, cut
        assert inflater.complete and inflater.produced == len(expected) and inflater.consumed == len(wire), cut
    assert inflate_all(Inflater(encoding), wire, 1) == expected


def test_codings_not_read_are_said_so() -> None:
    for encoding in ("br", "zstd", "gzip, deflate", "identity", ""):
        assert not decodable(encoding)
        with pytest.raises(ValueError, match="is not one of gzip, x-gzip, deflate"):
            Inflater(encoding)


def test_a_corrupt_body_raises_zlib_error() -> None:
    for encoding, wire in (("gzip", b"not gzip at all"), ("deflate", b"\x78\x9c\xff\xff"), ("deflate", b"\xff\xff")):
        with pytest.raises(zlib.error):
            b"".join(Inflater(encoding).feed(wire))
    # A body cut short is not complete: the caller says so (the span receiver answers 400).
    cut = Inflater("gzip")
    assert b"".join(cut.feed(gzip.compress(EVENTS)[:-12])) + cut.flush() != b""
    assert not cut.complete


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
    for wire in (zlib.compress(EVENTS * 4), _raw_deflate(EVENTS * 4)):
        assert inflate_all(Inflater(b"deflate"), wire, 4096) == EVENTS * 4


def test_a_full_piece_that_used_all_input_is_followed_by_what_zlib_still_held() -> None:
    # Highly compressible: one small read inflates to many pieces, all of them handed out in that read.
    wire = gzip.compress(b"\0" * (PIECE * 10))
    inflater = Inflater("gzip")
    assert sum(len(p) for p in inflater.feed(wire)) == PIECE * 10
    assert inflater.flush() == b"" and inflater.complete


def test_past_the_limit_inflating_stops() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))
    inflater = Inflater(b"gzip", limit=1 << 20)
    produced = 0
    with pytest.raises(InflateLimit, match=r"decompressed past 1048576 bytes"):
        for piece in inflater.feed(bomb):
            produced += len(piece)
    # The piece that crossed the limit is not handed out: what was is within the limit.
    assert (1 << 20) - PIECE < produced <= 1 << 20


def test_the_limit_counts_every_member() -> None:
    # Members each under the limit, together over it: the bound is the body's, not a member's.
    member = gzip.compress(b"x" * (600 << 10))
    inflater = Inflater("gzip", limit=1 << 20)
    with pytest.raises(InflateLimit):
        for _ in inflater.feed(member + member):
            pass
    assert inflater.produced > 1 << 20


def test_past_the_ratio_inflating_stops_beyond_the_allowance() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))  # about 1000:1
    inflater = Inflater("gzip", ratio=256, allowance=1 << 20)
    produced = 0
    with pytest.raises(InflateLimit, match=r"past 256 times its \d+ compressed bytes"):
        for start in range(0, len(bomb), 512):
            for piece in inflater.feed(bomb[start : start + 512]):
                produced += len(piece)
    assert produced <= (1 << 20) + 256 * inflater.consumed
    # A real stream (gzip'd SSE runs 13x to 37x) is read to its end under the same bound.
    wire = gzip.compress(EVENTS)
    assert inflate_all(Inflater("gzip", ratio=256, allowance=0), wire, 1000) == EVENTS


# --- through the telemetry tap, and the span receiver ---------------------------------------------------


def _tap(encoding: str) -> tuple[Timeline, Tap]:
    provider = provider_for("POST", "/v1/chat/completions")
    assert provider is not None
    tl = Timeline("POST", "/v1/chat/completions", "r", "http://u", "u", 80, provider.name, "openai", 0.0, 0)
    return tl, Tap(tl, provider, content_type="text/event-stream", content_encoding=encoding, stream_requested=True)


def test_the_tap_reads_every_gzip_member() -> None:
    # An upstream that compresses each flush as its own member (as a gzip filter per write does): before one
    # module served both sides, the tap stopped at the first member and lost the usage at the end.
    events = [chat_chunk({"content": word}) for word in WORDS * 20] + [usage_event(12, 345)]
    members = [gzip.compress(e) for e in events]
    tl, tap = _tap("gzip")
    for i, member in enumerate(members):
        tap.feed(member, float(i))
    tap.finish(1e9)
    assert tl.unread is None
    assert tl.usage is not None and tl.usage.output_tokens == 345
    assert len(tl.chunk_times) == len(events) - 1  # one content chunk per read
    # The same through x-gzip and raw deflate, split at every 7 bytes.
    for encoding, wire in (("x-gzip", b"".join(members)), ("deflate", _raw_deflate(b"".join(events)))):
        tl, tap = _tap(encoding)
        for start in range(0, len(wire), 7):
            tap.feed(wire[start : start + 7], float(start))
        tap.finish(1e9)
        assert tl.usage is not None and tl.usage.output_tokens == 345, encoding


def test_the_tap_stops_at_its_bound_across_members(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tap_module, "MAX_INFLATED_BYTES", 64 << 10)
    event = chat_chunk({"content": "a" * 1000})
    member = gzip.compress(event * 40)  # about 44 KB each: the second member crosses the bound
    tl, tap = _tap("gzip")
    tap.feed(member, 0.0)
    assert tl.unread is None
    tap.feed(member, 1.0)
    assert tl.unread == "inflate_limit"


def test_the_span_receiver_reads_the_same_codings_with_its_bounds() -> None:
    body = EVENTS[:5000]
    for encoding, wire in (
        ("gzip", gzip.compress(body[:2000]) + gzip.compress(body[2000:])),
        ("x-gzip", gzip.compress(body)),
        ("deflate", zlib.compress(body)),
        ("deflate", _raw_deflate(body)),
    ):
        assert inflate(wire, encoding) == body, encoding
    with pytest.raises(BadBody) as bad:
        inflate(gzip.compress(body) + gzip.compress(body)[:-12], "gzip")
    assert bad.value.reason == "bad_body" and str(bad.value).endswith("gzip: truncated")
    with pytest.raises(BadBody) as bad:
        inflate(gzip.compress(body) * 3, "gzip", max_inflated=len(body) * 2)
    assert bad.value.reason == "inflated_too_large"
