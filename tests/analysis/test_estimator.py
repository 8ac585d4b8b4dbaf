"""The queue/prefill estimator on exact synthetic timelines: slot replay, the learned envelope, bounds."""

from __future__ import annotations

import pytest

from llmtap.analysis import estimator as est
from llmtap.analysis.estimator import Envelope, Estimator, SlotLog
from llmtap.analysis.slots import FROM_METRICS, Slots
from llmtap.analysis.summary import summarize
from llmtap.analysis.timeline import Timeline
from llmtap.types import RequestInfo, Usage


def timeline(seq: int, sent: float, ahead: int, first: float, end: float, model: str = "m") -> Timeline:
    tl = Timeline(
        method="POST",
        path="/v1/chat/completions",
        route="default",
        upstream="http://up",
        server_address="up",
        server_port=80,
        protocol="openai_chat",
        provider_name="openai",
        received=sent,
        received_wall_ns=0,
    )
    tl.request = RequestInfo(operation="chat", model=model, stream=True)
    tl.sent, tl.first_content, tl.end = sent, first, end
    tl.upstream_seq, tl.upstream_ahead = seq, ahead
    return tl


def test_envelope_learns_the_lower_line_through_noise() -> None:
    env = Envelope()
    assert env.prefill(1000) is None
    base, per_token = 0.010, 1 / 5000
    for i, tokens in enumerate(range(100, 4000, 150)):
        env.add(tokens, base + tokens * per_token + (0.05 if i % 3 == 0 else 0.0))  # some saw interference
    assert env.prefill(2000) == pytest.approx(base + 2000 * per_token, rel=0.02)


def test_envelope_with_a_configured_rate_needs_one_sample() -> None:
    env = Envelope(rate=1000.0)
    env.add(500, 0.52)
    assert env.line() == pytest.approx((0.02, 0.001))


def test_envelope_is_bounded() -> None:
    env = Envelope()
    for i in range(100_000):
        env.add(i % 5000, 0.1)
    assert env.samples <= est._BINS * est._PER_BIN


def test_slot_replay_admits_at_the_right_completion() -> None:
    log = SlotLog()
    # Two slots. Requests sent at 0.0 and 0.1 run; others are sent at 1.0 while both run.
    log.add(0.0, 5.0)
    log.add(0.1, 6.0)
    assert log.admitted(sent=1.0, ahead=2, slots=2, first=5.5) == 5.0  # the first end frees a slot
    assert log.admitted(sent=1.0, ahead=3, slots=2, first=6.5) == 6.0  # the second end frees the next
    assert log.admitted(sent=5.5, ahead=1, slots=2, first=5.7) == 5.5  # a free slot: no wait
    # Not enough ends seen before the first chunk: the server has more slots than configured.
    assert log.admitted(sent=1.0, ahead=4, slots=2, first=5.5) is None


def test_slot_replay_counts_at_least_the_logged_requests_in_flight() -> None:
    """Two relays sending within microseconds may each read the shared in-flight count before the other's
    request is in it: the log, which holds every request that ended, raises such a count to what it knows."""
    log = SlotLog()
    # Two slots: requests sent at 0.0 and 0.1 run; one sent at 0.2 waits for the first end.
    log.add(0.0, 5.0)
    log.add(0.1, 6.0)
    log.add(0.2, 7.0)
    # Sent at 0.3 with three ahead, yet counted with two: admitted at the second end, not the first.
    assert log.admitted(sent=0.3, ahead=2, slots=2, first=6.5) == 6.0
    # A count above what the log knows stands (requests still running are not in the log).
    assert log.admitted(sent=0.3, ahead=4, slots=2, first=7.5) == 7.0


def test_slot_replay_counts_only_requests_sent_before() -> None:
    """Ends are ordered by send time, not by any relay's numbering: a request sent later that ended first (a
    server that is not first come, first served) frees no slot for one sent before it."""
    log = SlotLog()
    log.add(0.0, 5.0)
    log.add(2.0, 4.0)  # sent after the request below, ended before the first of those ahead of it
    log.add(0.5, 6.0)
    assert log.admitted(sent=1.0, ahead=2, slots=2, first=7.0) == 5.0
    assert log.admitted(sent=1.0, ahead=3, slots=2, first=7.0) == 6.0
    assert log.admitted(sent=2.5, ahead=3, slots=2, first=7.0) == 5.0  # sent after all three: each counts


def test_requests_decoding_together_are_a_floor_under_the_slots() -> None:
    e = Estimator()
    # Recorded in the order they end: 1 decodes 1.0-2.0, 2 from 1.5, 3 from 1.8 (while both still decode),
    # 4 from 3.0 (alone again).
    assert e.decoding_peak(timeline(1, 0.0, 0, 1.0, 2.0)) == 1
    assert e.decoding_peak(timeline(2, 0.1, 1, 1.5, 2.5)) == 2
    assert e.decoding_peak(timeline(3, 0.2, 2, 1.8, 3.0)) == 3
    assert e.decoding_peak(timeline(4, 2.9, 0, 3.0, 3.5)) == 3  # the peak stays
    other = timeline(1, 0.0, 0, 1.0, 2.0)
    other.upstream = "http://other"
    assert e.decoding_peak(other) == 1  # per upstream


def test_learned_slots_rise_to_what_decoded_together() -> None:
    """The gauges said 1 (sampled while one ran and others waited); two streams overlapped: the replay uses 2,
    unconfirmed."""
    e = Estimator()
    learned = Slots(1, FROM_METRICS, 0.9)
    tls = [timeline(1, 0.0, 0, 1.0, 2.0), timeline(2, 0.1, 1, 1.5, 2.5)]
    for tl in tls:
        tl.usage = Usage(input_tokens=100, output_tokens=10)
    summarize(tls[0], None, estimator=e, slots=learned)
    s = summarize(tls[1], None, estimator=e, slots=learned)
    assert s.slots == Slots(2, FROM_METRICS, 0.0)


def test_estimator_slot_split_and_fallback_to_envelope() -> None:
    e = Estimator()
    # Unloaded requests teach the envelope: base 5 ms + 1 ms per 10 tokens.
    t = 0.0
    for seq, tokens in enumerate((100, 400, 800, 1600), start=1):
        first = t + 0.005 + tokens / 10_000
        e.observe(timeline(seq, t, 0, first, first + 0.1), tokens, slots=None, rate=None)
        t += 1.0
    # One that queued 0.3 s behind others, with no slot count: the envelope gives its prefill.
    tl = timeline(10, 10.0, 3, 10.0 + 0.3 + 0.005 + 0.08, 11.0)
    split = e.observe(tl, 800, slots=None, rate=None)
    assert split is not None and split.method == "envelope"
    assert split.queue == pytest.approx(0.3, abs=1e-6) and split.prefill == pytest.approx(0.085, abs=1e-6)


def test_the_replay_orders_requests_as_they_were_written_not_begun() -> None:
    """Two slots. A request begun at 1.0 opens a connection and is written at 1.6; one begun at 1.1 on a connection
    already open is written at 1.2 and reaches the server first, taking the free slot; the first waits for a slot
    to end. Each counts the requests in flight as it is written."""
    e = Estimator()
    running = timeline(1, 0.0, 0, 0.5, 5.0)
    late = timeline(2, 1.0, 2, 5.3, 6.0)
    late.written = 1.6
    early = timeline(3, 1.1, 1, 1.4, 8.0)
    early.written = 1.2
    for tl in (running, late, early):  # in the order they ended
        split = e.observe(tl, 100, slots=2, rate=None)
        assert split is not None and split.method == "slots"
        if tl is late:
            # It queued from its write to the running request's end; its connect stays in prefill.
            assert split.queue == pytest.approx(5.0 - 1.6) and split.prefill == pytest.approx(5.3 - 1.0 - 3.4)
        if tl is early:
            assert split.queue == 0.0 and split.prefill == pytest.approx(0.3)


def test_estimator_split_never_negative_nor_longer_than_ttft() -> None:
    e = Estimator()
    e.observe(timeline(1, 0.0, 0, 1.0, 2.0), 100, slots=None, rate=None)
    e.observe(timeline(2, 2.0, 0, 4.0, 5.0), 10_000, slots=None, rate=None)
    # Faster than the envelope says (a warm cache the usage did not report): all of it is prefill.
    split = e.observe(timeline(3, 6.0, 0, 6.01, 7.0), 10_000, slots=None, rate=None)
    assert split is not None and split.queue == 0.0 and split.prefill == pytest.approx(0.01)


def test_estimator_models_are_bounded() -> None:
    e = Estimator()
    for i in range(est.MAX_MODELS * 3):
        e.observe(timeline(i + 1, float(i), 0, i + 0.1, i + 0.2, model=f"m{i}"), 100, slots=None, rate=None)
    assert e.models == est.MAX_MODELS


def test_nothing_to_split_without_a_first_chunk() -> None:
    e = Estimator()
    tl = timeline(1, 0.0, 0, 0.0, 1.0)
    tl.first_content = None
    assert e.observe(tl, 100, slots=2, rate=None) is None
