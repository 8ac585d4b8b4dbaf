"""Replicas joined: the model server's spans reach the replica that relayed their request, within one bound.

Two real ``llmtap serve`` processes stand in front of one upstream that traces as vLLM does (the scripted
upstream with the OpenTelemetry SDK, here; the real vLLM in ``test_real_vllm_fleet``), and the upstream
exports to one shared address that passes each body to the replicas in turn, as a Service does. Also here:
the tracestate entry's rules, the receiver's refusal to pass on spans of traces nobody relayed, and the
recorder's timer that writes a record whose wait ended without another request coming.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.settings import (
    ConfigError,
    Records as RecordSettings,
    Route,
    Settings,
    Telemetry as TelemetrySettings,
    telemetry_from_env,
)
from proxy.telemetry import peers, semconv as sc
from proxy.telemetry.admin import AdminApp
from proxy.telemetry.recorder import Recorder
from proxy.telemetry.upstreams import UpstreamWatch
from proxy.tracestate import MAX_LENGTH, MAX_MEMBERS, entry, owner, upstream_tracestate
from tests.conftest import PATIENCE, ServerThread, Telemetry
from tests.test_forward import PROTOBUF, _Source, vllm_export, wait_for
from tests.test_otlp import HTTPReceiver
from tests.test_serverspans import TRACE, UPSTREAM, counter, traced

TOKEN = "replicas-share-this"


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


# --- the receiver and the recorder -------------------------------------------------------------------


@pytest.fixture
def make_admin(telemetry: Telemetry) -> Iterator[Callable[..., tuple[Recorder, str]]]:
    """An admin listener over a recorder: (recorder, its /v1/traces URL)."""
    opened: list[tuple[Recorder, ServerThread]] = []

    def make(record: str | None = None, **telemetry_settings: Any) -> tuple[Recorder, str]:
        settings = Settings(
            routes=(Route(prefix="/", upstream=UPSTREAM, name="default"),),
            telemetry=TelemetrySettings(**telemetry_settings),
            record=RecordSettings(path=record),
        )
        rec = Recorder(settings, tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
        server = ServerThread(AdminApp(_Source(rec), None)).__enter__()
        opened.append((rec, server))
        return rec, server.url + "/v1/traces"

    yield make
    for rec, server in opened:
        server.__exit__(None, None, None)
        rec.close(5)


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


def test_a_record_whose_wait_ends_is_written_at_once_without_another_request(
    make_admin: Callable[..., tuple[Recorder, str]], tmp_path: Path
) -> None:
    path = tmp_path / "records.jsonl"
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
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
