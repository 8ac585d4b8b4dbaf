"""collectors/: the contrib configs checked against the distribution's component list, and rotel run for real.

The contrib collector cannot run on these machines, so its configs are checked for what breaks a collector
at start-up: a component type the distribution does not build, a pipeline naming an undefined component, a
defined component no pipeline uses, YAML that does not lint. rotel, the one OTLP collector that installs
here (its binary ships inside the PyPI wheel), runs with ``collectors/rotel/rotel.env``: llmtap exports to
it over gRPC and over HTTP, it forwards to a second rotel that prints what it received, and the spans and
metrics are read back from that print-out, names, attributes and values.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import yaml
from yamllint import linter  # type: ignore[import-untyped]
from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

from llmtap.store.files import ReadStats, read_records
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit.chunkdetail import REASONS
from tests.conftest import PATIENCE, Scripted, free_port, require_real
from tests.support.procs import stop
from tests.support.scripted_upstream import script

ROOT = Path(__file__).resolve().parents[2]
COLLECTORS = ROOT / "collectors"
COMPONENTS = COLLECTORS / "otelcol-contrib-components.yaml"
ROTEL_ENV = COLLECTORS / "rotel" / "rotel.env"
CONTRIB_CONFIGS = sorted(p for p in COLLECTORS.glob("*.yaml") if p != COMPONENTS)
KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
SIGNALS = ("traces", "metrics", "logs", "profiles")
YAMLLINT = YamlLintConfig(
    "{extends: default, rules: {line-length: {max: 120}, document-start: disable, truthy: {check-keys: false}}}"
)

# The scripted upstream's stream: 8 content chunks, the first 30 ms after the request, 12 tokens in all.
CHUNKS = 8
TTFT = 0.03
PLAN = script(TTFT, 0.005, CHUNKS)
TOKENS = sum(len(tokens) for _, tokens in PLAN)
CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}


# --- child processes ------------------------------------------------------------------------------


class Proc:
    """A child process whose output goes to a file (a pipe could fill and block it); ended by its own pid."""

    def __init__(self, argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_path = log
        self.log: IO[str] = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=dict(env or clean_env()), stdout=self.log, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def tail(self) -> str:
        return self.output()[-3000:]

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = PATIENCE) -> None:
        """Poll ``ready`` until it holds; fail with the process's output if it dies or time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: the process exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without telemetry or llmtap settings, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_", "ROTEL_"))}
    return {**base, **extra}


def listening(port: int) -> Callable[[], bool]:
    def check() -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    return check


def answers(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    return check


@dataclass
class Llmtap:
    """``llmtap serve`` in a child process on free ports."""

    proc: Proc
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def start_llmtap(upstream: str | None, log: Path, env: Mapping[str, str], *args: str) -> Llmtap:
    """Start the proxy with ``env`` on top of a clean environment and wait for ``/readyz``."""
    port, admin_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "llmtap",
        "serve",
        *(["--upstream", upstream] if upstream else []),
        "--port",
        str(port),
    ]
    # Every request keeps its chunk spans here (the spans checked on the far side); test_chunk_detail.py checks
    # the default decision.
    env = {"LLMTAP_CHUNK_DETAIL_SAMPLE": "1", **env}
    proc = Proc([*argv, "--admin-port", str(admin_port), *args], log, clean_env(**env))
    proxy = Llmtap(proc, port, admin_port)
    proc.wait_until("llmtap /readyz", answers(f"{proxy.admin_url}/readyz"))
    return proxy


def stream_chat(client: httpx.Client, url: str, body: Mapping[str, Any] = CHAT, **headers: str) -> list[str]:
    """One streamed request; returns its ``data:`` payloads."""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


# --- the contrib configs, structurally -------------------------------------------------------------


@dataclass(frozen=True)
class Distribution:
    """The component types one contrib collector version builds in, by kind."""

    version: str
    types: Mapping[str, frozenset[str]]


def load_distribution(path: Path = COMPONENTS) -> Distribution:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return Distribution(str(data["version"]), {kind: frozenset(data[kind]) for kind in KINDS})


def config_problems(config: Mapping[str, Any], dist: Distribution) -> list[str]:
    """What would stop a contrib collector from starting with ``config``, one line each, naming the key."""
    problems: list[str] = []
    defined: dict[str, set[str]] = {}
    for kind in KINDS:
        section = config.get(kind) or {}
        if not isinstance(section, dict):
            problems.append(f"{kind}: expected a mapping of component ids")
            section = {}
        defined[kind] = set(section)
        for cid in section:
            ctype = str(cid).split("/", 1)[0]
            if ctype not in dist.types[kind]:
                problems.append(f"{kind}.{cid}: {ctype!r} is not among the {kind} of otelcol-contrib {dist.version}")
    service = config.get("service") or {}
    used: dict[str, set[str]] = {kind: set() for kind in KINDS}
    for ext in service.get("extensions") or []:
        if ext not in defined["extensions"]:
            problems.append(f"service.extensions: {ext!r} is not defined under extensions")
        used["extensions"].add(ext)
    pipelines = service.get("pipelines") or {}
    if not pipelines:
        problems.append("service.pipelines: no pipeline defined")
    roles = {
        "receivers": ("receivers", "connectors"),
        "processors": ("processors",),
        "exporters": ("exporters", "connectors"),
    }
    for name, pipeline in pipelines.items():
        if str(name).split("/", 1)[0] not in SIGNALS:
            problems.append(f"service.pipelines.{name}: the signal must be one of {', '.join(SIGNALS)}")
        for role, kinds in roles.items():
            ids = (pipeline or {}).get(role) or []
            if not ids and role != "processors":
                problems.append(f"service.pipelines.{name}.{role}: empty")
            for cid in ids:
                owner = next((k for k in kinds if cid in defined[k]), None)
                if owner is None:
                    problems.append(f"service.pipelines.{name}.{role}: {cid!r} is not defined under {kinds[0]}")
                else:
                    used[owner].add(cid)
    for kind in KINDS:
        for cid in sorted(defined[kind] - used[kind]):
            problems.append(f"{kind}.{cid}: defined but used by no pipeline")
    return problems


def load_config(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), path
    return data


def test_component_list_is_pinned_and_plausible() -> None:
    dist = load_distribution()
    assert re.fullmatch(r"\d+\.\d+\.\d+", dist.version), dist.version
    text = COMPONENTS.read_text(encoding="utf-8")
    assert "distributions/otelcol-contrib/manifest.yaml" in text  # the source is named
    for kind in KINDS:
        listed = yaml.safe_load(text)[kind]
        assert len(listed) == len(set(listed)), f"{kind}: duplicates"
    # The distribution is large; a truncated list would wave typos through as "unknown" less often, not more,
    # but it would also fail good configs. Floors well under what the manifest builds in.
    assert len(dist.types["receivers"]) > 80 and len(dist.types["exporters"]) > 30
    for kind, name in (("receivers", "otlp"), ("processors", "tail_sampling"), ("exporters", "load_balancing")):
        assert name in dist.types[kind]


@pytest.mark.parametrize("path", CONTRIB_CONFIGS, ids=[p.name for p in CONTRIB_CONFIGS])
def test_contrib_config_is_structurally_valid(path: Path) -> None:
    assert config_problems(load_config(path), load_distribution()) == []


def test_collector_yaml_lints() -> None:
    files = [*CONTRIB_CONFIGS, COMPONENTS]
    assert len(CONTRIB_CONFIGS) >= 3
    problems = [
        f"{path.name}:{p.line}:{p.column}: {p.message}"
        for path in files
        for p in linter.run(path.read_text(encoding="utf-8"), YAMLLINT)
    ]
    assert problems == []


def test_bad_configs_are_named() -> None:
    dist = load_distribution()
    good = load_config(COLLECTORS / "gateway.yaml")
    # An old type name that the current distribution only keeps as a deprecated alias, and a typo.
    renamed = {**good, "exporters": {**good["exporters"], "loadbalancing": {}, "otlp/typo": {}}}
    problems = config_problems(renamed, dist)
    assert (
        f"exporters.loadbalancing: 'loadbalancing' is not among the exporters of otelcol-contrib {dist.version}"
        in problems
    )
    assert "exporters.loadbalancing: defined but used by no pipeline" in problems
    assert any(p.startswith("exporters.otlp/typo: 'otlp' is not") for p in problems)
    service = good["service"]
    broken = {**good, "service": {**service, "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["x"]}}}}
    problems = config_problems(broken, dist)
    assert "service.pipelines.traces.exporters: 'x' is not defined under exporters" in problems
    assert "processors.tail_sampling: defined but used by no pipeline" in problems
    bad_lint = [p.rule for p in linter.run("a: 1\na: 2\nb:  [x ]\n", YAMLLINT)]
    assert "key-duplicates" in bad_lint and "brackets" in bad_lint


def test_every_pipeline_limits_memory_first_and_batches_last() -> None:
    for path in CONTRIB_CONFIGS:
        for name, pipeline in load_config(path)["service"]["pipelines"].items():
            processors = [p.split("/", 1)[0] for p in pipeline["processors"]]
            assert processors[0] == "memory_limiter", (path.name, name)
            assert processors[-1] == "batch", (path.name, name)


def test_tail_sampling_keeps_errors_slow_ttft_slo_misses_and_chunk_detail() -> None:
    gateway = load_config(COLLECTORS / "gateway.yaml")
    sampling = gateway["processors"]["tail_sampling"]
    assert sampling == load_config(COLLECTORS / "standalone.yaml")["processors"]["tail_sampling"]
    by_type = {p["type"]: p for p in sampling["policies"]}
    assert by_type["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    (ttft_rule,) = by_type["ottl_condition"]["ottl_condition"]["span"]
    # An attribute every llmtap root span carries, a hop's too (test_slow_ttft_rule_sees_every_root_span).
    assert f'attributes["{sc.HOP_TIME_TO_FIRST_CHUNK}"] >' in ttft_rule
    strings = [p["string_attribute"] for p in sampling["policies"] if p["type"] == "string_attribute"]
    assert {"key": sc.SLO_OUTCOME, "values": ["missed"]} in strings
    # The requests the proxy kept chunk detail for (every reason it gives) are kept whole.
    assert {"key": sc.CHUNK_DETAIL, "values": list(REASONS)} in strings
    assert 0 < by_type["probabilistic"]["probabilistic"]["sampling_percentage"] < 100
    # Tail sampling only holds behind a trace-ID-aware hop: the agent tier routes traces by trace ID.
    agent = load_config(COLLECTORS / "agent.yaml")
    assert agent["service"]["pipelines"]["traces"]["exporters"] == ["load_balancing"]
    assert agent["exporters"]["load_balancing"]["routing_key"] == "traceID"
    for path in (COLLECTORS / "gateway.yaml", COLLECTORS / "agent.yaml", COLLECTORS / "standalone.yaml"):
        assert "tail_sampling" not in load_config(path)["service"]["pipelines"]["metrics"]["processors"]


def test_slow_ttft_rule_sees_every_root_span(tmp_path: Path) -> None:
    """The gateway keeps slow-TTFT traces by an attribute of the root span: a generation's, and a hop's under a
    client that traces (``traceparent``), whose gen_ai.* attributes are its client's to report. Real llmtap,
    spans read off a real OTLP/HTTP receiver; the attribute is the one the gateway's rule names."""
    from tests.e2e.test_otlp import HTTPReceiver, attributes
    from tests.support.procs import Llmtap as Proxy

    sampling = load_config(COLLECTORS / "gateway.yaml")["processors"]["tail_sampling"]
    (rule,) = next(p for p in sampling["policies"] if p["type"] == "ottl_condition")["ottl_condition"]["span"]
    match = re.fullmatch(r'attributes\["([^"]+)"\] > ([0-9.]+)', rule)
    assert match is not None, rule
    key, threshold = match[1], float(match[2])
    upstream = Scripted(SCRIPT_TTFT="0.02", SCRIPT_GAP="0.005", SCRIPT_CHUNKS="4")
    receiver = HTTPReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    proxy = Proxy(upstream.url, tmp_path / "llmtap.log", env=env)
    try:
        with httpx.Client(timeout=10) as client:
            stream_chat(client, proxy.url)
            stream_chat(client, proxy.url, traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            # A slow one, by the upstream's own delay: the rule keeps it.
            slow = {"x-script-delay": f"{threshold + 0.1}"}
            with client.stream("POST", f"{proxy.url}/v1/chat/completions", json=CHAT, headers=slow) as r:
                assert r.status_code == 200
                assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        deadline = time.monotonic() + PATIENCE

        def roots() -> list[dict[str, Any]]:
            spans = receiver.received.spans()
            ids = {s.span_id for _, s in spans}
            # A root here: a span whose parent is not among llmtap's (the hop's parent is the client's).
            return [attributes(s.attributes) for _, s in spans if not s.parent_span_id or s.parent_span_id not in ids]

        while len(roots()) < 3:
            assert time.monotonic() < deadline, f"no three root spans:\n{proxy.logs()[-2000:]}"
            time.sleep(0.05)
        found = roots()
        assert {a.get("llmtap.span.role", "generation") for a in found} == {"generation", "hop"}
        assert all(isinstance(a.get(key), float) and a[key] > 0 for a in found), [a.get(key) for a in found]
        assert sorted(a[key] > threshold for a in found) == [False, False, True]
    finally:
        proxy.close()
        receiver.close()
        upstream.close()


def test_attribute_names_in_configs_are_llmtap_names() -> None:
    known = {v for k, v in vars(sc).items() if k.isupper() and isinstance(v, str)}
    named: set[str] = set()
    for path in CONTRIB_CONFIGS:
        text = path.read_text(encoding="utf-8")
        named |= set(re.findall(r'attributes\["([^"]+)"\]', text))
        named |= {p["string_attribute"]["key"] for p in _policies(load_config(path)) if "string_attribute" in p}
    assert named and named <= known, sorted(named - known)


def _policies(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        p for cid, body in config["processors"].items() if cid.startswith("tail_sampling") for p in body["policies"]
    ]


def test_environment_variables_are_documented() -> None:
    readme = (COLLECTORS / "README.md").read_text(encoding="utf-8")
    variables = {v for path in CONTRIB_CONFIGS for v in re.findall(r"\$\{env:(\w+)", path.read_text(encoding="utf-8"))}
    assert variables and {v for v in variables if f"`{v}`" not in readme} == set()


# --- rotel, for real ---------------------------------------------------------------------------


def rotel_binary() -> Path | None:
    """The agent binary inside the installed ``rotel`` wheel."""
    spec = importlib.util.find_spec("rotel")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "rotel-agent"
    return binary if binary.is_file() else None


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and ``#`` comments skipped."""
    out: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


@pytest.fixture(scope="module")
def rotel() -> Path:
    binary = rotel_binary()
    require_real(binary is not None, "rotel", "pip install rotel, part of the test extra")
    assert binary is not None
    return binary


@pytest.mark.real
def test_rotel_env_names_only_rotel_options(rotel: Path) -> None:
    usage = subprocess.run([str(rotel), "start", "--help"], capture_output=True, text=True, timeout=30, check=True)
    options = set(re.findall(r"\[env: (ROTEL_\w+)=", usage.stdout))
    assert len(options) > 50
    settings = read_env_file(ROTEL_ENV)
    assert settings and set(settings) - options == set()


_VALUE = re.compile(r"(Str|Int|Double|Bool|Slice|Bytes|Map|Empty)\((.*)\)$")


def _value(text: str) -> Any:
    """A value as rotel's detailed debug log prints it: ``Str(chat)``, ``Int(12)``, ``Slice(Str(stop))``."""
    match = _VALUE.match(text.strip())
    if match is None:
        return text.strip()
    kind, inner = match.groups()
    if kind == "Int":
        return int(inner)
    if kind == "Double":
        return float(inner)
    if kind == "Bool":
        return inner == "true"
    if kind == "Slice":
        return [_value(part) for part in re.findall(r"\w+\([^()]*\)", inner)]
    return inner


@dataclass
class SpanSeen:
    """One span as the collector printed it."""

    resource: dict[str, Any]
    fields: dict[str, str] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.fields["Name"]


@dataclass
class PointSeen:
    """One metric data point as the collector printed it (cumulative: later prints supersede earlier ones)."""

    resource: dict[str, Any]
    metric: dict[str, Any]
    fields: dict[str, str] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    #: Each exemplar's fields (``Trace ID``, ``Span ID``, ``Value``, ...), in the order printed.
    exemplars: list[dict[str, Any]] = field(default_factory=list)


def parse_debug_log(text: str) -> tuple[list[SpanSeen], list[PointSeen]]:
    """Spans and data points from rotel's ``--debug-log-verbosity detailed`` output."""
    spans: list[SpanSeen] = []
    points: list[PointSeen] = []
    resource: dict[str, Any] = {}
    metric: dict[str, Any] = {}
    target: dict[str, Any] = resource
    current: SpanSeen | PointSeen | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if line.startswith(("ResourceSpans #", "ResourceMetrics #")):
            resource, current = {}, None
        elif line == "Resource attributes:":
            target = resource
        elif line.startswith("Span #"):
            current = SpanSeen(dict(resource))
            spans.append(current)
        elif line.startswith("Metric #"):
            metric, current = {}, None
        elif line == "Descriptor:":
            target = metric
        elif re.match(r"(Number|Histogram)DataPoints #", line):
            current = PointSeen(dict(resource), metric)
            points.append(current)
        elif line in ("Attributes:", "Data point attributes:") and current is not None:
            target = current.attributes
        elif line.startswith("Exemplar #") and isinstance(current, PointSeen):
            current.exemplars.append({})
            target = current.exemplars[-1]
        elif stripped.startswith("-> ") and ": " in stripped:
            key, _, value = stripped[3:].partition(": ")
            target[key] = _value(value)
        elif ":" in stripped and current is not None:
            key, _, value = stripped.partition(":")
            current.fields[key.strip()] = value.strip()
    return spans, points


@dataclass
class Received:
    """What the sink printed, for one llmtap service."""

    spans: list[SpanSeen]
    points: list[PointSeen]

    def latest(self, metric: str) -> list[PointSeen]:
        """The newest point of each series of ``metric``."""
        series: dict[str, PointSeen] = {}
        for p in self.points:
            if p.metric.get("Name") == metric:
                series[json.dumps(p.attributes, sort_keys=True)] = p
        return list(series.values())


def received(text: str, service: str) -> Received:
    spans, points = parse_debug_log(text)
    return Received(
        [s for s in spans if s.resource.get("service.name") == service],
        [p for p in points if p.resource.get("service.name") == service],
    )


@dataclass
class RotelStack:
    """rotel with the shipped configuration (the agent), forwarding to a rotel that prints (the sink)."""

    agent: Proc
    sink: Proc
    grpc_port: int
    http_port: int


@pytest.fixture(scope="module")
def rotel_stack(rotel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RotelStack]:
    tmp = tmp_path_factory.mktemp("rotel")
    sink_grpc, sink_http, grpc_port, http_port = (free_port() for _ in range(4))
    sink = Proc(
        [
            str(rotel),
            "start",
            "--otlp-grpc-endpoint",
            f"127.0.0.1:{sink_grpc}",
            "--otlp-http-endpoint",
            f"127.0.0.1:{sink_http}",
            "--exporter",
            "blackhole",
            *("--debug-log", "traces", "--debug-log", "metrics", "--debug-log-verbosity", "detailed"),
            *("--pid-file", str(tmp / "sink.pid"), "--log-file", str(tmp / "sink.log")),
        ],
        tmp / "sink.out",
    )
    agent_env = {
        **read_env_file(ROTEL_ENV),
        # Only the addresses change: loopback ports of this test, and the sink as the next hop.
        "ROTEL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc_port}",
        "ROTEL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}",
        "ROTEL_OTLP_EXPORTER_ENDPOINT": f"http://127.0.0.1:{sink_grpc}",
        "ROTEL_PID_FILE": str(tmp / "agent.pid"),
        "ROTEL_LOG_FILE": str(tmp / "agent.log"),
    }
    agent = Proc([str(rotel), "start"], tmp / "agent.out", clean_env(**agent_env))
    try:
        sink.wait_until("rotel sink gRPC port", listening(sink_grpc))
        agent.wait_until("rotel agent gRPC port", listening(grpc_port))
        agent.wait_until("rotel agent HTTP port", listening(http_port))
        yield RotelStack(agent, sink, grpc_port, http_port)
    finally:
        agent.close()
        sink.close()


@pytest.fixture(scope="module")
def scripted_upstream() -> Iterator[Scripted]:
    up = Scripted(SCRIPT_TTFT=str(TTFT), SCRIPT_GAP="0.005", SCRIPT_CHUNKS=str(CHUNKS))
    yield up
    up.close()


REQUESTS = 3


@pytest.mark.real
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_rotel_receives_llmtap_spans_and_metrics(
    protocol: str, rotel_stack: RotelStack, scripted_upstream: Scripted, tmp_path: Path
) -> None:
    port = rotel_stack.grpc_port if protocol == "grpc" else rotel_stack.http_port
    service = "llmtap-" + protocol.split("/")[0]
    env = {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    proxy = start_llmtap(scripted_upstream.url, tmp_path / "llmtap.log", env)
    try:
        with httpx.Client(timeout=10) as client:
            for _ in range(REQUESTS):
                assert stream_chat(client, proxy.url)[-1] == "[DONE]"

        def arrived() -> bool:
            got = received(rotel_stack.sink.output(), service)
            roots = [s for s in got.spans if s.name == "chat scripted"]
            counts = [int(p.fields.get("Count", 0)) for p in got.latest(RELEASED_TTFC)]
            return len(roots) == REQUESTS and sum(counts) == REQUESTS

        rotel_stack.sink.wait_until(f"{REQUESTS} traces and metrics from {service}", arrived, timeout=PATIENCE)
    finally:
        proxy.proc.close()
    got = received(rotel_stack.sink.output(), service)
    check_spans(got.spans)
    check_metrics(got)
    print(f"\nrotel sink, {protocol}: {len(got.spans)} spans, {len(got.points)} data points printed")


RELEASED_TTFC = sc.RELEASED.time_to_first_chunk


def check_spans(spans: list[SpanSeen]) -> None:
    roots = [s for s in spans if s.name == "chat scripted"]
    assert len(roots) == REQUESTS
    for root in roots:
        assert root.fields["Kind"] == "SPAN_KIND_CLIENT"
        assert root.fields["Parent ID"] == ""
        assert root.fields["Status code"] == "STATUS_CODE_UNSET"
        attrs = root.attributes
        assert attrs[sc.OPERATION_NAME] == sc.OP_CHAT
        assert attrs[sc.PROVIDER_NAME] == "openai"
        assert attrs[sc.REQUEST_MODEL] == attrs[sc.RESPONSE_MODEL] == "scripted"
        assert attrs[sc.REQUEST_STREAM] is True
        assert attrs[sc.USAGE_OUTPUT_TOKENS] == TOKENS
        assert attrs[sc.RESPONSE_FINISH_REASONS] == ["stop"]
        assert attrs[sc.OUTCOME] == "ok"
        assert TTFT <= attrs[sc.RESPONSE_TIME_TO_FIRST_CHUNK] < TTFT + 1.0
        trace = [s for s in spans if s.fields["Trace ID"] == root.fields["Trace ID"]]
        children = {s.name: s for s in trace if s.fields["Parent ID"] == root.fields["ID"]}
        assert {sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE} <= set(children)
        decode_id = children[sc.SPAN_DECODE].fields["ID"]
        chunks = [s for s in trace if s.name == sc.SPAN_CHUNK and s.fields["Parent ID"] == decode_id]
        assert sorted(c.attributes[sc.CHUNK_INDEX] for c in chunks) == list(range(CHUNKS))
        assert sum(c.attributes[sc.CHUNK_TOKENS] for c in chunks) == TOKENS
        assert children[sc.SPAN_DECODE].attributes[sc.OUTPUT_TOKENS] == TOKENS


def check_metrics(got: Received) -> None:
    (ttfc,) = got.latest(RELEASED_TTFC)
    assert ttfc.metric["Unit"] == "s" and ttfc.metric["DataType"] == "Histogram"
    # Exemplars through a real collector (each export carries those of its own interval): every one names a trace
    # llmtap exported, with a value inside the histogram's.
    traces = {s.fields["Trace ID"] for s in got.spans}
    exemplars = [e for p in got.points if p.metric.get("Name") == RELEASED_TTFC for e in p.exemplars]
    assert exemplars and {e["Trace ID"] for e in exemplars} <= traces, exemplars
    assert all(float(ttfc.fields["Min"]) <= float(e["Value"]) <= float(ttfc.fields["Max"]) for e in exemplars)
    assert int(ttfc.fields["Count"]) == REQUESTS
    assert REQUESTS * TTFT <= float(ttfc.fields["Sum"]) < REQUESTS * (TTFT + 1.0)
    assert ttfc.attributes[sc.REQUEST_MODEL] == "scripted"
    assert sc.ROUTE not in ttfc.attributes  # the conventions' attributes only; llmtap's own TTFT has the route
    (ttft,) = got.latest(sc.METRIC_TTFT)
    assert int(ttft.fields["Count"]) == REQUESTS and ttft.attributes[sc.ROUTE] == "default"
    usage = {p.attributes[sc.TOKEN_TYPE]: p for p in got.latest(sc.RELEASED.token_usage or "")}
    assert int(usage["output"].fields["Count"]) == REQUESTS
    assert float(usage["output"].fields["Sum"]) == REQUESTS * TOKENS
    (requests,) = got.latest(sc.METRIC_REQUESTS)
    assert requests.metric["DataType"] == "Sum" and requests.metric["IsMonotonic"] == "true"
    assert requests.attributes[sc.OUTCOME] == "ok"
    assert float(requests.fields["Value"]) == REQUESTS
    (active,) = got.latest(sc.METRIC_ACTIVE_STREAMS)
    assert float(active.fields["Value"]) == 0


# --- records as OTLP log records, into rotel for real ------------------------------------------------------


@dataclass
class LogSeen:
    """One log record as rotel's detailed debug log printed it."""

    resource: dict[str, Any]
    fields: dict[str, str] = field(default_factory=dict)


def parse_log_records(text: str) -> list[LogSeen]:
    """Log records from rotel's ``--debug-log logs --debug-log-verbosity detailed`` output."""
    logs: list[LogSeen] = []
    resource: dict[str, Any] = {}
    current: LogSeen | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if line.startswith("ResourceLog #"):
            resource, current = {}, None
        elif line.startswith("LogRecord #"):
            current = LogSeen(dict(resource))
            logs.append(current)
        elif stripped.startswith("-> ") and ": " in stripped and current is None:
            key, _, value = stripped[3:].partition(": ")
            resource[key] = _value(value)
        elif ":" in stripped and current is not None:
            key, _, value = stripped.partition(":")
            current.fields.setdefault(key.strip(), value.strip())
    return logs


@pytest.mark.real
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_records_reach_rotel_as_otlp_log_records(
    protocol: str, rotel: Path, scripted_upstream: Scripted, tmp_path: Path
) -> None:
    grpc_port, http_port = free_port(), free_port()
    sink = Proc(
        [
            str(rotel),
            "start",
            *("--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}", "--otlp-http-endpoint", f"127.0.0.1:{http_port}"),
            *("--exporter", "blackhole", "--debug-log", "logs", "--debug-log-verbosity", "detailed"),
            *("--pid-file", str(tmp_path / "sink.pid"), "--log-file", str(tmp_path / "sink.log")),
        ],
        tmp_path / "sink.out",
    )
    records = tmp_path / "records"
    try:
        sink.wait_until("rotel gRPC port", listening(grpc_port))
        sink.wait_until("rotel HTTP port", listening(http_port))
        port = grpc_port if protocol == "grpc" else http_port
        env = {
            "OTEL_SERVICE_NAME": "llmtap-logs",
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": f"http://127.0.0.1:{port}" + ("/v1/logs" if protocol != "grpc" else ""),
            "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": protocol,
            "OTEL_BLRP_SCHEDULE_DELAY": "100",
        }
        proxy = start_llmtap(
            scripted_upstream.url, tmp_path / "llmtap.log", env, "--record", str(records), "--record-logs", "true"
        )
        try:
            with httpx.Client(timeout=10) as client:
                for _ in range(REQUESTS):
                    assert stream_chat(client, proxy.url)[-1] == "[DONE]"
            sink.wait_until(
                f"{REQUESTS} log records", lambda: len(parse_log_records(sink.output())) >= REQUESTS, timeout=PATIENCE
            )
        finally:
            proxy.proc.close()
    finally:
        sink.close()
    logs = parse_log_records(sink.output())
    on_disk = {r["trace_id"]: r for r in read_records(records, ReadStats())}
    assert len(logs) == len(on_disk) == REQUESTS
    for seen in logs:
        f = seen.fields
        assert f["EventName"] == "llmtap.request" and f["SeverityText"] == "INFO"
        record = on_disk[f["Trace ID"]]  # the log record carries the request's trace and root span
        assert f["Span ID"] == record["span_id"]
        assert seen.resource["service.name"] == "llmtap-logs"
        assert seen.resource["service.instance.id"] == record["instance_id"]
        # The body is the record: the same fields and values as its line on disk.
        body = f["Body"]
        assert body.startswith("Map(llmtap_record:Int(2), time:Str(" + record["time"] + ")")
        for key in ("trace_id", "span_id", "instance_id", "route", "outcome", "response_id"):
            assert f"{key}:Str({record[key]})" in body, key
        assert f"ttft:Double({record['ttft']})" in body and f"pid:Int({record['pid']})" in body


def test_record_pipelines_land_logs_in_clickhouse_and_in_files() -> None:
    clickhouse = load_config(COLLECTORS / "records-clickhouse.yaml")
    assert clickhouse["service"]["pipelines"]["logs"]["exporters"] == ["clickhouse"]
    exporter = clickhouse["exporters"]["clickhouse"]
    assert exporter["endpoint"] == "${env:CLICKHOUSE_ENDPOINT}" and exporter["create_schema"] is True
    assert (exporter["database"], exporter["logs_table_name"]) == ("llmtap", "llmtap_records")
    files = load_config(COLLECTORS / "records-files.yaml")
    assert files["service"]["pipelines"]["logs"]["exporters"] == ["file"]
    assert (
        files["exporters"]["file"]["path"] == "${env:RECORDS_FILE}" and files["exporters"]["file"]["format"] == "json"
    )
    for config in (clickhouse, files):
        assert set(config["service"]["pipelines"]) == {"logs"}
        assert config["receivers"]["otlp"]["protocols"].keys() == {"grpc", "http"}
    readme = (COLLECTORS / "README.md").read_text(encoding="utf-8")
    assert "records-clickhouse.yaml" in readme and "records-files.yaml" in readme
