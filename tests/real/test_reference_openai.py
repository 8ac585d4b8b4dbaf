"""The independent reference: the official OpenTelemetry instrumentation of the ``openai`` SDK, through llmtap.

An application (``tests/support/reference_client.py``: the ``openai`` SDK under
``opentelemetry-instrumentation-openai-v2``, in its own virtual environment) calls ``llmtap serve`` in
front of ``llmtap simulate``; both export over OTLP/HTTP to one receiver that decodes what arrives. The
calls: a whole answer, a stream without and with ``include_usage``, an unknown model (the upstream's 404),
and a call llmtap refuses itself (``--max-concurrency 1 --queue-limit 0``, made while a stream holds the
slot). Twice: with llmtap's default span role (``hop`` when a ``traceparent`` arrives) and with
``LLMTAP_SPAN_ROLE=generation``.

For every call, the application's ``chat {model}`` span and llmtap's span are compared attribute by
attribute, and the two sides' ``gen_ai.client.*`` metrics point by point. Every difference is listed once,
in ``SPAN_DIFFERENCES`` and ``METRIC_DIFFERENCES``, with its reason: a difference not listed fails, and so
does a listed one that no longer differs. ``docs/reference-comparison.md`` is the same list as a table,
with the values seen and the conventions' words (v1.41.1). The upstream's own record of each request
(``GET /debug/requests``) is the truth usage is held to.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from llmtap.telemetry.emit.instruments import DURATION_BUCKETS, TOKEN_BUCKETS
from tests.conftest import PATIENCE, TOOLS, free_port, require_real
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.real.test_collectors import Proc, clean_env, listening, start_llmtap

ROOT = Path(__file__).resolve().parents[2]
PYTHON = TOOLS / "openai-reference" / "bin" / "python"
CLIENT = ROOT / "tests" / "support" / "reference_client.py"
MODEL = "llmtap-sim"
ROLES = ("hop", "generation")

# The calls tests/support/reference_client.py makes, by its names for them.
OK_CALLS = frozenset({"chat", "stream", "stream_usage", "held"})
STREAMED = frozenset({"stream", "stream_usage", "held"})
ERRORS = frozenset({"unknown_model", "refused"})
ALL_CALLS = OK_CALLS | ERRORS
#: Calls whose answer carried usage to the application (non-streamed, or ``include_usage``).
USAGE_SEEN = frozenset({"chat", "stream_usage", "held"})
STATUS = {"unknown_model": 404, "refused": 503}

# v1.41.1 model/gen-ai/metrics.yaml: the advisory ExplicitBucketBoundaries.
DURATION_BOUNDS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TOKEN_BOUNDS = [float(4**i) for i in range(14)]  # 1, 4, 16, ... 67108864
#: v1.41.1 gen-ai-metrics.md and openai.md: the attributes of gen_ai.client.operation.duration and
#: gen_ai.client.token.usage (the latter adds gen_ai.token.type).
METRIC_ATTRIBUTES = frozenset(
    {
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "server.address",
        "server.port",
        "error.type",
        "openai.response.service_tier",
        "openai.response.system_fingerprint",
    }
)

REFERENCE, INTENDED = "the reference's fault", "intended"
#: llmtap's own metrics, which see every request through the proxy, in either span role.
REQUESTS, OWN_INPUT, OWN_OUTPUT = "llmtap.requests", "llmtap.usage.input_tokens", "llmtap.usage.output_tokens"
OWN_TTFT = "llmtap.time_to_first_token"


@dataclass(frozen=True)
class Difference:
    """Where the application's span (or metric) and llmtap's differ on purpose or by the reference's fault."""

    calls: frozenset[str]
    verdict: str
    reason: str


#: Attribute by attribute, application span against llmtap's span (span role ``generation``). Names under
#: ``llmtap.`` are llmtap's own and not compared.
SPAN_DIFFERENCES: dict[str, tuple[Difference, ...]] = {
    "server.port": (
        Difference(
            ALL_CALLS,
            INTENDED,
            "each side names the server it called: the application llmtap's port, llmtap the model server's "
            "(server.address is 127.0.0.1 for both here). The application cannot see behind the proxy.",
        ),
    ),
    "gen_ai.request.stream": (
        Difference(STREAMED, REFERENCE, 'v1.41.1: "Conditionally Required: If and only if the request is streaming."'),
    ),
    "gen_ai.response.finish_reasons": (
        Difference(
            STREAMED,
            REFERENCE,
            'Recommended: "Array of reasons the model stopped generating tokens, corresponding to each generation '
            'received." The reference records them for whole answers only.',
        ),
        Difference(
            ERRORS,
            INTENDED,
            'llmtap follows semantic-conventions-genai: a missing or aborted finish is reported as "error".',
        ),
    ),
    "gen_ai.response.time_to_first_chunk": (
        Difference(STREAMED, REFERENCE, 'v1.41.1: "Recommended if the request was a streaming request".'),
    ),
    "gen_ai.usage.input_tokens": (
        Difference(
            frozenset({"stream"}),
            INTENDED,
            "llmtap asks the upstream for usage (stream_options.include_usage, stripped from what the client "
            "reads); the application's SDK got none, and rightly reports none (metrics: 'Otherwise it MUST NOT "
            "report usage').",
        ),
    ),
    "gen_ai.usage.output_tokens": (Difference(frozenset({"stream"}), INTENDED, "as gen_ai.usage.input_tokens"),),
    "gen_ai.usage.cache_read.input_tokens": (
        Difference(
            OK_CALLS,
            REFERENCE,
            'openai.md: Recommended; "Corresponds to usage.input_tokens_details.cached_tokens or a similar property '
            'in the model response" (Chat Completions: usage.prompt_tokens_details.cached_tokens, here 0).',
        ),
    ),
    "error.type": (
        Difference(
            ERRORS,
            REFERENCE,
            "the reference records the exception class's repr, \"<class 'openai.NotFoundError'>\"; v1.41.1: \"SHOULD "
            "match the error code returned by the Generative AI provider or the client library, the canonical name "
            'of exception that occurred, or another low-cardinality error identifier". For the refusal llmtap names '
            "its own reason (queue_full) where the application sees only a 503.",
        ),
    ),
    "openai.response.system_fingerprint": (
        Difference(
            STREAMED - {"stream"},
            REFERENCE,
            "openai.md: Recommended. The upstream sends it in the stream's usage chunk; the reference reads it "
            "from whole answers only.",
        ),
        Difference(
            frozenset({"stream"}),
            INTENDED,
            "it came in the usage chunk llmtap asked for and removed from what the client reads",
        ),
    ),
    "openai.api.type": (
        Difference(ALL_CALLS, REFERENCE, 'openai.md: Recommended, "chat_completions" or "responses".'),
    ),
    "http.request.method": (
        Difference(ALL_CALLS, INTENDED, "llmtap's span is also the HTTP exchange of its hop: method, path, status."),
    ),
    "http.response.status_code": (Difference(ALL_CALLS, INTENDED, "as http.request.method"),),
    "url.path": (Difference(ALL_CALLS, INTENDED, "as http.request.method"),),
}

#: What differs between the two sides' metrics, by instrument or metric attribute.
METRIC_DIFFERENCES: dict[str, Difference] = {
    "server.port": Difference(ALL_CALLS, INTENDED, "each side's own next hop, as on the spans"),
    "error.type": Difference(ERRORS, REFERENCE, "the class repr, as on the spans (and llmtap's own queue_full)"),
    "openai.response.system_fingerprint": Difference(
        frozenset({"chat"}),
        INTENDED,
        "openai.md lists it as Recommended on both metrics; llmtap keeps it on spans: every server deployment "
        "would start new series of every instrument.",
    ),
    "gen_ai.client.token.usage": Difference(
        frozenset({"stream"}),
        INTENDED,
        "llmtap has the upstream's usage of the stream the client read without include_usage",
    ),
    "gen_ai.client.operation.time_to_first_chunk": Difference(
        STREAMED,
        REFERENCE,
        'v1.41.1: Recommended, "SHOULD be reported for streaming calls"; the reference does not record it.',
    ),
    "gen_ai.client.operation.time_per_output_chunk": Difference(
        STREAMED, REFERENCE, "v1.41.1: Recommended for streaming calls; the reference does not record it."
    ),
}


# --- what the receiver decoded ----------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class SpanSeen:
    """One span as it arrived: its service, ids, times and attributes."""

    service: str
    span: Span
    attrs: dict[str, Any]

    @property
    def id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def trace(self) -> str:
        return self.span.trace_id.hex()


@dataclass(repr=False)
class Run:
    """One pass of the application's calls through llmtap, and what each side exported."""

    llmtap_port: int
    upstream_port: int
    calls: dict[str, dict[str, Any]]
    truth: dict[str, dict[str, Any]]
    app: dict[str, SpanSeen]  # by call name
    llmtap: dict[str, SpanSeen]  # by call name: llmtap's span under the application's
    children: Counter[str]  # llmtap spans by the application span they are under
    metrics: dict[str, dict[str, Metric]]  # service -> name -> latest export

    def usage(self, call: str) -> tuple[int, int]:
        """(input, output) tokens as the upstream recorded them for a call's response."""
        record = self.truth[self.calls[call]["id"]]
        return record["prompt_tokens"], record["output_tokens"]


def spans_of(receiver: HTTPReceiver) -> list[SpanSeen]:
    return [SpanSeen(str(res["service.name"]), s, attributes(s.attributes)) for res, s in receiver.received.spans()]


def metrics_of(receiver: HTTPReceiver) -> dict[str, dict[str, Metric]]:
    out: dict[str, dict[str, Metric]] = {}
    with receiver.received.lock:
        for request in receiver.received.metrics:
            for rm in request.resource_metrics:
                service = str(attributes(rm.resource.attributes)["service.name"])
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        out.setdefault(service, {})[metric.name] = metric
    return out


def points(metric: Metric | None) -> list[tuple[dict[str, Any], Any]]:
    """(attributes, data point) of a histogram."""
    if metric is None:
        return []
    return [(attributes(p.attributes), p) for p in metric.histogram.data_points]


def total_count(metric: Metric | None) -> int:
    return sum(p.count for _, p in points(metric))


def counter_total(metric: Metric | None) -> float:
    """The sum of a counter's data points (cumulative: the latest export's)."""
    if metric is None:
        return 0
    return float(sum(p.as_int or p.as_double for p in metric.sum.data_points))


def wait(what: str, check: Callable[[], bool], proc: Proc, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s:\n{proc.tail()}"
        time.sleep(0.1)


def run_calls(role: str, receiver: HTTPReceiver, upstream_port: int, tmp: Path) -> Run:
    """Start llmtap for ``role``, run the application through it, and collect both sides' telemetry."""
    env = {
        "OTEL_SERVICE_NAME": f"llmtap-{role}",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRIC_EXPORT_INTERVAL": "250",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    if role == "generation":
        env["LLMTAP_SPAN_ROLE"] = "generation"
    upstream = f"http://127.0.0.1:{upstream_port}"
    proxy = start_llmtap(upstream, tmp / f"llmtap-{role}.log", env, "--max-concurrency", "1", "--queue-limit", "0")
    try:
        client = subprocess.run(
            [str(PYTHON), str(CLIENT), f"{proxy.url}/v1", receiver.url],
            env=clean_env(OTEL_SERVICE_NAME=f"app-{role}"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert client.returncode == 0, client.stderr[-4000:]
        calls = {c["case"]: c for c in map(json.loads, client.stdout.splitlines())}
        assert set(calls) == ALL_CALLS, calls

        app_ids = {c["span_id"]: name for name, c in calls.items()}

        def by_call() -> tuple[dict[str, SpanSeen], dict[str, SpanSeen]]:
            seen = spans_of(receiver)
            app = {app_ids[s.id]: s for s in seen if s.service == f"app-{role}" and s.id in app_ids}
            under = {app_ids[s.parent]: s for s in seen if s.service == f"llmtap-{role}" and s.parent in app_ids}
            return app, under

        wait("span of each side for every call", lambda: all(len(side) == len(calls) for side in by_call()), proxy.proc)

        def ours() -> dict[str, Metric]:
            return metrics_of(receiver).get(f"llmtap-{role}", {})

        # llmtap's own request count, in either role (a hop records no gen_ai.client.* metric).
        every = len(calls)
        wait("llmtap's request count for every call", lambda: counter_total(ours().get(REQUESTS)) == every, proxy.proc)
        if role == "generation":
            name = "gen_ai.client.operation.duration"
            wait("llmtap's duration metric for every call", lambda: total_count(ours().get(name)) == every, proxy.proc)
        # A request's instruments are recorded one after another, and an export can fall between two of them:
        # the token counts of the last call may come an export later than its request count.
        settled: list[tuple[float, ...]] = []

        def tokens_settled() -> bool:
            now = ours()
            tokens = (total_count(now.get("gen_ai.client.token.usage")),)
            settled.append(tokens + tuple(counter_total(now.get(n)) for n in (OWN_INPUT, OWN_OUTPUT)))
            return len(settled) > 10 and len(set(settled[-10:])) == 1  # the same over 1 s, 4 exports

        wait("llmtap's token counts to settle", tokens_settled, proxy.proc)
        truth = {r["id"]: r for r in httpx.get(f"{upstream}/debug/requests", timeout=5).json()["requests"]}
        app, under = by_call()
        children = Counter(
            s.parent for s in spans_of(receiver) if s.service == f"llmtap-{role}" and s.parent in app_ids
        )
        return Run(proxy.port, upstream_port, calls, truth, app, under, children, metrics_of(receiver))
    finally:
        proxy.proc.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    require_real(
        PYTHON.is_file(), "opentelemetry-instrumentation-openai-v2", "run .ci/install.d/27-openai-reference.sh"
    )
    tmp = tmp_path_factory.mktemp("reference")
    port = free_port()
    simulator = Proc(
        [sys.executable, "-m", "llmtap", "simulate", "--profile", "fast", "--port", str(port)],
        tmp / "simulate.log",
    )
    receiver = HTTPReceiver()
    try:
        simulator.wait_until("llmtap simulate", listening(port))
        yield {role: run_calls(role, receiver, port, tmp) for role in ROLES}
    finally:
        receiver.close()
        simulator.close()


# --- the comparisons ----------------------------------------------------------------------------------

#: The model each call asked for.
MODELS = {"unknown_model": "no-such-model"}
#: Wall-clock stamps of two processes, one converted from monotonic time: their agreement, generously.
CLOCK_SLACK_NS = 5_000_000
#: The SDK ends its span at the stream's ``[DONE]`` event; llmtap's hop ends when the upstream's body ends, which
#: follows ``[DONE]`` by the upstream's last write and the relay's next turn: a few ms, more on a busy machine.
END_SLACK_NS = 100_000_000
#: What makes a span a generation (gen-ai-spans.md): the hop span carries none of it.
GENERATION = frozenset({"gen_ai.operation.name", "gen_ai.request.model"})


def same(a: Any, b: Any) -> bool:
    """Equal in value and in type: an int is not a double, a list not a string."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.real
@pytest.mark.parametrize("role", ROLES)
def test_llmtap_span_is_the_child_of_the_applications_span(runs: dict[str, Run], role: str) -> None:
    run = runs[role]
    assert run.children == Counter({c["span_id"]: 1 for c in run.calls.values()}), "one llmtap span per call"
    for call, app in run.app.items():
        ours = run.llmtap[call]
        assert app.span.kind == Span.SPAN_KIND_CLIENT
        assert app.span.name == f"chat {MODELS.get(call, MODEL)}"
        assert (ours.trace, ours.parent) == (app.trace, app.id), call
        # The hop is part of the call: llmtap's span lies inside the application's.
        assert app.span.start_time_unix_nano - CLOCK_SLACK_NS <= ours.span.start_time_unix_nano, call
        assert ours.span.end_time_unix_nano <= app.span.end_time_unix_nano + END_SLACK_NS, call


@pytest.mark.real
def test_hop_role_leaves_the_generation_to_the_application(runs: dict[str, Run]) -> None:
    """With a ``traceparent``, llmtap's span is the HTTP hop: one generation per call, its tokens counted once."""
    run = runs["hop"]
    for call in sorted(ALL_CALLS):
        app, ours = run.app[call], run.llmtap[call]
        assert app.attrs["gen_ai.operation.name"] == "chat"
        assert (ours.span.kind, ours.span.name) == (Span.SPAN_KIND_SERVER, "POST /v1/chat/completions"), call
        repeated = sorted(k for k in ours.attrs if k.startswith("gen_ai.usage.") or k in GENERATION)
        assert not repeated, (call, repeated)
        tokens = (ours.attrs.get("llmtap.usage.input_tokens"), ours.attrs.get("llmtap.usage.output_tokens"))
        assert tokens == (run.usage(call) if call in OK_CALLS else (None, None)), call
        assert ours.attrs.get("http.response.status_code") == STATUS.get(call, 200), call
        # http-spans.md: a SERVER span leaves 4xx unset unless the instrumentation knows better (llmtap may:
        # the model is unknown), and sets Error for 5xx.
        if call != "unknown_model":
            expected = Status.STATUS_CODE_ERROR if call in ERRORS else Status.STATUS_CODE_UNSET
            assert ours.span.status.code == expected, call


@pytest.mark.real
def test_hop_role_counts_each_generation_once_in_the_metrics(runs: dict[str, Run]) -> None:
    """With a ``traceparent``, the application's instrumentation records the generation in the gen_ai.client.*
    metrics; llmtap records it in its own (llmtap.*) alone. A backend summing gen_ai.client.token.usage over
    everything it received counts what the application made, once; llmtap's own metrics count every call."""
    run = runs["hop"]
    app, ours = run.metrics["app-hop"], run.metrics["llmtap-hop"]
    for index, kind in enumerate(("input", "output")):
        made = sum(run.usage(c)[index] for c in USAGE_SEEN)
        counted = {
            service: sum(p.sum for attrs, p in points(metrics.get(TOKENS)) if attrs["gen_ai.token.type"] == kind)
            for service, metrics in run.metrics.items()
            if service.endswith("-hop")
        }
        # The instrumentation's own count is what the application made, and the backend's total is that count.
        assert counted["app-hop"] == made > 0, (kind, counted)
        assert sum(counted.values()) == made, (kind, counted)
    assert not sorted(n for n in ours if n.startswith("gen_ai.")), sorted(ours)
    # llmtap's own metrics: every call once, the tokens of every answer the model gave (the stream the client
    # read without usage included), none for the two calls it never processed.
    assert counter_total(ours[REQUESTS]) == len(ALL_CALLS)
    assert counter_total(ours[OWN_INPUT]) == sum(run.usage(c)[0] for c in OK_CALLS)
    assert counter_total(ours[OWN_OUTPUT]) == sum(run.usage(c)[1] for c in OK_CALLS)
    assert total_count(ours[OWN_TTFT]) == len(STREAMED)
    assert set(app) == {DURATION, TOKENS}, sorted(app)


@pytest.mark.real
def test_generation_role_matches_the_reference_attribute_by_attribute(runs: dict[str, Run]) -> None:
    run = runs["generation"]
    problems: list[str] = []
    for call in sorted(ALL_CALLS):
        app, ours = run.app[call], run.llmtap[call]
        for what in ("name", "kind"):
            if getattr(app.span, what) != getattr(ours.span, what):
                problems.append(f"{call}: span {what}: {getattr(app.span, what)!r} != {getattr(ours.span, what)!r}")
        if app.span.status.code != ours.span.status.code:
            problems.append(f"{call}: status {app.span.status.code} != {ours.span.status.code}")
        for key in sorted((set(app.attrs) | set(ours.attrs)) - {k for k in ours.attrs if k.startswith("llmtap.")}):
            a, b = app.attrs.get(key), ours.attrs.get(key)
            listed = [d for d in SPAN_DIFFERENCES.get(key, ()) if call in d.calls]
            if not listed and not same(a, b):
                problems.append(f"{call}: {key}: application {a!r}, llmtap {b!r} (not a listed difference)")
            if listed and same(a, b):
                problems.append(f"{call}: {key}: listed as {listed[0].verdict}, but both have {a!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.real
def test_generation_role_agreed_values(runs: dict[str, Run]) -> None:
    """What both sides must say, against the SDK's answer and the upstream's own record of each request."""
    run = runs["generation"]
    (fingerprint,) = {c["system_fingerprint"] for c in run.calls.values() if c.get("system_fingerprint")}
    for call in sorted(ALL_CALLS):
        seen, app, ours = run.calls[call], run.app[call].attrs, run.llmtap[call].attrs
        for side in (app, ours):
            assert side["gen_ai.operation.name"] == "chat", call
            assert side["gen_ai.provider.name"] == "openai", call
            assert side["gen_ai.request.model"] == MODELS.get(call, MODEL), call
            assert side["server.address"] == "127.0.0.1", call
        assert (app["server.port"], ours["server.port"]) == (run.llmtap_port, run.upstream_port), call
        assert ours["openai.api.type"] == "chat_completions", call
        usage = sorted(k for k in ours if k.startswith("gen_ai.usage."))
        if call in ERRORS:
            assert ours["http.response.status_code"] == seen["error"]["status"] == STATUS[call], call
            assert ours["error.type"] == {"unknown_model": "NotFoundError", "refused": "queue_full"}[call]
            # The model processed nothing: no usage, and no offline count presented as usage.
            assert not usage, (call, {k: ours[k] for k in usage})
            continue
        assert ours["gen_ai.response.id"] == app["gen_ai.response.id"] == seen["id"], call
        assert ours["gen_ai.response.model"] == app["gen_ai.response.model"] == seen["model"], call
        assert ours["gen_ai.response.finish_reasons"] == seen["finish_reasons"], call
        # The server's one fingerprint, also where the SDK did not get it (the usage chunk llmtap removed).
        assert ours["openai.response.system_fingerprint"] == fingerprint, call
        truth = run.usage(call)
        assert (ours["gen_ai.usage.input_tokens"], ours["gen_ai.usage.output_tokens"]) == truth, call
        if call in USAGE_SEEN:
            assert tuple(seen["usage"]) == truth, call
            assert (app["gen_ai.usage.input_tokens"], app["gen_ai.usage.output_tokens"]) == truth, call


DURATION, TOKENS = "gen_ai.client.operation.duration", "gen_ai.client.token.usage"
TTFC, TPOC = "gen_ai.client.operation.time_to_first_chunk", "gen_ai.client.operation.time_per_output_chunk"
#: Metric attributes whose values differ between the sides (METRIC_DIFFERENCES): left out of the series compared.
DIFFERING = frozenset(k for k in METRIC_DIFFERENCES if k in METRIC_ATTRIBUTES)


def series(metric: Metric | None, **where: str) -> Counter[frozenset[tuple[str, Any]]]:
    """Observations by attribute set (less the ``DIFFERING`` ones; whether it had ``error.type`` kept)."""
    out: Counter[frozenset[tuple[str, Any]]] = Counter()
    for attrs, p in points(metric):
        if all(attrs.get(k) == v for k, v in where.items()):
            key = {(k, v) for k, v in attrs.items() if k not in DIFFERING} | {("error", "error.type" in attrs)}
            out[frozenset(key)] += p.count
    return out


def values(metric: Metric | None, attribute: str) -> set[Any]:
    return {attrs[attribute] for attrs, _ in points(metric) if attribute in attrs}


@pytest.mark.real
def test_generation_role_metrics_match_the_reference(runs: dict[str, Run]) -> None:
    run = runs["generation"]
    app, ours = run.metrics["app-generation"], run.metrics["llmtap-generation"]
    # Every instrument the reference records, llmtap records too, in the same unit. The reference takes the
    # advisory buckets; llmtap by default its fine ones (a listed difference: percentiles within a few %).
    assert set(app) == {DURATION, TOKENS}, sorted(app)
    for name, bounds, fine in (
        (DURATION, DURATION_BOUNDS, DURATION_BUCKETS),
        (TOKENS, TOKEN_BOUNDS, TOKEN_BUCKETS),
        (TTFC, DURATION_BOUNDS, DURATION_BUCKETS),
    ):
        assert ours[name].unit == (app[name].unit if name in app else "s"), name
        for side, metric, want in (("application", app.get(name), bounds), ("llmtap", ours[name], fine)):
            for _, p in points(metric):
                assert list(p.explicit_bounds) == list(want), (side, name, len(p.explicit_bounds))
        extra = {k for attrs, _ in points(ours[name]) for k in attrs} - METRIC_ATTRIBUTES - {"gen_ai.token.type"}
        assert not extra, (name, sorted(extra))
    # The model server's own metrics are its own: a proxy's would collide with them.
    assert not sorted(n for n in ours if n.startswith("gen_ai.server.")), sorted(ours)
    # The listed attribute differences are real differences.
    for attribute in DIFFERING:
        assert values(app[DURATION], attribute) != values(ours[DURATION], attribute), attribute
    assert values(ours[DURATION], "error.type") == {"NotFoundError", "queue_full"}

    # Duration: one observation per call on each side, series for series; llmtap's hop inside each call.
    assert series(ours[DURATION]) == series(app[DURATION]) and series(ours[DURATION]).total() == len(ALL_CALLS)
    total = {side: sum(p.sum for _, p in points(m[DURATION])) for side, m in (("app", app), ("llmtap", ours))}
    assert 0 < total["llmtap"] <= total["app"], total

    # Token usage: the upstream's, once per answer; none for the two calls the model never processed. The
    # only difference is listed: llmtap has the usage of the stream read without include_usage.
    unseen = METRIC_DIFFERENCES[TOKENS].calls
    for index, kind in enumerate(("input", "output")):
        mine, theirs = (
            series(ours[TOKENS], **{"gen_ai.token.type": kind}),
            series(app[TOKENS], **{"gen_ai.token.type": kind}),
        )
        assert set(mine) == set(theirs), kind
        assert not values(ours[TOKENS], "error.type"), "usage reported for a request the model never processed"
        assert mine.total() == theirs.total() + len(unseen) == len(OK_CALLS), kind
        sums = {
            side: sum(p.sum for attrs, p in points(m[TOKENS]) if attrs["gen_ai.token.type"] == kind)
            for side, m in (("app", app), ("llmtap", ours))
        }
        assert sums["app"] == sum(run.usage(c)[index] for c in USAGE_SEEN), kind
        assert sums["llmtap"] == sums["app"] + sum(run.usage(c)[index] for c in unseen), kind

    # The streaming instruments, which the reference does not record: one first chunk per stream, and a gap
    # per content chunk after the first (each of the upstream's chunks here).
    assert TTFC not in app and TPOC not in app
    assert total_count(ours[TTFC]) == len(STREAMED)
    gaps = sum(len(run.truth[run.calls[c]["id"]]["chunk_offsets_s"]) - 1 for c in STREAMED)
    assert total_count(ours[TPOC]) == gaps


def test_every_listed_difference_is_in_the_comparison_table() -> None:
    """docs/reference-comparison.md has a row naming each listed difference with its verdict."""
    rows = [
        line for line in (ROOT / "docs" / "reference-comparison.md").read_text("utf-8").splitlines() if line[:1] == "|"
    ]
    listed = [(key, d) for key, ds in SPAN_DIFFERENCES.items() for d in ds] + list(METRIC_DIFFERENCES.items())
    missing = [(key, d.verdict) for key, d in listed if not any(f"`{key}`" in r and d.verdict in r for r in rows)]
    assert not missing, missing
