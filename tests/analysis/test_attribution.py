"""Attribution, cost and embeddings end to end: ``llmtap serve`` in front of the simulator (and the scripted
upstream), its spans at a real OTLP/HTTP receiver, its records on disk, its ``/metrics`` as Prometheus reads it.

- a request with ``x-llmtap-tenant: acme`` carries the tenant on its span and its record, and on its metrics
  where ``--metric-dimensions`` allows it; a property not allowed stays off the metrics;
- 10,000 distinct tenants leave ``/metrics`` bounded;
- a priced model's record carries its cost, an unknown model's says unknown;
- an embeddings request (OpenAI's and Ollama's) is recorded with its tokens, operation ``embeddings``;
- the caller's ``x-llmtap-*`` headers do not reach the upstream.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.analysis.cost import PriceTable
from tests.conftest import PATIENCE, Scripted
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.procs import Llmtap, Simulator
from tests.support.records import written
from tests.telemetry.test_metrics_standard import labels, otlp_env, series, total, wait_for

#: What the user's price file says the simulator's model costs, per million tokens.
SIM_PRICES = {"input": 2.0, "cached_input": 0.5, "output": 8.0}
KEY = "sk-test-0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def simulator() -> Iterator[Simulator]:
    sim = Simulator()
    yield sim
    sim.close()


def records(folder: Path, n: int, proxy: Llmtap) -> list[dict[str, Any]]:
    """The first ``n`` records written to ``folder`` (waiting for them)."""
    out: list[dict[str, Any]] = []

    def enough() -> bool:
        out[:] = written(folder)  # an hour closing meanwhile: its file compressed under the reader
        return len(out) >= n

    wait_for(f"{n} records", enough, proxy)
    return out


def test_tenant_cost_and_embeddings_on_spans_records_and_metrics(simulator: Simulator, tmp_path: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"models": {"llmtap-sim": SIM_PRICES}}), encoding="utf-8")
    receiver = HTTPReceiver()
    folder = tmp_path / "records"
    proxy = Llmtap(
        simulator.url,
        tmp_path / "llmtap.log",
        "--record",
        str(folder),
        "--metric-dimensions",
        "tenant,api_key",
        "--prices",
        str(prices),
        env=otlp_env(receiver),
    )
    try:
        headers = {
            "x-llmtap-tenant": "acme",
            "x-llmtap-property-team": "search",
            "authorization": f"Bearer {KEY}",
        }
        chat = {"model": "llmtap-sim", "stream": True, "user": "u-1", "messages": [{"role": "user", "content": "Hi"}]}
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=chat, headers=headers, timeout=30) as r:
            assert r.status_code == 200
            assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        embed = {"model": "text-embedding-3-small", "input": ["the sky is blue", "why"]}
        answer = httpx.post(proxy.url + "/v1/embeddings", json=embed, headers={"x-llmtap-tenant": "acme"}, timeout=30)
        assert answer.status_code == 200, answer.text
        embed_tokens = answer.json()["usage"]["prompt_tokens"]
        assert embed_tokens > 0
        ollama = httpx.post(proxy.url + "/api/embed", json={"model": "my-embedder", "input": "hello"}, timeout=30)
        assert ollama.status_code == 200, ollama.text
        ollama_tokens = ollama.json()["prompt_eval_count"]

        chat_rec, embed_rec, ollama_rec = sorted(records(folder, 3, proxy), key=lambda r: r["time"])
        # Who sent it: on the record, every dimension, the key only as a fingerprint.
        attribution = chat_rec["attribution"]
        fingerprint = attribution.pop("api_key")
        assert attribution == {"tenant": "acme", "user": "u-1", "properties": {"team": "search"}}
        assert len(fingerprint) == 12 and KEY not in json.dumps(chat_rec) and fingerprint not in KEY
        # What it cost: the reported tokens at the user's price.
        tokens = chat_rec["tokens"]
        assert tokens["input_source"] == tokens["output_source"] == "usage"
        cached = tokens["cache_read"] or 0
        expected = (
            (tokens["input"] - cached) * SIM_PRICES["input"]
            + cached * SIM_PRICES["cached_input"]
            + tokens["output"] * SIM_PRICES["output"]
        ) / 1e6
        assert chat_rec["cost"]["status"] == "priced" and chat_rec["cost"]["prices"] == "file"
        assert chat_rec["cost"]["source"] == "local"
        assert chat_rec["cost"]["amount"] == pytest.approx(expected) and expected > 0
        # Embeddings: recognised, with their tokens; the shipped table prices OpenAI's model, not an unknown one.
        assert (embed_rec["protocol"], embed_rec["operation"]) == ("openai_embeddings", "embeddings")
        assert embed_rec["tokens"]["input"] == embed_tokens and embed_rec["tokens"]["input_source"] == "usage"
        shipped = PriceTable()
        assert embed_rec["cost"] == {
            "amount": pytest.approx(embed_tokens * 0.02 / 1e6),
            "currency": "USD",
            "status": "priced",
            "prices": f"default {shipped.date}",
            "source": "local",
        }
        assert embed_rec["attribution"] == {"tenant": "acme"}
        assert (ollama_rec["protocol"], ollama_rec["operation"]) == ("ollama_embed", "embeddings")
        assert ollama_rec["tokens"]["input"] == ollama_tokens > 0
        assert ollama_rec["cost"]["status"] == "unknown_model" and ollama_rec["cost"]["amount"] is None
        assert ollama_rec["attribution"] is None

        # The spans, at the receiver.
        def root(name: str) -> dict[str, Any] | None:
            found = [attributes(s.attributes) for _, s in receiver.received.spans() if s.name == name]
            return found[0] if found else None

        wait_for("root spans", lambda: bool(root("chat llmtap-sim") and root("embeddings my-embedder")), proxy)
        span = root("chat llmtap-sim")
        assert span is not None
        assert span["llmtap.tenant"] == "acme" and span["user.id"] == "u-1"
        assert span["llmtap.property.team"] == "search" and span["llmtap.api_key.fingerprint"] == fingerprint
        assert span["gen_ai.usage.cost.amount"] == pytest.approx(expected)
        assert (span["gen_ai.usage.cost.currency"], span["gen_ai.usage.cost.source"]) == ("USD", "local")
        unknown = root("embeddings my-embedder")
        assert unknown is not None and unknown["llmtap.cost.status"] == "unknown_model"
        assert "gen_ai.usage.cost.amount" not in unknown and unknown["gen_ai.operation.name"] == "embeddings"

        # The metrics: the allowed dimensions, no other; the cost by tenant; embeddings' duration.
        wait_for("three requests on /metrics", lambda: total(proxy.metrics(), "llmtap_requests_total") == 3, proxy)
        text = proxy.metrics()
        assert total(text, "llmtap_requests_total", llmtap_tenant="acme") == 2
        assert total(text, "llmtap_requests_total", llmtap_api_key_fingerprint=fingerprint) == 1
        assert total(text, "llmtap_cost_usd_total", llmtap_tenant="acme") == pytest.approx(
            expected + embed_tokens * 0.02 / 1e6
        )
        assert total(text, "llmtap_cost_unpriced_total", llmtap_cost_status="unknown_model") == 1
        assert "llmtap_property_team" not in text and "user_id" not in text
        assert "acme" not in "".join(series(text, "llmtap_time_to_first_token_seconds_count"))  # counters only
        duration = series(text, "gen_ai_client_operation_duration_seconds_count")
        assert sum(float(line.rpartition(" ")[2]) for line in duration if 'operation_name="embeddings"' in line) == 2
        assert total(text, "llmtap_usage_input_tokens_total", gen_ai_operation_name="embeddings") == (
            embed_tokens + ollama_tokens
        )
    finally:
        proxy.close()
        receiver.close()


def test_private_headers_do_not_reach_the_upstream(tmp_path: Path) -> None:
    upstream = Scripted(SCRIPT_TTFT="0", SCRIPT_GAP="0", SCRIPT_CHUNKS="1")
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log")
    forwarding = Llmtap(upstream.url, tmp_path / "forwarding.log", "--forward-llmtap-headers")
    try:
        chat = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        sent = {"x-llmtap-tenant": "acme", "x-llmtap-property-team": "search", "x-other": "1"}
        for p, forwarded in ((proxy, False), (forwarding, True)):
            with httpx.stream("POST", p.url + "/v1/chat/completions", json=chat, headers=sent, timeout=30) as r:
                assert r.status_code == 200
                r.read()
            last = httpx.get(upstream.url + "/last-headers", timeout=5).json()["headers"]
            seen = {k.lower(): v for k, v in last.items()}
            assert seen.get("x-other") == "1"
            assert ("x-llmtap-tenant" in seen, "x-llmtap-property-team" in seen) == (forwarded, forwarded)
    finally:
        proxy.close()
        forwarding.close()
        upstream.close()


def test_ten_thousand_tenants_leave_metrics_bounded(tmp_path: Path) -> None:
    """Every request a tenant of its own: /metrics keeps ``--metric-dimension-values`` of them and ``_OTHER``,
    while spans and records would keep them all."""
    n, values = 10_000, 5
    upstream = Scripted(SCRIPT_TTFT="0", SCRIPT_GAP="0", SCRIPT_CHUNKS="1")
    proxy = Llmtap(
        upstream.url,
        tmp_path / "llmtap.log",
        "--metric-dimensions",
        "tenant",
        "--metric-dimension-values",
        str(values),
    )
    try:
        chat = {"model": "scripted", "stream": False, "messages": [{"role": "user", "content": "Hi"}]}
        url = proxy.url + "/v1/chat/completions"
        with httpx.Client(timeout=30) as client:
            assert client.post(url, json=chat, headers={"x-llmtap-tenant": "first"}).status_code == 200
        wait_for("the first request", lambda: total(proxy.metrics(), "llmtap_requests_total") == 1, proxy)
        control = proxy.metrics().splitlines()

        deadline = time.monotonic() + 30 * PATIENCE
        failures: list[int] = []
        next_id = iter(range(n - 1))
        lock = threading.Lock()

        def send() -> None:
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < deadline:
                    with lock:
                        i = next(next_id, None)
                    if i is None:
                        return
                    r = client.post(url, json=chat, headers={"x-llmtap-tenant": f"tenant-{i:05d}"})
                    if r.status_code != 200:
                        failures.append(r.status_code)

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures and next(next_id, None) is None, "the load did not finish in time"

        def settled() -> bool:
            text = proxy.metrics()
            return total(text, "llmtap_requests_total") + total(text, "llmtap_telemetry_tapes_dropped_total") >= n

        wait_for("every request counted", settled, proxy, timeout=10 * PATIENCE)
        text = proxy.metrics()
        tenants = {labels(line).get("llmtap_tenant") for line in text.splitlines() if "llmtap_tenant=" in line}
        assert len(tenants) <= values + 1 and "_OTHER" in tenants, tenants
        # Tapes the telemetry side dropped under this load are counted, never labelled; of those recorded, all
        # but the kept tenants' read _OTHER.
        recorded = total(text, "llmtap_requests_total")
        assert recorded >= 1 + values
        assert total(text, "llmtap_requests_total", llmtap_tenant="_OTHER") >= recorded - values - 1
        # Each kept tenant adds a few counter series, never one per request; the rest of the page grows only as
        # the histograms' sparse buckets widen to the load's spread of values (a bound far below one per request).
        lines = text.splitlines()
        tenant_lines = sum("llmtap_tenant=" in line for line in lines) - sum("llmtap_tenant=" in x for x in control)
        assert tenant_lines < 40 * (values + 1), tenant_lines
        grown = len(lines) - len(control)
        assert grown < 1000, grown
    finally:
        proxy.close()
        upstream.close()
