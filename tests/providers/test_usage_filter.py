"""UsageEventFilter: exactly the injected usage event is removed, every other byte passes, at any split."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from llmtap.providers import UsageEventFilter
from llmtap.providers.usage_filter import _BOUNDARY, MAX_HELD_BYTES, _last_boundary_end

TRANSCRIPTS = Path(__file__).parents[1] / "transcripts"


def body(name: str) -> bytes:
    return (TRANSCRIPTS / f"{name}.body").read_bytes()


def without_usage_event(raw: bytes, sep: bytes = b"\n\n") -> bytes:
    """The body with its one ``choices: []`` event (and that event's blank line) cut out by hand."""
    blocks = raw.split(sep)
    usage = [i for i, block in enumerate(blocks) if b'"choices":[]' in block]
    assert len(usage) == 1
    del blocks[usage[0]]
    return sep.join(blocks)


def direct(name: str, end: bytes = b"\n") -> bytes:
    """What vLLM sends when usage is not asked for: the recording without ``include_usage``, with the asked-for
    recording's response id (the two recordings are the same generation)."""
    return with_line_ends(body(name).replace(b"a4408b88914d15a8", b"98282bffbafe2265"), end)


def run(chunks: list[bytes]) -> tuple[bytes, UsageEventFilter]:
    usage_filter = UsageEventFilter()
    out = b"".join(usage_filter.feed(chunk) for chunk in chunks) + usage_filter.flush()
    return out, usage_filter


def with_line_ends(raw: bytes, end: bytes) -> bytes:
    return raw.replace(b"\n", end)


@pytest.mark.parametrize("name", ["chat-stream-usage", "completions-stream-usage"])
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_usage_event_removed_at_every_split(name: str, end: bytes) -> None:
    raw = with_line_ends(body(name), end)
    # Chat: exactly the bytes vLLM sends unasked (its fingerprint back on the terminal chunk). Completions: vLLM
    # stamps no terminal chunk, so the stream minus its usage event.
    expected = direct("chat-stream", end) if name == "chat-stream-usage" else without_usage_event(raw, end + end)
    assert len(expected) < len(raw)
    for cut in range(len(raw) + 1):
        out, usage_filter = run([raw[:cut], raw[cut:]])
        assert out == expected, cut
        assert usage_filter.removed == 1


def test_usage_event_removed_byte_by_byte_and_in_random_chunks() -> None:
    raw = body("chat-stream-usage")
    expected = direct("chat-stream")
    assert run([raw[i : i + 1] for i in range(len(raw))])[0] == expected
    rng = random.Random(1)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(1, 12)))
        bounds = [0, *cuts, len(raw)]
        assert run([raw[a:b] for a, b in itertools.pairwise(bounds)])[0] == expected


@pytest.mark.parametrize("name", ["chat-stream", "responses-stream", "messages-stream"])
def test_stream_without_usage_event_passes_byte_for_byte(name: str) -> None:
    raw = body(name)
    for cut in range(len(raw) + 1):
        out, usage_filter = run([raw[:cut], raw[cut:]])
        assert out == raw and usage_filter.removed == 0


def test_continuous_usage_chunks_with_choices_are_kept() -> None:
    raw = body("chat-stream-continuous-usage")
    out, usage_filter = run([raw])
    # The usage event goes; its fingerprint goes back on the terminal chunk, as that chunk's last member.
    blocks = without_usage_event(raw).split(b"\n\n")
    (terminal,) = [i for i, block in enumerate(blocks) if b'"finish_reason":"length"' in block]
    blocks[terminal] = blocks[terminal][:-1] + b',"system_fingerprint":"vllm-0.32.0-358ce51c"}'
    assert out == b"\n\n".join(blocks) and usage_filter.removed == 1
    assert out.count(b'"usage":{') == raw.count(b'"usage":{') - 1


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices": [], "usage": null}\n\n',  # OpenAI's null usage on other chunks
        b'data: {"choices": [{"index": 0}], "usage": {"prompt_tokens": 1}}\n\n',
        b'event: usage\ndata: {"choices": [], "usage": {"prompt_tokens": 1}}\n\n',
        b'id: 7\ndata: {"choices": [], "usage": {"prompt_tokens": 1}}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 1}\n\n',  # not JSON
        b'data: ["choices", [], "usage"]\n\n',
        b': comment "choices":[] "usage"\n\n',
    ],
)
def test_lookalikes_are_kept(event: bytes) -> None:
    raw = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n' + event + b"data: [DONE]\n\n"
    assert run([raw])[0] == raw


def test_spaced_json_usage_event_is_removed() -> None:
    usage = b'data: {"id": "c", "choices": [ ], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n'
    head, tail = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n', b"data: [DONE]\n\n"
    assert run([head + usage + tail])[0] == head + tail


def test_complete_events_leave_at_once_and_only_a_partial_event_is_held() -> None:
    usage_filter = UsageEventFilter()
    first, partial = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', b'data: {"choices": [{"de'
    assert usage_filter.feed(first + partial) == first
    assert usage_filter.feed(b'lta": {}}]}\n') == b""
    assert usage_filter.feed(b"\n") == partial + b'lta": {}}]}\n\n'
    assert usage_filter.feed(b"data: [DO") == b""
    assert usage_filter.flush() == b"data: [DO"


def test_gives_up_on_a_partial_event_over_one_mib() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n'
    huge = b"data: " + b"x" * (MAX_HELD_BYTES // 5)  # five of these pass the limit, four do not
    chunks = [usage, huge, huge, huge, huge, huge, b"\n\n", usage]
    usage_filter = UsageEventFilter()
    outs = [usage_filter.feed(chunk) for chunk in chunks]
    assert outs[:5] == [b"", b"", b"", b"", b""]
    assert usage_filter.gave_up and outs[5] == b"".join(chunks[1:6])  # the held bytes go out at once
    assert outs[6:] == chunks[6:] and usage_filter.flush() == b""
    assert usage_filter.removed == 1


def test_held_bytes_stay_bounded_until_the_limit() -> None:
    usage_filter = UsageEventFilter(max_held=100)
    assert usage_filter.feed(b"data: " + b"y" * 90) == b""
    assert usage_filter.feed(b"y" * 20) == b"data: " + b"y" * 110
    assert usage_filter.gave_up


def test_the_last_boundary_is_where_the_regex_finds_it() -> None:
    # ``_last_boundary_end`` finds the last blank line with ``rfind`` and runs the regex only around it: on every
    # mix of CR, LF and other bytes it must agree with the regex run over everything.
    rng = random.Random(28)
    for _ in range(20000):
        buf = bytearray(rng.choice(b"\r\n\r\nx") for _ in range(rng.randrange(0, 24)))
        start = rng.randrange(0, len(buf) + 1)
        expected = -1
        for match in _BOUNDARY.finditer(buf, start):
            expected = match.end()
        assert _last_boundary_end(buf, start) == expected, (bytes(buf), start)


# OpenAI's shape once usage is asked for (standards D.1): the fingerprint on every chunk, "usage":null on every
# chunk but the usage chunk, which comes last; unasked, the same chunks without the usage member.
OPENAI_ASKED = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_1",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_1",'
    b'"choices":[{"index":0,"delta":{"content":"\\"usage\\":null"},"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_1",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null,"obfuscation":"a1"}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_1",'
    b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    b"data: [DONE]\n\n"
)


def test_openai_null_usage_members_are_cut_at_every_split() -> None:
    expected = without_usage_event(OPENAI_ASKED).replace(b',"usage":null', b"")
    assert expected.count(b"usage") == 1  # the escaped text content stays as it was
    for cut in range(len(OPENAI_ASKED) + 1):
        out, usage_filter = run([OPENAI_ASKED[:cut], OPENAI_ASKED[cut:]])
        assert out == expected, cut
        assert usage_filter.removed == 1


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices":[{"delta":{"usage":null}}],"usage":null}\n\n',  # two keys: which is top-level is unsaid
        b'data: {"usage":null}\n\n',  # no choices: not a content chunk
        b'data: {"choices":[{"delta":{},"usage":null}]}\n\n',  # nested only
        b'event: chunk\ndata: {"choices":[{"index":0}],"usage":null}\n\n',  # a named event is not a plain chunk
    ],
)
def test_null_usage_lookalikes_are_kept(event: bytes) -> None:
    raw = event + b"data: [DONE]\n\n"
    assert run([raw])[0] == raw


def chat_chunk(index: int, finish: str | None, fingerprint: bool = False) -> bytes:
    choice = {"index": index, "delta": {"content": "x"}, "finish_reason": finish}
    obj = {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}
    if fingerprint:
        obj["system_fingerprint"] = "fp"
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


USAGE_FP = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":1},'
    b'"system_fingerprint":"fp"}\n\n'
)


def test_terminal_chunks_of_several_choices_get_the_fingerprint_back() -> None:
    # n = 2, both ending in the same step (vLLM writes both terminal chunks, then the usage chunk).
    asked = [chat_chunk(0, None), chat_chunk(1, None), chat_chunk(0, "length"), chat_chunk(1, "length"), USAGE_FP]
    unasked = [chat_chunk(0, None), chat_chunk(1, None), chat_chunk(0, "length", True), chat_chunk(1, "length", True)]
    usage_filter = UsageEventFilter()
    outs = [usage_filter.feed(event) for event in asked]
    assert outs[2:4] == [b"", b""]  # held for the next event, which brings the fingerprint
    assert b"".join(outs) + usage_filter.flush() == b"".join(unasked)


def test_a_terminal_chunk_is_held_only_until_the_next_event() -> None:
    usage_filter = UsageEventFilter()
    early, other = chat_chunk(0, "stop"), chat_chunk(1, None)
    assert usage_filter.feed(early) == b""
    assert usage_filter.feed(other) == early + other  # released unstamped: the fingerprint is not known yet
    assert usage_filter.feed(chat_chunk(1, "stop")) == b""
    assert usage_filter.flush() == chat_chunk(1, "stop")  # the stream ended without a usage chunk: as sent


def test_completions_and_stamped_chunks_are_never_held() -> None:
    stamped = chat_chunk(0, "stop", fingerprint=True)
    choice = b'{"index":0,"text":"x","finish_reason":"length"}'
    completion = b'data: {"id":"c","object":"text_completion","choices":[' + choice + b"]}\n\n"
    for event in (stamped, completion):
        usage_filter = UsageEventFilter()
        assert usage_filter.feed(event) == event
