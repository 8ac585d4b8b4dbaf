"""``llmtap.relay.heads``: which upstream response heads the relay passes on, and why it refuses the others."""

from __future__ import annotations

import pytest

from llmtap.relay.heads import unrelayable

CHUNKED = [(b"Transfer-Encoding", b"chunked")]


@pytest.mark.parametrize(
    "status, headers",
    [
        (200, []),
        (599, [(b"content-length", b"0")]),
        (200, [(b"transfer-encoding", b" Chunked ")]),
        (200, [(b"transfer-encoding", b"chunked,")]),  # an empty list member is no member (RFC 9110 section 5.6.1)
        (200, [(b"x-odd", b"tab\there \xff obs-text")]),  # HTAB and obs-text are field content
        (204, [(b"etag", b'"v1"')]),
    ],
)
def test_what_can_be_relayed_faithfully(status: int, headers: list[tuple[bytes, bytes]]) -> None:
    assert unrelayable(status, headers) is None


@pytest.mark.parametrize(
    "status, headers, why",
    [
        (999, [], "status 999 is not an HTTP status"),
        (600, [], "status 600"),
        (99, [], "status 99"),
        (0, [], "status 0"),
        (150, [], "interim (1xx)"),
        (100, [], "interim (1xx)"),
        (200, [(b"transfer-encoding", b"gzip, chunked")], "'gzip, chunked'"),
        (200, [(b"transfer-encoding", b"gzip"), *CHUNKED], "'gzip, chunked'"),
        (200, [*CHUNKED, *CHUNKED], "'chunked, chunked'"),
        (200, [(b"transfer-encoding", b"chunked, gzip")], "'chunked, gzip'"),
        (200, [(b"transfer-encoding", b"identity")], "'identity'"),
        (200, [*CHUNKED, (b"content-length", b"9")], "both Transfer-Encoding and Content-Length"),
        (200, [(b"bad name", b"x")], "cannot be written"),
        (200, [(b"", b"x")], "cannot be written"),
        (200, [(b"x-a", b"a\x01b")], "cannot be written"),
        (200, [(b"x-a", b"a\x7fb")], "cannot be written"),
    ],
)
def test_what_cannot_and_why(status: int, headers: list[tuple[bytes, bytes]], why: str) -> None:
    said = unrelayable(status, headers)
    assert said is not None and why in said, said
