"""Serving the simulator with uvicorn: in the foreground, or in a background thread for tests."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import uvicorn

from llmtap.simulator.app import create_app
from llmtap.simulator.faults import FaultPlan
from llmtap.simulator.profiles import Profile
from llmtap.simulator.spans import SpanExporter

__all__ = ["Background", "announce", "run_in_thread", "serve"]

log = logging.getLogger(__name__)


def _config(app: Any, **kwargs: Any) -> uvicorn.Config:
    # No lifespan or websockets to set up; access logs would cost more than the simulated work at
    # benchmark rates. Open streams get a short grace period on shutdown, not the whole answer.
    return uvicorn.Config(app, lifespan="off", ws="none", access_log=False, timeout_graceful_shutdown=2, **kwargs)


def _freeze_heap() -> None:
    # A full garbage collection walks every object in the process (the encodings, every imported
    # module) and stalls all streams for ~20 ms; freezing what exists after start-up leaves the
    # collector only the objects that requests create. Process-wide, and harmless to other code.
    gc.collect()
    gc.freeze()


async def serve(
    host: str, port: int, profile: Profile, *, faults: FaultPlan | None = None, otlp_traces_endpoint: str | None = None
) -> None:
    """Serve the simulator on ``host:port`` until the process is told to stop; with ``otlp_traces_endpoint``, each
    request's span is exported there as vLLM's are."""
    spans = SpanExporter(otlp_traces_endpoint) if otlp_traces_endpoint else None
    app = create_app(profile, faults=faults, spans=spans)
    _freeze_heap()
    log.info("%s", announce(profile, host, port))
    try:
        await uvicorn.Server(_config(app, host=host, port=port, log_level="info")).serve()
    finally:
        if spans is not None:
            await asyncio.to_thread(spans.close)


def announce(profile: Profile, host: str, port: int) -> str:
    """What ``llmtap simulate`` serves: the profile, its models and timing, and the endpoints to point a client at."""
    base = f"http://{host}:{port}"
    return (
        f"simulating profile {profile.name!r} ({profile.about or 'no description'}): "
        f"model {', '.join(profile.served_models)}; prefill {profile.prefill_tokens_per_s:,.0f} tokens/s, "
        f"decode {profile.decode_s_per_token * 1000:g} ms/token, {profile.max_num_seqs} slots\n"
        f"  OpenAI     {base}/v1/chat/completions  {base}/v1/completions  {base}/v1/responses\n"
        f"  Anthropic  {base}/v1/messages\n"
        f"  Ollama     {base}/api/chat  {base}/api/generate\n"
        f"  Gemini     {base}/v1beta/models/{profile.served_models[0]}:streamGenerateContent\n"
        f"  truth      {base}/debug/requests   metrics {base}/metrics"
    )


class Background(NamedTuple):
    """A simulator running in a thread: its base URL and how to stop it."""

    url: str
    stop: Callable[[], None]


def run_in_thread(
    profile: Profile,
    *,
    host: str = "127.0.0.1",
    seed: int | None = None,
    clock: Callable[[], float] = time.time,
    timeout: float = 10.0,
    faults: FaultPlan | None = None,
    spans: SpanExporter | None = None,
) -> Background:
    """Start the simulator on a free port in a daemon thread; returns once it accepts connections. ``spans``
    exports each request's span (and is closed by ``stop``)."""
    # Binding the socket here, not in uvicorn, gives the port before the thread starts and no race.
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and without it
    # Nagle holds each small SSE write until the client's delayed ACK, 40 ms later.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        _config(create_app(profile, seed=seed, clock=clock, faults=faults, spans=spans), log_level="warning")
    )
    _freeze_heap()
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name=f"llmtap-sim-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the simulator did not start on {host}:{port}")
        time.sleep(0.005)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        if spans is not None:
            spans.close()

    return Background(f"http://{host}:{port}", stop)
