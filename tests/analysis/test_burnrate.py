"""Burn-rate alerts generated from the objectives (``llmtap slo --rules``), against a real Prometheus.

The rule file passes ``promtool check rules``; under ``promtool test rules`` the alerts fire on synthetic series that
burn each route and shape's own budget (read from the objective the proxy exports) and stay quiet on series that do
not; and a live Prometheus scraping ``llmtap serve`` in front of the scripted upstream, with the rules loaded, fires
the fast alert for the route whose every request misses its objective and not for the route whose requests meet it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from llmtap.analysis.burnrate import BUDGET, OBJECTIVE_METRIC, WINDOWS, error_ratio, rule_groups
from llmtap.analysis.slo import config_objectives
from llmtap.commands.slo import from_prometheus, render
from llmtap.config.load import build
from tests.analysis.test_compare import wait_until_up
from tests.conftest import PATIENCE, Scripted, free_port, require_real
from tests.support.procs import ROOT, Llmtap, stop
from tests.telemetry.test_metrics_standard import labels, series, total, wait_for


def _tool(name: str) -> str:
    found = shutil.which(name)
    require_real(found is not None, name, "Debian's prometheus package; .ci/install.d/20-prometheus.sh")
    assert found is not None
    return found


def _rules(tmp_path: Path, *args: str) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "llmtap", "slo", "--rules", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    path = tmp_path / "rules.yaml"
    path.write_text(done.stdout, encoding="utf-8")
    return path


def test_the_rules_are_the_workbooks_windows_and_read_the_exported_objective() -> None:
    groups = rule_groups(selector='job="llmtap"', by="namespace")
    recorded = {r["record"]: r["expr"] for r in groups[0]["rules"]}
    assert list(recorded) == [*(error_ratio(w) for w in WINDOWS), BUDGET]
    # The selector's labels are kept, so its alerts read its own series.
    assert "sum by (namespace, job, llmtap_route, llmtap_request_shape)" in recorded[error_ratio("1h")]
    assert OBJECTIVE_METRIC + '{job="llmtap"}' in recorded[BUDGET]
    fast, slow = (r["expr"] for r in groups[1]["rules"])
    for expr, pairs in (
        (fast, (("1h", "5m", "14.4"), ("6h", "30m", "6"))),
        (slow, (("1d", "2h", "3"), ("3d", "6h", "1"))),
    ):
        for long, short, rate in pairs:
            assert f'{error_ratio(long)}{{job="llmtap"}} > ({rate} * {BUDGET}{{job="llmtap"}})' in expr
            assert f'{error_ratio(short)}{{job="llmtap"}} > ({rate} * {BUDGET}{{job="llmtap"}})' in expr


def test_rules_list_the_configs_objectives_and_refuse_a_config_without_any(tmp_path: Path) -> None:
    config = tmp_path / "llmtap.yaml"
    config.write_text(
        "routes:\n"
        "  - prefix: /\n    upstream: http://127.0.0.1:9\n    name: chat\n    slo:\n"
        "      - {shape: short_prompt, percentile: 0.95, ttft_ms: 800}\n"
        "      - {percentile: 0.99, ttft_ms: 2000, tpot_ms: 50}\n",
        encoding="utf-8",
    )
    text = _rules(tmp_path, "--config", str(config)).read_text(encoding="utf-8")
    assert "#   route chat, shape short_prompt: p95 TTFT <= 800 ms (budget 0.05)" in text
    assert "#   route chat, shape other: p99 TTFT <= 2.00 s, TPOT <= 50 ms (budget 0.01)" in text
    empty = tmp_path / "empty.yaml"
    empty.write_text("routes:\n  - {prefix: /, upstream: 'http://127.0.0.1:9'}\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "llmtap", "slo", "--rules", "--config", str(empty)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "sets no objective" in done.stderr, done.stderr


def test_the_rule_file_passes_promtool(tmp_path: Path) -> None:
    path = _rules(tmp_path, "--rules-selector", 'job="llmtap"', "--rules-by", "namespace")
    done = subprocess.run([_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def _traffic(route: str, shape: str, objective: float, missed: int, met: int, minutes: int) -> list[dict[str, str]]:
    """Counters growing by ``missed`` and ``met`` a minute, and the objective the proxy exports: one route and shape."""
    where = f'job="llmtap",llmtap_route="{route}",llmtap_request_shape="{shape}"'
    return [
        {"series": f'llmtap_requests_total{{llmtap_slo="missed",{where}}}', "values": f"0+{missed}x{minutes}"},
        {"series": f'llmtap_requests_total{{llmtap_slo="met",{where}}}', "values": f"0+{met}x{minutes}"},
        # Requests without an objective never count.
        {"series": f'llmtap_requests_total{{llmtap_slo="none",{where}}}', "values": f"0+1000x{minutes}"},
        {"series": f"{OBJECTIVE_METRIC}{{{where}}}", "values": f"{objective}x{minutes}"},
    ]


def _alert(name: str, route: str, shape: str, severity: str) -> dict[str, Any]:
    return {
        "exp_labels": {"severity": severity, "job": "llmtap", "llmtap_route": route, "llmtap_request_shape": shape},
        "exp_annotations": next(r["annotations"] for r in rule_groups()[1]["rules"] if r["alert"] == name)
        | {"summary": next(r["annotations"]["summary"] for r in rule_groups()[1]["rules"] if r["alert"] == name)
           .replace("{{ $labels.llmtap_route }}", route).replace("{{ $labels.llmtap_request_shape }}", shape)},
    }  # fmt: skip


#: promtool evaluates the groups it is not told the order of in any order, and alerts evaluated before the recording
#: rules they read never see them: the recording group first, as a Prometheus server reads it once recorded.
ORDER = ["llmtap.slo.rules", "llmtap.slo.alerts"]


def test_alerts_fire_on_each_budget_burning_and_only_then(tmp_path: Path) -> None:
    """Two shapes of one route miss 10% of their requests: against a p95 objective (budget 5%) that burns 2x, which
    pages no one; against p99.5 (budget 0.5%) it burns 20x, and the fast alert fires within ten minutes. Over three
    days, 2x opens a ticket; a shape missing 0.1% of a 1% budget (0.1x) never alerts."""
    rules = _rules(tmp_path, "--rules-selector", 'job="llmtap"')
    fast = {
        "interval": "1m",
        "input_series": _traffic("chat", "short_prompt", 0.95, 10, 90, 120)
        + _traffic("chat", "long_prompt", 0.995, 10, 90, 120),
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "LlmtapErrorBudgetBurnFast",
                "exp_alerts": [_alert("LlmtapErrorBudgetBurnFast", "chat", "long_prompt", "critical")],
            }
        ],
    }
    slow = {
        "interval": "10m",
        "input_series": _traffic("chat", "short_prompt", 0.95, 10, 90, 3 * 24 * 6 + 6)
        + _traffic("chat", "other", 0.99, 1, 999, 3 * 24 * 6 + 6),
        "alert_rule_test": [
            {"eval_time": "3d", "alertname": "LlmtapErrorBudgetBurnFast", "exp_alerts": []},
            {
                "eval_time": "3d",
                "alertname": "LlmtapErrorBudgetBurnSlow",
                "exp_alerts": [_alert("LlmtapErrorBudgetBurnSlow", "chat", "short_prompt", "warning")],
            },
        ],
    }
    test_file = tmp_path / "rules_test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "evaluation_interval": "1m",
                "group_eval_order": ORDER,
                "tests": [fast, slow],
            }
        ),
        encoding="utf-8",
    )
    done = subprocess.run(
        [_tool("promtool"), "test", "rules", test_file.name], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.e2e
@pytest.mark.real
def test_a_live_prometheus_scraping_serve_fires_for_the_burning_route_alone(tmp_path: Path) -> None:
    binary = _tool("prometheus")
    upstream = Scripted(SCRIPT_TTFT="0.05", SCRIPT_GAP="0.01", SCRIPT_CHUNKS="3")
    config = tmp_path / "llmtap.yaml"
    # Every request misses a 1 ms TTFT (the scripted upstream waits 50 ms) and meets a 10-minute one.
    config.write_text(
        "routes:\n"
        f"  - {{prefix: /burn, upstream: '{upstream.url}', strip_prefix: true, name: burn,"
        " slo: {ttft_ms: 1, percentile: 0.95}}\n"
        f"  - {{prefix: /calm, upstream: '{upstream.url}', strip_prefix: true, name: calm,"
        " slo: {ttft_ms: 600000, percentile: 0.95}}\n",
        encoding="utf-8",
    )
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--config", str(config))
    rules = _rules(tmp_path, "--rules-selector", 'job="llmtap"')
    port = free_port()
    target = proxy.admin_url.removeprefix("http://")
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        f"scrape_configs: [{{job_name: llmtap, static_configs: [{{targets: ['{target}']}}]}}]\n",
        encoding="utf-8",
    )
    cmd = [binary, f"--config.file={prom_config}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    prom = subprocess.Popen(
        [*cmd, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # The objective each route exports: what the budget is read from.
        text = proxy.metrics()
        exported = {(labels(line)["llmtap_route"], labels(line)["llmtap_request_shape"]): line.rpartition(" ")[2]
                    for line in series(text, OBJECTIVE_METRIC)}  # fmt: skip
        assert exported[("burn", "short_prompt")] == exported[("calm", "other")] == "0.95"
        assert not any(route == "default" for route, _ in exported)  # --upstream's route has no objective
        wait_until_up(url + "/-/ready", prom, "Prometheus")
        chat = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}

        def firing() -> list[dict[str, str]]:
            query = 'ALERTS{alertname="LlmtapErrorBudgetBurnFast",alertstate="firing"}'
            result = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=10).json()["data"]["result"]
            return [r["metric"] for r in result]

        deadline = time.monotonic() + PATIENCE
        while not firing():
            assert time.monotonic() < deadline, f"no alert fired within {PATIENCE} s"
            for prefix, asked in (("/burn", "1"), ("/calm", "600000")):
                # Each request asks for its own TTFT too: llmtap slo reports them beside the verdicts.
                path = proxy.url + prefix + "/v1/chat/completions"
                with httpx.stream("POST", path, json=chat, headers={"x-slo-ttft-ms": asked}, timeout=30) as r:
                    assert r.status_code == 200
                    r.read()
            time.sleep(0.2)
        time.sleep(3)  # a few more evaluations: the calm route must still not fire
        fired = firing()
        assert {(m["llmtap_route"], m["llmtap_request_shape"], m["severity"]) for m in fired} == {
            ("burn", "short_prompt", "critical")
        }
        ratio = httpx.get(url + "/api/v1/query", params={"query": error_ratio("5m")}, timeout=10).json()
        by_route = {r["metric"]["llmtap_route"]: float(r["value"][1]) for r in ratio["data"]["result"]}
        assert by_route["burn"] == 1.0 and by_route["calm"] == 0.0

        # llmtap slo over the same Prometheus: each route's per-request objectives beside its verdict, as counted.
        def scraped() -> dict[str, float]:
            query = "sum by (llmtap_route) (llmtap_objective_requests_total)"
            result = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=10).json()["data"]["result"]
            return {r["metric"]["llmtap_route"]: float(r["value"][1]) for r in result}

        sent = total(proxy.metrics(), "llmtap_requests_total", llmtap_route="burn")
        wait_for("the objectives scraped", lambda: scraped().get("burn") == sent, proxy)
        settings = build({"config": str(config)}, env={})
        report = from_prometheus(url, config_objectives(settings), resamples=100)
        per_request = {(v.route, v.shape): v.request_objectives for v in report.verdicts if v.request_objectives}
        assert per_request[("burn", "short_prompt")] == {"ttft": {"violated": int(sent)}}
        calm = per_request[("calm", "short_prompt")]["ttft"]
        assert set(calm) == {"met"} and calm["met"] >= 1
        text = render(report)
        assert f"burn short_prompt  TTFT: 0 of {int(sent)} met (0%)" in text, text
    finally:
        stop(prom)
        proxy.close()
        upstream.close()
