"""Replicas joined, against the real vLLM (CPU build): two llmtap replicas in front of one vLLM that exports its
spans to one shared address, which passes each body to the replicas in turn.

Done when every request's queue and prefill come out as the server's (or as a marked fallback), and no
request's telemetry is held past the replicas' wait: vLLM's own spans carry the ``tracestate`` llmtap sent
(its SDK's child span keeps the parent's trace state), so a span that lands on the other replica is passed
to the one that relayed its request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE
from tests.support.vllm_server import (
    VllmServer,
    vllm_medium as vllm_medium,  # the fixture: one server, shared with the other real-vLLM modules
)
from tests.telemetry.test_fleet import WAIT, Fleet


@pytest.fixture
def fleet(vllm_medium: VllmServer, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(lambda _: vllm_medium.url, tmp_path, wait=WAIT, peers=True)
    vllm_medium.receiver.forward_to = f.service.url  # vLLM's --otlp-traces-endpoint, now the shared address
    try:
        yield f
    finally:
        vllm_medium.receiver.forward_to = None
        f.close()


def test_two_replicas_in_front_of_one_real_vllm_each_get_the_server_truth(
    fleet: Fleet, vllm_medium: VllmServer
) -> None:
    n = 8
    body = {"model": "medium", "max_tokens": 8, "ignore_eos": True, "stream": True}
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            # Four at once against vLLM's two slots: two of each four wait in its queue.
            prompt = f"{time.monotonic_ns()} request {i} " + "word " * 60
            fleet.chat(i, {**body, "messages": [{"role": "user", "content": prompt}]})
        except BaseException as exc:
            errors.append(exc)

    for wave in range(n // 4):
        threads = [threading.Thread(target=send, args=(wave * 4 + k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE)
    assert not errors, errors
    lines = fleet.watch_records(WAIT + PATIENCE)
    assert set(lines) == set(fleet.ended), fleet.logs()
    # vLLM's own spans (its receiver's copy, the ground truth) carry the owner's entry llmtap sent.
    truth = vllm_medium.request_spans(list(fleet.ended))
    joined = fleet.sum_counts(sc.METRIC_SERVER_SPANS, sc.SERVER_SPAN_OUTCOME)
    routed = fleet.sum_counts(sc.METRIC_OTLP_ROUTED, sc.OTLP_FORWARD_OUTCOME)
    why = (joined, routed, fleet.service.sent)
    waited = []
    for trace, line in lines.items():
        # The server's, or a marked fallback: never an unmarked figure.
        assert line["prefill_source"] in ("server", "estimated", "upstream_ttft"), (line, why)
        assert line["queue_source"] in ("server", "proxy", "estimated"), (line, why)
        waited.append(fleet.seen[trace] - fleet.ended[trace])
        assert waited[-1] < WAIT + 1.5, (trace, waited[-1], why)
    # Here every span came in time: each request has vLLM's own queue and prefill.
    server = [t for t, line in lines.items() if line["prefill_source"] == "server"]
    assert len(server) == n, (lines, why)
    for trace in server:
        span = truth[trace]
        assert lines[trace]["prefill"] == pytest.approx(span.seconds("gen_ai.latency.time_in_model_prefill"), abs=1e-5)
    landed_elsewhere = sum(
        1
        for target, traces, status in fleet.service.sent
        for trace in traces
        if status == 200 and trace in fleet.owner and target != fleet.replicas[fleet.owner[trace]].traces_url
    )
    assert landed_elsewhere >= 1 and routed == {"sent": landed_elsewhere, "dropped": 0, "failed": 0}, why
    assert joined == {"matched": n, "late": 0, "unmatched": 0, "missing": 0, "duplicate": 0}, why
    # vLLM's spans, as each owner forwarded them to the backend, carry the entry naming that owner.
    deadline = time.monotonic() + PATIENCE
    while len([s for _, s in fleet.backend.received.spans() if s.name == "llm_request"]) < n:
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.05)
    for _, span in fleet.backend.received.spans():
        if span.name == "llm_request":
            owner = fleet.replicas[fleet.owner[span.trace_id.hex()]]
            assert span.trace_state.startswith(f"llmtap=127.0.0.1:{owner.admin_port}~"), span.trace_state
            assert span.trace_state.endswith(",vendor=abc"), span.trace_state
    held = sorted(round(w, 3) for w in waited)
    print(f"held per request (s): max {max(waited):.3f}, {held}; routed {landed_elsewhere}")
