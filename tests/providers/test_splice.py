"""The relay's request step: ``include_usage`` spliced into the client's bytes (proxy/llmtap/providers/splice.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from llmtap.providers import PROVIDERS, OpenAIChat, OpenAICompletions, Provider
from llmtap.providers.splice import prepare_usage
from llmtap.types import UNCHANGED, Prepared

CHAT, COMPLETIONS = OpenAIChat(), OpenAICompletions()
OPENAI = [p for p in PROVIDERS if p.name in ("openai_chat", "openai_completions")]
OTHERS = [p for p in PROVIDERS if p not in OPENAI]
ADDED = b',"stream_options":{"include_usage":true}'
# What may be inserted, and nothing else: a new stream_options member, or members at the end of one.
INSERTS = {
    ADDED,
    b'"include_usage":true',
    b',"include_usage":true',
    b'"include_usage":true,"continuous_usage_stats":false',
    b',"include_usage":true,"continuous_usage_stats":false',
}


def inserted(original: bytes, result: bytes) -> bytes:
    """The one contiguous run of bytes ``result`` adds to ``original``; fails unless there is exactly one."""
    k = len(result) - len(original)
    assert k > 0
    i = 0
    while i < len(original) and original[i] == result[i]:
        i += 1
    # An insertion can always be read at the first difference (sliding it right keeps the same bytes).
    assert result[:i] + result[i + k :] == original, "the client's bytes are not preserved exactly"
    return result[i : i + k]


def expected(original: bytes) -> Any:
    """The object the upstream should read, or None when the body should go unchanged (the model of splicing)."""
    if json.detect_encoding(original) not in ("utf-8", "utf-8-sig"):
        return None  # json.loads reads UTF-16 and UTF-32 too, but bytes cannot be spliced into them
    try:
        obj = json.loads(original)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("stream") is not True:
        return None
    if "stream_options" not in obj:
        return {**obj, "stream_options": {"include_usage": True}}
    options = obj["stream_options"]
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    options = {**options, "include_usage": True}
    if options.get("continuous_usage_stats"):
        options["continuous_usage_stats"] = False
    return {**obj, "stream_options": options}


def check(original: bytes) -> Prepared:
    """``prepare`` against the model; when it splices, the bytes are preserved and the insert is known."""
    prepared = prepare_usage(original, inject_usage=True)
    want = expected(original)
    if want is None:
        assert prepared == UNCHANGED
        return prepared
    assert prepared.strip_usage and prepared.body is not None
    assert json.loads(prepared.body) == want
    assert inserted(original, prepared.body) in INSERTS
    for provider in OPENAI:
        assert provider.prepare(original, inject_usage=True) == prepared
        info = provider.inspect(original, inject_usage=True)
        assert (info.rewritten_body, info.strip_usage) == (prepared.body, prepared.strip_usage)
    return prepared


def spliced(original: bytes) -> bytes:
    body = check(original).body
    assert body is not None
    return body


def test_no_stream_options_goes_before_the_closing_brace() -> None:
    assert spliced(b'{"stream":true}') == b'{"stream":true' + ADDED + b"}"
    assert spliced(b'{"model":"m","stream":true}  \r\n') == b'{"model":"m","stream":true' + ADDED + b"}  \r\n"


def test_bom_crlf_and_tabs_are_kept() -> None:
    raw = b'\xef\xbb\xbf{\r\n\t"model":\t"m",\r\n\t"stream" :\ttrue\r\n}\r\n'
    assert spliced(raw) == raw[:-3] + ADDED + b"}\r\n"


def test_pretty_printed() -> None:
    raw = json.dumps({"model": "m", "stream": True, "stream_options": {"x": 1}, "n": 1}, indent=4).encode()
    body = spliced(raw)
    assert body.startswith(raw[: raw.index(b"1\n    }")]) and b'1\n    ,"include_usage":true}' in body


def test_numbers_escapes_and_big_ints_reach_the_upstream_as_sent() -> None:
    raw = (
        b'{"temperature": 1.0e3, "seed": 123456789012345678901234567890, "user": "caf\\u00e9 \\ud83d\\ude00",'
        b' "x": -0.0, "stream": true}'
    )
    assert spliced(raw) == raw[:-1] + ADDED + b"}"


def test_duplicate_keys_last_wins() -> None:
    # A stream false after a stream true: not a stream for json.loads, so nothing changes.
    assert check(b'{"stream":true,"stream":false}') == UNCHANGED
    assert spliced(b'{"stream":false,"stream":true}') == b'{"stream":false,"stream":true' + ADDED + b"}"
    # Two stream_options: the option goes into the last one, the one json.loads reads.
    raw = b'{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"a":1}}'
    assert spliced(raw) == raw[:-2] + b',"include_usage":true}}'
    assert check(b'{"stream":true,"stream_options":{},"stream_options":{"include_usage":true}}') == UNCHANGED


def test_include_usage_false_is_overridden_at_the_end_of_the_object() -> None:
    raw = b'{"stream":true,"stream_options":{"include_usage":false}}'
    assert spliced(raw) == b'{"stream":true,"stream_options":{"include_usage":false,"include_usage":true}}'


def test_other_stream_options_are_kept_and_continuous_usage_stats_is_turned_off() -> None:
    raw = b'{"stream_options": {"include_obfuscation": false, "continuous_usage_stats": true}, "stream": true}'
    assert spliced(raw) == raw.replace(b"true}", b'true,"include_usage":true,"continuous_usage_stats":false}', 1)
    # continuous_usage_stats false or absent: left alone.
    assert spliced(b'{"stream":true,"stream_options":{"continuous_usage_stats":false}}').endswith(
        b'false,"include_usage":true}}'
    )


def test_empty_stream_options_gets_no_comma() -> None:
    assert (
        spliced(b'{"stream":true,"stream_options":{ \n }}')
        == b'{"stream":true,"stream_options":{ \n "include_usage":true}}'
    )


def test_nested_stream_options_are_not_touched() -> None:
    raw = (
        b'{"metadata":{"stream_options":{"a":1}},"tools":[{"stream_options":{}}],"stream":true,'
        b'"stream_options":{"b":[{"stream_options":{}}]},"extra":{"stream_options":{"c":2}}}'
    )
    body = spliced(raw)
    assert body == raw.replace(b"{}}]}", b'{}}],"include_usage":true}')
    # Only nested ones: the top level has none, so a new member is added.
    nested = b'{"messages":[{"stream_options":{"x":1}}],"stream":true}'
    assert spliced(nested) == nested[:-1] + ADDED + b"}"


def test_escaped_key_spelling_is_the_same_key() -> None:
    raw = b'{"stream":true,"stream\\u005Foptions":{"a":1}}'
    assert spliced(raw) == raw[:-2] + b',"include_usage":true}}'


def test_strings_with_braces_quotes_and_backslashes() -> None:
    raw = (
        b'{"content":"}{\\"stream_options\\":{\\\\\\"","stream":true,'
        b'"stop":["\\\\","}","\\"}"],"stream_options":{"k":"{\\\\}\\""}}'
    )
    assert spliced(raw) == raw[:-2] + b',"include_usage":true}}'
    key_like = b'{"a":"\\"stream_options\\":{}","stream":true}'
    assert spliced(key_like) == key_like[:-1] + ADDED + b"}"


def test_nan_and_infinity_are_forwarded_as_sent() -> None:
    # json.loads reads them; they are not JSON, but the upstream sees exactly what the client sent.
    raw = b'{"stream":true,"temperature":NaN,"top_p":-Infinity}'
    body = prepare_usage(raw, inject_usage=True).body
    assert body == raw[:-1] + ADDED + b"}"


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b'{"stream":false}',
        b'{"stream":"true"}',
        b'{"stream":1}',
        b'{"model":"m"}',
        b'[{"stream":true}]',
        b"[]",
        b'"stream"',
        b"true",
        b"null",
        b"",
        b"not json",
        b'{"stream":true',
        b'{"stream":true,"stream_options":{"a":1}',
        b'{"stream":true}}',
        b'{"stream":true} x',
        b'{"stream":true,"stream_options":null}',
        b'{"stream":true,"stream_options":[]}',
        b'{"stream":true,"stream_options":"include_usage"}',
        b'{"stream":true,"stream_options":{"include_usage":true}}',
        b'{"stream":true,"stream_options":{"include_usage":false,"include_usage":true}}',
        b'{"stream":true,"x":"\xff"}',
        b"[" * 100_000 + b"]" * 100_000,
        '{"stream":true}'.encode("utf-16"),
        '{"stream":true}'.encode("utf-32-le"),
    ],
)
def test_unchanged(raw: bytes) -> None:
    assert check(raw) == UNCHANGED


def test_not_asked_to_inject() -> None:
    assert prepare_usage(b'{"stream":true}', inject_usage=False) == UNCHANGED
    assert CHAT.prepare(b'{"stream":true}', inject_usage=False) == UNCHANGED


@pytest.mark.parametrize("provider", OTHERS, ids=[f"{p.name}-{i}" for i, p in enumerate(OTHERS)])
def test_other_providers_never_change_the_body(provider: Provider) -> None:
    for raw in (b'{"stream":true}', b'{"stream":true,"stream_options":{}}', b"{", b"\xff", b""):
        assert provider.prepare(raw, inject_usage=True, path="/v1beta/models/m:streamGenerateContent") == Prepared(
            None, False
        )


# Properties: generated objects, spelt with arbitrary whitespace, escapes and duplicate keys.

WS = st.sampled_from(["", " ", "\n", "\r\n", "\t", "  \n\t"])
KEYS = st.sampled_from(["stream_options", "include_usage", "continuous_usage_stats", "model", 'q"}{', "\\"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["{", "}", '"', "\\", "stream_options", "\x00", "\u2028", "\U0001f600"])
)


def _key(draw: st.DrawFn, depth: int) -> str:
    # A top-level ``stream`` is drawn by request_body; a nested one is just another key.
    names = KEYS | st.text(max_size=6)
    key = draw(names | st.just("stream") if depth else names)
    style = draw(st.sampled_from(["plain", "ascii", "escaped"]))
    if style == "escaped":  # every character as a \\uXXXX escape (surrogate pairs for astral ones)
        units = key.encode("utf-16-be")
        return '"' + "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2)) + '"'
    return json.dumps(key, ensure_ascii=style == "ascii")


@st.composite
def spelt(draw: st.DrawFn, depth: int = 0) -> str:
    """The text of one JSON value, spelt as a client might: any whitespace, escapes, duplicate keys."""
    kind = draw(st.sampled_from(["scalar", "object", "array"] if depth < 3 else ["scalar"]))
    if kind == "scalar":
        return json.dumps(draw(SCALARS), ensure_ascii=draw(st.booleans()))
    if kind == "array":
        items = draw(st.lists(spelt(depth + 1), max_size=3))
        return "[" + ",".join(draw(WS) + item + draw(WS) for item in items) + draw(WS) + "]"
    return _object(draw, depth)


def _object(draw: st.DrawFn, depth: int, extra: list[str] | None = None) -> str:
    members = [
        draw(WS) + _key(draw, depth) + draw(WS) + ":" + draw(WS) + draw(spelt(depth + 1)) + draw(WS)
        for _ in range(draw(st.integers(0, 4)))
    ]
    members += extra or []
    members = draw(st.permutations(members))
    return "{" + ",".join(members) + draw(WS) + "}"


@st.composite
def request_body(draw: st.DrawFn) -> bytes:
    """A top-level object that often streams and often has stream_options (possibly twice)."""
    extra: list[str] = []
    if draw(st.integers(0, 9)) > 0:
        extra.append('"stream"' + draw(WS) + ":" + draw(WS) + draw(st.sampled_from(["true"] * 4 + ["false", '"true"'])))
    for _ in range(draw(st.integers(0, 2))):
        options = {
            k: draw(st.booleans() | st.none() | st.integers(0, 2))
            for k in draw(st.lists(st.sampled_from(["include_usage", "continuous_usage_stats", "other"])))
        }
        as_object = json.dumps(options, indent=draw(st.sampled_from([None, 2])))
        value = draw(st.sampled_from([as_object] * 4 + ["null", "[]"]))
        extra.append(draw(WS) + '"stream_options"' + draw(WS) + ":" + draw(WS) + value + draw(WS))
    text = draw(WS) + _object(draw, 0, extra) + draw(WS)
    return (b"\xef\xbb\xbf" if draw(st.booleans()) else b"") + text.encode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(raw=request_body())
def test_property_splice_matches_the_model_and_keeps_every_byte(raw: bytes) -> None:
    check(raw)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | request_body().map(lambda b: b[: len(b) // 2]))
def test_property_never_raises_and_only_splices_valid_objects(raw: bytes) -> None:
    for provider in PROVIDERS:
        prepared = provider.prepare(raw, inject_usage=True)
        if prepared.body is not None:
            check(raw)
