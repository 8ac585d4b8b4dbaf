"""The lessons between telemetry processes: every kind survives encode, ``marshal`` and decode with its names; a
lesson of another build, garbled or of the wrong field types, is refused with ``WireError`` (a ``ValueError``)."""

from __future__ import annotations

import marshal

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from llmtap.wire.lessons import (
    Decoding,
    Ended,
    Idle,
    Lesson,
    LiveEntry,
    PassedSpans,
    Prefix,
    SlotCount,
    decode_lesson,
    encode_lesson,
)
from llmtap.wire.messages import FACTS, Facts, WireError, decode, encode

text = st.text(max_size=20)
times = st.floats(allow_nan=False, allow_infinity=False)
numbers = times | st.integers(-(2**40), 2**40)
lessons: st.SearchStrategy[Lesson] = (
    st.builds(Decoding, text, numbers, numbers)
    | st.builds(Ended, text, numbers, numbers)
    | st.builds(Idle, text, text, st.integers(0, 2**30), numbers, st.none() | numbers)
    | st.builds(Prefix, st.lists(st.binary(min_size=16, max_size=16), max_size=5).map(tuple), numbers)
    | st.builds(SlotCount, text, st.integers(0, 4096), text, times)
    | st.builds(LiveEntry, st.tuples(text, st.none() | times, st.tuples(text, st.integers())))
    | st.builds(PassedSpans, st.binary(max_size=64))
)


@given(lesson=lessons)
@hsettings(max_examples=200, deadline=None)
def test_each_lesson_kind_comes_back_equal_with_its_names(lesson: Lesson) -> None:
    raw = encode_lesson(lesson)
    # What crosses is a plain tuple, its kind's name first: marshal takes it.
    assert type(raw) is tuple and type(raw[0]) is str and marshal.loads(marshal.dumps(raw)) == raw
    back = decode_lesson(marshal.loads(marshal.dumps(raw)))
    assert back == lesson and type(back) is type(lesson)


@given(batch=st.lists(lessons, max_size=6))
@hsettings(max_examples=50, deadline=None)
def test_lessons_cross_inside_facts_and_come_back_named(batch: list[Lesson]) -> None:
    raw = encode(Facts(tuple(encode_lesson(x) for x in batch)))
    facts = decode(marshal.loads(marshal.dumps(raw)))
    assert raw[0] == FACTS and isinstance(facts, Facts)
    assert [decode_lesson(x) for x in facts.lessons] == batch


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ((), "not a non-empty tuple"),
        (["ended", "u", 1.0, 2.0], "not a non-empty tuple"),
        (("nonsense", 1), "unknown kind 'nonsense'"),
        (("ended", "http://up", "x", 1.0), "written is a str"),
        (("ended", "http://up", 1.0), "2 fields where this build has 3"),
        (("slots", "http://up", 4), "2 fields where this build has 4"),
        (("slots", "http://up", 4.5, "gauges", 1.0), "slots is a float"),
        (("prefix", ("not bytes",), 1.0), "digests is a tuple"),
        (("idle", "http://up", "m", 10, 0.2, "fast"), "rate is a str"),
        (("spans", "not bytes"), "export is a str"),
        (("decoding", 7, 1.0, 2.0), "upstream is a int"),
    ],
)
def test_a_lesson_this_build_cannot_read_is_refused_with_what_is_wrong(raw: object, says: str) -> None:
    with pytest.raises(WireError, match=says):
        decode_lesson(raw)
    assert issubclass(WireError, ValueError)
