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


def chat_tape(
    key: int,
    reads: Sequence[bytes],
    *,
    received: float = 1000.0,
    body: bytes = b'{"model": "m", "stream": true, "messages": []}',
    gap: float = 0.02,
    trace_id: int | None = None,
    span_id: int | None = None,
    fail: tuple[str, str | None, bool] | None = None,
) -> tuple[Tape, list[tuple[Any, ...]]]:
    """A relay's tape of one streamed chat request whose upstream sent ``reads``, ``gap`` seconds apart from
    ``received + 0.1``, and the messages the relay would hand over for it (segments, then the end).

    ``fail`` is the relay's own failure, if any: ``(error_type, message, cancelled)``. Also what the tests
    build their tapes with.
    """
    t = Tape(
        key,
        method="POST",
        path="/v1/chat/completions",
        inner_path="/v1/chat/completions",
        route="default",
        protocol="openai_chat",
        received=received,
        received_wall_ns=1_700_000_000_000_000_000,
    )
    t.trace_id = trace_id if trace_id is not None else key + 1
    t.span_id = span_id if span_id is not None else key + 1
    t.body, t.body_read, t.admitted, t.sent = body, received + 0.001, received + 0.002, received + 0.003
    t.headers_at, t.status_code = received + 0.05, 200
    t.response_headers = [(b"content-type", b"text/event-stream")]
    messages: list[tuple[Any, ...]] = []
    for i, data in enumerate(reads):
        at = received + 0.1 + i * gap
        full = t.read(at, data)
        t.delivered(at + 0.0001)
        if full:
            messages.append(t.segment_message())
    t.end = received + 0.1 + len(reads) * gap
    if fail is not None:
        t.fail(fail[0], fail[1], cancelled=fail[2])
    messages.append(t.end_message())
    return t, messages


def tape(key: int, chunks: int) -> tuple[Any, ...]:
    """The end message of one finished stream of ``chunks`` content chunks (one upstream read each), usage last."""
    usage = {"model": "m", "choices": [], "usage": {"prompt_tokens": 51, "completion_tokens": 2 * chunks}}
    reads = [_event(" word word")] * chunks + [b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"]
    prompt = [{"role": "user", "content": "hello " * 50}]
    body = json.dumps({"model": "m", "stream": True, "messages": prompt}).encode()
    return chat_tape(key, reads, body=body)[1][-1]


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
