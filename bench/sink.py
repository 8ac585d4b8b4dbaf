"""A local OTLP/gRPC receiver for the benchmark: llmtap exports here, so export cost is part of what is measured.

Every root span (a request) becomes one JSON line in ``--out`` with its numeric attributes (TTFT, TPOT,
duration, ...) and the number of chunk spans that arrived for its trace; metrics exports are counted.
The harness reads the file for llmtap's exact per-request figures. Run ``python -m bench.sink --out F``;
it prints its port on stdout.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from collections import Counter
from concurrent import futures
from typing import Any, TextIO

import grpc  # type: ignore[import-untyped]
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

CHUNK_SPAN = "llmtap.decode.chunk"
ROOT_PREFIXES = ("chat", "text_completion", "generate_content", "POST", "GET")


def _numeric(attributes: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    kv: KeyValue
    for kv in attributes:
        which = kv.value.WhichOneof("value")
        if which == "double_value":
            out[kv.key] = kv.value.double_value
        elif which == "int_value":
            out[kv.key] = float(kv.value.int_value)
    return out


class Sink(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """Writes one line per root span; counts chunk spans per trace and metric exports."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.chunks: Counter[bytes] = Counter()
        self.spans = 0
        self.metric_exports = 0

    def Export(self, request: Any, context: Any) -> Any:
        """Both services' one method; told apart by the request's type."""
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            with self.lock:
                self.metric_exports += 1
            return metrics_service_pb2.ExportMetricsServiceResponse()
        lines: list[str] = []
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans += 1
                        if span.name == CHUNK_SPAN:
                            self.chunks[span.trace_id] += 1
                        elif not span.parent_span_id:
                            record = {
                                "trace": span.trace_id.hex(),
                                "name": span.name,
                                "start_ns": span.start_time_unix_nano,
                                "end_ns": span.end_time_unix_nano,
                                "attrs": _numeric(span.attributes),
                            }
                            lines.append(json.dumps(record))
            if lines:
                self.out.write("\n".join(lines) + "\n")
            self.out.write(json.dumps({"spans": self.spans, "chunk_spans": sum(self.chunks.values())}) + "\n")
            self.out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.sink``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.out, "a", encoding="utf-8") as out:
        sink = Sink(out)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port(f"127.0.0.1:{args.port}")
        server.start()
        print(port, flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        stop.wait()
        server.stop(2).wait()


if __name__ == "__main__":
    main()
