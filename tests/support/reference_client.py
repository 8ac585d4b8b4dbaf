"""An application instrumented the official way: the ``openai`` SDK under ``opentelemetry-instrumentation-openai-v2``.

It runs in its own virtual environment (``.ci/install.d/27-openai-reference.sh``), whose versions are the
instrumentation's own (an ``openai`` on httpx), so it imports nothing from llmtap or the tests.
``python tests/support/reference_client.py BASE_URL OTLP_URL`` sends a fixed set of calls through ``BASE_URL``
(llmtap), exports its spans and metrics over OTLP/HTTP to ``OTLP_URL`` under ``OTEL_SERVICE_NAME``, and
prints one JSON line per call: the ids of the instrumentation's span and what the SDK returned.

The ``traceparent`` of the instrumentation's span goes out on each request, as an instrumented HTTP
client would send it: an httpx request hook injects the current context with the global propagator.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
MAX_TOKENS = 8
#: The stream that holds llmtap's one slot while the refused call is made: long enough (about 1.2 s on the
#: simulator's fast profile) that the refusal never depends on how quickly this process makes the next call.
HELD_TOKENS = 400


class Calls:
    """The SDK client and a record of each call: the span it ran under, and what came back."""

    def __init__(self, base_url: str) -> None:
        self.sent: list[dict[str, str]] = []
        hooks = {"request": [self._inject]}
        http = openai.DefaultHttpxClient(event_hooks=hooks)
        self.client = openai.OpenAI(base_url=base_url, api_key="not-checked", max_retries=0, http_client=http)

    def _inject(self, request: Any) -> None:
        propagate.inject(request.headers)
        ctx = trace.get_current_span().get_span_context()
        self.sent.append({"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")})

    def chat(self, case: str, **kwargs: Any) -> dict[str, Any]:
        """One non-streamed call (an error is a result too)."""
        out: dict[str, Any] = {"case": case}
        try:
            reply = self.client.chat.completions.create(messages=MESSAGES, **kwargs)
        except openai.APIStatusError as exc:
            out["error"] = {"status": exc.status_code, "type": type(exc).__qualname__}
        else:
            usage = reply.usage
            out["id"], out["model"] = reply.id, reply.model
            out["finish_reasons"] = [c.finish_reason for c in reply.choices]
            out["system_fingerprint"] = reply.system_fingerprint
            out["usage"] = None if usage is None else [usage.prompt_tokens, usage.completion_tokens]
        return self._ids(out)

    def stream(self, case: str, **kwargs: Any) -> dict[str, Any]:
        """One streamed call, read to its end."""
        return self.finish(self.open(case, **kwargs))

    def open(self, case: str, **kwargs: Any) -> tuple[dict[str, Any], Any, Any]:
        """Start a stream and read its first chunk; ``finish`` reads the rest."""
        stream = self.client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs)
        out = self._ids({"case": case})
        return out, stream, next(iter(stream))

    def finish(self, opened: tuple[dict[str, Any], Any, Any]) -> dict[str, Any]:
        out, stream, first = opened
        reasons: dict[int, str] = {}
        usage = None
        for chunk in [first, *stream]:
            out["id"], out["model"] = chunk.id, chunk.model
            out["system_fingerprint"] = chunk.system_fingerprint or out.get("system_fingerprint")
            for choice in chunk.choices:
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
            if chunk.usage is not None:
                usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
        out["finish_reasons"] = [reasons[i] for i in sorted(reasons)]
        out["usage"] = usage
        return out

    def _ids(self, out: dict[str, Any]) -> dict[str, Any]:
        out.update(self.sent.pop())
        assert not self.sent, "one HTTP request per call (max_retries=0)"
        return out


def run(base_url: str, otlp: str) -> list[dict[str, Any]]:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp}/v1/traces")))
    # One export at shutdown: every value of the run, cumulative.
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"{otlp}/v1/metrics"), export_interval_millis=3_600_000
    )
    meter_provider = MeterProvider(metric_readers=[reader])
    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    calls = Calls(base_url)
    model = {"model": "llmtap-sim", "max_tokens": MAX_TOKENS}
    results = [
        calls.chat("chat", **model),
        calls.stream("stream", **model),
        calls.stream("stream_usage", **model, stream_options={"include_usage": True}),
        calls.chat("unknown_model", model="no-such-model", max_tokens=MAX_TOKENS),
    ]
    # llmtap admits one request at a time with no line (--max-concurrency 1 --queue-limit 0): a call made
    # while a stream holds the slot is refused by llmtap itself and never reaches the model.
    held = calls.open("held", model="llmtap-sim", max_tokens=HELD_TOKENS, stream_options={"include_usage": True})
    results.append(calls.chat("refused", **model))
    results.append(calls.finish(held))
    tracer_provider.shutdown()
    meter_provider.shutdown()
    return results


if __name__ == "__main__":
    for line in run(sys.argv[1], sys.argv[2]):
        print(json.dumps(line), flush=True)
