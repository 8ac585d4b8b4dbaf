"""``llmtap.providers.bodyscan``: a body read piece by piece gives exactly what ``prepare_usage`` gives.

Every body is cut every way a listener might hand it over (at every byte for the short ones, at random points
for the others) and held to ``prepare_usage(body, inject_usage=True)``, which ``tests/providers/test_splice.py``
holds to a model of the splice; the bounds that make the reader forward a body unchanged are shown one by one.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
from hypothesis import given, settings, strategies as st

from llmtap.providers import bodyscan
from llmtap.providers.bodyscan import MAX_DEPTH, MAX_TOKEN, BodyScan
from llmtap.providers.splice import prepare_usage
from llmtap.types import UNCHANGED, Prepared
from tests.providers.test_splice import request_body

# What json.loads reads and refuses (kept from the stepwise parser this reader replaced).
VALID = [
    b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}',
    b' \n{ "a" : [ 1 , 2.5e3 , -0 , true , false , null , "x\\u00e9" , { } , [ ] ] , "a" : {"b":[[[[1]]]]} } \t',
    '\ufeff{"bom": "utf-8-sig"}'.encode(),
    '{"é":"ü","n":[{"deep":[{"deeper":[1,{"x":[]}]}]}]}'.encode(),
    "[1,2,3]".encode("utf-16"),
    b'"just a string"',
    b"12",
    b"[]",
    b"{}",
]
INVALID = [
    b"",
    b"   ",
    b"{",
    b'{"a":1,}',
    b"[1,2,]",
    b'{"a" 1}',
    b"{1:2}",
    b'{"a":1} x',
    b"[1 2]",
    b'{"a":[1,{"b":}]}',
    b'{"a":nul}',
    b"\xff\xfe\x00",
    b'{"a":"\xff"}',
    b"NaN-",
]


def scanned(body: bytes, cuts: list[int]) -> Prepared:
    """What the reader gives for ``body`` handed over in pieces cut at ``cuts``."""
    scan = BodyScan()
    last = 0
    for cut in sorted(set(cuts)):
        scan.feed(body[last:cut])
        last = cut
    scan.feed(body[last:])
    return scan.prepared(body)


def every_cut(body: bytes) -> None:
    want = prepare_usage(body, inject_usage=True)
    assert scanned(body, []) == want, body
    for cut in range(1, len(body)):
        assert scanned(body, [cut]) == want, (body, cut)
    assert scanned(body, list(range(1, len(body)))) == want, body  # a byte at a time


STREAMS = [
    b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}',
    b'{"stream":true}',
    b' {"stream" : true , "stream_options" : { } } \n',
    b'{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":1}}',
    b'{"stream":true,"stream_options":{"continuous_usage_stats":[0]},"x":[1,2,{"a":[]},"\\"}"]}',
    b'{"stream":true,"stream_options":{"continuous_usage_stats":-0.0e5}}',
    b'{"stream":true,"stream_options":{"continuous_usage_stats":1e-400}}',
    b'{"stream":true,"stream_options":{"continuous_usage_stats":""}}',
    b'{"stream":true,"stream_options":{"continuous_usage_stats":{}}}',
    b'{"stream":true,"stream_options":{"include_usage":true}}',
    b'{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"include_usage":false}}',
    b'{"stream":true,"stream_options":{},"stream_options":null}',
    b'{"stream":true,"stream":false}',
    b'{"stream":false,"stream":true}',
    b'{"stream":"true"}',
    b'{"stream":[true]}',
    b'{"str\\u0065am":true,"stream\\u005foptions":{"include\\u005fusage":false}}',
    b'{"stream":true,"nested":{"stream_options":{}},"list":[{"stream_options":1}]}',
    '\ufeff{"stream":true,"é":"ü\U0001f600","n":[NaN,Infinity,-Infinity,1.5E+3,-0,[],{}]}'.encode(),
    b'{"stream":true,"s":"tab\\tnewline\\nquote\\"slash\\\\u\\u00e9\\ud800"}',
    b'{"stream":true,"p":[1,2,3,4,5,6,7,8,9,10,"a","b",true,false,null,{"k":1},[1,2]]}',
    b'{"stream":true,"p":[[1,[2]],{"a":{"b":1}},[{"c":[]}]]}',
    b'{"stream":true,"big":' + b"9" * 700 + b"}",
    b'{"stream":true,"big":[' + b"9" * 700 + b",1]}",
]
BROKEN = [
    b'{"stream":true,"s":"a\tb"}',  # a raw tab in a string
    b'{"stream":true,"s":"a\x01b"}',
    b'{"stream":true,"s":"\\x"}',
    b'{"stream":true,"s":"\\u12"}',
    b'{"stream":true,"s":"\xff"}',
    b'{"stream":true,"s":"\xe2\x82"}',
    b'{"stream":true,"n":01}',
    b'{"stream":true,"n":1.}',
    b'{"stream":true,"n":-NaN}',
    b'{"stream":true,"n":[1,]}',
    b'{"stream":true,"n":[1 2]}',
    b'{"stream":true,}',
    b'{"stream":true} {}',
    b'{"stream":true',
    b'{"stream":true,"s":"open',
    b'{"stream":true]',
    b'{"stream":true,"a":{"b":1]}',
    b'{"stream" true}',
    b'{"stream":true,"x":tru}',
    b"[1]",
    b'"stream"',
    b"",
    b" ",
    b"\xef\xbb\xbf",
    b'{"stream":true,"big":' + b"9" * 4301 + b"}",
    b'{"stream":true,"big":[' + b"9" * 4301 + b",1]}",
    '{"stream":true}'.encode("utf-16"),
    '{"stream":true}'.encode("utf-32-le"),
    b'{\x00"stream":true}',
]


@pytest.mark.parametrize("body", STREAMS + BROKEN + VALID + INVALID)
def test_every_cut_gives_what_prepare_usage_gives(body: bytes) -> None:
    every_cut(body)


def test_the_broken_ones_are_refused_and_the_streams_spliced() -> None:
    assert all(prepare_usage(b, inject_usage=True) == UNCHANGED for b in BROKEN)
    assert sum(prepare_usage(b, inject_usage=True) != UNCHANGED for b in STREAMS) >= 15


@settings(max_examples=300, deadline=None)
@given(raw=request_body(), seed=st.integers(0, 2**32))
def test_property_generated_bodies_cut_anywhere(raw: bytes, seed: int) -> None:
    rnd = random.Random(seed)
    cuts = [rnd.randrange(len(raw) + 1) for _ in range(rnd.randrange(0, 8))]
    assert scanned(raw, cuts) == prepare_usage(raw, inject_usage=True)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=120) | request_body().map(lambda b: b[: len(b) * 2 // 3]), cut=st.integers(0, 200))
def test_property_any_bytes(raw: bytes, cut: int) -> None:
    assert scanned(raw, [cut]) == prepare_usage(raw, inject_usage=True)


def _chat(content: str, messages: int = 1) -> bytes:
    return json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}] * messages}
    ).encode()


@pytest.mark.parametrize(
    "body",
    [
        _chat("word " * 200_000),
        _chat('print("x\\ty", d["k"])  # \\"q\\" C:\\\\tmp\n' * 20_000),
        _chat("ü€😀 " * 50_000),
        _chat("hello " * 200, messages=2000),
        json.dumps({"model": "m", "stream": True, "prompt": list(range(300_000))}).encode(),
        json.dumps({"model": "m", "stream": True, "prompt": [[i, i + 1] for i in range(100_000)]}).encode(),
    ],
    ids=["prose", "code", "unicode", "many-messages", "token-ids", "nested-ids"],
)
def test_large_bodies_in_pieces_as_a_listener_hands_them_over(body: bytes) -> None:
    want = prepare_usage(body, inject_usage=True)
    assert want.body is not None
    rnd = random.Random(len(body))
    cuts = sorted(rnd.randrange(len(body)) for _ in range(len(body) // 50_000))
    assert scanned(body, cuts) == want
    assert scanned(body, list(range(65536, len(body), 65536))) == want


def test_past_its_bounds_the_reader_forwards_the_body_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    deep = b'{"stream":true,"d":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    assert prepare_usage(deep, inject_usage=True) != UNCHANGED
    assert scanned(deep, [100]) == UNCHANGED  # json.loads stops near a thousand; the reader at MAX_DEPTH
    shallower = b'{"stream":true,"d":' + b"[" * (MAX_DEPTH - 2) + b"]" * (MAX_DEPTH - 2) + b"}"
    assert scanned(shallower, [100]) == prepare_usage(shallower, inject_usage=True)
    long_number = b'{"stream":true,"n":1.' + b"5" * MAX_TOKEN + b"}"
    assert prepare_usage(long_number, inject_usage=True) != UNCHANGED
    assert scanned(long_number, list(range(16, len(long_number), 4096))) == UNCHANGED
    many = json.dumps({"stream": True, "a": [{"b": [i]} for i in range(2000)]}).encode()
    assert scanned(many, []) == prepare_usage(many, inject_usage=True)
    monkeypatch.setattr(bodyscan, "MAX_STEPS", 1000)
    assert scanned(many, []) == UNCHANGED  # too many steps: stopped, forwarded unchanged


def test_the_integer_digit_limit_is_python_s(monkeypatch: pytest.MonkeyPatch) -> None:
    body = b'{"stream":true,"n":' + b"7" * 5000 + b"}"
    old = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(0)  # no limit: json.loads takes it, and so does the reader
        assert scanned(body, [100]) == prepare_usage(body, inject_usage=True) != UNCHANGED
    finally:
        sys.set_int_max_str_digits(old)
    assert scanned(body, [100]) == prepare_usage(body, inject_usage=True) == UNCHANGED
