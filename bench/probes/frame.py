"""What the application frame costs: ``python -m bench.probes.frame``.

The relay's endpoint is a raw ASGI callable; the frame around it (Starlette's router and its error
middleware) is paid on every request, and its ``send`` wrappers on every relayed chunk. This measures
both, in process CPU time, against calling the endpoint bare: N requests of one ``http.response.start``,
``chunks`` body messages and an end, through a no-op ``send``. Medians of several rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from llmtap.types import ASGIApp, Message, Receive, Scope, Send


def _endpoint(chunks: int) -> ASGIApp:
    async def relay(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return relay


def _scope() -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"x"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    return None


async def _per_request(app: ASGIApp, requests: int) -> float:
    started = time.process_time()
    for _ in range(requests):
        await app(_scope(), _receive, _send)
    return (time.process_time() - started) / requests


def measure(requests: int, chunks: int, rounds: int) -> dict[str, Any]:
    """Median CPU µs per request for the bare endpoint and for it inside the relay's frame."""
    from llmtap.relay.frame import relay_frame

    bare = _endpoint(chunks)
    framed = relay_frame(bare)
    out: dict[str, list[float]] = {"bare": [], "frame": []}
    for _ in range(rounds):
        out["bare"].append(asyncio.run(_per_request(bare, requests)))
        out["frame"].append(asyncio.run(_per_request(framed, requests)))
    bare_us = statistics.median(out["bare"]) * 1e6
    frame_us = statistics.median(out["frame"]) * 1e6
    return {
        "requests": requests,
        "chunks_per_request": chunks,
        "bare_us_per_request": round(bare_us, 2),
        "frame_us_per_request": round(frame_us, 2),
        "frame_cost_us_per_request": round(frame_us - bare_us, 2),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the frame's cost per request with no chunks and with 50 chunks (its per-send share)."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.frame", description=__doc__)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    for chunks in (0, 50):
        print(json.dumps(measure(args.requests, chunks, args.rounds)))


if __name__ == "__main__":
    main()
