"""Several telemetry processes, one upstream: the state kept whole per upstream is whole in each of them.

Each request is recorded by one process; what it teaches the estimator and the cache index goes to the others
as lessons. Held here: processes told each other's lessons give every request the figures one process that
saw everything gives; lessons that come late still land in order; the spans the receiver takes go to the
process that recorded their request, as the relay chose it; lessons travel as ``Facts`` and bad ones are
refused without harm.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from llmtap.analysis.cachediag import COLD, HIT, MISS_CHANGED, MISS_EVICTED, CacheDiagnoser
from llmtap.analysis.estimator import Estimator, QueuePrefill
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Route, Settings
from llmtap.telemetry.fleet.siblings import by_process
from llmtap.telemetry.recorder import Recorder
from llmtap.types import PromptRegion
from llmtap.wire.messages import FACTS, Facts, WireError, decode, encode
from llmtap.wire.tape import shard_of
from tests.analysis.test_estimator import timeline

SLOTS = 2


def workload(n: int, seed: int) -> list[Timeline]:
    """``n`` requests to a first-come-first-served server of ``SLOTS`` slots, in bursts, as the relay numbers them;
    returned in the order they end (the order a telemetry process records them)."""
    rng = random.Random(seed)
    free = [0.0] * SLOTS  # when each slot frees
    ends: list[float] = []
    made: list[Timeline] = []
    t = 0.0
    for seq in range(1, n + 1):
        t += rng.choice((0.0, 0.0, 0.001, 0.05, 0.4))  # bursts, then gaps
        ahead = sum(1 for e in ends if e > t)
        slot = min(range(SLOTS), key=lambda i: free[i])
        admitted = max(t, free[slot])
        tokens = rng.randrange(100, 3000)
        first = admitted + 0.01 + tokens / 20000
        end = first + rng.uniform(0.05, 0.3)
        free[slot] = end
        ends.append(end)
        tl = timeline(seq, t, ahead, first, end, model=rng.choice(("m", "n")))
        UNCACHED[id(tl)] = tokens
        made.append(tl)
    return sorted(made, key=lambda tl: tl.end or 0.0)


#: Each synthetic request's uncached input tokens, by the timeline's id.
UNCACHED: dict[int, int] = {}


def observe(e: Estimator, tl: Timeline) -> tuple[int, QueuePrefill | None]:
    """What the summary asks of the estimator for one request (``summary._phases``)."""
    peak = e.decoding_peak(tl)
    return peak, e.observe(tl, UNCACHED[id(tl)], slots=SLOTS, rate=None)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_estimators_told_each_others_lessons_split_every_request_as_one_that_saw_all(seed: int) -> None:
    requests = workload(300, seed)
    whole = Estimator()
    expected = [observe(whole, tl) for tl in requests]
    assert sum(1 for _, split in expected if split is not None and split.method == "slots" and split.queue > 0) > 20
    shards = [Estimator(), Estimator()]
    for e in shards:
        e.learned = []
    got = []
    for tl in requests:
        owner = shards[(tl.upstream_seq or 0) % 2]
        got.append(observe(owner, tl))
        other = shards[1 - shards.index(owner)]
        assert owner.learned
        for lesson in owner.learned:
            other.learn(lesson)
        owner.learned.clear()
    assert [split for _, split in got] == [split for _, split in expected]
    # The decoding peak (a floor under the slots) is taken where each process's own requests began: no higher.
    assert all(peak <= whole_peak for (peak, _), (whole_peak, _) in zip(got, expected, strict=True))
    assert max(peak for peak, _ in got) >= 2
    assert not shards[0].learned and not shards[1].learned  # what is learned is not told again


def test_lessons_that_come_late_land_in_the_order_the_requests_ended() -> None:
    requests = workload(200, 7)
    whole = Estimator()
    for tl in requests:
        observe(whole, tl)
    shards = [Estimator(), Estimator()]
    for e in shards:
        e.learned = []
    held: list[list[Any]] = [[], []]  # each process's lessons, delivered three requests late
    for i, tl in enumerate(requests):
        k = (tl.upstream_seq or 0) % 2
        observe(shards[k], tl)
        held[1 - k].append(list(shards[k].learned or []))
        shards[k].learned.clear()  # type: ignore[union-attr]
        for j in (0, 1):
            if len(held[j]) > 3 or i == len(requests) - 1:
                while held[j] and (len(held[j]) > 3 or i == len(requests) - 1):
                    for lesson in held[j].pop(0):
                        shards[j].learn(lesson)
    for e in shards:
        up, ref = e._upstreams["http://up"], whole._upstreams["http://up"]
        assert list(up.log._ends) == list(ref.log._ends)
        assert list(up.log._decoding) == list(ref.log._decoding)
        assert up.log.decoding_peak <= ref.log.decoding_peak  # taken at this process's own requests only
        assert {m: env.line() for m, env in up.envelopes.items()} == {m: env.line() for m, env in ref.envelopes.items()}


def test_a_full_slot_log_takes_a_late_end_in_place_and_drops_one_older_than_all_it_keeps() -> None:
    from llmtap.analysis.estimator import SlotLog

    log = SlotLog(maxlen=4)
    for sent, end in ((0.1, 1.0), (0.2, 2.0), (0.4, 4.0), (0.5, 5.0)):
        log.add(sent, end)
    log.add(0.3, 3.0)  # late: the oldest goes, the late one takes its place in order
    assert list(log._ends) == [(0.2, 2.0), (0.3, 3.0), (0.4, 4.0), (0.5, 5.0)]
    log.add(0.0, 0.5)  # older than everything kept: nothing to gain from it
    assert list(log._ends) == [(0.2, 2.0), (0.3, 3.0), (0.4, 4.0), (0.5, 5.0)]


def chat(system: str, user: str, sent: float, first: float, cached: int) -> tuple[Timeline, Summary]:
    tl = timeline(1, sent, 0, first, first + 0.1)
    assert tl.request is not None
    tl.request.regions = [
        PromptRegion("system", system),
        PromptRegion("message", {"role": "user", "content": user}),
    ]
    return tl, Summary(input_tokens=2000, cache_read_tokens=cached)


def test_a_prompt_another_process_indexed_is_known_here() -> None:
    routes = [Route(prefix="/", upstream="http://up", name="default", provider="vllm")]
    whole = CacheDiagnoser(routes)
    shards = [CacheDiagnoser(routes), CacheDiagnoser(routes)]
    for d in shards:
        d.learned = []
    system = "Answer about invoices. " * 200
    sequence = [
        chat(system, "first", 0.0, 0.5, 0),
        chat(system, "second", 1.0, 1.2, 960),  # the server read the system prompt from its cache
        chat("Another prompt entirely. " * 200, "third", 2.0, 2.5, 0),
        chat(system, "fourth", 3.0, 3.2, 0),  # sent before, yet nothing read: evicted
    ]
    expected = [whole.diagnose(tl, s) for tl, s in sequence]
    got = []
    for i, (tl, s) in enumerate(sequence):
        d = shards[i % 2]
        got.append(d.diagnose(tl, s))
        for lesson in d.learned or []:
            shards[1 - i % 2].learn(lesson)
        d.learned.clear()  # type: ignore[union-attr]
    assert [g.cache_class for g in got if g] == [e.cache_class for e in expected if e]
    assert [e.cache_class for e in expected if e] == [COLD, HIT, MISS_CHANGED, MISS_EVICTED]
    assert [(g.shared_prefix_tokens, g.expected_prefix_tokens, g.changed_region) for g in got if g] == [
        (e.shared_prefix_tokens, e.expected_prefix_tokens, e.changed_region) for e in expected if e
    ]
    assert got[1] is not None and got[1].shared_prefix_tokens > 700  # process 1 knew process 0's prompt
    with pytest.raises(ValueError):
        shards[0].learn(("prefix", ("not bytes",), 1.0))  # type: ignore[arg-type]


def test_lessons_cross_as_facts_and_a_recorder_refuses_bad_ones_without_harm() -> None:
    lessons = (("ended", "http://up", 3, 1.5), ("prefix", (b"\x00" * 16,), 2.0), ("slots", "http://up", 4, "x", 0.5))
    raw = encode(Facts(lessons))
    assert raw[0] == FACTS and decode(raw) == Facts(lessons)
    for bad in ((FACTS,), (FACTS, [("ended",)]), (FACTS, ((),)), (FACTS, ("ended",))):
        with pytest.raises(WireError):
            decode(bad)
    recorder = Recorder(Settings(routes=(Route(prefix="/", upstream="http://up", name="default"),)))
    try:
        recorder.take(-2, (FACTS, (("ended", "http://up", "x", 1.0), ("nonsense", 1), ("slots", "http://up", 4))))
        assert recorder.unreadable == 3
        recorder.take(-2, raw)
        assert recorder._sibling_slots["http://up"].slots == 4
        assert list(recorder.estimator._upstreams["http://up"].log._ends) == [(3, 1.5)]
    finally:
        recorder.close()


def span(trace: int) -> Span:
    return Span(trace_id=trace.to_bytes(16, "big"), span_id=b"\x01" * 8, name="llm_request")


def test_the_receiver_passes_each_span_to_the_process_the_relay_chose_for_its_request() -> None:
    rng = random.Random(5)
    traces = [rng.getrandbits(128) for _ in range(40)]
    request = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span(t) for t in traces])])]
    )
    for count in (2, 3):
        for index in range(count):
            mine, others = by_process(request, index, count)
            kept = [s.trace_id for rs in mine.resource_spans for ss in rs.scope_spans for s in ss.spans] if mine else []
            assert kept == [t.to_bytes(16, "big") for t in traces if shard_of(t, 0, count) == index]
            for k, (data, n) in others.items():
                export = ExportTraceServiceRequest.FromString(data)
                ids = [s.trace_id for rs in export.resource_spans for ss in rs.scope_spans for s in ss.spans]
                assert k != index and n == len(ids) > 0
                assert all(shard_of(int.from_bytes(i, "big"), 0, count) == k for i in ids)
            assert len(kept) + sum(n for _, n in others.values()) == len(traces)


def test_the_relay_spreads_requests_by_their_trace_ids_high_half() -> None:
    rng = random.Random(9)
    counts = [0, 0, 0]
    for key in range(3000):
        counts[shard_of(rng.getrandbits(128), key, 3)] += 1
    assert min(counts) > 900  # about a third each
    assert shard_of(0, 7, 3) == 1  # no trace (tracing off): the tape's key
    # A ratio sampler keeps low trace ids' low half: the high half still spreads them.
    assert {shard_of((h << 64) | 1, 0, 2) for h in range(4)} == {0, 1}
