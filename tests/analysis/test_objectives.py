"""Per-request objectives (``x-slo-ttft-ms``, ``x-slo-tpot-ms``): read, judged, counted, kept from the upstream.

The pure rules first (what a valid header is, how a request is judged), then the whole path through ``llmtap serve``
with the ``openai`` SDK in front of the scripted upstream: the record, the root span and ``/metrics`` say what each
request asked for and whether it got it, an invalid header is counted and harms nothing, and the headers reach the
upstream only when ``--forward-slo-headers`` asks for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmtap.analysis.objectives import MET, VIOLATED, RequestObjective, judge_request, parse_objective
from llmtap.analysis.slo import Report, config_objectives, judge_share
from llmtap.commands.slo import from_prometheus, from_records, render
from llmtap.config.load import build
from tests.analysis.test_attribution import records
from tests.conftest import Scripted, require_real
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.procs import Llmtap
from tests.support.prometheus import promql, start_prometheus
from tests.telemetry.test_metrics_standard import otlp_env, total, wait_for


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        (b"250", 0.25),
        (b" 1500.5 ", 1.5005),
        (b"3600000", 3600.0),
        (b"0", None),
        (b"-5", None),
        (b"abc", None),
        (b"NaN", None),
        (b"inf", None),
        (b"1e3", None),
        (b"3600001", None),
        (b"99999999999999999999", None),
        (b"", None),
        (b"\xff\xfe", None),
    ],
)
def test_a_limit_is_a_plain_number_of_milliseconds_within_an_hour(value: bytes, limit: float | None) -> None:
    parsed = parse_objective([(b"x-slo-ttft-ms", value)])
    assert parsed is not None
    assert parsed.ttft == pytest.approx(limit) if limit is not None else parsed.ttft is None
    assert parsed.invalid == ([] if limit is not None else ["ttft"])


def test_without_the_headers_there_is_no_objective_and_a_repeated_header_keeps_its_first_value() -> None:
    assert parse_objective([(b"x-llmtap-tenant", b"acme"), (b"x-slo-e2e-ms", b"5")]) is None
    parsed = parse_objective([(b"x-slo-tpot-ms", b"20"), (b"x-slo-tpot-ms", b"junk"), (b"x-slo-ttft-ms", b"x")])
    assert parsed == RequestObjective(ttft=None, tpot=0.02, invalid=["ttft"])


def test_each_figure_is_judged_on_its_own() -> None:
    both = RequestObjective(ttft=0.5, tpot=0.05)
    judge = judge_request
    assert judge(both, ok=True, streamed=True, ttft=0.4, tpot=0.06) == {"ttft": MET, "tpot": VIOLATED}
    assert judge(both, ok=True, streamed=True, ttft=0.5, tpot=0.05) == {"ttft": MET, "tpot": MET}
    # A failure violates everything asked; a whole answer has no TTFT to judge; one chunk has no TPOT to miss.
    assert judge(both, ok=False, streamed=True, ttft=0.1, tpot=0.01) == {"ttft": VIOLATED, "tpot": VIOLATED}
    assert judge(both, ok=True, streamed=False, ttft=None, tpot=None) == {"tpot": MET}
    assert judge(both, ok=True, streamed=True, ttft=None, tpot=None) == {"ttft": VIOLATED, "tpot": MET}
    assert judge(RequestObjective(tpot=0.05), ok=True, streamed=True, ttft=9.0, tpot=0.01) == {"tpot": MET}
    assert judge(None, ok=True, streamed=True, ttft=0.1, tpot=0.01) == {}


def _chat(client: openai.OpenAI, headers: dict[str, str]) -> str:
    stream = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Hi"}], stream=True, extra_headers=headers
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _upstream_saw(upstream: Scripted) -> dict[str, str]:
    last = httpx.get(upstream.url + "/last-headers", timeout=5).json()["headers"]
    return {k.lower(): v for k, v in last.items()}


def _snapshot(proxy: Llmtap) -> dict[str, Any]:
    """The live view's first snapshot of every request so far (its ``/events`` stream)."""
    with httpx.stream("GET", proxy.admin_url + "/events?window=all", timeout=30) as r:
        kind = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: ") and kind == "snapshot":
                out: dict[str, Any] = json.loads(line[len("data: ") :])
                return out
    raise AssertionError("no snapshot on /events")


def test_the_share_that_got_its_objective_is_judged_as_a_percentile_is() -> None:
    # p95 needs 20 requests; 19 of 19 is still too few, 100 of 100 is met, 90 of 100 missed, 19 of 20 uncertain.
    assert judge_share("ttft", 19, 0, 0.95).verdict == "insufficient"
    assert judge_share("ttft", 100, 0, 0.95).verdict == "met"
    assert judge_share("ttft", 90, 10, 0.95).verdict == "missed"
    check = judge_share("tpot", 19, 1, 0.95)
    assert (check.verdict, check.asked, check.needed, check.share) == ("uncertain", 20, 20, 0.95)
    assert 0.0 <= check.low < 0.95 < check.high <= 1.0


def test_objectives_through_serve_with_the_openai_sdk(tmp_path: Path, closing: Any) -> None:
    # TTFT 0.3 s, then a chunk every 30 ms: a 1 ms TPOT and a 10 ms TTFT cannot be met however idle the machine,
    # a 10-minute TTFT and a 10 s TPOT cannot be missed however busy.
    upstream = Scripted(SCRIPT_TTFT="0.3", SCRIPT_GAP="0.03", SCRIPT_CHUNKS="6")
    receiver = HTTPReceiver()
    folder = tmp_path / "records"
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--record", str(folder), env=otlp_env(receiver))
    forwarding = Llmtap(upstream.url, tmp_path / "forwarding.log", "--forward-slo-headers")
    try:
        client = closing(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0))
        asked = [
            {"x-slo-ttft-ms": "600000", "x-slo-tpot-ms": "10000", "x-request": "met"},
            {"x-slo-ttft-ms": "10", "x-slo-tpot-ms": "1", "x-request": "violated"},
            {"x-slo-ttft-ms": "fast please", "x-slo-tpot-ms": "-5", "x-request": "invalid"},
            {"x-request": "none"},
        ]
        answers = []
        for headers in asked:
            answers.append(_chat(client, headers))
            seen = _upstream_saw(upstream)
            assert seen["x-request"] == headers["x-request"]
            assert "x-slo-ttft-ms" not in seen and "x-slo-tpot-ms" not in seen
        # Invalid objectives change nothing the client gets.
        assert answers[0] and len(set(answers)) == 1

        got: dict[str, Any] = {}
        for rec in records(folder, 4, proxy):
            got[rec["trace_id"]] = rec
        by_time = sorted(got.values(), key=lambda r: r["time"])
        met, violated, invalid, none = (r["request_objective"] for r in by_time)
        assert met == {"ttft": 600.0, "tpot": 10.0, "ttft_outcome": "met", "tpot_outcome": "met", "invalid": []}
        assert violated == {
            "ttft": 0.01,
            "tpot": 0.001,
            "ttft_outcome": "violated",
            "tpot_outcome": "violated",
            "invalid": [],
        }
        assert invalid == {"ttft": None, "tpot": None, "ttft_outcome": None, "tpot_outcome": None,
                           "invalid": ["ttft", "tpot"]}  # fmt: skip
        assert none is None
        assert by_time[1]["ttft"] > 0.01 and by_time[1]["tpot"] > 0.001  # what the verdicts rest on

        def roots() -> list[dict[str, Any]]:
            return [attributes(s.attributes) for _, s in receiver.received.spans() if s.name == "chat scripted"]

        wait_for("four root spans", lambda: len(roots()) >= 4, proxy)
        spans = {r["llmtap.objective.ttft_limit"]: r for r in roots() if "llmtap.objective.ttft_limit" in r}
        assert spans[600.0]["llmtap.objective.ttft_outcome"] == "met"
        assert spans[0.01]["llmtap.objective.ttft_outcome"] == "violated"
        assert spans[0.01]["llmtap.objective.tpot_outcome"] == "violated"
        assert spans[0.01]["llmtap.objective.tpot_limit"] == pytest.approx(0.001)
        ignored = [r for r in roots() if "llmtap.objective.ignored" in r]
        assert [r["llmtap.objective.ignored"] for r in ignored] == [["ttft", "tpot"]]

        name = "llmtap_objective_requests_total"
        wait_for("the objectives on /metrics", lambda: total(proxy.metrics(), name) == 4, proxy)
        text = proxy.metrics()
        for figure in ("ttft", "tpot"):
            for verdict in ("met", "violated"):
                where = {"llmtap_objective_figure": figure, "llmtap_objective_outcome": verdict}
                assert total(text, name, llmtap_route="default", llmtap_request_shape="short_prompt", **where) == 1
        assert total(text, "llmtap_objective_headers_ignored_total", llmtap_objective_figure="ttft") == 1
        assert total(text, "llmtap_objective_headers_ignored_total", llmtap_objective_figure="tpot") == 1

        # The live view's card says how many got what they asked.
        (card,) = [s for s in _snapshot(proxy)["series"] if s["requests"] == 4]
        assert card["request_objectives"] == {"ttft": {"met": 1, "violated": 1}, "tpot": {"met": 1, "violated": 1}}

        # Forwarding, when asked: the upstream gets the headers as sent.
        forward = closing(openai.OpenAI(base_url=forwarding.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0))
        _chat(forward, {"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "bad"})
        seen = _upstream_saw(upstream)
        assert (seen.get("x-slo-ttft-ms"), seen.get("x-slo-tpot-ms")) == ("250", "bad")
    finally:
        proxy.close()
        forwarding.close()
        receiver.close()
        upstream.close()


@pytest.mark.e2e
@pytest.mark.real
def test_slo_over_records_and_over_prometheus_say_the_same_of_one_run(tmp_path: Path) -> None:
    """One run of ``llmtap serve`` with records on, scraped by a real Prometheus: ``llmtap slo`` over the records and
    over Prometheus count and judge the requests' own objectives alike, route by route, figure by figure."""
    require_real(shutil.which("prometheus") is not None, "prometheus", "Debian's prometheus package")
    # TTFT 50 ms: a 1 ms TTFT cannot be met however idle the machine, a 10-minute one cannot be missed however busy.
    upstream = Scripted(SCRIPT_TTFT="0.05", SCRIPT_GAP="0.01", SCRIPT_CHUNKS="3")
    config = tmp_path / "llmtap.yaml"
    # p50 objectives: 12 requests are enough for a verdict (``needed``), and 12 of 12 (or 0 of 12) settle it.
    config.write_text(
        "routes:\n"
        + "".join(
            f"  - {{prefix: /{name}, upstream: '{upstream.url}', strip_prefix: true, name: {name},"
            " slo: {e2e_ms: 600000, percentile: 0.5}}\n"
            for name in ("burn", "calm")
        ),
        encoding="utf-8",
    )
    folder = tmp_path / "records"
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--config", str(config), "--record", str(folder))
    target = proxy.admin_url.removeprefix("http://")
    jobs = f"  - {{job_name: llmtap, static_configs: [{{targets: ['{target}']}}]}}\n"
    prom, port = start_prometheus(tmp_path / "prom", jobs, cpu=None, log=tmp_path / "prometheus.log")
    try:
        chat = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        sent = 0
        for i in range(12):
            for prefix, ttft in (("/burn", "1"), ("/calm", "600000")):
                headers = {"x-slo-ttft-ms": ttft}
                if i < 2:
                    headers["x-slo-tpot-ms"] = "10000"  # two requests: too few for a verdict on TPOT
                r = httpx.post(proxy.url + prefix + "/v1/chat/completions", json=chat, headers=headers, timeout=30)
                assert r.status_code == 200
                sent += 1
        records(folder, sent, proxy)
        asked = "sum(llmtap_objective_requests_total{llmtap_objective_figure='ttft'})"
        wait_for("the objectives scraped", lambda: promql(port, asked) == sent, proxy)

        from_files = from_records([folder], engine="python", resamples=100)
        from_prom = from_prometheus(
            f"http://127.0.0.1:{port}", config_objectives(build({"config": str(config)}, env={})), resamples=100
        )

        def judged(report: Report) -> dict[tuple[str, str], Any]:
            return {(v.route, v.shape): (v.request_objectives, v.request_checks) for v in report.verdicts}

        assert judged(from_files) == judged(from_prom)
        counts, checks = judged(from_files)[("burn", "short_prompt")]
        assert counts == {"ttft": {"violated": 12}, "tpot": {"met": 2}}
        assert [(c.figure, c.verdict, c.needed) for c in checks] == [("ttft", "missed", 3), ("tpot", "insufficient", 3)]
        counts, checks = judged(from_files)[("calm", "short_prompt")]
        assert counts == {"ttft": {"met": 12}, "tpot": {"met": 2}}
        assert [(c.figure, c.verdict) for c in checks] == [("ttft", "met"), ("tpot", "insufficient")]

        def lines(report: Report) -> list[str]:
            return render(report).partition("per-request objectives")[2].splitlines()[1:]

        assert lines(from_files) == lines(from_prom)
        assert "  burn short_prompt  TTFT: 0 of 12 met (0%), 12 violated; p50 [0%, 24%]  missed" in lines(from_files)
        tpot = (
            "  calm short_prompt  TPOT: 2 of 2 met (100%), 0 violated; p50 [34%, 100%]  insufficient (2 of 3 requests)"
        )
        assert tpot in lines(from_files)
        as_json = from_files.to_json()["verdicts"]
        assert {v["route"]: v["request_checks"][0]["verdict"] for v in as_json} == {"burn": "missed", "calm": "met"}
    finally:
        prom.stop()
        proxy.close()
        upstream.close()
