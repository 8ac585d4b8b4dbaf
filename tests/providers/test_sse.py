"""The incremental decoders: named edge cases, recorded vLLM bodies, and split-anywhere properties."""

from __future__ import annotations

import itertools
import json
import re
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from llmtap.providers.sse import Decoder, Event, JSONArrayDecoder, NDJSONDecoder, SSEDecoder, decoder_for

TRANSCRIPTS = Path(__file__).parents[1] / "transcripts"
# Recorded from vLLM 0.32 (see /work/shared/data/transcripts/vllm-0.32-cpu/README.md), copied unchanged.
SSE_BODIES = [
    TRANSCRIPTS / f"{name}.body"
    for name in (
        "chat-stream",
        "chat-stream-usage",
        "chat-stream-cached-1",
        "chat-stream-cached-2",
        "chat-stream-continuous-usage",
        "completions-stream-usage",
        "responses-stream",
        "messages-stream",
    )
]

Factory = Callable[[], Decoder]
Result = tuple[list[Event], int]

# More examples than the default 100 (the decoders are cheap); no deadline, as shared CI runners stall.
fuzz = settings(max_examples=300, deadline=None)


def run(factory: Factory, pieces: Iterable[bytes]) -> Result:
    """Feed the pieces to a fresh decoder, then flush; the events and the oversized count."""
    decoder = factory()
    events = [event for piece in pieces for event in decoder.feed(piece)]
    return events + decoder.flush(), decoder.oversized


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def assert_split_invariant(factory: Factory, data: bytes) -> Result:
    """Every two-piece split and the byte-by-byte feed decode exactly like the whole input."""
    whole = run(factory, [data])
    for i in range(len(data) + 1):
        assert run(factory, [data[:i], data[i:]]) == whole, f"split at byte {i}"
    assert run(factory, [data[i : i + 1] for i in range(len(data))]) == whole
    return whole


def sse(data: bytes, *, max_bytes: int = 1 << 24) -> list[Event]:
    events, oversized = run(lambda: SSEDecoder(max_bytes), [data])
    assert oversized == 0
    return events


def spec_sse(body: bytes) -> list[Event]:
    """The WHATWG algorithm transcribed line by line over the whole decoded body: the test oracle."""
    text = body.decode("utf-8", "replace")
    text = text.removeprefix("\ufeff")
    events: list[Event] = []
    data, event_type, last_id = "", "", None
    for line in re.split("\r\n|\r|\n", text)[:-1]:  # the unterminated last line is discarded at EOF
        if line == "":
            if data:
                events.append(Event(event_type, data.removesuffix("\n"), last_id))
            data, event_type = "", ""
        elif line.startswith(":"):
            continue
        else:
            name, colon, value = line.partition(":")
            if colon and value.startswith(" "):
                value = value[1:]
            if name == "event":
                event_type = value
            elif name == "data":
                data += value + "\n"
            elif name == "id" and "\0" not in value:
                last_id = value
    return events


def held(decoder: Decoder) -> int:
    """Bytes a decoder holds between feeds (white box: the buffers the memory bound is about)."""
    if isinstance(decoder, SSEDecoder):
        return len(decoder._line) + sum(map(len, decoder._data)) + len(decoder._event)
    if isinstance(decoder, NDJSONDecoder):
        return len(decoder._line)
    assert isinstance(decoder, JSONArrayDecoder)
    return len(decoder._buf)


# --- SSE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_sse_line_endings(eol: bytes) -> None:
    body = b"event: a\ndata: 1\ndata: 2\n\ndata: 3\n\n".replace(b"\n", eol)
    assert sse(body) == [Event("a", "1\n2"), Event("", "3")]


def test_sse_mixed_line_endings_in_one_stream() -> None:
    assert sse(b"data: 1\rdata: 2\r\ndata: 3\n\r\n") == [Event("", "1\n2\n3")]


def test_sse_crlf_split_across_feeds_is_one_line_ending() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    # Were this LF a second line ending, it would be the blank line that dispatches.
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\r") == [Event("", "x")]
    assert decoder.feed(b"\ndata: y\r") == []
    assert decoder.feed(b"\r\n") == [Event("", "y")]


def test_sse_cr_at_chunk_end_then_other_byte_ends_the_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"data: y\r") == []
    assert decoder.feed(b"\r") == [Event("", "x\ny")]


def test_sse_comments_are_ignored() -> None:
    assert sse(b": keep-alive\n\n") == []
    assert sse(b": ping\ndata: a\n:data: b\n\n") == [Event("", "a")]


def test_sse_data_with_and_without_the_space() -> None:
    assert sse(b"data:x\n\ndata: x\n\ndata:  x\n\n") == [Event("", "x"), Event("", "x"), Event("", " x")]


def test_sse_field_name_alone_has_an_empty_value() -> None:
    assert sse(b"data\n\ndata:\ndata\n\n") == [Event("", ""), Event("", "\n")]


def test_sse_value_keeps_later_colons() -> None:
    assert sse(b'data: {"a": "b:c"}\n\n') == [Event("", '{"a": "b:c"}')]


def test_sse_event_without_data_is_not_dispatched_and_resets_the_name() -> None:
    assert sse(b"event: ping\n\ndata: a\n\n") == [Event("", "a")]


def test_sse_anthropic_event_names() -> None:
    body = (
        b'event: message_start\ndata: {"type":"message_start"}\n\n'
        b'event: ping\ndata: {"type": "ping"}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
    )
    assert [(e.event, json.loads(e.data)["type"]) for e in sse(body)] == [
        ("message_start", "message_start"),
        ("ping", "ping"),
        ("content_block_delta", "content_block_delta"),
    ]


def test_sse_openai_done() -> None:
    assert sse(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')[-1] == Event("", "[DONE]")


def test_sse_id_persists_and_nul_ids_are_ignored() -> None:
    body = b"id: 1\ndata: a\n\ndata: b\n\nid: x\0y\ndata: c\n\nid\ndata: d\n\n"
    assert [e.id for e in sse(body)] == ["1", "1", "1", ""]
    assert sse(b"data: a\n\n") == [Event("", "a", None)]


def test_sse_retry_and_unknown_fields_are_ignored() -> None:
    assert sse(b"retry: 10\nfoo: bar\nDATA: no\ndata: a\n\n") == [Event("", "a")]


def test_sse_bom_is_dropped_once_and_only_at_the_start() -> None:
    assert sse(b"\xef\xbb\xbfdata: a\n\n") == [Event("", "a")]
    # A second BOM makes the field name "\ufeffdata", an unknown field.
    assert sse(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n") == [Event("", "b")]
    assert sse(b"data: \xef\xbb\xbfa\n\n") == [Event("", "\ufeffa")]


def test_sse_bom_split_across_feeds() -> None:
    assert run(SSEDecoder, [b"\xef", b"\xbb", b"\xbfdata: a\n\n"])[0] == [Event("", "a")]
    # A start that looked like a BOM but is not one is kept (and decoded as U+FFFD).
    assert run(SSEDecoder, [b"\xef", b"\xbbdata: a\n\ndata: b\n\n"])[0] == [Event("", "b")]


def test_sse_invalid_utf8_is_replaced() -> None:
    events = sse(b"event: \xffx\nid: \xc3\ndata: \xf0\x9f\ndata: \xe2\x82 ok\n\n")
    assert events == [Event("\ufffdx", "\ufffd\n\ufffd ok", "\ufffd")]


def test_sse_flush_discards_an_unterminated_event_and_resets() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"id: 7\nevent: e\ndata: a\n") == []
    assert decoder.flush() == []
    # Nothing of the old stream survives: no pending data, name, id, half line or CR state; a new
    # stream may start with a BOM again.
    assert decoder.feed(b"\xef\xbb\xbf\n") == []
    assert decoder.feed(b"data: b\n\n") == [Event("", "b")]
    decoder.feed(b"data: c\r")
    decoder.flush()
    assert decoder.feed(b"\ndata: d\n\n") == [Event("", "d")]


def test_sse_oversized_event_is_dropped_counted_and_the_next_decoded() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    body = b"data: " + b"x" * 200 + b"\nevent: leak\ndata: y\n\ndata: next\n\n"
    assert decoder.feed(body) == [Event("", "next")]
    assert decoder.oversized == 1


def test_sse_oversized_by_many_small_lines() -> None:
    body = b"data: 123456789\n" * 20 + b"\ndata: ok\n\n"
    assert run(lambda: SSEDecoder(100), [body]) == ([Event("", "ok")], 1)


def test_sse_oversized_line_arriving_in_pieces() -> None:
    pieces = [b"data: ", *[b"x" * 30] * 10, b"\n", b"\n", b"data: ok\n\n"]
    assert run(lambda: SSEDecoder(100), pieces) == ([Event("", "ok")], 1)


def test_sse_limit_boundary() -> None:
    # The size of an event is the bytes of its `data` and `event` lines, without line endings.
    assert run(lambda: SSEDecoder(10), [b"data: 1234\n\n"]) == ([Event("", "1234")], 0)
    assert run(lambda: SSEDecoder(10), [b"data: 12345\n\n"]) == ([], 1)


# --- recorded vLLM bodies -------------------------------------------------------------------------


def test_transcripts_are_event_streams() -> None:
    for body in SSE_BODIES:
        headers = body.with_suffix(".headers").read_bytes()
        assert headers.startswith(b"HTTP/1.1 200 OK") and b"content-type: text/event-stream" in headers


@pytest.mark.parametrize("path", SSE_BODIES, ids=lambda p: p.stem)
def test_transcript_split_anywhere(path: Path) -> None:
    body = path.read_bytes()
    events, oversized = assert_split_invariant(SSEDecoder, body)
    assert oversized == 0
    assert events == spec_sse(body)
    assert len(events) == body.count(b"\n\n")
    # vLLM ends OpenAI streams with [DONE]; every other event is one JSON value.
    payloads = [json.loads(e.data) for e in events if e.data != "[DONE]"]
    assert len(payloads) == len(events) - (events[-1].data == "[DONE]")
    if events[0].event:  # Responses and Messages streams name every event after its `type`
        assert [e.event for e in events] == [p["type"] for p in payloads]
    else:
        assert events[-1] == Event("", "[DONE]")


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["CRLF", "CR"])
@pytest.mark.parametrize("path", SSE_BODIES, ids=lambda p: p.stem)
def test_transcript_other_line_endings(path: Path, eol: bytes) -> None:
    body = path.read_bytes()
    converted = body.replace(b"\n", eol)
    assert assert_split_invariant(SSEDecoder, converted) == run(SSEDecoder, [body])


def test_messages_transcript_event_names() -> None:
    events = sse((TRANSCRIPTS / "messages-stream.body").read_bytes())
    names = [e.event for e in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_sse_synthetic_split_anywhere() -> None:
    body = (
        b"\xef\xbb\xbf: comment\r\nretry: 5\rid: 1\nevent: a\r\ndata:x\r\ndata\r\r\n"
        b"event: skipped\n\ndata: \xe2\x82\xac \xff\r\rdata: tail"
    )
    events, _ = assert_split_invariant(SSEDecoder, body)
    assert events == [Event("a", "x\n", "1"), Event("", "€ \ufffd", "1")]
    # Under a 12-byte limit "event: a" + "data:x" (14) and "event: skipped" (14) are dropped; id persists.
    assert assert_split_invariant(lambda: SSEDecoder(12), body) == ([Event("", "€ \ufffd", "1")], 2)


# --- SSE fuzzing ----------------------------------------------------------------------------------

SSE_TOKENS = [b"data:", b"data: ", b"event: ", b"id: ", b"id:\0", b"retry: 1", b":", b" ", b"x", b"{}", b"\n"]
SSE_TOKENS += [b"\r", b"\r\n", b"\n\n", b"\xef\xbb\xbf", b"\xef", b"\xff", "é€".encode(), b"\xe2\x82"]
sse_bodies = st.one_of(st.binary(max_size=300), st.lists(st.sampled_from(SSE_TOKENS), max_size=80).map(b"".join))


@st.composite
def body_and_cuts(draw: st.DrawFn, bodies: st.SearchStrategy[bytes]) -> tuple[bytes, list[int]]:
    body = draw(bodies)
    return body, draw(st.lists(st.integers(0, len(body)), max_size=12))


@fuzz
@given(body_and_cuts(sse_bodies))
def test_sse_fuzz_matches_the_spec_however_split(case: tuple[bytes, list[int]]) -> None:
    body, cuts = case
    expected = spec_sse(body)
    assert run(SSEDecoder, [body]) == (expected, 0)
    assert run(SSEDecoder, split_at(body, cuts)) == (expected, 0)


@fuzz
@given(body_and_cuts(sse_bodies), st.integers(0, 40))
def test_sse_fuzz_oversize_is_split_invariant(case: tuple[bytes, list[int]], limit: int) -> None:
    body, cuts = case
    whole = run(lambda: SSEDecoder(limit), [body])
    assert run(lambda: SSEDecoder(limit), split_at(body, cuts)) == whole
    assert all(len(e.data) <= limit for e in whole[0])


# Reads of whole events, as streaming servers write them: the decoder's fast path (a read of whole one-line ``data:``
# events, between events) must give what the general path and the spec give, whatever precedes and follows it.
SSE_PAYLOADS = [b"", b"x", b"{}", b'{"a": "b: c"}', "é€".encode(), b"\xff", b"[DONE]", b"data: x", b" y"]
SSE_EVENTS = [b"data: " + p + b"\n\n" for p in SSE_PAYLOADS]
SSE_EVENTS += [b"data:x\n\n", b"event: e\ndata: x\n\n", b"id: 7\ndata: x\n\n", b"data: a\ndata: b\n\n", b": c\n\n"]
SSE_EVENTS += [b"data: x\r\n\r\n", b"data: x\r\r", b"data: x\n", b"\n", b"data: x", b"\xef\xbb\xbfdata: x\n\n"]
SSE_EVENTS += [b"id:\0\n"]


@st.composite
def event_reads(draw: st.DrawFn) -> list[bytes]:
    """Reads of one or more events each (some events malformed, cut, or with other fields)."""
    events = draw(st.lists(st.sampled_from(SSE_EVENTS), max_size=30))
    sizes = draw(st.lists(st.integers(1, 4), min_size=len(events), max_size=len(events)))
    reads, at = [], 0
    for size in sizes:
        if at >= len(events):
            break
        reads.append(b"".join(events[at : at + size]))
        at += size
    return reads


@fuzz
@given(event_reads(), st.integers(0, 40))
def test_sse_reads_of_whole_events_match_the_spec(reads: list[bytes], limit: int) -> None:
    body = b"".join(reads)
    assert run(SSEDecoder, reads) == (spec_sse(body), 0)
    assert run(lambda: SSEDecoder(limit), reads) == run(lambda: SSEDecoder(limit), [body])


def test_sse_a_read_of_whole_events_takes_the_fast_path_with_the_last_id() -> None:
    """Between events, a read of whole one-line data events is decoded at once; the last event id persists."""
    decoder = SSEDecoder()
    assert decoder.feed(b"id: 4\ndata: a\n\n") == [Event("", "a", "4")]
    assert decoder._between
    assert decoder.feed(b'data: b\n\ndata: {"c": 1}\n\n') == [Event("", "b", "4"), Event("", '{"c": 1}', "4")]
    assert decoder._between
    assert decoder.feed(b"data: d\n") == []  # a line not yet ended: no longer between events
    assert not decoder._between
    assert decoder.feed(b"\ndata: e\n\n") == [Event("", "d", "4"), Event("", "e", "4")]


# --- NDJSON ---------------------------------------------------------------------------------------


def ndjson(data: bytes, *, max_bytes: int = 1 << 24) -> Result:
    return run(lambda: NDJSONDecoder(max_bytes), [data])


def test_ndjson_lf_and_crlf() -> None:
    assert ndjson(b'{"a":1}\n{"b":2}\r\n') == ([Event("", '{"a":1}'), Event("", '{"b":2}')], 0)


def test_ndjson_crlf_split_across_feeds() -> None:
    decoder = NDJSONDecoder()
    assert decoder.feed(b'{"a":1}\r') == []
    assert decoder.feed(b"\n") == [Event("", '{"a":1}')]


def test_ndjson_blank_lines_are_skipped() -> None:
    assert ndjson(b'\n\r\n  \n{"a":1}\n\n')[0] == [Event("", '{"a":1}')]


def test_ndjson_flush_returns_an_unterminated_last_line() -> None:
    decoder = NDJSONDecoder()
    assert decoder.feed(b'{"a":1}\n{"done":') == [Event("", '{"a":1}')]
    assert decoder.feed(b"true}") == []
    assert decoder.flush() == [Event("", '{"done":true}')]
    assert decoder.flush() == []


def test_ndjson_invalid_utf8_is_replaced() -> None:
    assert ndjson(b'{"a":"\xff"}\n')[0] == [Event("", '{"a":"\ufffd"}')]


def test_ndjson_oversized_line_is_dropped_counted_and_the_next_decoded() -> None:
    assert ndjson(b"x" * 200 + b"\nok\n", max_bytes=100) == ([Event("", "ok")], 1)
    pieces = [b"x" * 60, b"x" * 60, b"x\n", b"ok"]
    assert run(lambda: NDJSONDecoder(100), pieces) == ([Event("", "ok")], 1)
    # The limit counts a trailing CR, whatever the split, so that splitting cannot change the outcome.
    assert ndjson(b"1234\r\n", max_bytes=4) == ([], 1)
    assert ndjson(b"1234\n", max_bytes=4) == ([Event("", "1234")], 0)


def ollama_body() -> bytes:
    """Ollama-style NDJSON built from the JSON payloads of a recorded stream."""
    events = sse((TRANSCRIPTS / "chat-stream.body").read_bytes())
    return b"".join(e.data.encode() + b"\n" for e in events if e.data != "[DONE]")


def test_ndjson_split_anywhere() -> None:
    body = ollama_body()
    events, oversized = assert_split_invariant(NDJSONDecoder, body)
    assert [e.data.encode() + b"\n" for e in events] == body.splitlines(keepends=True)
    assert oversized == 0
    assert assert_split_invariant(NDJSONDecoder, body.replace(b"\n", b"\r\n")) == (events, 0)
    assert assert_split_invariant(NDJSONDecoder, body.rstrip(b"\n")) == (events, 0)


def spec_ndjson(body: bytes) -> list[Event]:
    lines = (line.removesuffix(b"\r") for line in body.split(b"\n"))
    return [Event("", line.decode("utf-8", "replace")) for line in lines if line.strip()]


ndjson_bodies = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b" ", b"{}", b"\xff", b"x" * 7]), max_size=60).map(b"".join),
)


@fuzz
@given(body_and_cuts(ndjson_bodies), st.integers(0, 20))
def test_ndjson_fuzz_however_split(case: tuple[bytes, list[int]], limit: int) -> None:
    body, cuts = case
    assert run(NDJSONDecoder, split_at(body, cuts)) == (spec_ndjson(body), 0)
    whole = run(lambda: NDJSONDecoder(limit), [body])
    assert run(lambda: NDJSONDecoder(limit), split_at(body, cuts)) == whole


# --- JSON array -----------------------------------------------------------------------------------


def array(data: bytes, *, max_bytes: int = 1 << 24) -> Result:
    return run(lambda: JSONArrayDecoder(max_bytes), [data])


def test_json_array_gemini_shape() -> None:
    body = b'[{"candidates": [{"content": {"parts": [{"text": "Hi"}]}}]}\n,\r\n{"usageMetadata": {}}\n]'
    assert array(body) == (
        [Event("", '{"candidates": [{"content": {"parts": [{"text": "Hi"}]}}]}'), Event("", '{"usageMetadata": {}}')],
        0,
    )


def test_json_array_yields_at_the_closing_brace() -> None:
    decoder = JSONArrayDecoder()
    assert decoder.feed(b'[{"a": {"b": 1}') == []
    assert decoder.feed(b"}") == [Event("", '{"a": {"b": 1}}')]
    assert decoder.feed(b"\n,\r\n") == []
    assert decoder.feed(b'{"c": 2}\n]') == [Event("", '{"c": 2}')]
    assert decoder.flush() == []


def test_json_array_brackets_and_quotes_inside_strings() -> None:
    element = rb'{"t": "} ] { [ \" \\", "u": "\\\\", "v": "\u005d"}'
    assert array(b"[" + element + b"]")[0] == [Event("", element.decode())]
    assert json.loads(element.decode())["t"] == '} ] { [ " \\'


def test_json_array_escape_split_across_feeds() -> None:
    pieces = [b'[{"t": "a\\', b'"}"}', b"]"]
    assert run(JSONArrayDecoder, pieces)[0] == [Event("", '{"t": "a\\"}"}')]


def test_json_array_nested_arrays_and_array_elements() -> None:
    assert array(b'[[1, [2]], {"a": [{}]}]')[0] == [Event("", "[1, [2]]"), Event("", '{"a": [{}]}')]


def test_json_array_scalars_between_elements_are_ignored() -> None:
    assert array(b'[1, "x{", true, {"a": 1}, null]')[0] == [Event("", '{"a": 1}')]


def test_json_array_lone_object_is_one_event() -> None:
    error = b'{"error": {"code": 400, "message": "bad [request]"}}'
    assert array(b"\xef\xbb\xbf" + error + b"\n")[0] == [Event("", error.decode())]


def test_json_array_empty_and_unclosed() -> None:
    assert array(b"[]") == ([], 0)
    assert array(b'[{"a": 1}, {"b": ') == ([Event("", '{"a": 1}')], 0)


def test_json_array_invalid_utf8_is_replaced() -> None:
    assert array(b'[{"a": "\xc3("}]')[0] == [Event("", '{"a": "\ufffd("}')]


def test_json_array_oversized_element_is_dropped_counted_and_the_next_decoded() -> None:
    body = b'[{"a": "' + b"x" * 200 + b'"}, {"b": "}"}]'
    assert array(body, max_bytes=100) == ([Event("", '{"b": "}"}')], 1)
    assert run(lambda: JSONArrayDecoder(100), [body[:60], body[60:150], body[150:]]) == ([Event("", '{"b": "}"}')], 1)
    assert array(b"[{}, {}]", max_bytes=2) == ([Event("", "{}")] * 2, 0)
    assert array(b"[{ }]", max_bytes=2) == ([], 1)


def gemini_body(payloads: list[Any], sep: bytes = b"\n,\r\n") -> bytes:
    return b"[" + sep.join(json.dumps(p).encode() for p in payloads) + b"\n]"


def test_json_array_split_anywhere() -> None:
    events = sse((TRANSCRIPTS / "messages-stream.body").read_bytes())
    payloads = [json.loads(e.data) for e in events]
    result, oversized = assert_split_invariant(JSONArrayDecoder, gemini_body(payloads))
    assert [json.loads(e.data) for e in result] == payloads
    assert oversized == 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='{}[]"\\,: \n\x00aé€😀'),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@st.composite
def gemini_and_cuts(draw: st.DrawFn) -> tuple[list[Any], bytes, list[int]]:
    payloads = draw(st.lists(st.dictionaries(st.text(max_size=5), json_values, max_size=4), max_size=5))
    sep = draw(st.sampled_from([b",", b"\n,\r\n", b" , ", b",\n\n"]))
    ascii_only = draw(st.booleans())
    body = b"[" + sep.join(json.dumps(p, ensure_ascii=ascii_only).encode() for p in payloads) + b"\n]"
    return payloads, body, draw(st.lists(st.integers(0, len(body)), max_size=12))


@settings(fuzz, max_examples=100)  # recursive JSON is slow to generate
@given(gemini_and_cuts())
def test_json_array_fuzz_elements_round_trip_however_split(case: tuple[list[Any], bytes, list[int]]) -> None:
    payloads, body, cuts = case
    events, oversized = run(JSONArrayDecoder, split_at(body, cuts))
    assert [json.loads(e.data) for e in events] == payloads
    assert oversized == 0


@fuzz
@given(body_and_cuts(st.binary(max_size=300) | sse_bodies.map(lambda b: b.replace(b"x", b'"\\{['))), st.integers(0, 40))
def test_json_array_fuzz_arbitrary_bytes_however_split(case: tuple[bytes, list[int]], limit: int) -> None:
    body, cuts = case
    for make in (JSONArrayDecoder, lambda: JSONArrayDecoder(limit)):
        assert run(make, split_at(body, cuts)) == run(make, [body])


# --- all decoders ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "opener", "closer", "after", "expected"),
    [
        (SSEDecoder, b"data: ", b"\n\n", b"data: after\n\n", Event("", "after")),
        (NDJSONDecoder, b"", b"\n", b"after\n", Event("", "after")),
        (JSONArrayDecoder, b'[{"a": "', b'"},', b'{"after": 1}]', Event("", '{"after": 1}')),
    ],
    ids=["sse", "ndjson", "json-array"],
)
def test_memory_is_bounded(
    make: Callable[[int], Decoder], opener: bytes, closer: bytes, after: bytes, expected: Event
) -> None:
    """A 20 MB event in 64 KiB pieces under a 1 MB limit never holds more than the limit plus a piece."""
    limit, piece = 1 << 20, b"x" * (64 << 10)
    decoder = make(limit)
    assert decoder.feed(opener) == []
    tracemalloc.start()
    try:
        for _ in range((20 << 20) // len(piece)):
            assert decoder.feed(piece) == []
            assert held(decoder) <= limit + len(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * limit
    assert decoder.feed(closer + after) + decoder.flush() == [expected]
    assert decoder.oversized == 1


@pytest.mark.parametrize(
    ("framing", "kind"), [("sse", SSEDecoder), ("ndjson", NDJSONDecoder), ("json-array", JSONArrayDecoder)]
)
def test_decoder_for(framing: str, kind: type[object]) -> None:
    first, second = decoder_for(framing), decoder_for(framing)
    assert isinstance(first, kind) and first is not second
    assert first.oversized == 0
    small = decoder_for(framing, max_bytes=1)
    small.feed(b'data: [{"a": 1}]\n\n')
    small.flush()
    assert small.oversized == 1


def test_decoder_for_unknown_framing() -> None:
    with pytest.raises(ValueError, match="unknown framing: 'xml'"):
        decoder_for("xml")
