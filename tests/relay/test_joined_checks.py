"""The header checks that search every field at once say what a search of each field says.

``guard.check_request``, ``heads.unrelayable`` and ``oneshot.head_of`` look for a byte a field may not hold in
all names (or values) joined: the same refusal, for the same header, as checking them one by one.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings, strategies as st
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from llmtap.relay import guard, heads, oneshot
from llmtap.relay.guard import Refusal, check_request

# Bytes each check turns on, with ordinary ones: most drawn fields are clean, some hold one bad byte.
_BYTES = st.sampled_from(list(b'ab-Z09 \t\r\n\x00\x01\x7f/?:@"\\[]\xff'))
_FIELD = st.lists(_BYTES, max_size=6).map(bytes)
_NAMES = st.sampled_from(
    [b"host", b"content-length", b"x-a", b"connection", b"upgrade", b"transfer-encoding", b"expect", b"Host"]
)
_HEADERS = st.lists(st.tuples(st.one_of(_NAMES, _FIELD), _FIELD), max_size=6)


def _check_each(scope: dict[str, Any], max_header_bytes: int) -> Refusal | None:
    """The header part of ``check_request`` field by field: the bad-byte refusal, else the size refusal."""
    bad = re.compile(rb"[\r\n\0]")
    size = len(scope["raw_path"]) + len(scope["query_string"])
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
        if bad.search(value) or bad.search(name):
            return Refusal(400, "bad_header", "a header holds CR, LF or NUL")
    if size > max_header_bytes:
        return Refusal(431, "headers_too_large", f"request line and headers exceed {max_header_bytes} bytes")
    return None


@settings(max_examples=400, deadline=None)
@given(headers=_HEADERS, limit=st.integers(min_value=10, max_value=80))
def test_check_request_refuses_the_fields_each_check_would(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    scope = {
        "method": "POST",
        "path": "/v1/x",
        "raw_path": b"/v1/x",
        "query_string": b"q=1",
        "headers": headers,
        "http_version": "1.0",
    }
    said = check_request(scope, max_header_bytes=limit, max_request_bytes=1 << 30)
    expected = _check_each(scope, limit)
    if expected is not None:
        assert said == expected
    else:
        assert said is None or said.error_type not in ("bad_header", "headers_too_large")


@settings(max_examples=400, deadline=None)
@given(headers=_HEADERS)
def test_unrelayable_names_the_first_unwritable_header(headers: list[tuple[bytes, bytes]]) -> None:
    first = next((n for n, v in headers if heads._BAD_NAME.search(n) or heads._BAD_VALUE.search(v)), None)
    said = heads.unrelayable(200, headers)
    if first is None:
        assert said is None or "cannot be written" not in said
    else:
        assert said == f"header {first[:64]!r} cannot be written as sent (RFC 9110 section 5.5)"


@settings(max_examples=400, deadline=None)
@given(headers=_HEADERS)
def test_head_of_refuses_what_uvicorn_refuses(headers: list[tuple[bytes, bytes]]) -> None:
    fields = tuple(headers)
    each = any(HEADER_RE.search(n) or HEADER_VALUE_RE.search(v) for n, v in fields)
    assert oneshot._refused(fields) is each


def test_uvicorns_checks_are_classes_of_bytes() -> None:
    """The joined search is taken only while uvicorn's patterns are one class of bytes each."""
    assert oneshot._JOINABLE
    assert not oneshot._one_class(re.compile(rb"[a]|^$"))
    assert oneshot._one_class(re.compile(rb"[\]a]"))


_HOSTS = st.lists(st.sampled_from(list(b"ab.-:[]1_ %@/")), max_size=8).map(bytes)


@settings(max_examples=300, deadline=None)
@given(hosts=st.lists(_HOSTS, min_size=1, max_size=6))
def test_a_host_kept_as_valid_is_one_the_pattern_takes(hosts: list[bytes]) -> None:
    """Asked again (the kept values answer), every Host value is judged as the pattern judges it."""
    for value in hosts * 2:
        assert guard._valid_host(value) is (guard._HOST.fullmatch(value.strip()) is not None)
