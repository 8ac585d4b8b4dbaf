"""``llmtap.relay.bodyread``: a large body stays the pieces it came in, and the splice goes between them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmtap.providers.bodyscan import BodyScan
from llmtap.providers.splice import prepare_usage
from llmtap.relay import bodyread
from llmtap.relay.bodyread import SCAN_FROM, prepend, read_body, spliced


def test_the_splice_goes_between_the_pieces_without_joining_them() -> None:
    parts = (b"abc", b"", b"defgh", b"ij")
    whole = b"".join(parts)
    for at in range(len(whole) + 1):
        out = spliced(parts, at, b"XY")
        assert b"".join(out) == whole[:at] + b"XY" + whole[at:]
        assert all(len(p) for p in out)
    assert b"".join(spliced(whole, 2, b"-")) == b"ab-cdefghij"
    with pytest.raises(ValueError):
        spliced(parts, len(whole) + 1, b"X")


def _receive(pieces: list[bytes]) -> Any:
    messages = [{"type": "http.request", "body": p, "more_body": i + 1 < len(pieces)} for i, p in enumerate(pieces)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


def test_a_large_body_is_read_as_it_comes_and_kept_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodyread, "SCAN_SLICE", 1000)
    body = b'{"stream":true,"messages":[{"role":"user","content":"' + b"word " * (SCAN_FROM // 4) + b'"}]}'
    pieces = [body[i : i + 65536] for i in range(0, len(body), 65536)]
    scan = BodyScan()
    got, more = asyncio.run(read_body(_receive(pieces), len(body), len(body), scan=scan))
    assert more is None and isinstance(got, tuple) and got == tuple(pieces)
    found = scan.insertion()
    assert found is not None and scan.fed == len(body) > SCAN_FROM
    assert b"".join(spliced(got, *found)) == prepare_usage(body, inject_usage=True).body
    # A small one is read whole, and not by the reader (json.loads is quicker for it).
    small, scan = b'{"stream":true}', BodyScan()
    got, more = asyncio.run(read_body(_receive([small[:5], small[5:]]), 100, 100, scan=scan))
    assert got == small and more is None and scan.fed == 0


def test_past_the_inspect_limit_the_rest_streams_after_the_pieces() -> None:
    pieces = [b"a" * SCAN_FROM, b"b" * 10, b"c" * 10]

    async def run() -> bytes:
        got, more = await read_body(_receive(pieces), SCAN_FROM + 5, 10 * SCAN_FROM)
        assert more is not None and isinstance(got, tuple)
        return b"".join([part async for part in prepend(got, more)])

    assert asyncio.run(run()) == b"".join(pieces)
