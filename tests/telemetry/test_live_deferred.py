"""The live view's cheaper per-request work: a waterfall drawn when read is the one drawn at once, and busy time
looked over for old slots only when some are past the horizon keeps the same slots and seconds."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest

from llmtap.analysis.summary import summarize
from llmtap.analysis.timeline import CANCELLED, ERROR, OK
from llmtap.config.types import SLO
from llmtap.telemetry.admin.live.measures import _EDGE, _TICKS, HORIZON, SLOT, TICK, Busy
from llmtap.telemetry.admin.live.waterfall import draw, facts, waterfall
from llmtap.telemetry.admin.live.window import HISTORY, LiveWindow
from llmtap.types import ServerTiming
from tests.telemetry.test_live import Harness, make_timeline, varied


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(slo=SLO(ttft=0.5, tpot=0.05), traces=True)
    yield h
    h.close()


def test_waterfalls_drawn_when_read_are_those_drawn_at_once(harness: Harness) -> None:
    varied(harness, 60)
    timed = make_timeline(60, timing=ServerTiming(queue=0.1, prefill=0.15))
    timed.admitted = timed.received + 0.011
    harness.run(timed)
    want = [
        waterfall(i + 1, tl, s, route=tl.route, model=(tl.request.model or "") if tl.request else "", trace=True)
        for i, (tl, s) in enumerate(harness.seen)
    ]
    got = harness.window.since(0)
    assert got == want
    assert {p["phase"] for p in got[-1]["phases"]} == {"queue", "unattributed", "prefill", "decode"}
    # Drawn once and kept drawn: a second read gives the same objects.
    assert all(a is b for a, b in zip(harness.window.since(0), got, strict=True))
    assert harness.window.latest() == 61


def test_an_entry_for_another_process_carries_the_waterfall_drawn(harness: Harness) -> None:
    harness.run(make_timeline(0))  # the model is one the recorder's label guard knows
    tl = make_timeline(3, outcome=ERROR)
    s = summarize(tl)
    entry = harness.window.entry(tl, s)
    assert entry is not None
    assert entry[-1] == waterfall(0, tl, s, route="chat", model="m1", trace=True)
    other = LiveWindow(lambda tl, s: ("chat", "m1", ""), slo=True, traces=True)
    other.take(entry)
    harness.window(tl, s)  # the same request, this process's own
    (theirs,) = other.since(0)
    mine = harness.window.since(1)
    assert theirs["id"] == 1 and [r["id"] for r in mine] == [2]
    assert {**theirs, "id": 2} == mine[0]


def test_snapshot_and_history_read_the_drawn_waterfalls(harness: Harness) -> None:
    for i in range(HISTORY + 10):
        harness.run(make_timeline(i, outcome=CANCELLED if i % 9 == 4 else OK, ttft=0.01 * (1 + i % 40)))
    snap = harness.window.snapshot(None)
    (row,) = snap["series"]
    kept = {r["id"]: r for r in harness.window.since(0)}
    assert len(kept) == HISTORY and min(kept) == 11
    for ids in row["slowest"]["ttft"].values():
        assert ids and all(i in kept for i in ids)
        times = [kept[i]["ttft"] for i in ids]
        assert times == sorted(times, reverse=True)


def test_facts_copy_the_chunk_times() -> None:
    tl = make_timeline(1, chunks=3)
    s = summarize(tl)
    f = facts(tl, s, route="chat", model="m1", trace=False)
    before = draw(5, f)
    tl.add_chunk(tl.received + 9.0, 10, "later")
    assert draw(5, f) == before and len(before["ticks"]) == 3


class _Pruned:
    """Busy time as it was kept before: the slots past the horizon looked for at every ``add``."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.ticks = 0

    def add(self, start: float, end: float) -> None:
        first = math.floor(start / TICK + _EDGE)
        last = max(math.ceil(end / TICK - _EDGE), first + 1)
        oldest = (last - 1) // _TICKS - math.ceil(HORIZON / SLOT)
        if first < oldest * _TICKS:
            self.ticks += oldest * _TICKS - first
            first = oldest * _TICKS
        for slot in range(first // _TICKS, (last - 1) // _TICKS + 1):
            base = slot * _TICKS
            lo, hi = max(first, base) - base, min(last, base + _TICKS) - base
            old = self.slots.get(slot, 0)
            new = old | (((1 << (hi - lo)) - 1) << lo)
            self.ticks += new.bit_count() - old.bit_count()
            self.slots[slot] = new
        for k in [k for k in self.slots if k < oldest]:
            del self.slots[k]


@pytest.mark.parametrize("seed", range(6))
def test_busy_time_looked_over_only_past_the_horizon_keeps_the_same_slots(seed: int) -> None:
    rng = random.Random(seed)
    busy, pruned = Busy(), _Pruned()
    now = 100.0
    for _ in range(3000):
        now += rng.expovariate(2.0)
        roll = rng.random()
        if roll < 0.05:
            start = now - rng.uniform(HORIZON, 3 * HORIZON)  # recorded long after it began
        elif roll < 0.08:
            now += rng.uniform(HORIZON / 2, 2 * HORIZON)  # a pause
            start = now
        else:
            start = now - rng.uniform(0.0, 30.0)
        # Most end now; some ended long ago and come late (another process's, a backlog's).
        end = now if rng.random() < 0.9 else start + rng.uniform(0.0, 2.0)
        busy.add(start, end)
        pruned.add(start, end)
        assert busy.slots == pruned.slots and busy.ticks == pruned.ticks
        assert busy.low == min(busy.slots, default=None)
    before = Busy(slots=dict(pruned.slots), ticks=pruned.ticks)
    for since in (None, now - 60.0, now - 900.0, now - 5000.0):
        assert busy.seconds(since) == before.seconds(since)
