"""dashboards/: generated, fresh, valid against Grafana's schema, and every query answered by a real Prometheus.

The checked-in JSON must be what ``python -m dashboards.build`` builds; it must validate against the JSON
Schema derived from npm's ``@grafana/schema`` (``.ci/install.d/26-npm-schema.sh``); every metric a query
names must be one the proxy exports and every label one of its attributes. Then Debian's Prometheus,
started here as a plain process, scrapes ``llmtap serve`` in front of ``llmtap simulate`` while mixed
traffic flows, and every panel query and template variable must come back with data.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, UpDownCounter

from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.instruments import create
from llmtap.telemetry.exposition.prometheus import metric_name
from tests.conftest import TOOLS, free_port, require_real
from tests.real.test_collectors import Llmtap, Proc, answers, listening, start_llmtap
from tests.support.net import LoopbackHTTPServer, answer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
VARIABLES = ("model", "route", "shape", "version")
# PromQL words that look like names but are not metrics.
KEYWORDS = {"and", "or", "unless", "on", "ignoring", "group_left", "group_right", "bool", "offset", "by", "without"}


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a dashboard, and where it sits."""

    where: str
    expr: str


def queries(dashboard: Mapping[str, Any], name: str = "") -> list[Query]:
    return [
        Query(f"{name}: {panel.get('title')} [{target.get('refId')}]", target["expr"])
        for panel in dashboard.get("panels", [])
        for target in panel.get("targets", [])
    ]


def variable_queries(dashboard: Mapping[str, Any]) -> dict[str, str]:
    return {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}


def all_queries() -> list[Query]:
    return [q for path in DASHBOARDS for q in queries(load(path), path.name)]


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression reads: names that are neither functions, keywords nor labels."""
    bare = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", bare)  # grouping labels
    bare = re.sub(r"\[[^\]]*\]", " ", bare)  # range selectors
    bare = re.sub(r'"[^"]*"', " ", bare)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        if bare[m.end() :].lstrip().startswith("(") or m.group() in KEYWORDS:
            continue
        names.add(m.group())
    return names


def label_names(expr: str) -> set[str]:
    """Labels in matchers and in ``by (...)`` clauses."""
    out = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        out |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    for groups in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        out |= {g.strip() for g in groups.split(",") if g.strip()}
    return out


def grouping(expr: str) -> set[str]:
    """Labels the result is grouped by (the outermost meaning of a panel's series), ``le`` aside."""
    return {g.strip() for groups in re.findall(r"\bby\s*\(([^)]*)\)", expr) for g in groups.split(",")} - {"le", ""}


def exported_metrics() -> set[str]:
    """Every Prometheus series name the proxy can put on ``/metrics``, from its instruments (both flavours)."""
    names: set[str] = set()
    for latest in (False, True):
        provider = MeterProvider()
        instruments = create(provider.get_meter("names"), latest=latest)
        for f in fields(instruments):
            ins = getattr(instruments, f.name)
            if isinstance(ins, Histogram):
                base = metric_name(ins.name, ins.unit or "")
                names |= {base + "_bucket", base + "_sum", base + "_count"}
            elif isinstance(ins, Counter):
                names.add(metric_name(ins.name, ins.unit or "", counter=True))
            elif isinstance(ins, UpDownCounter):
                names.add(metric_name(ins.name, ins.unit or ""))
        provider.shutdown()
    return names


def known_labels() -> set[str]:
    attributes = {v for k, v in vars(sc).items() if k.isupper() and isinstance(v, str) and "." in v}
    return {re.sub(r"[^a-zA-Z0-9_]", "_", a) for a in attributes} | {"le"}


def unknown_metrics(items: Iterable[Query], exported: set[str]) -> dict[str, set[str]]:
    """Queries naming a metric the proxy does not export, with those names."""
    out = {}
    for q in items:
        missing = metric_names(q.expr) - exported
        if missing:
            out[q.where] = missing
    return out


# --- the files ---------------------------------------------------------------------------------------


def build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dashboards.build", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_checked_in_dashboards_are_what_the_code_builds(tmp_path: Path) -> None:
    assert [p.name for p in DASHBOARDS] == ["llmtap-caching.json", "llmtap-overview.json"]
    result = build("--check")
    assert result.returncode == 0, result.stderr
    # A hand edit, or a code change without regenerating, is caught and the file named.
    for path in DASHBOARDS:
        shutil.copy(path, tmp_path / path.name)
    edited = load(tmp_path / "llmtap-overview.json")
    edited["panels"][1]["title"] = "edited by hand"
    (tmp_path / "llmtap-overview.json").write_text(json.dumps(edited, indent=2), encoding="utf-8")
    result = build("--check", "--out", str(tmp_path))
    assert result.returncode == 1
    assert "llmtap-overview.json: stale" in result.stderr and "llmtap-caching.json" not in result.stderr


def schema_path() -> Path | None:
    found = sorted((TOOLS / "npm").glob("dashboard-*.schema.json"))
    return found[-1] if found else None


@pytest.mark.real
def test_dashboards_validate_against_grafana_schema() -> None:
    path = schema_path()
    require_real(
        path is not None, "the dashboard JSON Schema from npm @grafana/schema", "run .ci/install.d/26-npm-schema.sh"
    )
    assert path is not None
    validator = jsonschema.Draft7Validator(json.loads(path.read_text(encoding="utf-8")))
    for dash in DASHBOARDS:
        errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(load(dash))]
        assert errors == [], dash.name
    broken = load(DASHBOARDS[0])
    broken["refresh"], broken["panels"][0]["gridPos"]["h"] = 30, "tall"
    assert len(list(validator.iter_errors(broken))) == 2


def test_every_query_names_a_metric_the_proxy_exports() -> None:
    items = all_queries()
    assert len(items) >= 40
    exported = exported_metrics()
    assert all(metric_names(q.expr) for q in items)
    assert unknown_metrics(items, exported) == {}
    for name, expr in {n: e for d in DASHBOARDS for n, e in variable_queries(load(d)).items()}.items():
        metric = re.fullmatch(r"label_values\((\w+), *(\w+)\)", expr)
        assert metric is not None and metric.group(1) in exported, name


def test_a_query_on_a_metric_the_proxy_does_not_export_is_named() -> None:
    dashboard = copy.deepcopy(load(DASHBOARDS[0]))
    panel = next(p for p in dashboard["panels"] if p.get("targets"))
    panel["targets"][0]["expr"] = 'sum(rate(llmtap_made_up_total{llmtap_route=~"$route"}[5m])) / sum(llmtap_requests)'
    problems = unknown_metrics(queries(dashboard, "doctored"), exported_metrics())
    assert list(problems.values()) == [{"llmtap_made_up_total", "llmtap_requests"}]
    assert metric_names('histogram_quantile(0.5, sum by (le, a_b) (rate(x_bucket{c="d"}[1m])))') == {"x_bucket"}


def test_every_label_is_an_llmtap_attribute() -> None:
    known = known_labels()
    unknown = {q.where: label_names(q.expr) - known for q in all_queries() if label_names(q.expr) - known}
    assert unknown == {}


def test_template_variables_filter_every_dashboard() -> None:
    for path in DASHBOARDS:
        dashboard = load(path)
        assert set(variable_queries(dashboard)) == set(VARIABLES)
        text = " ".join(q.expr for q in queries(dashboard))
        assert "$model" in text and "$route" in text, path.name
    caching = " ".join(q.expr for q in queries(load(ROOT / "dashboards" / "llmtap-caching.json")))
    assert "$version" in caching


def test_latency_percentiles_turn_exemplars_on() -> None:
    # Grafana draws a panel's exemplars (and links them to their traces) only when its query asks for them.
    overview = load(ROOT / "dashboards" / "llmtap-overview.json")
    shaped = [p for p in overview["panels"] if "by route and request shape" in p.get("title", "")]
    assert {p["title"] for p in shaped} >= {"TTFT by route and request shape", "TPOT by route and request shape"}
    for panel in overview["panels"]:
        for target in panel.get("targets", []):
            if "llmtap_time_to_first_token_seconds_bucket" in target["expr"]:
                assert target.get("exemplar") is True, (panel["title"], target["refId"])
    for panel in shaped:
        assert all("llmtap_request_shape" in t["expr"] for t in panel["targets"]), panel["title"]


# --- a real Prometheus scraping a real proxy ----------------------------------------------------------

TRAFFIC_SECONDS = 8.0
WINDOW = "30s"
FIXED = " ".join(["policy"] * 1200)  # the prompt's unchanging part, long enough for many cache blocks


@dataclass
class Live:
    """Prometheus with the traffic's samples in it, queried as of one successful scrape after the traffic."""

    url: str
    outcomes: dict[str, int]
    at: float = 0.0

    def query(self, expr: str) -> list[dict[str, Any]]:
        params = {"query": expr, **({"time": repr(self.at)} if self.at else {})}
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        result = body["data"]["result"]
        assert isinstance(result, list)
        return result

    def settle(self) -> None:
        """Pin queries to the last successful scrape. A scrape that times out (the exposition is megabytes
        once many label sets exist, and this machine is shared) marks every series stale until the next
        one, which would blank gauges at whatever moment a query happened to land."""
        (up,) = self.query("up[1m]")
        self.at = max(float(ts) for ts, value in up["values"] if value == "1")

    def scrapes(self) -> str:
        """How many scrapes failed, for the failure message."""
        failed = self.query("count_over_time(up[5m]) - sum_over_time(up[5m])")
        return f"as of {self.at}: {failed[0]['value'][1]} failed scrapes in the last 5 minutes"


class Misreporting(LoopbackHTTPServer):
    """A model server that reports impossible timings (vLLM's per-request ``metrics``: a negative queue time,
    a first token later than the whole request), so the proxy's rejected-timings counter has something to
    count. Everything else about its answer is ordinary."""

    def __init__(self) -> None:
        super().__init__(_MisreportingHandler)


class _MisreportingHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        reply = {
            "id": "chatcmpl-misreporting",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "llmtap-sim",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Done."}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
            "metrics": {"queue_time_ms": -5.0, "time_to_first_token_ms": 9e12, "generation_time_ms": 1.0},
        }
        payload = json.dumps(reply).encode()
        answer(self, payload, "application/json")

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


def body(i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Request ``i`` of the mix: two prompt layouts (versions), two sizes, some unknown models, and now and
    then a request to the misreporting server."""
    if i % 17 == 9:
        chat: dict[str, Any] = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "Status?"}]}
        return "/misreporting/v1/chat/completions", chat, {}
    version = "v2" if i % 2 else "v1"
    variable = f"ticket {i}: my order {i * 7} arrived broken"
    if i % 4 < 2:
        content = variable  # a short prompt: another request shape
    else:
        content = f"{FIXED} {variable}" if version == "v2" else f"{variable} {FIXED}"
    model = "no-such-model" if i % 11 == 5 else "llmtap-sim"
    chat = {"model": model, "stream": True, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
    return "/v1/chat/completions", chat, {"x-llmtap-prompt-version": version, "x-llmtap-tenant": f"team-{i % 3}"}


def traffic(proxy: Llmtap, seconds: float, workers: int = 6) -> dict[str, int]:
    """Streams from several threads until ``seconds`` pass; some are cut short by the client (cancellations)."""
    deadline = time.monotonic() + seconds
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    counter = iter(range(1_000_000))

    def worker() -> None:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter)
                path, chat, headers = body(i)
                with client.stream("POST", path, json=chat, headers=headers) as r:
                    kind = str(r.status_code)
                    for n, _ in enumerate(r.iter_lines()):
                        if i % 13 == 7 and n == 2:
                            kind = "cancelled"
                            break
                with lock:
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                if kind == "503":
                    time.sleep(0.2)  # refused by the admission queue: back off as a client would

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return outcomes


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prometheus = shutil.which("prometheus")
    require_real(prometheus is not None, "Prometheus", "apt-get install prometheus; see .ci/install.d/20-prometheus.sh")
    assert prometheus is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    sim_port = free_port()
    sim = Proc(
        [sys.executable, "-m", "llmtap", "simulate", "--port", str(sim_port), "--profile", "code"], tmp / "sim.log"
    )
    started: list[Proc] = [sim]
    misreporting = Misreporting()
    routes = tmp / "llmtap.yaml"
    routes.write_text(
        "routes:\n"
        f"  - {{prefix: /misreporting, upstream: '{misreporting.url}', strip_prefix: true, name: misreporting}}\n"
        f"  - {{prefix: /, upstream: 'http://127.0.0.1:{sim_port}'}}\n",
        encoding="utf-8",
    )
    try:
        sim.wait_until("llmtap simulate", listening(sim_port))
        # A small admission limit so that requests wait and some are refused; SLOs so that goodput is judged.
        limits = ("--max-concurrency", "3", "--queue-limit", "2", "--queue-timeout", "5")
        slo = ("--slo-ttft-ms", "1000", "--slo-tpot-ms", "40")
        env = {"OTEL_TRACES_EXPORTER": "none"}
        # Tenants on the metrics, and a price for the simulator's model, so the cost panels have data.
        prices = tmp / "prices.yaml"
        prices.write_text("models:\n  llmtap-sim: {input: 2.0, cached_input: 0.5, output: 8.0}\n", encoding="utf-8")
        attribution = ("--metric-dimensions", "tenant", "--prices", str(prices))
        proxy = start_llmtap(None, tmp / "llmtap.log", env, "--config", str(routes), *limits, *slo, *attribution)
        started.append(proxy.proc)
        port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 2s, scrape_timeout: 2s, evaluation_interval: 2s}\n"
            "scrape_configs:\n"
            f"  - job_name: llmtap\n    static_configs: [{{targets: ['127.0.0.1:{proxy.admin_port}']}}]\n",
            encoding="utf-8",
        )
        promtool = shutil.which("promtool")
        require_real(promtool is not None, "promtool", "it comes with Prometheus: see .ci/install.d/20-prometheus.sh")
        assert promtool is not None
        subprocess.run([promtool, "check", "config", str(config)], check=True, capture_output=True, timeout=30)
        argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}"]
        prom = Proc([*argv, f"--web.listen-address=127.0.0.1:{port}"], tmp / "prometheus.log")
        started.append(prom)
        url = f"http://127.0.0.1:{port}"
        prom.wait_until("Prometheus /-/ready", answers(f"{url}/-/ready"))
        outcomes = traffic(proxy, TRAFFIC_SECONDS)
        time.sleep(4.5)  # two more scrapes, so the last requests are in
        result = Live(url, outcomes)
        result.settle()
        yield result
    finally:
        for proc in reversed(started):
            proc.close()
        misreporting.close()


def substitute(expr: str) -> str:
    """What Grafana sends with every variable on "All" and a rate window covering the traffic."""
    for name in VARIABLES:
        expr = expr.replace(f"${name}", ".*")
    return expr.replace("$__rate_interval", WINDOW)


def problem(live: Live, q: Query) -> str | None:
    """Why a panel query shows nothing, naming the metrics that have no series; None when it has data."""
    result = live.query(substitute(q.expr))
    values = [float(r["value"][1]) for r in result]
    if result and any(math.isfinite(v) for v in values):
        absent = {g for g in grouping(q.expr) if not any(r["metric"].get(g) for r in result)}
        return f"{q.where}: no series carries label {sorted(absent)}" if absent else None
    empty = sorted(m for m in metric_names(q.expr) if not live.query(f"count({m})"))
    why = f"metrics with no series: {', '.join(empty)}" if empty else "its metrics have series, the query none"
    return f"{q.where}: {'no data' if not result else 'only NaN'}; {why}"


@pytest.mark.real
def test_every_dashboard_query_returns_data_from_prometheus(live: Live) -> None:
    assert live.outcomes.get("200", 0) >= 20, live.outcomes
    items = all_queries()
    problems = [p for p in (problem(live, q) for q in items) if p is not None]
    print(
        f"\nPrometheus: {len(items)} queries checked, {len(items) - len(problems)} with data; traffic {live.outcomes}"
    )
    assert problems == [], "\n".join([*problems, live.scrapes()])


@pytest.mark.real
def test_every_template_variable_has_values(live: Live) -> None:
    empty = []
    for path in DASHBOARDS:
        for name, expr in variable_queries(load(path)).items():
            match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", expr)
            assert match is not None, expr
            metric, lbl = match.groups()
            if not any(r["metric"].get(lbl) for r in live.query(f"count by ({lbl}) ({metric})")):
                empty.append(f"{path.name}: ${name}: no {lbl} values on {metric}")
    assert empty == [], "\n".join(empty)
