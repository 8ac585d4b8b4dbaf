"""Cost with its source end to end: ``llmtap serve`` in front of an upstream that states costs as OpenRouter and
LiteLLM do (``usage.cost`` in the final chunk, the ``x-litellm-response-cost`` header), the spans at a real
OTLP/HTTP receiver and the records on disk: a stated cost wins (``provider``), the table prices the rest (``local``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmtap.telemetry import semconv as sc
from tests.analysis.test_attribution import records
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.procs import Llmtap
from tests.telemetry.test_metrics_standard import otlp_env, wait_for

#: What the upstream says each model's request cost: in the body's usage, in a header, or not at all.
STATED, HEADER = 0.0125, 0.0042


class _Gateway(BaseHTTPRequestHandler):
    """A streamed chat answer whose final chunk's usage (and headers) say what the request cost."""

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
        model = request["model"]
        usage: dict[str, Any] = {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010}
        if model == "stated":
            usage["cost"] = STATED
        chunks = [
            {"id": "c1", "model": model, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
            {"id": "c1", "model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"id": "c1", "model": model, "choices": [], "usage": usage},
        ]
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        if model == "header":
            self.send_header("x-litellm-response-cost", str(HEADER))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def gateway() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_a_stated_cost_wins_and_the_table_prices_the_rest(gateway: str, tmp_path: Path) -> None:
    receiver = HTTPReceiver()
    folder = tmp_path / "records"
    proxy = Llmtap(gateway, tmp_path / "llmtap.log", "--record", str(folder), env=otlp_env(receiver))
    try:
        for model in ("stated", "header", "gpt-4o", "unknown-model"):
            body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
            with proxy.client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                r.read()
        spans: dict[str, dict[str, Any]] = {}

        def four() -> bool:
            for _, span in receiver.received.spans():
                attrs = attributes(span.attributes)
                if sc.REQUEST_MODEL in attrs:
                    spans[attrs[sc.REQUEST_MODEL]] = attrs
            return len(spans) == 4

        wait_for("four root spans", four, proxy)
        by_model = {r["model"]: r["cost"] for r in records(folder, 4, proxy)}
    finally:
        proxy.close()
        receiver.close()
    # The body's usage.cost, then the gateway's header: taken as they are, source provider, no price table named.
    for model, amount in (("stated", STATED), ("header", HEADER)):
        span = spans[model]
        assert (span[sc.COST_AMOUNT], span[sc.COST_SOURCE], span[sc.COST_CURRENCY]) == (amount, "provider", "USD")
        assert sc.COST_PRICES not in span
        assert by_model[model] == {
            "amount": amount,
            "currency": "USD",
            "status": "priced",
            "prices": None,
            "source": "provider",
        }
    # Neither: the shipped table, source local, the table named with its date.
    local = spans["gpt-4o"]
    assert local[sc.COST_SOURCE] == "local" and local[sc.COST_PRICES].startswith("default 20")
    assert local[sc.COST_AMOUNT] == pytest.approx((1000 * 2.5 + 10 * 10.0) / 1e6)
    assert by_model["gpt-4o"]["source"] == "local"
    # Unknown: no amount at all, never 0.
    unknown = spans["unknown-model"]
    assert sc.COST_AMOUNT not in unknown and sc.COST_SOURCE not in unknown
    assert unknown[sc.COST_STATUS] == "unknown_model"
    assert by_model["unknown-model"]["amount"] is None and by_model["unknown-model"]["source"] is None
