"""Exemplars that stay: each histogram bucket keeps its last exemplar across scrapes until a newer request
replaces it, and several telemetry processes' pages merge into one OpenMetrics page that keeps them."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricsData
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.server import Background
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import create
from llmtap.telemetry.exposition.prometheus import PrometheusReader, merge_metrics
from tests.conftest import PATIENCE, free_port, require_real
from tests.serve.test_workers import _serve, two_routes
from tests.support.procs import stop, stop_clean, wait_ready

OPENMETRICS = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75"
TTFT = "llmtap_time_to_first_token_seconds"
BODY = {"model": "llmtap-sim", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

#: (series with its ``le``) -> (trace id, exemplar value, exemplar time), as a scrape shows them.
Exemplars = dict[str, tuple[str, float, float]]


def scrape(admin: str) -> tuple[str, Exemplars]:
    """One scrape as Prometheus makes it (OpenMetrics asked): the page and its exemplars by bucket."""
    r = httpx.get(admin + "/metrics", headers={"accept": OPENMETRICS}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text"), r.headers
    text = r.text
    assert text.endswith("# EOF\n"), text[-200:]
    out: Exemplars = {}
    for line in text.splitlines():
        if " # {" not in line:
            continue
        sample, exemplar = line.split(" # {", 1)
        labels, value, when = exemplar.rsplit(" ", 2)
        trace_id = labels.split('trace_id="', 1)[1][:32]
        out[sample.rsplit(" ", 1)[0]] = (trace_id, float(value), float(when))
    return text, out


def ttft_count(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(TTFT + "_count{"))


def until_counted(admin: str, count: int) -> tuple[str, Exemplars]:
    """OpenMetrics scrapes until the time-to-first-token histograms count ``count`` requests; the last one."""
    deadline = time.monotonic() + PATIENCE
    while True:
        text, exemplars = scrape(admin)
        if ttft_count(text) >= count:
            assert ttft_count(text) == count, text
            return text, exemplars
        assert time.monotonic() < deadline, f"{ttft_count(text)} of {count} requests counted"
        time.sleep(0.1)


def send(url: str) -> str:
    """One streamed request under a sampled ``traceparent`` of ours; its trace id (the proxy's span joins it)."""
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=headers, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    return trace_id


@contextmanager
def serving(argv: list[str], tmp_path: Path) -> Iterator[str]:
    """``llmtap serve`` with ``argv`` (its proxy port is ``argv``'s); yields the admin listener's address."""
    admin_port = free_port()
    proc = _serve([*argv, "--admin-port", str(admin_port)], tmp_path)
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(proc, admin)
        yield admin
        stop_clean(proc)
    finally:
        stop(proc, grace=0)


@pytest.fixture
def sims() -> Iterator[list[Background]]:
    """Two simulators (the ``fast`` profile), stopped after the test."""
    running = [run_in_thread(get_profile("fast"), seed=i) for i in range(2)]
    yield running
    for sim in running:
        sim.stop()


# -- the reader ------------------------------------------------------------------------------------


def test_the_reader_keeps_each_buckets_exemplar_and_forgets_a_series_that_went_away() -> None:
    reader = PrometheusReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        ins = create(provider.get_meter("llmtap-test"), latest=False)

        def record(value: float, trace_id: int) -> None:
            ctx = set_span_in_context(NonRecordingSpan(SpanContext(trace_id, 1, False, TraceFlags(1))))
            ins.ttft.record(value, {sc.ROUTE: "r"}, context=ctx)

        def marks() -> dict[str, str]:
            lines = reader.render(openmetrics=True).splitlines()
            return {m.split(" ", 1)[0]: m.split('trace_id="')[1][:32] for m in lines if " # {" in m}

        record(0.12, 0xA)
        record(0.9, 0xB)
        first = marks()
        assert sorted(first.values()) == [f"{0xA:032x}", f"{0xB:032x}"]
        assert reader.render() and marks() == first  # a plain scrape in between takes nothing either
        record(0.121, 0xC)  # the bucket of 0.12: replaced; 0.9's stays
        assert sorted(marks().values()) == [f"{0xB:032x}", f"{0xC:032x}"]
        # A collection without the series: its exemplars are forgotten (the kept ones never outgrow the page).
        reader._keep(MetricsData(resource_metrics=[]))
        assert reader._kept == {}
    finally:
        provider.shutdown()


# -- merging OpenMetrics pages ----------------------------------------------------------------------

A = """# HELP ttft_seconds TTFT.
# TYPE ttft_seconds histogram
ttft_seconds_bucket{route="a",le="0.1"} 1 # {trace_id="aa",span_id="01"} 0.05 100.000
ttft_seconds_bucket{route="a",le="+Inf"} 2 # {trace_id="ab",span_id="02"} 0.5 200.000
ttft_seconds_sum{route="a"} 0.5
ttft_seconds_count{route="a"} 2
# HELP req Finished requests.
# TYPE req counter
req_total{route="a # {x}"} 2
# EOF
"""
B = """# HELP ttft_seconds TTFT.
# TYPE ttft_seconds histogram
ttft_seconds_bucket{route="a",le="0.1"} 1 # {trace_id="ba",span_id="03"} 0.07 150.000
ttft_seconds_bucket{route="a",le="+Inf"} 1
ttft_seconds_sum{route="a"} 0.25
ttft_seconds_count{route="a"} 1
# HELP req Finished requests.
# TYPE req counter
req_total{route="a # {x}"} 1
# EOF
"""


def test_merged_openmetrics_sums_values_and_keeps_each_buckets_newest_exemplar() -> None:
    merged = merge_metrics([A, B], openmetrics=True)
    assert merged.splitlines() == [
        "# HELP ttft_seconds TTFT.",
        "# TYPE ttft_seconds histogram",
        'ttft_seconds_bucket{route="a",le="0.1"} 2 # {trace_id="ba",span_id="03"} 0.07 150.000',
        'ttft_seconds_bucket{route="a",le="+Inf"} 3 # {trace_id="ab",span_id="02"} 0.5 200.000',
        'ttft_seconds_sum{route="a"} 0.75',
        'ttft_seconds_count{route="a"} 3',
        "# HELP req Finished requests.",
        "# TYPE req counter",
        'req_total{route="a # {x}"} 3',
        "# EOF",
    ]
    # The plain format merges as before: no exemplars there, no ``# EOF``.
    plain = [a.split(" # {")[0] for a in (A, B)]
    assert "# EOF" not in merge_metrics(plain) and " # {" not in merge_metrics(plain)


# -- a real server ----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_exemplars_survive_scrapes_until_a_newer_request_replaces_them(sims: list[Background], tmp_path: Path) -> None:
    sim = sims[0].url
    port = free_port()
    with serving(["serve", "--upstream", sim, "--provider", "llmtap-sim", "--port", str(port)], tmp_path) as admin:
        url = f"http://127.0.0.1:{port}"
        sent = {send(url) for _ in range(6)}
        _, first = until_counted(admin, 6)
        ttft = {k: v for k, v in first.items() if k.startswith(TTFT + "_bucket{")}
        assert ttft and {trace for trace, _, _ in first.values()} <= sent, first
        # A second scrape with no request in between (an HA pair's other server, a curl): the same exemplars.
        _, second = scrape(admin)
        assert second == first
        _, third = scrape(admin)
        assert third == first

        # A newer request: every bucket it falls in now shows it; every other bucket keeps its exemplar.
        newer = send(url)
        _, after = until_counted(admin, 7)
        mine = {k for k, (trace, _, _) in after.items() if trace == newer}
        assert any(k.startswith(TTFT + "_bucket{") for k in mine), after
        assert {k: v for k, v in after.items() if k not in mine} == {k: v for k, v in first.items() if k not in mine}
        # Some of its buckets held an older request's exemplar, which it replaced (token counts repeat).
        replaced = mine & set(first)
        assert replaced and all(after[k][2] >= first[k][2] for k in replaced)
        assert scrape(admin)[1] == after


@pytest.mark.e2e
def test_two_telemetry_processes_give_one_openmetrics_page_with_both_exemplars(
    sims: list[Background],
) -> None:
    # llmtap's Unix sockets go under TMPDIR only when the path fits: a short one.
    with tempfile.TemporaryDirectory(prefix="lt-", dir="/tmp") as folder:
        two_processes(sims, Path(folder))


def two_processes(sims: list[Background], tmp_path: Path) -> None:
    port = free_port()
    config = two_routes(tmp_path, sims)
    argv = ["serve", "--config", str(config), "--port", str(port), "--telemetry-workers", "2"]
    with serving(argv, tmp_path) as admin:
        sent = {route: {send(f"http://127.0.0.1:{port}/{route}") for _ in range(3)} for route in "ab"}
        text, first = until_counted(admin, 6)
        # One family each, HELP and TYPE once, and each route's exemplars from its own process.
        types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types)) and text.count("# EOF") == 1
        for route in "ab":
            shown = {trace for k, (trace, _, _) in first.items() if f'llmtap_route="{route}"' in k}
            assert shown and shown <= sent[route], (route, shown, first)
        assert scrape(admin)[1] == first

        # A real Prometheus scrapes it (OpenMetrics) and stores the exemplars.
        require_real(shutil.which("prometheus") is not None, "Prometheus", "bash .ci/install.d/20-prometheus.sh")
        from tests.support.prometheus import start_prometheus

        target = admin[len("http://") :]
        jobs = f"  - {{job_name: llmtap, static_configs: [{{targets: ['{target}']}}]}}\n"
        log = tmp_path / "prometheus.log"
        svc, prom = start_prometheus(
            tmp_path / "prometheus", jobs, cpu=None, log=log, flags=["--enable-feature=exemplar-storage"]
        )
        try:
            base = f"http://127.0.0.1:{prom}"
            deadline = time.monotonic() + PATIENCE
            while True:
                targets = httpx.get(f"{base}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
                params = {
                    "query": TTFT + "_bucket",
                    "start": f"{time.time() - 600:.3f}",
                    "end": f"{time.time() + 60:.3f}",
                }
                answer = httpx.get(f"{base}/api/v1/query_exemplars", params=params, timeout=10).json()
                stored = {e["labels"]["trace_id"] for s in answer["data"] for e in s["exemplars"]}
                if targets and targets[0]["health"] == "up" and stored:
                    break
                assert time.monotonic() < deadline, (targets, answer, log)
                assert not targets or targets[0]["lastError"] == "", targets  # the page parses
                time.sleep(0.5)
            # Both processes' requests among them: the merged page carried both.
            assert stored <= sent["a"] | sent["b"]
            assert stored & sent["a"] and stored & sent["b"], stored
        finally:
            svc.stop()
