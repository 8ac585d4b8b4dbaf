"""What one telemetry core can take: ``python -m bench.telemetry``.

Plays tapes of streamed chat requests (``chunks`` content chunks of a few tokens each, usage at the end,
as the relay hands them over) through a recorder with the SDK's tracer and meter providers, a span per
chunk, and spans exported by the batch processor to an exporter that encodes OTLP protobuf and drops it
(the work a real export does short of the socket). Reports CPU seconds of this process per 1,000 chunks
and the chunks per second one core sustains: the telemetry process's capacity, which ``--workers``
relays share.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from proxy.settings import Route, Settings
from proxy.tape import Tape
from proxy.telemetry.recorder import Recorder


class _Encoding(SpanExporter):
    """Encodes every batch as OTLP protobuf, as the OTLP exporters do before sending, and keeps nothing."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release."""


def _event(text: str) -> bytes:
    chunk = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def tape(key: int, chunks: int) -> tuple[Any, ...]:
    """The end message of one finished stream of ``chunks`` content chunks (one upstream read each)."""
    t = Tape(
        key,
        method="POST",
        path="/v1/chat/completions",
        inner_path="/v1/chat/completions",
        route="default",
        protocol="openai_chat",
        received=1000.0,
        received_wall_ns=1_700_000_000_000_000_000,
    )
    t.trace_id, t.span_id = key + 1, key + 1
    prompt = [{"role": "user", "content": "hello " * 50}]
    t.body = json.dumps({"model": "m", "stream": True, "messages": prompt}).encode()
    t.body_read, t.admitted, t.sent, t.headers_at, t.status_code = 1000.001, 1000.001, 1000.002, 1000.02, 200
    t.response_headers = [(b"content-type", b"text/event-stream")]
    for i in range(chunks):
        at = 1000.05 + i * 0.02
        t.read(at, _event(" word word"))
        t.delivered(at + 0.0001)
    usage = {"model": "m", "choices": [], "usage": {"prompt_tokens": 51, "completion_tokens": 2 * chunks}}
    t.read(1000.05 + chunks * 0.02, b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    t.delivered(1000.05 + chunks * 0.02)
    t.end = 1000.06 + chunks * 0.02
    return t.end_message()


def measure(requests: int, chunks: int) -> dict[str, Any]:
    """CPU per 1,000 chunks for ``requests`` tapes, all telemetry on."""
    exporter = _Encoding()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    settings = Settings(routes=(Route(prefix="/", upstream="http://upstream:8000", name="default"),))
    recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    messages = [tape(i, chunks) for i in range(requests)]
    recorder.take(0, tape(requests, chunks))  # warm-up: the tokenizer and the first spans
    cpu, wall = time.process_time(), time.perf_counter()
    for message in messages:
        recorder.take(0, message)
    tracer_provider.force_flush()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    recorder.close()
    tracer_provider.shutdown()
    meter_provider.shutdown()
    total = requests * chunks
    return {
        "requests": requests,
        "chunks_per_request": chunks,
        "spans_exported": exporter.spans,
        "cpu_s_per_1k_chunks": round(1000 * cpu / total, 4),
        "chunks_per_s_per_core": round(total / cpu),
        "wall_s": round(wall, 2),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the telemetry side's CPU per 1,000 chunks, a span per chunk and with chunk spans folded."""
    p = argparse.ArgumentParser(prog="python -m bench.telemetry", description=__doc__)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--chunks", type=int, default=50)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.requests, args.chunks)))


if __name__ == "__main__":
    main()
