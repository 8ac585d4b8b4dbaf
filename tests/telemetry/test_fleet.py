"""Replicas joined: the model server's spans reach the replica that relayed their request, within one bound.

Two real ``llmtap serve`` processes stand in front of one upstream that traces as vLLM does (the scripted
upstream with the OpenTelemetry SDK, here; the real vLLM in ``test_real_vllm_fleet``), and the upstream
exports to one shared address that passes each body to the replicas in turn, as a Service does. Also here:
the tracestate entry's rules, the receiver's refusal to pass on spans of traces nobody relayed, and the
recorder's timer that writes a record whose wait ended without another request coming.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from llmtap.config.otel import telemetry_from_env
from llmtap.config.types import ConfigError
from llmtap.store.files import ReadStats, read_records
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.fleet import peers
from llmtap.telemetry.fleet.upstreams import UpstreamWatch
from llmtap.telemetry.recorder import Recorder
from llmtap.wire.tape import shard_of
from llmtap.wire.tracestate import MAX_LENGTH, MAX_MEMBERS, entry, owner, upstream_tracestate
from tests.conftest import PATIENCE, Scripted, Telemetry, free_port
from tests.e2e.test_otlp import HTTPReceiver
from tests.support.procs import stop, wait_ready
from tests.telemetry.test_forward import PROTOBUF, admins, vllm_export, wait_for
from tests.telemetry.test_serverspans import TRACE, counter, traced

TOKEN = "replicas-share-this"
ROOT = Path(__file__).resolve().parents[2]


# --- the tracestate entry ---------------------------------------------------------------------------


def test_the_entry_names_its_replica_and_only_a_holder_of_the_token_can_sign_one() -> None:
    mine = entry("10.1.2.3:9464", TOKEN)
    assert mine.startswith("llmtap=10.1.2.3:9464~") and len(mine) == len("llmtap=10.1.2.3:9464~") + 16
    assert owner(mine, TOKEN) == "10.1.2.3:9464"
    assert owner(f"vendor=x, {mine},other=y", TOKEN) == "10.1.2.3:9464"
    # A forged or altered entry names nobody: a replica never sends a span (and its token) where it says.
    assert owner(mine, "another token") is None
    assert owner(mine.replace("10.1.2.3", "10.1.2.4"), TOKEN) is None
    assert owner("llmtap=evil.example:80~0000000000000000", TOKEN) is None
    assert owner("llmtap=garbage", TOKEN) is None and owner("", TOKEN) is None
    with pytest.raises(ValueError):
        entry("no port", TOKEN)
    assert entry("[fd00::1]:9464", TOKEN).startswith("llmtap=[fd00::1]:9464~")


def test_the_entry_goes_first_and_the_clients_own_follow_within_the_standards_bounds() -> None:
    mine = entry("10.1.2.3:9464", TOKEN)
    assert upstream_tracestate(None, mine) == mine
    # The client's members keep their order; an older llmtap entry (a proxy before this one) is replaced;
    # a member that does not parse is left out (an SDK drops the whole header at one).
    client = f"congo=t61rcWkgMzE, llmtap=old:1~{'0' * 16},bad member,rojo=00f067aa0ba902b7,,tenant@sys=v"
    assert upstream_tracestate(client, mine) == f"{mine},congo=t61rcWkgMzE,rojo=00f067aa0ba902b7,tenant@sys=v"
    many = ",".join(f"k{i}=v{i}" for i in range(40))
    kept = upstream_tracestate(many, mine).split(",")
    assert len(kept) == MAX_MEMBERS and kept[0] == mine and kept[-1] == "k30=v30"  # dropped from the end
    # Past 512 characters, members over 128 characters go first, then from the end.
    long = [f"l{i}=" + "x" * 200 for i in range(2)]
    short = [f"s{i}=" + "y" * 60 for i in range(3)]
    kept = upstream_tracestate(",".join([long[0], *short, long[1]]), mine).split(",")
    assert kept[0] == mine and len(",".join(kept)) <= MAX_LENGTH
    assert kept[1:] == [long[0], *short]  # the later long member went first, and that was enough


def test_the_peer_address_needs_the_token_and_a_port() -> None:
    env = {"LLMTAP_PEER_ADDRESS": "10.1.2.3:9464"}
    with pytest.raises(ConfigError, match="peer_token"):
        telemetry_from_env(env)
    t = telemetry_from_env({**env, "LLMTAP_PEER_TOKEN": TOKEN})
    assert (t.peer_address, t.peer_token) == ("10.1.2.3:9464", TOKEN) and TOKEN not in repr(t)
    with pytest.raises(ConfigError, match="host:port"):
        telemetry_from_env({"LLMTAP_PEER_ADDRESS": "10.1.2.3", "LLMTAP_PEER_TOKEN": TOKEN})


# --- ownership: what reaches the backend --------------------------------------------------------------


def test_ownership_passes_spans_of_relayed_traces_holds_unknown_ones_and_drops_them_at_the_wait() -> None:
    dropped: list[int] = []
    owned = peers.Ownership(3.0, dropped.append)
    owned.relayed(TRACE)
    other = "1" * 32
    export = ExportTraceServiceRequest.FromString(vllm_export("b7ad6b7169203331"))
    found = owned.take(export, 0.0)
    assert found is not None and found == (export, 2)  # both spans of a trace relayed here, unchanged
    assert owned.take(ExportTraceServiceRequest.FromString(vllm_export("aaaaaaaaaaaaaaaa", trace=other)), 1.0) is None
    assert owned.waiting == 2 and owned.next_deadline() == 4.0
    # Its request's tape came late (the queue was behind): its spans go now.
    later = owned.relayed(other)
    assert later is not None and later[1] == 2 and owned.waiting == 0
    third = "2" * 32
    assert owned.take(ExportTraceServiceRequest.FromString(vllm_export("aaaaaaaaaaaaaaaa", trace=third)), 1.0) is None
    owned.due(3.9)
    assert dropped == [] and owned.waiting == 2
    owned.due(4.0)
    assert dropped == [2] and owned.waiting == 0 and owned.next_deadline() is None


def test_spans_of_unknown_traces_wait_within_a_bound_of_bytes_too() -> None:
    """Few spans of many bytes each (a body of megabytes is allowed in) cannot hold more than ``MAX_WAITING_BYTES``
    while they wait for their trace: the oldest trace's spans go first, counted."""
    dropped: list[int] = []
    owned = peers.Ownership(3.0, dropped.append)
    big = ExportTraceServiceRequest.FromString(vllm_export("aaaaaaaaaaaaaaaa"))
    big.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="blob").value.string_value = "x" * (1 << 20)
    traces = 3 * peers.MAX_WAITING_BYTES // big.ByteSize()
    for i in range(traces):
        export = ExportTraceServiceRequest()
        export.CopyFrom(big)
        for span in export.resource_spans[0].scope_spans[0].spans:
            span.trace_id = i.to_bytes(16, "big")
        assert owned.take(export, 1.0) is None
        assert owned.waiting_bytes <= peers.MAX_WAITING_BYTES
    assert owned.waiting < 2 * traces // 3 and sum(dropped) + owned.waiting == 2 * traces
    found = owned.relayed((traces - 1).to_bytes(16, "big").hex())  # the newest trace's spans are still there
    assert found is not None and found[1] == 2


# --- the receiver and the recorder -------------------------------------------------------------------


@pytest.fixture
def make_admin(telemetry: Telemetry) -> Iterator[Callable[..., tuple[Recorder, str]]]:
    """An admin listener over a recorder: (recorder, its /v1/traces URL)."""
    with admins(telemetry, None) as make:
        yield make


def test_a_span_of_a_trace_nobody_relayed_is_not_forwarded_and_is_counted(
    make_admin: Callable[..., tuple[Recorder, str]], telemetry: Telemetry
) -> None:
    backend = HTTPReceiver()
    try:
        recorder, admin = make_admin(
            traces_exporter="otlp", traces_endpoint=backend.url, traces_protocol="http/protobuf", server_spans_wait=0.5
        )
        recorder.record_timeline(traced("b7ad6b7169203331"))  # relayed here: trace TRACE
        forged = vllm_export("cccccccccccccccc", trace="f" * 32)  # anyone's, of a trace nobody relayed
        with httpx.Client(timeout=10) as client:
            assert client.post(admin, content=forged, headers=PROTOBUF).status_code == 200
            assert client.post(admin, content=vllm_export("b7ad6b7169203331"), headers=PROTOBUF).status_code == 200
        wait_for(backend.received, 1)
        deadline = time.monotonic() + PATIENCE
        while counter(telemetry, sc.METRIC_OTLP_FORWARDED, sc.OTLP_FORWARD_OUTCOME).get("unowned", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        recorder.close(5)
        # Only the relayed trace's spans reached the backend; the forged body's two were counted, not sent.
        assert {s.trace_id.hex() for _, s in backend.received.spans()} == {TRACE}
        outcomes = counter(telemetry, sc.METRIC_OTLP_FORWARDED, sc.OTLP_FORWARD_OUTCOME)
        assert outcomes == {"sent": 2, "dropped": 0, "failed": 0, "unowned": 2}
    finally:
        backend.close()


def test_a_body_marked_as_a_peers_needs_the_replicas_token(
    make_admin: Callable[..., tuple[Recorder, str]], telemetry: Telemetry
) -> None:
    _, admin = make_admin(peer_address="127.0.0.1:1", peer_token=TOKEN)
    body = vllm_export("b7ad6b7169203331")
    with httpx.Client(timeout=10) as client:
        marked = {**PROTOBUF, peers.PEER_HEADER: "1"}
        assert client.post(admin, content=body, headers=marked).status_code == 401
        wrong = {**marked, "authorization": "Bearer guess"}
        assert client.post(admin, content=body, headers=wrong).status_code == 401
        right = {**marked, "authorization": f"Bearer {TOKEN}"}
        assert client.post(admin, content=body, headers=right).status_code == 200
    assert counter(telemetry, sc.METRIC_OTLP_REJECTED, sc.OTLP_REJECT_REASON)["unauthorized"] == 2


def test_a_record_whose_wait_ends_is_written_at_once_without_another_request(
    make_admin: Callable[..., tuple[Recorder, str]], tmp_path: Path
) -> None:
    path = tmp_path / "records"
    recorder, _ = make_admin(record=str(path), server_spans_wait=0.3)
    recorder.upstreams = _Traces()
    recorder.record_timeline(traced("b7ad6b7169203331"))
    handed = time.monotonic()
    deadline = handed + PATIENCE
    while recorder.join.held == 0:
        assert time.monotonic() < deadline and not _lines(path), "the request never waited"
        time.sleep(0.005)
    while not _lines(path):
        assert time.monotonic() < deadline, "the record was never written"
        time.sleep(0.01)
    written = time.monotonic() - handed
    # Written by the worker's timer at the wait's end (0.3 s), nothing else arriving: within 1 s of it.
    assert 0.3 <= written < 0.3 + 1.0, written
    (line,) = _lines(path)
    assert line["trace_id"] == TRACE and line["prefill_source"] != "server"  # the marked fallback


class _Traces(UpstreamWatch):
    """An upstream that shows a tracing server's gauges, without reading anything."""

    def compatible(self, upstream: str, wait: float = 0.0) -> bool:
        return True


def _lines(path: Path) -> list[dict[str, Any]]:
    """The records written so far in the record folder ``path``."""
    if not path.exists():
        return []
    return list(read_records(path, ReadStats()))


# --- two real replicas -------------------------------------------------------------------------------


class Service:
    """One address in front of several (a Service): each OTLP body goes to the next target in turn.

    The turns run over ``targets`` as given; listing one twice (``[a, a, b]``) keeps the turns out of step
    with requests sent to the replicas in turn, so some spans land on the replica that did not relay them
    whatever the phase. It notes, per body, where it went and which traces' ``llm_request`` spans it held.
    """

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.sent: list[tuple[str, list[str], int]] = []  # (target, trace ids of llm_request spans, status)
        self._turn = itertools.count()
        self._lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with service._lock:
                    target = service.targets[next(service._turn) % len(service.targets)]
                headers = {k: v for k, v in self.headers.items() if k.lower().startswith("content-")}
                answer = httpx.post(target, content=body, headers=headers, timeout=10)
                request = ExportTraceServiceRequest.FromString(body)
                traces = [
                    span.trace_id.hex()
                    for rs in request.resource_spans
                    for ss in rs.scope_spans
                    for span in ss.spans
                    if span.name == "llm_request"
                ]
                with service._lock:
                    service.sent.append((target, traces, answer.status_code))
                self.send_response(answer.status_code)
                self.send_header("content-type", answer.headers.get("content-type", "application/x-protobuf"))
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


_taken: set[int] = set()


def _port() -> int:
    port = free_port()
    while port in _taken:
        port = free_port()
    _taken.add(port)
    return port


class Replica:
    """``llmtap serve`` on free ports, recording to a file, exporting to ``backend``; ``peers``: routing on."""

    def __init__(
        self, name: str, upstream: str, backend: str, tmp: Path, *, wait: float, peers: bool, workers: int = 1
    ) -> None:
        self.name = name
        self.port, self.admin_port = _port(), _port()
        self.record = tmp / f"{name}-records"
        self.log_path = tmp / f"{name}.log"
        self.log: IO[str] = self.log_path.open("w", encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
        env |= {
            "OTEL_SERVICE_NAME": f"llmtap-{name}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": backend,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_METRICS_EXPORTER": "none",
            "LLMTAP_SERVER_SPANS_WAIT": str(wait),
            "LLMTAP_RECORD": str(self.record),
        }
        if peers:
            env |= {"LLMTAP_PEER_ADDRESS": f"127.0.0.1:{self.admin_port}", "LLMTAP_PEER_TOKEN": TOKEN}
        argv = ["serve", "--upstream", upstream, "--provider", "vllm"]
        argv += ["--port", str(self.port), "--admin-port", str(self.admin_port), "--telemetry-workers", str(workers)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmtap", *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.log
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=PATIENCE)

    @property
    def traces_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}/v1/traces"

    def logs(self) -> str:
        return self.log_path.read_text(encoding="utf-8")[-4000:]

    def wait_ready(self) -> None:
        wait_ready(self.proc, f"http://127.0.0.1:{self.admin_port}", self.logs)

    def counts(self, metric: str, label: str) -> dict[str, float]:
        """A counter's values on this replica's ``/metrics``, by ``label``."""
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=10).text
        found: dict[str, float] = {}
        pattern = re.compile(rf'^{metric}_total\{{[^}}]*{label}="([^"]+)"[^}}]*\}} (\S+)$', re.M)
        for key, value in pattern.findall(text):
            found[key] = found.get(key, 0.0) + float(value)
        return found

    def close(self) -> None:
        self.client.close()
        stop(self.proc, grace=20)
        self.log.close()


def _prom(name: str) -> str:
    return name.replace(".", "_")


class Fleet:
    """Two replicas, the shared span address in front of them, the OTLP backend, and what each request did."""

    def __init__(
        self, upstream: Callable[[str], str], tmp: Path, *, wait: float, peers: bool, workers: int = 1
    ) -> None:
        self.wait = wait
        self.backend = HTTPReceiver()
        self.service = Service()
        self.upstream_url = upstream(self.service.url)
        self.replicas = [
            Replica(name, self.upstream_url, self.backend.url, tmp, wait=wait, peers=peers, workers=workers)
            for name in ("a", "b")
        ]
        a, b = (r.traces_url for r in self.replicas)
        self.service.targets = [a, a, b]
        for r in self.replicas:
            r.wait_ready()
        self.ended: dict[str, float] = {}  # trace id -> when the client had the whole answer
        self.owner: dict[str, int] = {}  # trace id -> the replica that relayed it
        self.seen: dict[str, float] = {}  # trace id -> when its record line was first seen on disk

    def chat(self, i: int, body: dict[str, Any], *, process: int | None = None) -> None:
        """Request ``i`` through replica ``i % 2``, in a trace of the client's (with its own tracestate); with
        ``process``, a trace id that telemetry process (of two) records (``shard_of``)."""
        trace = secrets.token_hex(16)
        while process is not None and shard_of(int(trace, 16), 0, 2) != process:
            trace = secrets.token_hex(16)
        headers = {"traceparent": f"00-{trace}-{secrets.token_hex(8)}-01", "tracestate": "vendor=abc"}
        with self.replicas[i % 2].client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            r.read()
        self.ended[trace] = time.monotonic()
        self.owner[trace] = i % 2

    def watch_records(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Every request's record line, noting when each first appeared; waits at most ``timeout``."""
        lines: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(lines) < len(self.ended) and time.monotonic() < deadline:
            for r in self.replicas:
                for line in _lines(r.record):
                    if line["trace_id"] not in lines:
                        lines[line["trace_id"]] = line
                        self.seen[line["trace_id"]] = time.monotonic()
            time.sleep(0.02)
        return lines

    def sum_counts(self, metric: str, label: str) -> dict[str, float]:
        total: dict[str, float] = {}
        for r in self.replicas:
            for key, value in r.counts(_prom(metric), _prom(label)).items():
                total[key] = total.get(key, 0.0) + value
        return total

    def logs(self) -> str:
        return "\n".join(f"--- {r.name}\n{r.logs()}" for r in self.replicas)

    def close(self) -> None:
        for r in self.replicas:
            r.close()
        self.service.close()
        self.backend.close()


CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
#: The replicas' wait for a server span, seconds: the bound every request's telemetry is held to.
WAIT = 4.0


@pytest.fixture
def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """Two routing replicas (``peers``: the test's parameter) in front of the scripted upstream that traces."""
    made: list[Scripted] = []

    def upstream(spans: str) -> str:
        up = Scripted(
            SCRIPT_TTFT="0.1",
            SCRIPT_GAP="0.01",
            SCRIPT_CHUNKS="4",
            SCRIPT_OTLP_TRACES=spans,
            OTEL_BSP_SCHEDULE_DELAY="200",
        )
        made.append(up)
        return up.url

    peers, workers = request.param if isinstance(request.param, tuple) else (request.param, 1)
    f = Fleet(upstream, tmp_path, wait=WAIT, peers=peers, workers=workers)
    try:
        yield f
    finally:
        f.close()
        for up in made:
            up.close()


@pytest.mark.parametrize("fleet", [True], indirect=True)
def test_two_replicas_each_get_the_server_truth_of_their_own_requests(fleet: Fleet) -> None:
    """The upstream exports to one address that alternates between the replicas; every request's queue and
    prefill come out as the server's, no record waits out the bound, and each span reaches the backend once,
    from the replica that relayed it."""
    n = 8
    for i in range(n):
        fleet.chat(i, CHAT)
    lines = fleet.watch_records(WAIT + PATIENCE)
    assert set(lines) == set(fleet.ended), fleet.logs()
    joined = fleet.sum_counts(sc.METRIC_SERVER_SPANS, sc.SERVER_SPAN_OUTCOME)
    routed = fleet.sum_counts(sc.METRIC_OTLP_ROUTED, sc.OTLP_FORWARD_OUTCOME)
    why = (joined, routed, fleet.service.sent, fleet.owner)
    for trace, line in lines.items():
        assert (line["queue_source"], line["prefill_source"]) == ("server", "server"), (trace, line, why)
        # The server's prefill is its own first token less its queue; the relay's upstream TTFT holds it and both
        # trips between them, which grow without bound on a busy machine: an upper bound, not a margin.
        assert line["queue"] >= 0.0625 and 0.0 <= line["prefill"] <= line["upstream_ttft"] - 0.0625 + 0.005
        # Written when its span came, never past the wait (1.5 s over it allowed for the telemetry queue).
        assert fleet.seen[trace] - fleet.ended[trace] < WAIT + 1.5, (trace, fleet.seen[trace] - fleet.ended[trace])
    # The shared address sent some spans to the replica that did not relay them: each was passed on, once.
    landed_elsewhere = sum(
        1
        for target, traces, status in fleet.service.sent
        for trace in traces
        if status == 200 and target != fleet.replicas[fleet.owner[trace]].traces_url
    )
    assert landed_elsewhere >= 1, fleet.service.sent
    assert routed == {"sent": landed_elsewhere, "dropped": 0, "failed": 0}
    assert joined == {"matched": n, "late": 0, "unmatched": 0, "missing": 0, "duplicate": 0}
    # At the backend: each request's server span once, under llmtap's span, carrying the client's tracestate.
    deadline = time.monotonic() + PATIENCE
    while len([s for _, s in fleet.backend.received.spans() if s.name == "llm_request"]) < n:
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.05)
    time.sleep(0.5)  # a duplicate would come about now
    server = [s for _, s in fleet.backend.received.spans() if s.name == "llm_request"]
    assert sorted(s.trace_id.hex() for s in server) == sorted(fleet.ended)
    for s in server:
        state = s.trace_state.split(",")
        assert state[0].startswith("llmtap=127.0.0.1:") and state[1:] == ["vendor=abc"], s.trace_state
        assert (
            state[0].split("=")[1].split("~")[0]
            == f"127.0.0.1:{fleet.replicas[fleet.owner[s.trace_id.hex()]].admin_port}"
        )


@pytest.mark.parametrize("fleet", [(True, 2)], indirect=True)
def test_two_telemetry_processes_per_replica_each_get_the_server_truth_of_their_own_requests(fleet: Fleet) -> None:
    """The same fleet with two telemetry processes in each replica: a span reaches the replica that relayed its
    request (process 0's admin listener), which passes it to the process that recorded the request; every
    request's queue and prefill are the server's, each span passed once per hop, none lost."""
    n = 8
    for i in range(n):
        fleet.chat(i, CHAT, process=(i // 2) % 2)  # each replica: requests its two processes record
    lines = fleet.watch_records(WAIT + PATIENCE)
    assert set(lines) == set(fleet.ended), fleet.logs()
    joined = fleet.sum_counts(sc.METRIC_SERVER_SPANS, sc.SERVER_SPAN_OUTCOME)
    routed = fleet.sum_counts(sc.METRIC_OTLP_ROUTED, sc.OTLP_FORWARD_OUTCOME)
    for trace, line in lines.items():
        assert (line["queue_source"], line["prefill_source"]) == ("server", "server"), (trace, line, joined, routed)
    assert len({line["instance_id"] for line in lines.values()}) == 4  # two replicas, two processes each
    landed_elsewhere = sum(
        1
        for target, traces, status in fleet.service.sent
        for trace in traces
        if status == 200 and target != fleet.replicas[fleet.owner[trace]].traces_url
    )
    # Passed between replicas, then (those of process 1) from process 0 to process 1 of the same replica.
    to_process_1 = sum(1 for trace in fleet.ended if shard_of(int(trace, 16), 0, 2) == 1)
    assert to_process_1 == n // 2
    assert routed == {"sent": landed_elsewhere + to_process_1, "dropped": 0, "failed": 0}
    assert joined == {"matched": n, "late": 0, "unmatched": 0, "missing": 0, "duplicate": 0}


@pytest.mark.parametrize("fleet", [False], indirect=True)
def test_without_routing_a_span_that_lands_on_the_other_replica_is_lost_to_its_request(fleet: Fleet) -> None:
    """The control: the same fleet without ``peer_address``. What the routing test holds fails here."""
    n = 4
    for i in range(n):
        fleet.chat(i, CHAT)
    lines = fleet.watch_records(WAIT + PATIENCE)
    assert set(lines) == set(fleet.ended), fleet.logs()
    landed_elsewhere = sum(
        1
        for target, traces, _ in fleet.service.sent
        for trace in traces
        if target != fleet.replicas[fleet.owner[trace]].traces_url
    )
    fallback = [t for t, line in lines.items() if line["prefill_source"] != "server"]
    assert landed_elsewhere >= 1 and len(fallback) == landed_elsewhere, fleet.service.sent
    # A span that found no request is kept for the wait (its request might still be queued), then counted.
    deadline = time.monotonic() + WAIT + PATIENCE
    while (joined := fleet.sum_counts(sc.METRIC_SERVER_SPANS, sc.SERVER_SPAN_OUTCOME))["unmatched"] < landed_elsewhere:
        assert time.monotonic() < deadline, joined
        time.sleep(0.1)
    assert joined["missing"] == landed_elsewhere and joined["unmatched"] == landed_elsewhere
    # Each fallback still came out within the bound, and marked.
    for trace in fallback:
        assert fleet.seen[trace] - fleet.ended[trace] < WAIT + 1.5
