"""A lean, scripted LLM upstream on raw asyncio streams, for exact timing checks.

The script: the role-only chunk (not content) goes out at once, the first content chunk ``ttft``
seconds after the request arrived, then one content chunk every ``gap`` seconds; every 4th chunk
carries three tokens. Deadlines are absolute from the request's arrival, so there is no drift.
Run ``python -m tests.support.scripted_upstream``; it prints its port on stdout.

Responses are deterministic (fixed ids and timestamps), so a direct call and a call through
the proxy can be compared byte for byte. A request header ``x-script-delay: SECONDS`` holds its whole
stream back by that much (a TTFT of that request's own). ``GET /last-headers`` returns the headers of the
request before it as they arrived here (what a proxy sent upstream).

With ``SCRIPT_OTLP_TRACES=URL`` it also traces as vLLM's ``--otlp-traces-endpoint`` does: the OpenTelemetry
SDK takes the request's ``traceparent`` and ``tracestate``, and each streamed request ends one SERVER span
``llm_request`` under it, with the script's own queue (``SCRIPT_QUEUE``, 0.0625 s), prefill (TTFT less queue,
less ``SCRIPT_UNATTRIBUTED``, 0 s: time the server's phases leave out, as vLLM's front end does) and decode in
vLLM's attributes, exported over OTLP/HTTP in batches (``OTEL_BSP_SCHEDULE_DELAY``); and
``/metrics`` shows vLLM's two gauges, so llmtap takes it for a server that can trace.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from typing import Any

from tests.support import chunks
from tests.support.rawhttp import parse_head, read_body

WORDS = ["alpha", "beta", "gamma", "delta", "river", "sigma", "omega", "theta"]  # one o200k token each


def script(ttft: float, gap: float, chunks: int) -> list[tuple[float, list[str]]]:
    """(offset from request arrival, tokens) per content chunk."""
    out = []
    for i in range(chunks):
        n = 3 if i % 4 == 3 else 1
        out.append((ttft + i * gap, [" " + WORDS[(i + k) % len(WORDS)] for k in range(n)]))
    return out


def _chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return chunks.chat_chunk(delta, finish, model="scripted", ident="chatcmpl-scripted")


def _usage_chunk(prompt: int, completion: int) -> bytes:
    return chunks.usage_chunk(prompt, completion, model="scripted", ident="chatcmpl-scripted")


def _anthropic(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class Upstream:
    """Serves the script on /v1/chat/completions and /v1/messages (streamed or not)."""

    def __init__(self, ttft: float, gap: float, chunks: int) -> None:
        self.plan = script(ttft, gap, chunks)
        self.tracer = _tracer(os.environ.get("SCRIPT_OTLP_TRACES"))
        self.queue_s = float(os.environ.get("SCRIPT_QUEUE", "0.0625"))
        self.unattributed_s = float(os.environ.get("SCRIPT_UNATTRIBUTED", "0"))
        self.output_tokens = sum(len(t) for _, t in self.plan)
        self.last_headers: dict[str, str] = {}
        self.active = 0
        self.first_content_offset = 0.0
        #: Each content chunk's offset from the request's arrival, as written (the latest stream's).
        self.content_offsets: list[float] = []
        self.cancelled = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = time.perf_counter()
                method, target, headers = parse_head(head)
                body = await read_body(reader, headers)
                if not target.startswith("/last-headers"):
                    self.last_headers = headers
                await self.respond(writer, method, target, headers, body, arrived)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        arrived: float,
    ) -> None:
        path = target.split("?", 1)[0]
        if path == "/metrics" and self.tracer is not None:
            page = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(page))
            writer.write(page)
            await writer.drain()
            return
        if path in ("/echo-headers", "/active", "/last-headers") or path.startswith("/echo-body/"):
            if path == "/last-headers":
                info: dict[str, Any] = {"headers": self.last_headers}
            elif path == "/active":
                info = {
                    "active": self.active,
                    "cancelled": self.cancelled,
                    "first_content_offset": self.first_content_offset,
                    "content_offsets": self.content_offsets,
                }
            elif path == "/echo-headers":
                info = {"headers": headers, "target": target}
            else:
                info = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
            payload = json.dumps(info).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload)
            )
            writer.write(payload)
            await writer.drain()
            return
        if path == "/status/500":
            payload = b'{"error":{"message":"boom","type":"InternalServerError","code":500}}'
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % len(payload)
            )
            writer.write(payload)
            await writer.drain()
            return
        if path.startswith("/special/"):
            await self.special(writer, path)
            return
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {}
        stream = bool(request.get("stream"))
        anthropic = path.endswith("/messages")
        if not stream:
            await asyncio.sleep(max(self.plan[-1][0] - (time.perf_counter() - arrived), 0))
            text = "".join(t for _, toks in self.plan for t in toks)
            if anthropic:
                payload = json.dumps(
                    {
                        "id": "msg_scripted",
                        "type": "message",
                        "role": "assistant",
                        "model": "scripted",
                        "content": [{"type": "text", "text": text}],
                        "stop_reason": "end_turn",
                        "stop_sequence": None,
                        "usage": {"input_tokens": 12, "output_tokens": self.output_tokens},
                    }
                ).encode()
            else:
                payload = json.dumps(
                    {
                        "id": "chatcmpl-scripted",
                        "object": "chat.completion",
                        "created": 1700000000,
                        "model": "scripted",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                        ],
                        "usage": {
                            "prompt_tokens": 12,
                            "completion_tokens": self.output_tokens,
                            "total_tokens": 12 + self.output_tokens,
                        },
                    }
                ).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload)
            )
            writer.write(payload)
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        self.active += 1
        try:
            await self._stream(writer, request, anthropic, arrived, chunk, float(headers.get("x-script-delay", 0)))
            self._trace(headers, arrived)
        except ConnectionError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _stream(
        self,
        writer: asyncio.StreamWriter,
        request: dict[str, Any],
        anthropic: bool,
        arrived: float,
        chunk: Any,
        shift: float = 0.0,
    ) -> None:
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        if anthropic:
            chunk(
                _anthropic(
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": "msg_scripted",
                            "type": "message",
                            "role": "assistant",
                            "content": [],
                            "model": "scripted",
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": {"input_tokens": 12, "output_tokens": 1},
                        },
                    },
                )
            )
            chunk(
                _anthropic(
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                )
            )
            chunk(_anthropic("ping", {"type": "ping"}))
        else:
            chunk(_chat_chunk({"role": "assistant", "content": ""}))
        await writer.drain()
        for i, (offset, toks) in enumerate(self.plan):
            delay = arrived + shift + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # What the script really did: each content chunk's offset from the request's arrival.
            written = time.perf_counter() - arrived
            if i == 0:
                self.first_content_offset, self.content_offsets = written, []
            self.content_offsets.append(written)
            last = i == len(self.plan) - 1
            if anthropic:
                chunk(
                    _anthropic(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": "".join(toks)},
                        },
                    )
                )
            else:
                chunk(_chat_chunk({"content": "".join(toks)}, "stop" if last else None))
            await writer.drain()
        if anthropic:
            chunk(_anthropic("content_block_stop", {"type": "content_block_stop", "index": 0}))
            chunk(
                _anthropic(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                        "usage": {"output_tokens": self.output_tokens},
                    },
                )
            )
            chunk(_anthropic("message_stop", {"type": "message_stop"}))
        else:
            if include_usage:
                chunk(_usage_chunk(12, self.output_tokens))
            chunk(b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def special(self, writer: asyncio.StreamWriter, path: str) -> None:
        """Hostile or broken streams, each named by its path."""
        name = path.split("/")[2]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        if name == "truncate":
            for i in range(5):
                chunk(_chat_chunk({"content": f" word{i}"}))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.transport.abort()  # dies mid-stream: no terminating chunk
            return
        if name == "weird":
            # Invalid UTF-8 inside a data line, and bare CR line endings.
            head = b'data: {"id":"x","object":"chat.completion.chunk","model":"scripted","choices":[{"index":0,'
            chunk(head + b'"delta":{"content":"caf\xff\xfe"}}]}\r\r')
            await writer.drain()
            await asyncio.sleep(0.01)
            chunk(head + b'"delta":{"content":" ok"},"finish_reason":"stop"}]}\r\r')
            chunk(b"data: [DONE]\r\r")
        elif name == "anthropic-error":
            chunk(
                _anthropic(
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": "msg_e",
                            "type": "message",
                            "role": "assistant",
                            "content": [],
                            "model": "scripted",
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": {"input_tokens": 5, "output_tokens": 1},
                        },
                    },
                )
            )
            chunk(
                _anthropic(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
                )
            )
            await writer.drain()
            await asyncio.sleep(0.01)
            chunk(
                _anthropic("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
            )
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    def _trace(self, headers: dict[str, str], arrived: float) -> None:
        """The server's span of a finished request, as vLLM makes it (``vllm/v1/engine/output_processor.py``)."""
        if self.tracer is None:
            return
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({k: v for k, v in headers.items() if k.startswith("trace")})
        ended = time.time_ns()
        started = ended - round((time.perf_counter() - arrived) * 1e9)
        first, last = self.content_offsets[0], self.content_offsets[-1]
        span = self.tracer.start_span("llm_request", context=context, kind=SpanKind.SERVER, start_time=started)
        span.set_attributes(
            {
                "gen_ai.latency.time_in_queue": self.queue_s,
                "gen_ai.latency.time_in_model_prefill": max(first - self.queue_s - self.unattributed_s, 0.0),
                "gen_ai.latency.time_in_model_decode": last - first,
                "gen_ai.latency.time_to_first_token": first,
            }
        )
        span.end(end_time=ended)


def _tracer(endpoint: str | None) -> Any:
    """An OpenTelemetry tracer exporting to ``endpoint`` over OTLP/HTTP in batches, or None."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "scripted-server"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("scripted.llm_engine")


async def main() -> None:
    up = Upstream(
        ttft=float(os.environ.get("SCRIPT_TTFT", "0.3")),
        gap=float(os.environ.get("SCRIPT_GAP", "0.02")),
        chunks=int(os.environ.get("SCRIPT_CHUNKS", "40")),
    )
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
