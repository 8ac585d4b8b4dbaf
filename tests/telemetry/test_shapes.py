"""Request shapes, objectives per route and shape, ``llmtap slo``, and exemplars from a bucket to its trace.

The end-to-end checks drive the demo's two workloads (``llmtap.commands.demo.default_workloads``: the course's support
assistant, 6,200-token prompts and 300-token answers, and its code completion, 200-token prompts) through
the proxy in front of the simulator, and read what came out: spans, metrics, records, the live view, and
on the real tier a real Prometheus with exemplar storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from llmtap import cli, simulator
from llmtap.analysis import shapes
from llmtap.analysis.slo import INSUFFICIENT, MET, MISSED, UNCERTAIN, judge
from llmtap.analysis.stats import Distribution
from llmtap.commands.demo import FIXED_FIRST, Workload, default_workloads
from llmtap.commands.demo_workloads import messages as _messages
from llmtap.config.load import build
from llmtap.config.types import DEFAULT_SHAPES, SLO, ConfigError, Records, Route, Settings, Shape
from llmtap.serve.local import in_process
from llmtap.simulator.text import Vocabulary
from llmtap.store.files import ReadStats, read_records as read_record_lines
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.admin.live.window import SLOWEST
from llmtap.telemetry.admin.server import AdminApp
from llmtap.telemetry.emit.bulk import Batch
from llmtap.telemetry.emit.instruments import create
from llmtap.telemetry.emit.metrics import _record_samples
from llmtap.telemetry.exposition.prometheus import PrometheusReader, wants_openmetrics
from tests.conftest import PATIENCE, ServerThread, require_real

# -- shapes and objectives from the configuration -------------------------------------------------


def config(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "llmtap.yaml"
    path.write_text(text)
    return build({"config": str(path)}, env={})


def test_default_shapes_split_the_course_workloads() -> None:
    support, code = default_workloads()
    prompt = support.fixed_tokens + support.variable_tokens
    assert shapes.classify(DEFAULT_SHAPES, prompt, support.output_tokens) == "long_prompt"
    assert shapes.classify(DEFAULT_SHAPES, code.fixed_tokens + code.variable_tokens, code.output_tokens) == (
        "short_prompt"
    )
    # Neither class: a short prompt with a long answer, a prompt between the two, an unknown input.
    assert shapes.classify(DEFAULT_SHAPES, 200, 4000) == "other"
    assert shapes.classify(DEFAULT_SHAPES, 1500, 10) == "other"
    assert shapes.classify(DEFAULT_SHAPES, None, 10) == "other"
    # A request that failed before any output: its output counts as none.
    assert shapes.classify(DEFAULT_SHAPES, 6200, None) == "long_prompt"
    assert shapes.names(DEFAULT_SHAPES) == ("long_prompt", "short_prompt", "other")


def test_shapes_and_route_objectives_from_the_file(tmp_path: Path) -> None:
    s = config(
        tmp_path,
        """
shapes:
  chat: {min_input_tokens: 1000, max_output_tokens: 1000}
  autocomplete: {max_input_tokens: 999}
slo: {ttft_ms: 2000}
routes:
  - prefix: /support
    upstream: http://127.0.0.1:9
    slo:
      - {shape: chat, percentile: 95, ttft_ms: 800}
      - {percentile: p90, e2e_ms: 9000}
  - prefix: /code
    upstream: http://127.0.0.1:9
    slo: {shape: autocomplete, percentile: 0.99, ttft_ms: 60, tpot_ms: 15}
""",
    )
    assert s.shapes == (
        Shape("chat", min_input_tokens=1000, max_output_tokens=1000),
        Shape("autocomplete", max_input_tokens=999),
    )
    routes = {r.name: r for r in s.routes}
    assert routes["support"].slo == (
        SLO(ttft=0.8, percentile=0.95, shape="chat"),
        SLO(e2e=9.0, percentile=0.9, shape=None),
    )
    assert routes["code"].slo == (SLO(ttft=0.06, tpot=0.015, percentile=0.99, shape="autocomplete"),)
    # The route's objective for the shape, then its objective for every shape, then the global one.
    assert shapes.objective(routes["support"], "chat", s.slo) == routes["support"].slo[0]
    assert shapes.objective(routes["support"], "other", s.slo) == routes["support"].slo[1]
    assert shapes.objective(routes["code"], "chat", s.slo) == s.slo == SLO(ttft=2.0)
    assert shapes.objective(None, "chat", SLO()) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("shapes: [a, b]", "shapes: expected a mapping"),
        ("shapes: {other: {}}", "not a class name"),
        ("shapes: {Big: {}}", "not a class name"),
        ("shapes: {a: {max_tokens: 3}}", "unknown key 'max_tokens'"),
        ("shapes: {a: {min_input_tokens: 9, max_input_tokens: 3}}", "min_input_tokens 9 is above"),
        ("shapes: {a: {min_input_tokens: -1}}", "expected an integer >= 0"),
        ("shapes: {" + ", ".join(f"s{i}: {{}}" for i in range(17)) + "}", "at most 16 classes"),
        ("routes: [{prefix: /, upstream: 'http://h:1', slo: {shape: long_prompt}}]", "at least one of ttft_ms"),
        ("routes: [{prefix: /, upstream: 'http://h:1', slo: {ttft_ms: 5, percentile: 100}}]", "a percentile"),
        ("routes: [{prefix: /, upstream: 'http://h:1', slo: {ttft_ms: 5, pct: 95}}]", "unknown key 'pct'"),
        ("routes: [{prefix: /, upstream: 'http://h:1', slo: {shape: nope, ttft_ms: 5}}]", "shape 'nope' is not"),
        ("routes: [{prefix: /, upstream: 'http://h:1', slo: 5}]", "expected an objective or a list of them"),
    ],
)
def test_bad_shapes_and_objectives_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    if not text.startswith("routes"):
        text += "\nupstream: http://127.0.0.1:9"
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, text)


# -- the verdict -----------------------------------------------------------------------------------


def test_a_verdict_rests_on_the_percentiles_interval() -> None:
    rng = random.Random(3)
    fast = Distribution([rng.uniform(0.10, 0.20) for _ in range(200)])
    assert shapes.needed(0.95) == 20 and shapes.needed(0.99) == 100 and shapes.needed(0.5) == 3
    assert judge("ttft", fast, 0.95, 0.5, rng, 500).verdict == MET
    assert judge("ttft", fast, 0.95, 0.05, rng, 500).verdict == MISSED
    # The limit inside the p95's interval: more requests would tell.
    check = judge("ttft", fast, 0.95, 0.195, rng, 500)
    assert check.estimate is not None and check.estimate.low <= 0.195 <= check.estimate.high
    assert check.verdict == UNCERTAIN
    # 50 requests cannot tell a p99: none of them lies past it.
    few = Distribution([0.1] * 50)
    assert judge("ttft", few, 0.99, 1.0, rng, 500).verdict == INSUFFICIENT
    assert judge("ttft", Distribution(), 0.99, 1.0, rng, 500).estimate is None


# -- exemplars on /metrics -------------------------------------------------------------------------


def test_openmetrics_carries_each_buckets_exemplar() -> None:
    reader = PrometheusReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        ins = create(provider.get_meter("llmtap-test"), latest=False)
        attrs = {sc.ROUTE: "support", sc.SHAPE: "long_prompt"}
        ids = []
        for i, value in enumerate((0.12, 0.125, 0.9)):
            trace_id, span_id = 0xABC0 + i, 0x10 + i
            ctx = set_span_in_context(NonRecordingSpan(SpanContext(trace_id, span_id, False, TraceFlags(1))))
            ins.ttft.record(value, attrs, context=ctx)
            ids.append(f"{trace_id:032x}")
        # Not sampled: no exemplar (the SDK's trace-based filter).
        unsampled = SpanContext(0xDEAD, 0xBEEF, False, TraceFlags(0))
        ins.ttft.record(5.0, attrs, context=set_span_in_context(NonRecordingSpan(unsampled)))
        ins.requests.add(1, attrs)
        text = reader.render(openmetrics=True)
        plain = reader.render()
    finally:
        provider.shutdown()
    assert text.endswith("# EOF\n") and "# EOF" not in plain and " # {" not in plain
    marked = [line for line in text.splitlines() if " # {" in line]
    assert all(line.startswith("llmtap_time_to_first_token_seconds_bucket{") for line in marked)
    by_trace = {line.split('trace_id="')[1][:32]: line for line in marked}
    # 0.12 and 0.125 share a bucket (2^(1/8) apart): the newer one stays; 0.9 has its own.
    assert set(by_trace) == {ids[1], ids[2]}
    slowest = by_trace[ids[2]]
    assert slowest.split(" # ")[1].startswith(f'{{trace_id="{ids[2]}",span_id="{0x12:016x}"}} 0.9 ')
    assert 'llmtap_request_shape="long_prompt"' in slowest
    # OpenMetrics names a counter's family without _total; its samples keep it.
    assert "# TYPE llmtap_requests counter" in text and "\nllmtap_requests_total{" in text
    assert "# TYPE llmtap_requests_total counter" in plain


def test_per_token_samples_link_only_the_slowest_to_the_request() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        ins = create(provider.get_meter("llmtap-test"), latest=False)
        ctx = set_span_in_context(NonRecordingSpan(SpanContext(0xF00D, 0x1, False, TraceFlags(1))))
        _record_samples(Batch(), ins.itl, [0.01, 0.5, 0.02, 0.011], {sc.ROUTE: "r"}, ctx)
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    assert data is not None
    (point,) = [
        p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points
    ]
    assert getattr(point, "count", 0) == 4
    assert [(e.value, e.trace_id) for e in point.exemplars] == [(0.5, 0xF00D)]


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        # Prometheus 2.42's own scrape header.
        (
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
            "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
            True,
        ),
        ("text/plain;version=0.0.4", False),
        ("", False),
        ("*/*", False),
        ("application/openmetrics-text;q=0", False),
        ("text/plain;q=1, application/openmetrics-text;q=0.5", False),
    ],
)
def test_openmetrics_when_the_scraper_asks(accept: str, expected: bool) -> None:
    assert wants_openmetrics(accept) is expected


# -- the course's two workloads through the proxy in front of the simulator ------------------------

#: Requests per workload: enough for each objective's percentile (p95: 20, p99: 100).
SUPPORT_REQUESTS, CODE_REQUESTS = 24, 100


@dataclass
class Course:
    """The proxy (with its admin listener) in front of two simulators, after the two workloads ran."""

    url: str
    admin: str
    records: Path
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    app: Any
    admin_app: AdminApp
    workloads: dict[str, Workload]
    profiles: dict[str, simulator.Profile]


def workloads() -> dict[str, Workload]:
    """The demo's workloads with the course's objectives, their limits set where the simulator's timing puts
    the verdict beyond doubt: support's p95 TTFT within 10 times its cold prefill (met); code's p99 TTFT
    under half the simulator's fixed prefill cost, which no request can beat (missed)."""
    support, code = default_workloads()
    sp, cp = simulator.get_profile("support"), simulator.get_profile("code")
    cold = sp.prefill_base_s + (support.fixed_tokens + support.variable_tokens) / sp.prefill_tokens_per_s
    return {
        "support": replace(
            support,
            requests=SUPPORT_REQUESTS,
            concurrency=6,
            slo=replace(support.slo, ttft=10 * cold, tpot=None),
        ),
        "code": replace(
            code, requests=CODE_REQUESTS, concurrency=10, slo=replace(code.slo, ttft=cp.prefill_base_s / 2, tpot=None)
        ),
    }


def profiles() -> dict[str, simulator.Profile]:
    # Decode sped up (prompt and answer sizes, and so the shapes, stay the course's): the run takes seconds.
    return {
        "support": simulator.get_profile("support", decode_s_per_token=0.001),
        "code": simulator.get_profile("code", decode_s_per_token=0.001),
    }


async def drive(base: str, w: Workload, vocab: Vocabulary) -> None:
    """The workload's requests at its concurrency, its unchanging prompt part first (the course's layout)."""
    sem = asyncio.Semaphore(w.concurrency)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> None:
            body = {
                "model": "llmtap-sim",
                "messages": _messages(w, FIXED_FIRST, i, vocab),
                "max_tokens": w.output_tokens,
                "stream": True,
            }
            async with sem, client.stream("POST", f"{base}/{w.route}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_raw():
                    pass

        await asyncio.gather(*(one(i) for i in range(w.requests)))


@contextlib.contextmanager
def running_course(tmp: Path) -> Iterator[Course]:
    """Both simulators, the proxy (routes judged by the workloads' objectives, records on) and its admin
    listener with the live view; the two workloads driven through it."""
    ws, ps = workloads(), profiles()
    sims = {name: simulator.run_in_thread(p) for name, p in ps.items()}
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    prometheus = PrometheusReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider(metric_readers=[reader, prometheus])
    routes = tuple(
        Route(
            prefix=f"/{w.route}",
            upstream=sims[name].url,
            name=w.route,
            provider="llmtap-sim",
            strip_prefix=True,
            server_slots=ps[name].max_num_seqs,
            slo=(w.slo,),
        )
        for name, w in ws.items()
    )
    records = tmp / "records"
    settings = Settings(routes=routes, log_level="warning", record=Records(path=str(records)))
    local = in_process(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    app = local.app
    threads: list[ServerThread] = []
    try:
        proxy = ServerThread(app).__enter__()
        threads.append(proxy)
        # Trace ids lead somewhere here (the in-memory exporter): the waterfalls carry them.
        admin_app = AdminApp(local, prometheus, traces=True)
        admin = ServerThread(admin_app).__enter__()
        threads.append(admin)
        vocab = Vocabulary("o200k_base")
        for w in ws.values():
            asyncio.run(drive(proxy.url, w, vocab))
        assert app.flush(30)
        yield Course(proxy.url, admin.url, records, spans, reader, app, admin_app, ws, ps)
    finally:
        for t in reversed(threads):
            t.__exit__(None, None, None)
        for sim in sims.values():
            sim.stop()
        tracer_provider.shutdown()
        meter_provider.shutdown()


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Course]:
    with running_course(tmp_path_factory.mktemp("course")) as c:
        yield c


def read_records(path: Path) -> list[dict[str, Any]]:
    stats = ReadStats()
    out = list(read_record_lines(path, stats))
    assert stats.skipped == 0, stats
    return out


@pytest.mark.e2e
def test_the_shapes_split_the_two_workloads_as_the_course_does(course: Course) -> None:
    records = read_records(course.records)
    by_route: dict[str, set[str]] = {}
    for rec in records:
        by_route.setdefault(rec["route"], set()).add(rec["shape"])
    assert by_route == {"support": {"long_prompt"}, "code": {"short_prompt"}}
    support = [r for r in records if r["route"] == "support"]
    # The shape follows the simulator's own token counts (usage): ~6,200 in and 300 out.
    assert all(r["tokens"]["input"] >= 6000 and r["tokens"]["output"] == 300 for r in support)
    # Each record carries the objective it was judged by.
    goal = {"shape": "long_prompt", "percentile": 0.95, "ttft": course.workloads["support"].slo.ttft}
    assert all(r["objective"] == goal for r in support)
    roots = [s for s in course.spans.get_finished_spans() if s.name.startswith("chat")]
    assert len(roots) == SUPPORT_REQUESTS + CODE_REQUESTS == len(records)
    shaped: dict[Any, set[Any]] = {(s.attributes or {})[sc.ROUTE]: set() for s in roots}
    for s in roots:
        shaped[(s.attributes or {})[sc.ROUTE]].add((s.attributes or {})[sc.SHAPE])
    assert shaped == {"support": {"long_prompt"}, "code": {"short_prompt"}}
    # On the latency metrics, a bounded attribute: one TTFT series per route and shape here.
    data = course.reader.get_metrics_data()
    assert data is not None
    points = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == sc.METRIC_TTFT
        for p in m.data.data_points
    ]
    counts = [((p.attributes or {})[sc.ROUTE], (p.attributes or {})[sc.SHAPE], getattr(p, "count", 0)) for p in points]
    assert sorted(counts) == [
        ("code", "short_prompt", CODE_REQUESTS),
        ("support", "long_prompt", SUPPORT_REQUESTS),
    ]


@pytest.mark.e2e
def test_each_shape_gets_its_verdict(course: Course, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["slo", str(course.records), "--json", "--resamples", "500"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = {(v["route"], v["shape"]): v for v in report["verdicts"]}
    assert set(got) == {("support", "long_prompt"), ("code", "short_prompt")}
    support, code = got["support", "long_prompt"], got["code", "short_prompt"]
    assert [(c["figure"], c["percentile"]) for c in support["checks"]] == [("ttft", 0.95)]
    assert [(c["figure"], c["percentile"]) for c in code["checks"]] == [("ttft", 0.99)]
    records = read_records(course.records)
    for v, route in ((support, "support"), (code, "code")):
        ttfts = sorted(r["ttft"] for r in records if r["route"] == route)
        check = v["checks"][0]
        assert check["requests"] == len(ttfts) == v["requests"]
        low, value, high = check["estimate"]["low"], check["estimate"]["value"], check["estimate"]["high"]
        assert ttfts[0] <= low <= value <= high <= ttfts[-1]
        # Goodput counts the requests the proxy judged met, against the same objective.
        assert v["met"] == sum(r["slo"] == "met" for r in records if r["route"] == route)
    assert support["verdict"] == MET and support["met"] == SUPPORT_REQUESTS
    assert support["checks"][0]["estimate"]["high"] <= course.workloads["support"].slo.ttft
    assert code["verdict"] == MISSED and code["met"] == 0 and code["goodput_per_s"] == 0
    assert code["checks"][0]["estimate"]["low"] > course.profiles["code"].prefill_base_s / 2
    # With --check, a missed objective is exit code 1; the table names each verdict.
    assert cli.main(["slo", str(course.records), "--check", "--resamples", "200"]) == 1
    text = capsys.readouterr().out
    assert "p95 TTFT <= " in text and "p99 TTFT <= 2 ms" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith(("support", "code"))}
    assert lines["support"].endswith(MET) and lines["code"].endswith(MISSED)
    # One shape only: --shape.
    assert cli.main(["slo", str(course.records), "--json", "--shape", "short_prompt", "--resamples", "200"]) == 0
    assert [v["route"] for v in json.loads(capsys.readouterr().out)["verdicts"]] == ["code"]


@pytest.mark.e2e
def test_compare_splits_by_shape_and_judges_each_side(course: Course, capsys: pytest.CaptureFixture[str]) -> None:
    records = read_records(course.records)
    middle = sorted(r["time"] for r in records if r["route"] == "code")[CODE_REQUESTS // 2]
    args = ["compare", str(course.records), "--shape", "short_prompt", "--split-at", middle, "--json"]
    assert cli.main([*args, "--resamples", "200"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["before"]["requests"] + data["after"]["requests"] == CODE_REQUESTS
    verdicts = data["slo"]
    assert set(verdicts) == {"before", "after"}
    for side in ("before", "after"):
        # Half the requests each: too few for a p99 (100 needed), and the verdict says so rather than guess.
        assert [(v["route"], v["shape"], v["verdict"]) for v in verdicts[side]] == [
            ("code", "short_prompt", INSUFFICIENT)
        ]
        assert verdicts[side][0]["checks"][0]["requests"] == data[side]["ttft_requests"]
        assert verdicts[side][0]["requests"] == data[side]["requests"]


@pytest.mark.e2e
def test_the_live_view_splits_by_shape_and_links_percentiles_to_the_slowest(course: Course) -> None:
    window = course.admin_app.live.window
    snap = window.snapshot(None)
    rows = {(r["route"], r["shape"]): r for r in snap["series"]}
    assert set(rows) == {("support", "long_prompt"), ("code", "short_prompt")}
    assert rows["support", "long_prompt"]["verdict"]["verdict"] == MET
    assert rows["code", "short_prompt"]["verdict"]["verdict"] == MISSED
    kept = {r["id"]: r for r in window.since(0)}
    for key, row in rows.items():
        mine = [r for r in kept.values() if (r["route"], r["shape"]) == key]
        slowest = max(mine, key=lambda r: r["ttft"])
        for q in ("p50", "p95", "p99"):
            ids = row["slowest"]["ttft"][q]
            assert ids and ids[0] == slowest["id"], (key, q)
            # Slowest first, each at the (exact) percentile or above, from this series only.
            assert row["ttft"]["exact"] is True
            at = round(row["ttft"][q] * 1000, 3)
            ttfts = [kept[i]["ttft"] for i in ids]
            assert ttfts == sorted(ttfts, reverse=True) and min(ttfts) >= at
            # ... and they are all the kept requests there are at it and above, up to the cap.
            assert len(ids) == min(SLOWEST, sum(r["ttft"] >= at for r in mine))
            assert all((kept[i]["route"], kept[i]["shape"]) == key for i in ids)
    # Every waterfall carries its trace id, the one its spans have.
    traces = {format(s.context.trace_id, "032x") for s in course.spans.get_finished_spans() if s.context}
    assert {r["trace_id"] for r in kept.values()} <= traces


# -- exemplars on a real Prometheus ----------------------------------------------------------------


def events(admin: str, kinds: set[str]) -> dict[str, Any]:
    """The live view's first event of each kind, read from its event stream (as the page reads it)."""
    out: dict[str, Any] = {}
    kind = None
    # after=0, as the page asks: from the first kept request (a stream that names none starts at the newest few).
    with httpx.stream("GET", f"{admin}/events", params={"window": "all", "after": "0"}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind in kinds and kind not in out:
                out[kind] = json.loads(line[6:])
                if set(out) == kinds:
                    break
    return out


@pytest.mark.e2e
@pytest.mark.real
def test_an_exemplar_of_the_slowest_bucket_is_a_trace_the_waterfall_shows(tmp_path: Path) -> None:
    require_real(shutil.which("prometheus") is not None, "Prometheus", "bash .ci/install.d/20-prometheus.sh")
    from tests.support.prometheus import start_prometheus

    with running_course(tmp_path) as c:
        target = c.admin[len("http://") :]
        jobs = f"  - {{job_name: llmtap, static_configs: [{{targets: ['{target}']}}]}}\n"
        svc, prom = start_prometheus(
            tmp_path / "prometheus",
            jobs,
            cpu=None,
            log=tmp_path / "prometheus.log",
            flags=["--enable-feature=exemplar-storage"],
        )
        try:
            base = f"http://127.0.0.1:{prom}"
            selector = (
                'llmtap_time_to_first_token_seconds_bucket{llmtap_route="support",llmtap_request_shape="long_prompt"}'
            )
            deadline = time.monotonic() + PATIENCE
            while True:
                params = {"query": selector, "start": f"{time.time() - 600:.3f}", "end": f"{time.time() + 60:.3f}"}
                answer = httpx.get(f"{base}/api/v1/query_exemplars", params=params, timeout=10).json()
                assert answer["status"] == "success", answer
                series = [s for s in answer["data"] if s["exemplars"]]
                if series:
                    break
                assert time.monotonic() < deadline, f"no exemplars stored; see {tmp_path / 'prometheus.log'}"
                time.sleep(0.5)
            # The slowest bucket that holds an exemplar: where a p99 panel's point leads.
            top = max(series, key=lambda s: float(s["seriesLabels"]["le"]))
            exemplars = top["exemplars"]
            trace_ids = {e["labels"]["trace_id"] for e in exemplars}
            # They are traces the proxy exported, requests it recorded, and waterfalls the live view shows.
            exported = {format(s.context.trace_id, "032x") for s in c.spans.get_finished_spans() if s.context}
            recorded = {r["trace_id"]: r for r in read_records(c.records)}
            assert trace_ids <= exported and trace_ids <= set(recorded)
            seen = events(c.admin, {"requests", "snapshot"})
            shown = {r["trace_id"]: r for r in seen["requests"]}
            assert trace_ids <= set(shown)
            le = float(top["seriesLabels"]["le"])
            for e in exemplars:
                request = shown[e["labels"]["trace_id"]]
                assert (request["route"], request["shape"]) == ("support", "long_prompt")
                assert math.isclose(float(e["value"]), request["ttft"] / 1000, abs_tol=1e-5)
                assert float(e["value"]) <= le
            # The slowest request of all lies in that bucket, and the live view's p99 link leads to it first.
            support = [r for r in shown.values() if r["route"] == "support"]
            slowest = max(support, key=lambda r: r["ttft"])
            assert slowest["ttft"] / 1000 <= le
            row = next(r for r in seen["snapshot"]["series"] if (r["route"], r["shape"]) == ("support", "long_prompt"))
            assert row["slowest"]["ttft"]["p99"][0] == slowest["id"]
            # The same page as Prometheus scrapes it: OpenMetrics, exemplars on the buckets.
            page = httpx.get(f"{c.admin}/metrics", headers={"accept": "application/openmetrics-text"}, timeout=10)
            assert page.headers["content-type"].startswith("application/openmetrics-text")
            assert page.text.endswith("# EOF\n")
        finally:
            svc.stop()
