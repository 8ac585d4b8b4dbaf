"""The live view: its window counts what ``/metrics`` counts, its percentiles are the exact ones the tables give,
its waterfalls hold no content, ``/events`` streams."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from llmtap import simulator
from llmtap.analysis.stats import quantile
from llmtap.analysis.summary import Summary, summarize
from llmtap.analysis.timeline import CANCELLED, ERROR, OK, Timeline
from llmtap.commands.demo import FIXED_FIRST, VARIABLE_FIRST, default_workloads
from llmtap.config.types import SLO, Route, Settings
from llmtap.telemetry.admin.live import LiveView
from llmtap.telemetry.admin.live.view import embed, recorder_labels
from llmtap.telemetry.admin.live.waterfall import TICK_CAP, waterfall
from llmtap.telemetry.admin.live.window import (
    HISTORY,
    HORIZON,
    SLOT,
    TICK,
    Busy,
    Hist,
    LiveWindow,
    Samples,
    Tally,
    verdict,
)
from llmtap.telemetry.admin.server import AdminApp
from llmtap.telemetry.emit.instruments import DURATION_BUCKETS
from llmtap.telemetry.exposition.prometheus import PrometheusReader
from llmtap.telemetry.recorder import Recorder
from llmtap.types import RequestInfo, ServerTiming, Usage
from tests.conftest import PATIENCE, Running
from tests.support.procs import stop
from tests.telemetry.test_prometheus import samples

WALL = 1_700_000_000_000_000_000
SECRET = "PROMPT-SECRET-7f3a"
ROUTES = (Route(prefix="/", upstream="http://upstream:8000", name="chat"),)


def make_timeline(
    i: int,
    *,
    route: str = "chat",
    model: str = "m1",
    stream: bool = True,
    outcome: str = OK,
    ttft: float = 0.3,
    chunks: int = 5,
    gap: float = 0.02,
    usage: Usage | None = None,
    timing: ServerTiming | None = None,
    t0: float = 1000.0,
) -> Timeline:
    """A chat request received at ``t0`` whose first content chunk comes ``ttft`` later; prompt and text are secret."""
    tl = Timeline(
        method="POST",
        path="/v1/chat/completions",
        route=route,
        upstream="http://upstream:8000",
        server_address="upstream",
        server_port=8000,
        protocol="openai_chat",
        provider_name="vllm",
        received=t0,
        received_wall_ns=WALL + i * 1_000_000_000,
        request=RequestInfo(operation="chat", model=model, stream=stream, prompt_text=f"{SECRET} prompt {i}"),
        body_read=t0 + 0.001,
        admitted=t0 + 0.002,
        sent=t0 + 0.003,
        headers=t0 + 0.01,
        first_byte=t0 + 0.01,
        status_code=200,
    )
    for k in range(chunks):
        tl.add_chunk(t0 + ttft + k * gap, 40, f" {SECRET} word{k}")
    tl.end = t0 + ttft + chunks * gap + 0.001
    tl.usage = (
        usage if usage is not None else Usage(input_tokens=100 + i, output_tokens=chunks * 2, cache_read_tokens=64)
    )
    tl.server_timing = timing
    tl.response_model = model
    tl.response_id = f"chatcmpl-{i}"
    if outcome == ERROR:
        tl.fail("upstream_closed", f"{SECRET} quoted back by the upstream")
    elif outcome == CANCELLED:
        tl.fail("cancelled", cancelled=True)
    return tl


class Harness:
    """A recorder with a real SDK meter provider read by the Prometheus reader, and a live window on it."""

    def __init__(
        self, *, slo: SLO | None = None, clock: Any = time.monotonic, traces: bool = False, budget: int = 1_000_000
    ) -> None:
        self.prometheus = PrometheusReader()
        self.meter_provider = MeterProvider(metric_readers=[self.prometheus], shutdown_on_exit=False)
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        settings = Settings(routes=ROUTES, slo=slo or SLO())
        self.recorder = Recorder(settings, tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)
        self.window = LiveWindow(
            recorder_labels(self.recorder),
            slo=settings.slo.configured,
            traces=traces,
            clock=clock,
            budget=budget,
            on_drop=self.recorder.live_samples_dropped,
        )
        self.seen: list[tuple[Timeline, Summary]] = []
        self.recorder.listeners.extend([self.window, lambda tl, s: self.seen.append((tl, s))])

    def run(self, tl: Timeline) -> None:
        self.recorder.record(tl)

    def close(self) -> None:
        self.recorder.close()
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(slo=SLO(ttft=0.5, tpot=0.05))
    yield h
    h.close()


def varied(h: Harness, n: int = 60) -> None:
    """Streams and unary calls, two routes, two models, errors, cancellations, TTFTs from 5 ms to 1.3 s."""
    for i in range(n):
        h.run(
            make_timeline(
                i,
                route="chat" if i % 4 else "code",
                model="m1" if i % 3 else "m2",
                stream=i % 7 != 0,
                outcome=ERROR if i % 11 == 5 else CANCELLED if i % 13 == 6 else OK,
                ttft=0.005 * (1 + (i * 37) % 260),
                chunks=1 + i % 9,
                gap=0.004 + (i % 5) * 0.01,
            )
        )


def prom_sum(text: str, name: str, route: str, model: str, **labels: str) -> float:
    """The sum of every sample of ``name`` for one route and model (and the given labels)."""
    want = {"llmtap_route": route, "gen_ai_request_model": model, **labels}
    return sum(v for lab, v in samples(text, name) if all(lab.get(k) == x for k, x in want.items()))


def prom_buckets(text: str, name: str, route: str, model: str) -> list[tuple[float, float]]:
    """``sum by (le)`` of one histogram's buckets for one route and model."""
    by_le: dict[float, float] = {}
    for lab, v in samples(text, name + "_bucket"):
        if lab.get("llmtap_route") == route and lab.get("gen_ai_request_model") == model:
            le = float(lab["le"])
            by_le[le] = by_le.get(le, 0.0) + v
    return sorted(by_le.items())


HISTOGRAMS = {
    "ttft": "llmtap_time_to_first_token_seconds",
    "itl": "llmtap_inter_token_latency_seconds",
    "tpot": "llmtap_time_per_output_token_seconds",
    "ttfot": "llmtap_time_to_first_output_token_seconds",
    "ttst": "llmtap_time_to_second_token_seconds",
}


def exact_values(seen: list[tuple[Timeline, Summary]], route: str, model: str, version: str | None = None) -> Any:
    """Each latency's values for one series, under the conditions of its ``llmtap.*`` histogram, from the
    requests' own summaries: TTFT and ITL of streams, TPOT of successful requests."""
    mine = [
        (tl, s)
        for tl, s in seen
        if tl.route == route and tl.request is not None and tl.request.model == model and tl.prompt_version == version
    ]
    streams = [s for tl, s in mine if tl.request is not None and tl.request.stream and s.ttft is not None]
    return {
        "ttft": [s.ttft for s in streams],
        "itl": [x for s in streams for x in s.itl_per_token],
        "tpot": [s.tpot for tl, s in mine if tl.outcome == OK and s.tpot is not None],
        "ttfot": [s.ttfot for s in streams if s.ttfot is not None],
        "ttst": [s.ttst for s in streams if s.ttst is not None],
    }


def test_since_start_counts_what_metrics_count_and_its_percentiles_are_exact(harness: Harness) -> None:
    varied(harness)
    text = harness.prometheus.render()
    snap = harness.window.snapshot(None)
    assert {(s["route"], s["model"]) for s in snap["series"]} == {
        ("chat", "m1"),
        ("chat", "m2"),
        ("code", "m1"),
        ("code", "m2"),
    }
    assert sum(s["requests"] for s in snap["series"]) == 60
    for s in snap["series"]:
        key = (s["route"], s["model"])
        assert s["requests"] == prom_sum(text, "llmtap_requests_total", *key)
        assert s["errors"] == prom_sum(text, "llmtap_requests_total", *key, llmtap_outcome="error")
        assert s["cancelled"] == prom_sum(text, "llmtap_requests_total", *key, llmtap_outcome="cancelled")
        assert s["slo_met"] == prom_sum(text, "llmtap_requests_total", *key, llmtap_slo="met")
        assert s["output_tokens"] == prom_sum(text, "llmtap_usage_output_tokens_total", *key)
        assert s["input_tokens"] == prom_sum(text, "llmtap_usage_input_tokens_total", *key)
        assert s["cache_read_tokens"] == prom_sum(text, "llmtap_usage_cache_read_input_tokens_total", *key)
        values = exact_values(harness.seen, *key)
        for fig, name in HISTOGRAMS.items():
            series = prom_buckets(text, name, *key)
            assert s[fig]["count"] == series[-1][1] == prom_sum(text, name + "_count", *key) == len(values[fig])
            assert s[fig]["sum"] == pytest.approx(prom_sum(text, name + "_sum", *key), rel=1e-12)
            assert s[fig]["exact"] is True
            for q in (0.5, 0.95, 0.99):
                # The requests' own values, read as the demo's tables and ``llmtap compare`` read them: equal.
                assert s[fig][f"p{round(q * 100)}"] == quantile(values[fig], q), (key, fig, q)
        assert s["requests_per_s"] == s["requests"] / snap["seconds"]


def test_percentiles_never_pass_the_largest_value(harness: Harness) -> None:
    # A few fast requests and one slow one: a bucket reading of p99 would interpolate far into the slow one's
    # bucket, past it; the exact p99 lies between the fast ones and it.
    ttfts = [0.126, 0.127, 0.13, 0.14, 0.791, 0.797]
    for i, ttft in enumerate(ttfts):
        harness.run(make_timeline(i, ttft=ttft))
    (s,) = harness.window.snapshot(None)["series"]
    measured = [x.ttft for _, x in harness.seen if x.ttft is not None]
    assert measured == pytest.approx(ttfts)
    for q in (0.5, 0.95, 0.99):
        assert s["ttft"][f"p{round(q * 100)}"] == quantile(measured, q)
    assert quantile(measured, 0.5) == pytest.approx(0.135)
    assert s["ttft"]["p99"] <= max(measured)


def test_prompt_versions_are_series_of_their_own(harness: Harness) -> None:
    for i in range(12):
        tl = make_timeline(i, ttft=0.791 if i % 2 else 0.126)
        tl.prompt_version = "variable-first" if i % 2 else "fixed-first"
        harness.run(tl)
    rows = {s["prompt_version"]: s for s in harness.window.snapshot(None)["series"]}
    assert set(rows) == {"variable-first", "fixed-first"}
    assert rows["variable-first"]["ttft"]["p50"] == pytest.approx(0.791)
    assert rows["fixed-first"]["ttft"]["p50"] == pytest.approx(0.126)
    assert rows["fixed-first"]["requests"] == rows["variable-first"]["requests"] == 6
    # The requests behind a percentile come from the row's own version only.
    kept = {r["id"]: r for r in harness.window.since(0)}
    for version, row in rows.items():
        ids = row["slowest"]["ttft"]["p95"]
        assert ids and {kept[i]["prompt_version"] for i in ids} == {version}


def test_past_the_budget_percentiles_come_from_buckets_marked_and_within_the_values() -> None:
    now = [0.0]
    # Room for 94 latency values; each request below has 1 TTFT, 4 ITL, 1 TPOT, 1 E2E, 1 TTFOT and 1 TTST value
    # (108 in all).
    h = Harness(clock=lambda: now[0], budget=94)
    try:
        for i in range(12):
            now[0] = 10.0 * i
            h.run(make_timeline(i, ttft=0.2 + 0.01 * i, chunks=3, gap=0.01 + 0.003 * i))
        kept = sum(len(x.values) for series in h.window._series.values() for x in series.samples.values())
        assert kept <= 94
        # What went is counted on /metrics.
        text = h.prometheus.render()
        assert sum(v for _, v in samples(text, "llmtap_admin_live_samples_dropped_total")) == 108 - kept
        values = exact_values(h.seen, "chat", "m1")
        (whole,) = h.window.snapshot(None)["series"]
        # The ITL values, the most numerous, gave up their oldest: read from buckets, marked, within the values.
        assert whole["itl"]["exact"] is False and whole["itl"]["count"] == len(values["itl"]) == 48
        for q in ("p50", "p95", "p99"):
            assert min(values["itl"]) <= whole["itl"][q] <= max(values["itl"])
        # TTFT kept every value: exact.
        assert whole["ttft"]["exact"] is True and whole["ttft"]["p50"] == quantile(values["ttft"], 0.5)
        # The last minute (requests 6 to 11) still has every ITL value it counts: exact there.
        (recent,) = h.window.snapshot(60.0)["series"]
        in_window = [x for tl, s in h.seen[6:] for x in s.itl_per_token]
        assert recent["itl"]["count"] == len(in_window) == 24
        assert recent["itl"]["exact"] is True and recent["itl"]["p95"] == quantile(in_window, 0.95)
    finally:
        h.close()


def test_samples_forget_their_oldest_and_know_which_windows_they_still_cover() -> None:
    kept = Samples()

    def ordered(samples: Samples, first: int | None) -> list[float] | None:
        values = samples.since(first)
        return None if values is None else sorted(values)

    for slot, values in ((1, [5.0, 4.0]), (1, [3.0]), (2, [2.0]), (4, [1.0, 0.5])):
        kept.add(slot, values)
    assert ordered(kept, None) == [0.5, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert ordered(kept, 2) == [0.5, 1.0, 2.0] and ordered(kept, 3) == [0.5, 1.0] and ordered(kept, 5) == []
    assert kept.drop_oldest(2) == 2  # two of slot 1's three values
    assert ordered(kept, None) is None and ordered(kept, 1) is None
    assert ordered(kept, 2) == [0.5, 1.0, 2.0]
    assert kept.drop_oldest(2) == 2  # slot 1's last and slot 2's only value
    assert ordered(kept, 2) is None and ordered(kept, 3) == [0.5, 1.0]
    kept.add(4, [9.0])
    assert ordered(kept, 4) == [0.5, 1.0, 9.0]
    assert kept.drop_oldest(10) == 3 and ordered(kept, 5) == [] and ordered(kept, 4) is None


def test_the_window_slides_and_forgets() -> None:
    now = [0.0]
    h = Harness(clock=lambda: now[0])
    try:
        for at in (2.0, 200.0, 880.0):
            now[0] = at
            h.run(make_timeline(int(at)))
        now[0] = 890.0
        counts = {w: sum(s["requests"] for s in h.window.snapshot(w)["series"]) for w in (60.0, 300.0, 900.0, None)}
        assert counts == {60.0: 1, 300.0: 1, 900.0: 3, None: 3}
        # A window covers whole slots up to now; before the first slot of its length it is shorter.
        assert h.window.window_seconds(60.0) == pytest.approx(890.0 - (178 - 12 + 1) * SLOT)
        assert h.window.window_seconds(None) == pytest.approx(890.0)
        now[0] = 5000.0
        h.run(make_timeline(5000))
        assert sum(s["requests"] for s in h.window.snapshot(900.0)["series"]) == 1
        assert sum(s["requests"] for s in h.window.snapshot(None)["series"]) == 4
        # Memory is bounded: slots older than the horizon are gone.
        kept = [len(series.slots) for series in h.window._series.values()]
        assert max(kept) <= HORIZON / SLOT + 1
        assert h.window.snapshot(60.0)["seconds"] == pytest.approx(5000.0 - (1000 - 12 + 1) * SLOT)
    finally:
        h.close()


def test_busy_time_counts_time_in_flight_once() -> None:
    b = Busy()
    b.add(10.0, 11.0)
    b.add(10.5, 12.0)  # overlaps the first: 2 s in flight in all
    b.add(20.0, 20.25)
    assert b.seconds() == pytest.approx(2.25)
    assert b.seconds(since=11.0) == pytest.approx(1.25)
    b.add(24.9, 25.1)  # across a slot's edge
    b.add(30.0, 30.0)  # shorter than a tick: one tick
    assert b.seconds() == pytest.approx(2.25 + 0.2 + TICK)
    # Past the horizon old slots go; the total keeps them.
    b.add(5000.0, 5001.0)
    assert b.seconds() == pytest.approx(3.46)
    assert b.seconds(since=4000.0) == pytest.approx(1.0)
    assert len(b.slots) <= HORIZON / SLOT + 2
    # A request longer than the horizon: counted whole, kept bounded.
    b.add(6000.0, 8000.0)
    assert b.seconds() == pytest.approx(2003.46)
    assert len(b.slots) <= HORIZON / SLOT + 2


def test_busy_rates_hold_while_idle_and_warmups_can_be_left_out() -> None:
    now = [0.0]

    def window(busy: bool) -> LiveWindow:
        return LiveWindow(
            lambda tl, s: (tl.route, "m1", ""),
            slo=False,
            traces=False,
            clock=lambda: now[0],
            busy=busy,
            skip=lambda tl: tl.prompt_version == "warmup",
        )

    # The requests' clock is not the window's: busy time is placed by the least lag seen (here 3000 s).
    now[0] = 4000.0
    busy, plain = window(True), window(False)
    for i in range(8):
        t0 = 1000.0 + (i // 2) * 1.0  # two at a time, a pause between pairs; each in flight 0.401 s
        tl = make_timeline(i, t0=t0)
        tl.prompt_version = "warmup" if i == 0 else "v1"
        now[0] = 4000.0 + (tl.end or 0.0) - 1000.0
        for w in (busy, plain):
            w(tl, summarize(tl))
    # The pairs' busy time at 10 ms ticks: 0.41 s each, four pairs.
    in_flight = 4 * 0.41
    before = busy.snapshot(None)
    (row,) = before["series"]
    assert before["rates"] == "busy" and row["requests"] == 7  # the warm-up is left out
    assert row["rate_seconds"] == pytest.approx(in_flight)
    assert row["requests_per_s"] == pytest.approx(7 / in_flight)
    assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / in_flight)
    ((recent,),) = [busy.snapshot(60.0)["series"]]
    assert recent["rate_seconds"] == pytest.approx(in_flight)
    # Ten idle minutes: the busy rate holds; the window's rate falls.
    falling = plain.snapshot(None)["series"][0]["requests_per_s"]
    now[0] += 600.0
    assert busy.snapshot(None)["series"][0]["requests_per_s"] == pytest.approx(7 / in_flight)
    assert plain.snapshot(None)["series"][0]["requests_per_s"] < falling / 100
    assert plain.snapshot(None)["rates"] == "window"


def test_history_is_bounded_and_resumable(harness: Harness) -> None:
    for i in range(HISTORY + 25):
        harness.run(make_timeline(i))
    kept = harness.window.since(0)
    assert len(kept) == HISTORY
    assert [r["id"] for r in kept] == list(range(26, HISTORY + 26))
    assert [r["id"] for r in harness.window.since(HISTORY + 20)] == [221, 222, 223, 224, 225]


def test_no_content_and_no_error_messages(harness: Harness) -> None:
    varied(harness, 30)
    out = json.dumps([harness.window.since(0), harness.window.snapshot(None)])
    assert SECRET not in out
    assert "word0" not in out


def test_waterfall_places_each_phase_where_it_happened() -> None:
    # The server says it queued the request 100 ms and read the prompt in 150 ms.
    tl = make_timeline(1, ttft=0.3, chunks=4, gap=0.05, timing=ServerTiming(queue=0.1, prefill=0.15))
    tl.admitted = tl.received + 0.011  # 10 ms in the proxy's own admission queue
    s = summarize(tl)
    r = waterfall(7, tl, s, route="chat", model="m1", trace=False)
    phases = {(p["phase"], p["class"]): p for p in r["phases"]}
    assert set(phases) == {
        ("queue", "measured"),
        ("queue", "server"),
        ("unattributed", "unattributed"),
        ("prefill", "server"),
        ("decode", "measured"),
    }
    own = phases[("queue", "measured")]
    assert (own["start"], own["length"]) == (pytest.approx(1.0), pytest.approx(10.0))
    upstream = phases[("queue", "server")]
    assert (upstream["start"], upstream["length"]) == (pytest.approx(3.0), pytest.approx(100.0))
    # Sent at 3 ms, the first token at 300 ms: of the upstream's 297 ms, the server's queue and prefill account
    # for 250; the other 47 ms are a part of their own between them, in neither.
    gap = phases[("unattributed", "unattributed")]
    assert (gap["start"], gap["length"], gap["source"]) == (pytest.approx(103.0), pytest.approx(47.0), "server")
    assert r["upstream_unattributed"] == pytest.approx(47.0)
    prefill = phases[("prefill", "server")]
    assert (prefill["start"], prefill["length"]) == (pytest.approx(150.0), pytest.approx(150.0))
    decode = phases[("decode", "measured")]
    assert (decode["start"], decode["length"]) == (pytest.approx(300.0), pytest.approx(150.0))
    assert r["ticks"] == pytest.approx([300.0, 350.0, 400.0, 450.0])
    assert r["trace_id"] is None and r["ttft"] == pytest.approx(300.0)

    # Nothing reported: the proxy measured prefill as request sent to first token.
    plain = make_timeline(2, ttft=0.25)
    (prefill,) = [
        p
        for p in waterfall(8, plain, summarize(plain), route="c", model="m", trace=True)["phases"]
        if p["phase"] == "prefill"
    ]
    assert (prefill["class"], prefill["source"], prefill["start"]) == ("measured", "upstream_ttft", pytest.approx(3.0))


def test_ticks_are_capped() -> None:
    tl = make_timeline(1, chunks=TICK_CAP + 50, gap=0.001)
    r = waterfall(1, tl, summarize(tl), route="c", model="m", trace=False)
    assert r["chunks"] == TICK_CAP + 50 and len(r["ticks"]) == TICK_CAP


def test_trace_ids_only_with_a_tracing_backend() -> None:
    for traces in (False, True):
        h = Harness(traces=traces)
        try:
            tl = make_timeline(1)
            h.run(tl)
            (r,) = h.window.since(0)
            assert tl.trace_id is not None
            assert r["trace_id"] == (tl.trace_id if traces else None)
        finally:
            h.close()


def test_buckets_match_the_sdk() -> None:
    # A value on a boundary falls in that boundary's bucket (le), as the SDK and Prometheus count it.
    from llmtap.telemetry.admin.live.window import Hist

    h = Hist()
    for v in (DURATION_BUCKETS[0], DURATION_BUCKETS[10], DURATION_BUCKETS[10] * 1.0001, 1e6):
        h.add(v)
    assert h.counts == {0: 1, 10: 1, 11: 1, len(DURATION_BUCKETS): 1}
    assert h.quantile(1.0) == DURATION_BUCKETS[-1]


# --- over real sockets ------------------------------------------------------------------------


def sse(lines: Iterator[str]) -> Iterator[tuple[str, str, str | None]]:
    """(event, data, id) for each server-sent event."""
    kind, eid = "message", None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield kind, "\n".join(data), eid
            kind, data, eid = "message", [], None
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            kind = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            eid = value


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    background = simulator.run_in_thread(simulator.get_profile("fast"))
    yield background.url
    background.stop()


@pytest.fixture
def live(proxy_factory: Any, sim: str) -> Running:
    routes = (Route(prefix="/", upstream=sim, name="sim", provider="vllm"),)
    return proxy_factory(Settings(routes=routes, slo=SLO(ttft=1.0)), admin=True)  # type: ignore[no-any-return]


def chat(url: str, n: int = 4) -> str:
    """One streamed chat request through the proxy; returns its response id."""
    body = {"model": "llmtap-sim", "stream": True, "max_tokens": n, "messages": [{"role": "user", "content": SECRET}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as r:
        raw = b"".join(r.iter_raw())
    match = re.search(rb'"id":\s*"([^"]+)"', raw)
    assert match is not None
    return match.group(1).decode()


def test_page_and_assets(live: Running) -> None:
    assert live.admin is not None
    base = live.admin.url
    page = httpx.get(base + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    for path, kind in (("/live.js", "text/javascript"), ("/live.css", "text/css")):
        r = httpx.get(base + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
    assert httpx.post(base + "/", content=b"x").status_code == 405
    assert httpx.get(base + "/live.json").status_code == 404
    assert httpx.get(base + "/metrics").status_code == 200


def initial(page: str) -> dict[str, Any]:
    """The first data a page carries in its ``#initial`` block."""
    match = re.search(r'<script id="initial" type="application/json">(.*?)</script>', page, re.DOTALL)
    assert match is not None
    data: dict[str, Any] = json.loads(match.group(1))
    return data


def test_page_carries_its_first_data(live: Running) -> None:
    assert live.admin is not None
    rid = chat(live.url)
    live.flush()
    first = initial(httpx.get(live.admin.url + "/?window=all").text)
    # What a stream would send first: hello, the kept requests, a snapshot of the asked window.
    assert first["hello"]["window"] == "all" and first["hello"]["slo"] is True
    assert [r["response_id"] for r in first["requests"]] == [rid]
    (series,) = first["snapshot"]["series"]
    assert (series["route"], series["requests"], series["slo_met"]) == ("sim", 1, 1)
    assert first["snapshot"]["last"] == first["requests"][-1]["id"]
    assert initial(httpx.get(live.admin.url + "/").text)["hello"]["window"] == "5m"


def test_embedded_data_cannot_close_its_block() -> None:
    hostile = {"model": "</script><script>alert(1)</script>", "note": "a & b > c"}
    text = embed(hostile).decode()
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == hostile


def test_assets_name_no_other_host() -> None:
    static = resources.files("llmtap.telemetry.admin.live").joinpath("static")
    for name in ("index.html", "live.js", "live.css"):
        text = static.joinpath(name).read_text()
        # The SVG namespace is a name, not an address the browser fetches.
        text = text.replace('"http://www.w3.org/2000/svg"', "")
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}|@import", text, re.IGNORECASE), name


def test_events_stream_requests_as_they_finish(live: Running) -> None:
    assert live.admin is not None
    events = f"{live.admin.url}/events?window=all"
    with httpx.stream("GET", events, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        stream = sse(r.iter_lines())
        kind, data, _ = next(stream)
        assert kind == "hello" and json.loads(data)["window"] == "all"
        kind, data, _ = next(stream)
        assert kind == "snapshot" and json.loads(data)["series"] == []
        done = time.monotonic()
        rid = chat(live.url)
        for kind, data, eid in stream:
            if kind == "requests":
                (rec,) = json.loads(data)
                assert time.monotonic() - done < 2.0
                assert rec["response_id"] == rid and eid == str(rec["id"])
                break
        kind, data, _ = next(stream)
        assert kind == "snapshot"
        (series,) = json.loads(data)["series"]
        assert (series["route"], series["model"], series["requests"], series["slo_met"]) == ("sim", "llmtap-sim", 1, 1)
        first = rec["id"]
    chat(live.url)
    live.flush()
    # A reconnecting browser sends the last id it saw and gets only what came after.
    with httpx.stream("GET", events, headers={"last-event-id": str(first)}, timeout=10) as r:
        for kind, data, _ in sse(r.iter_lines()):
            if kind == "requests":
                assert [x["id"] for x in json.loads(data)] == [first + 1]
                break


def view_of(running: Running) -> LiveView:
    """The live view served on a running proxy's admin listener."""
    assert running.admin is not None
    app = running.admin.server.config.app
    assert isinstance(app, AdminApp)
    return app.live


def test_close_ends_open_streams(live: Running) -> None:
    admin = live.admin
    assert admin is not None
    view = view_of(live)
    opened = threading.Event()
    ended: list[float] = []

    def read() -> None:
        with httpx.stream("GET", f"{admin.url}/events", timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("event: snapshot"):
                    opened.set()
        ended.append(time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    assert opened.wait(PATIENCE)
    closed = time.monotonic()
    view.close()
    reader.join(5)
    assert ended and ended[0] - closed < 1.5


def test_listener_runs_on_the_recorder_thread(live: Running) -> None:
    window = view_of(live).window
    threads: list[str] = []

    def spy(tl: Timeline, s: Any) -> None:
        threads.append(threading.current_thread().name)

    listeners = live.recorder.listeners
    listeners.insert(listeners.index(window), spy)
    chat(live.url)
    live.flush()
    assert threads == ["llmtap-recorder"]
    assert [r["response_id"] for r in window.since(0)] != []


def test_demo_serve_keeps_the_view_up_until_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmtap", "demo", "--serve", "--workload", "code", "--requests", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert proc.stdout is not None
        view = next(line.split()[-1] for line in proc.stdout if line.startswith("Live view:"))
        base = view.split("/?")[0]
        page = httpx.get(view).text
        assert "llmtap" in page
        # The page agrees with the tables: the workload's objective, no warm-up, rates over busy time.
        first = initial(page)
        (code,) = [w for w in default_workloads(1) if w.route == "code"]
        assert first["hello"]["slo"] is True and first["snapshot"]["rates"] == "busy"
        objective = {"ttft": code.slo.ttft, "tpot": code.slo.tpot, "percentile": code.slo.percentile}
        # One series per prompt layout, as the tables split them.
        rows = {s["prompt_version"]: s for s in first["snapshot"]["series"]}
        assert set(rows) == {VARIABLE_FIRST, FIXED_FIRST}
        for series in rows.values():
            assert (series["route"], series["shape"], series["objective"]) == ("code", code.slo.shape, objective)
            assert series["requests"] == 1
            assert 0 < series["rate_seconds"] < first["snapshot"]["seconds"]
        assert {r["prompt_version"] for r in first["requests"]} == {VARIABLE_FIRST, FIXED_FIRST}
        assert "llmtap_requests_total{" in httpx.get(base + "/metrics").text
        with httpx.stream("GET", base + "/events?window=all", timeout=10) as r:
            kinds = [kind for kind, _, _ in itertools.islice(sse(r.iter_lines()), 3)]
            assert kinds == ["hello", "requests", "snapshot"]
            # Ctrl-C while a browser holds an event stream open: the demo still stops at once.
            stopped = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(PATIENCE) == 0
        assert time.monotonic() - stopped < 5
    finally:
        stop(proc, grace=0)


def test_a_histogram_takes_many_values_as_it_takes_each() -> None:
    import random

    rng = random.Random(4)
    values = [rng.lognormvariate(-3, 1.5) for _ in range(500)] + [0.0, 1e-9, 100.0]
    one, many = Hist(), Hist()
    for value in values:
        one.add(value)
    many.add_many(values[:250])
    many.add_many([])
    many.add_many(values[250:])
    assert (many.counts, many.count, many.total, many.low, many.high) == (
        one.counts,
        one.count,
        one.total,
        one.low,
        one.high,
    )


def test_a_verdict_that_waits_says_how_many_requests_it_needs() -> None:
    """As ``llmtap slo`` says "18 of 20 requests": each check carries its count and what its percentile needs."""
    tally = Tally()
    for v in (0.01, 0.02, 0.03):
        tally.ttft.add(v)
    waiting = verdict(tally, SLO(ttft=0.5, percentile=0.99), {"ttft": [0.01, 0.02, 0.03]})
    assert waiting is not None and waiting["verdict"] == "insufficient"
    (check,) = waiting["checks"]
    assert (check["count"], check["needed"]) == (3, 100)
    for v in [0.01] * 17:
        tally.ttft.add(v)
    judged = verdict(tally, SLO(ttft=0.5, percentile=0.95), {"ttft": None})
    assert judged is not None and judged["checks"][0] == judged["checks"][0] | {"count": 20, "needed": 20}
    assert judged["verdict"] == "met"


def test_objectives_on_the_first_answer_token_and_the_second_token_are_judged_on_the_page() -> None:
    """Every figure an objective can bound is tallied, so a TTFOT or TTST objective gets a verdict as TTFT does."""
    tally = Tally()
    for v in [0.1] * 19 + [0.9]:
        tally.ttfot.add(v)
        tally.ttst.add(v / 2)
    objective = SLO(ttfot=0.5, ttst=0.3, percentile=0.95)
    judged = verdict(tally, objective, {"ttfot": None, "ttst": None})
    assert judged is not None
    assert {c["figure"]: c["verdict"] for c in judged["checks"]} == {"ttfot": "met", "ttst": "met"}
    missed = verdict(tally, SLO(ttfot=0.05, percentile=0.95), {"ttfot": [0.1] * 19 + [0.9]})
    assert missed is not None and missed["verdict"] == "missed" and missed["checks"][0]["value"] > 0.05


def test_a_series_judges_by_its_newest_requests_objective_whatever_came_before() -> None:
    """The objective a series shows is the newest request's, made once per change: the same again, another, none,
    and 1 against 1.0 (equal in Python, not on the page)."""
    window = LiveWindow(lambda tl, s: (tl.route, "m1", ""), slo=True, traces=False)
    objectives: list[tuple[Any, ...] | None] = [
        (0.5, None, None, 0.9, "other", None, None),
        (0.5, None, None, 0.9, "other", None, None),
        (1, None, None, 0.9, "other", None, None),
        (1.0, None, None, 0.9, "other", None, None),
        None,
        (None, 0.05, 2.0, 0.99, "other", 0.3, None),
        (None, 0.05, 2.0, 0.99, "other", 0.3, None),
    ]
    for i, objective in enumerate(objectives):
        tl = make_timeline(i)
        entry = window.entry(tl, summarize(tl))
        assert entry is not None
        window.take((entry[0], objective, *entry[2:]))
        (row,) = window.snapshot(None)["series"]
        goal = None if objective is None else SLO(*objective)
        wanted = None if goal is None else {**goal.limits(), "percentile": goal.percentile}
        assert repr(row["objective"]) == repr(wanted)
        assert row["requests"] == i + 1
