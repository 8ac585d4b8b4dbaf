"""The upstream request's head built in one pass is, byte for byte, the head built from the forwarded headers.

``forward.upstream_head`` (what the relay sends) against ``upstream.http11.request_head`` of
``forward.request_headers`` (the two steps it replaces, still what the httpx-facing client writes): the same
bytes and the same chunked framing, or the same refusal, for any client headers, flags and body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from hypothesis import given, settings, strategies as st

from llmtap.relay.forward import _connection_listed, dropped, request_headers, upstream_head
from llmtap.relay.upstream.errors import BadRequestHead
from llmtap.relay.upstream.http11 import Pieces, request_head

_NAMES = st.sampled_from(
    [
        b"Host", b"host", b"Content-Length", b"content-length", b"Transfer-Encoding", b"Connection", b"connection",
        b"Keep-Alive", b"TE", b"Upgrade", b"Accept-Encoding", b"traceparent", b"Tracestate", b"x-llmtap-tenant",
        b"X-LLMTAP-User", b"x-slo-ttft-ms", b"X-Slo-Tpot-Ms", b"authorization", b"content-type", b"x-custom",
        b"Proxy-Authorization", b"trailer",
    ]
)  # fmt: skip
_VALUES = st.sampled_from(
    [b"", b"1", b"12", b"chunked", b"gzip, chunked", b"keep-alive", b"x-custom, Content-Type", b"close, TE",
     b"identity", b"a\r\nb", b"v\n", b"Bearer sk-1"]
)  # fmt: skip
_HEADERS = st.lists(st.tuples(_NAMES, _VALUES), max_size=8)
_TRACE: st.SearchStrategy[list[tuple[bytes, bytes]] | None] = st.one_of(
    st.none(),
    st.just([]),
    st.just([(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]),
    st.just([(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"), (b"tracestate", b"a=b")]),
)


async def _stream() -> AsyncIterator[bytes]:
    yield b"x"


def _content(kind: int) -> bytes | Pieces | AsyncIterator[bytes]:
    bodies: list[bytes | Pieces] = [b"", b'{"input":"x"}', (b"ab", memoryview(b"cde")), ()]
    return bodies[kind] if kind < len(bodies) else _stream()


def _built(build: object) -> tuple[bytes, bool] | str:
    try:
        return build()  # type: ignore[operator, no-any-return]
    except BadRequestHead as exc:
        return f"refused: {exc}"


@settings(max_examples=1500, deadline=None)
@given(
    headers=_HEADERS,
    trace=_TRACE,
    body_changed=st.booleans(),
    plain=st.booleans(),
    private=st.booleans(),
    objectives=st.booleans(),
    method=st.sampled_from(["POST", "GET", "HEAD", "put", "DELETE", "PATCH"]),
    kind=st.integers(min_value=0, max_value=4),
)
def test_one_pass_head_is_the_two_step_head(
    headers: list[tuple[bytes, bytes]],
    trace: list[tuple[bytes, bytes]] | None,
    body_changed: bool,
    plain: bool,
    private: bool,
    objectives: bool,
    method: str,
    kind: int,
) -> None:
    content = _content(kind)
    target, host = b"/v1/embeddings?a=1", b"up.example:8000"

    def two_step() -> tuple[bytes, bool]:
        out = request_headers(
            headers, trace=trace, body_changed=body_changed, plain=plain, private=private, objectives=objectives
        )
        return request_head(method, target, host, out, content)

    def one_pass() -> tuple[bytes, bool]:
        drop = dropped(trace=trace is not None, body_changed=body_changed, plain=plain, objectives=objectives)
        return upstream_head(
            method, target, host, headers, content, drop=drop, trace=trace, plain=plain, private=private
        )

    assert _built(one_pass) == _built(two_step)


@settings(max_examples=300, deadline=None)
@given(headers=_HEADERS, trace=_TRACE, plain=st.booleans(), kind=st.integers(min_value=0, max_value=4))
def test_a_drop_set_without_host_takes_the_two_steps(
    headers: list[tuple[bytes, bytes]], trace: list[tuple[bytes, bytes]] | None, plain: bool, kind: int
) -> None:
    """Called with fields to drop that leave Host or Transfer-Encoding in, the head is ``request_head``'s of the
    fields kept: the one pass relies on both being dropped, and does not guess otherwise."""
    content = _content(kind)
    drop = frozenset({b"x-custom"})
    # The fields the ``Connection`` field lists are dropped with the rest, as ``request_headers`` drops them.
    gone = drop | _connection_listed(headers)
    kept = [(k, v) for k, v in headers if k.lower() not in gone and not k.lower().startswith(b"x-llmtap-")]
    added = ([(b"accept-encoding", b"identity")] if plain else []) + (trace or [])

    def one_pass() -> tuple[bytes, bool]:
        return upstream_head(
            "POST", b"/x", b"up:1", headers, content, drop=drop, trace=trace, plain=plain, private=False
        )

    assert _built(one_pass) == _built(lambda: request_head("POST", b"/x", b"up:1", [*kept, *added], content))
