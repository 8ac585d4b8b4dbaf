"""A short answer read whole with its head: ``Playback.feed`` skips the per-read loop for it (``_feed_whole``).

Every tape here is played twice, through ``feed`` (the short way, with the loop made to fail if it is taken) and
through ``feed_each`` (the loop), and the timelines and summaries are compared field by field: what the records,
metrics, live view and spans read of a request must not depend on the way it took."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from llmtap.analysis.shapes import configured_slo, objective
from llmtap.analysis.stats import sorted_quantile
from llmtap.analysis.summary import Summary, spread, summarize
from llmtap.analysis.timeline import Output, Timeline
from llmtap.config.load import build
from llmtap.config.types import SLO
from llmtap.telemetry.intake.replay import Playback
from llmtap.wire.messages import End, decode
from llmtap.wire.tape import Tape

SETTINGS = build({"upstream": "http://127.0.0.1:9", "provider": "vllm", "slo": {"e2e": 0.5}}, {})
ROUTES = {r.name: r for r in SETTINGS.routes}

EMBED_BODY = b'{"model": "e5", "input": "the quick brown fox"}'
EMBED_ANSWER = json.dumps(
    {"object": "list", "data": [{"index": 0, "embedding": [0.5, -0.25]}], "model": "e5", "usage": {"prompt_tokens": 5}}
).encode()
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "Say hello to the world."}]}'
CHAT_MESSAGE = {"role": "assistant", "content": "Hello, world! How are you today?"}
CHAT_ANSWER = {"id": "c1", "model": "m", "choices": [{"index": 0, "message": CHAT_MESSAGE, "finish_reason": "stop"}]}
CHAT_USAGE = {"prompt_tokens": 14, "completion_tokens": 9, "total_tokens": 23}
ERROR_ANSWER = b'{"error": {"message": "model not found", "type": "invalid_request_error"}}'
JSON = [(b"content-type", b"application/json")]


def _end(
    protocol: str,
    path: str,
    body: bytes,
    answer: bytes,
    *,
    status: int = 200,
    headers: list[tuple[bytes, bytes]] = JSON,
    delivered: bool = True,
    fail: tuple[str, str | None, bool] | None = None,
) -> End:
    """The one message a relay hands over for a request whose answer came whole in one read."""
    t = Tape(
        7,
        method="POST",
        path=path,
        inner_path=path,
        route="default",
        protocol=protocol,
        received=500.0,
        received_wall_ns=1_700_000_000_000_000_000,
    )
    t.trace_id, t.span_id = 11, 12
    t.body, t.body_read, t.admitted, t.sent = body, 500.001, 500.002, 500.003
    t.headers_at, t.status_code, t.response_headers = 500.05, status, headers
    t.read(500.05, answer)
    if delivered:
        t.delivered(500.0504)
    t.end = 500.051
    if fail is not None:
        t.fail(fail[0], fail[1], cancelled=fail[2])
    m = decode(t.end_message())
    assert isinstance(m, End) and m.head is not None
    return m


def _chat(usage: bool) -> bytes:
    return json.dumps({**CHAT_ANSWER, "usage": CHAT_USAGE} if usage else CHAT_ANSWER).encode()


TAPES = {
    "embeddings": _end("openai_embeddings", "/v1/embeddings", EMBED_BODY, EMBED_ANSWER),
    "embeddings without usage": _end(
        "openai_embeddings", "/v1/embeddings", EMBED_BODY, EMBED_ANSWER.replace(b', "usage": {"prompt_tokens": 5}', b"")
    ),
    "chat with usage": _end("openai_chat", "/v1/chat/completions", CHAT_BODY, _chat(True)),
    "chat without usage": _end("openai_chat", "/v1/chat/completions", CHAT_BODY, _chat(False)),
    "chat never delivered": _end("openai_chat", "/v1/chat/completions", CHAT_BODY, _chat(True), delivered=False),
    "chat, the client gone": _end(
        "openai_chat", "/v1/chat/completions", CHAT_BODY, _chat(True), delivered=False, fail=("cancelled", None, True)
    ),
    "error 400": _end("openai_chat", "/v1/chat/completions", CHAT_BODY, ERROR_ANSWER, status=400),
    "error 503 not JSON": _end(
        "openai_chat",
        "/v1/chat/completions",
        CHAT_BODY,
        b"<html>Service Unavailable</html>",
        status=503,
        headers=[(b"content-type", b"text/html")],
    ),
    "200 not JSON": _end("openai_embeddings", "/v1/embeddings", EMBED_BODY, b"this is not JSON at all"),
    "cut short": _end(
        "openai_chat",
        "/v1/chat/completions",
        CHAT_BODY,
        _chat(True)[:40],
        fail=("upstream_cut", "the upstream closed the connection", False),
    ),
    "empty body": _end("openai_embeddings", "/v1/embeddings", EMBED_BODY, b""),
}


def _fields(obj: Any) -> dict[str, Any]:
    """Every field of a timeline or summary, its output (which has no equality of its own) by what it holds."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Output):
            value = (value.encoding, value.text, value.chars, value.tokens(), value.estimated)
        out[f.name] = (type(value), repr(value))
    return out


def _played(m: End, *, whole: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Timeline, Summary]:
    assert m.head is not None
    playback = Playback(m.head, SETTINGS, ROUTES)
    if whole:
        with monkeypatch.context() as patched:
            patched.setattr(Playback, "feed_each", _loop_taken)
            playback.feed(m.reads)
    else:
        playback.feed_each(m.reads)
    tl = playback.finish(m.tail)
    return tl, summarize(tl, SETTINGS.slo)


def _loop_taken(self: Playback, reads: Any) -> None:
    raise AssertionError("the read went through the loop, not the short way")


@pytest.mark.parametrize("name", list(TAPES))
def test_one_read_plays_back_as_the_loop_does(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fast_tl, fast = _played(TAPES[name], whole=True, monkeypatch=monkeypatch)
    slow_tl, slow = _played(TAPES[name], whole=False, monkeypatch=monkeypatch)
    assert _fields(fast_tl) == _fields(slow_tl)
    assert _fields(fast) == _fields(slow)


def test_the_tapes_cover_what_the_short_way_must_keep() -> None:
    """The set above reaches each branch the short way touches: answers parsed and not, usage or none, content,
    errors, the relay's delay present and absent."""
    played = {name: _played_plain(m) for name, m in TAPES.items()}
    assert played["embeddings"].usage is not None and played["embeddings without usage"].usage is None
    assert played["chat with usage"].output is not None and played["chat with usage"].completed_delivered
    assert not played["chat never delivered"].completed_delivered and not played["chat never delivered"].relay_delays
    assert played["chat, the client gone"].outcome == "cancelled"
    assert played["error 400"].error_type == "invalid_request_error"
    assert played["error 503 not JSON"].error_type == "503"
    assert played["cut short"].error_type == "upstream_cut" and played["cut short"].usage is None
    assert played["embeddings"].relay_delays.tolist() == [pytest.approx(0.0004)]


def _played_plain(m: End) -> Timeline:
    assert m.head is not None
    playback = Playback(m.head, SETTINGS, ROUTES)
    playback.feed(m.reads)
    return playback.finish(m.tail)


def test_a_differing_short_way_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above fails when the short way leaves out what the loop does (here: the relay's delay)."""
    m = TAPES["chat with usage"]
    slow_tl, _ = _played(m, whole=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(Playback, "_feed_whole", _without_delay(Playback._feed_whole))
    fast_tl, _ = _played(m, whole=True, monkeypatch=monkeypatch)
    assert _fields(fast_tl) != _fields(slow_tl)


def _without_delay(feed_whole: Any) -> Any:
    def wrong(self: Playback, tap: Any, reads: Any) -> None:
        feed_whole(self, tap, reads)
        del self.tl.relay_delays[:]

    return wrong


def test_a_route_changed_under_its_name_gives_its_own_place() -> None:
    """The upstream's host and port are kept per route object: a route rebuilt under the same name (a reload) is
    read anew, so a timeline never names the old upstream."""
    m = TAPES["embeddings"]
    assert m.head is not None
    first = _played_plain(m)
    moved = dataclasses.replace(ROUTES["default"], upstream="https://models.example:8443")
    playback = Playback(m.head, SETTINGS, {"default": moved})
    assert (first.server_address, first.server_port) == ("127.0.0.1", 9)
    assert (playback.tl.server_address, playback.tl.server_port, playback.tl.upstream) == (
        "models.example",
        8443,
        "https://models.example:8443",
    )


@pytest.mark.parametrize(
    ("trace_id", "span_id"),
    [(bytes(range(16)), bytes(range(8))), (b"\x01\x02", b"\x03"), (b"\xff" * 17, b"\x00" * 9), (b"", b"")],
)
def test_ids_read_as_numbers_of_their_width(trace_id: bytes, span_id: bytes) -> None:
    """An id of its own length reads as its hex; one of another length as its number, zero-padded to the width."""
    m = TAPES["embeddings"]
    assert m.head is not None
    head = m.head._replace(trace_id=trace_id, span_id=span_id, record_id=trace_id)
    tl = Playback(head, SETTINGS, ROUTES).tl
    assert tl.trace_id == tl.record_id == format(int.from_bytes(trace_id, "big"), "032x")
    assert tl.span_id == format(int.from_bytes(span_id, "big"), "016x")


def test_each_objective_is_judged_by_its_own_limits() -> None:
    """The remembered answer of ``configured_slo`` is that objective's: objectives asked in turn, equal or not,
    each get their own."""
    some, none, again = SLO(e2e=0.5), SLO(), SLO(e2e=0.5)
    for slo, expected in [(some, True), (none, False), (some, True), (again, True), (none, False), (none, False)]:
        assert configured_slo(slo) is expected
        assert objective(None, "other", slo) == (slo if expected else None)


@pytest.mark.parametrize("name", list(TAPES))
def test_one_reads_figures_are_the_general_formulas(name: str) -> None:
    """A single read's delay is its sample and its p99, and a whole body has no gaps: what the formulas for many
    give (``summarize`` takes them directly for one)."""
    tl = _played_plain(TAPES[name])
    s = summarize(tl, SETTINGS.slo)
    delays = list(spread(tl.relay_delays))
    assert (type(s.relay_delay_samples), s.relay_delay_samples) == (list, delays)
    assert s.relay_delay_p99 == sorted_quantile(sorted(delays), 0.99)
    times = tl.chunk_times
    assert s.gaps == [times[i] - times[i - 1] for i in range(1, len(times))] == []


def test_a_stream_of_reads_keeps_its_gaps_and_delays() -> None:
    """Reads past the first: the general formulas, unchanged."""
    tl = _played_plain(TAPES["chat with usage"])
    tl.chunk_times.extend([500.06, 500.09])
    tl.relay_delays.extend([0.002, 0.0001])
    s = summarize(tl, SETTINGS.slo)
    assert s.gaps == [pytest.approx(0.009), pytest.approx(0.03)] and len(s.relay_delay_samples) == 3
    assert s.relay_delay_p99 == sorted_quantile(sorted(tl.relay_delays), 0.99)
