"""What one client can do to everyone else through the relay, before and after its bounds.

``python -m bench.probes.relay_limits`` starts ``tests/support/fault_upstream.py`` and, per scenario, a fresh ``llmtap
serve``
of whatever code ``PYTHONPATH`` selects (the bounds' flags are passed only when that code has them), and prints
one JSON line per scenario:

* ``bomb``: a gzip response inflating to ``--bomb-mib`` MiB (one gzip member, ``gzip-bomb``) whose usage event
  llmtap removes, so the relay inflates it; probes' time to first token beside it and alone (a second, idle
  llmtap probed in turn);
* ``non_reader``: a streamed response of 256 MiB to a client that reads nothing (4 KiB receive buffer) under
  ``--max-concurrency 1``: how long until the next request is served (``--cap`` seconds at most);
* ``idle_sockets``: 4,000 idle connections from 127.0.0.2 with ``--max-client-connections 4000``: the status
  a client on 127.0.0.3 gets;
* ``stalled_upload``: a body that stops after 8 KB (the inspect limit 1 KiB) under ``--max-concurrency 1``:
  how long until the next request is served;
* ``big_bodies``: two clients sending 6.6 MB chat bodies back to back beside a stream of 200 chunks 10 ms
  apart: the stream's longest gap between chunks, alone and beside them.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from llmtap.config.options import OPTIONS
from tests.support.procs import FaultUpstream, Llmtap

CHAT = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
BOUNDED = "client_send_timeout" in OPTIONS


def _ttft(proxy: Llmtap, headers: dict[str, str] | None = None) -> float | str:
    """Seconds to the first content event, or what came instead (a status, an error)."""
    started = time.perf_counter()
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=120) as r:
            for chunk in r.iter_raw():
                if b'"content"' in chunk:
                    return time.perf_counter() - started
            return f"{r.status_code} without content"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _ms(values: Sequence[float | str]) -> dict[str, Any]:
    ordered = sorted(v for v in values if isinstance(v, float))
    failed = [v for v in values if isinstance(v, str)]
    if not ordered:
        return {"failed": failed}
    return {
        "failed": failed,
        "p50_ms": round(statistics.median(ordered) * 1e3, 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1e3, 1),
        "max_ms": round(ordered[-1] * 1e3, 1),
        "n": len(ordered),
    }


def bomb(start: Callable[..., Llmtap], upstream: str, mib: int) -> dict[str, Any]:
    size = mib << 20
    # The upstream compresses a bomb once per size: do it before anything is timed.
    with httpx.stream(
        "POST",
        upstream + "/v1/chat/completions",
        json=CHAT,
        headers={"x-fault": "gzip-bomb", "x-fault-arg": str(size)},
        timeout=600,
    ) as r:
        next(r.iter_raw())
    proxy = start(*(["--max-inflate-bytes", str(2 * size)] if BOUNDED else []))
    control = start()
    _ttft(proxy), _ttft(control)
    done = threading.Event()
    took: list[float] = []
    outcome: list[str] = []

    def run() -> None:
        t = time.perf_counter()
        headers = {"x-fault": "gzip-bomb", "x-fault-arg": str(size)}
        got = 0
        try:
            with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=600) as r:
                for piece in r.iter_raw(1 << 20):
                    got += len(piece)
            outcome.append(f"complete, {got >> 20} MiB")
        except httpx.HTTPError as exc:
            outcome.append(f"{type(exc).__name__} after {got >> 20} MiB")
        finally:
            took.append(time.perf_counter() - t)
            done.set()

    # The bomb's reader is a thread here; the probes' reads compete with it for this process's GIL in both runs.
    threading.Thread(target=run, daemon=True).start()
    beside: list[float | str] = []
    alone: list[float | str] = []
    time.sleep(0.3)
    while not done.is_set():
        alone.append(_ttft(control))
        beside.append(_ttft(proxy))
        time.sleep(0.05)
    return {"bomb_s": round(took[0], 1), "bomb": outcome[0], "ttft_beside": _ms(beside), "ttft_alone": _ms(alone)}


def _served_after(proxy: Llmtap, cap: float) -> float | str:
    started = time.monotonic()
    try:
        r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=cap)
    except httpx.TimeoutException:
        return f">{cap:g}"
    return (
        round(time.monotonic() - started, 2)
        if r.status_code == 200
        else f"{r.status_code} after {time.monotonic() - started:.1f} s"
    )


def non_reader(start: Callable[..., Llmtap], cap: float) -> dict[str, Any]:
    flags = ["--max-concurrency", "1", "--queue-timeout", str(cap)]
    proxy = start(*flags, *(["--client-send-timeout", "5"] if BOUNDED else []))
    body = json.dumps(CHAT).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proxy.port))
    sock.sendall(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: llmtap\r\ncontent-type: application/json\r\n"
            f"x-fault: flood\r\nx-fault-arg: {256 << 20}\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    time.sleep(0.5)
    served = _served_after(proxy, cap)
    sock.close()
    return {"next_request_served_after_s": served, "send_timeout_s": 5 if BOUNDED else None}


def idle_sockets(start: Callable[..., Llmtap]) -> dict[str, Any]:
    proxy = start("--max-client-connections", "4000", "--keep-alive-timeout", "120")
    idle = []
    try:
        for _ in range(4000):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", proxy.port))
            idle.append(s)
        time.sleep(2)
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=10)
        try:
            status: int | str = other.get(proxy.url + "/echo").status_code
        except httpx.TransportError as exc:
            status = type(exc).__name__
        other.close()
    finally:
        for s in idle:
            s.close()
    return {"other_client_status": status}


def stalled_upload(start: Callable[..., Llmtap], cap: float) -> dict[str, Any]:
    flags = ["--max-concurrency", "1", "--queue-timeout", str(cap)]
    proxy = start(
        *flags, *(["--client-upload-timeout", "5"] if BOUNDED else []), env={"LLMTAP_MAX_INSPECT_BYTES": "1024"}
    )
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: llmtap\r\ncontent-type: application/json\r\ncontent-length: "
        f"{len(body)}\r\n\r\n".encode()
        + body[:8000]
    )
    time.sleep(0.5)
    served = _served_after(proxy, cap)
    sock.close()
    return {"next_request_served_after_s": served, "upload_timeout_s": 5 if BOUNDED else None}


def _longest_gap(proxy: Llmtap) -> float:
    headers = {"x-chunks": "200", "x-gap-ms": "10"}
    last, gap = None, 0.0
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60) as r:
        for _ in r.iter_raw():
            now = time.perf_counter()
            if last is not None:
                gap = max(gap, now - last)
            last = now
    return gap


def big_bodies(start: Callable[..., Llmtap]) -> dict[str, Any]:
    proxy = start()
    messages = [{"role": "user", "content": f"message {i} " + "hello world " * 50} for i in range(10_500)]
    body = json.dumps({"model": "fault", "stream": True, "messages": messages}).encode()
    alone = [_longest_gap(proxy) for _ in range(3)]
    stop = threading.Event()

    def send() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                client.post(
                    proxy.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
                )

    senders = [threading.Thread(target=send, daemon=True) for _ in range(2)]
    for t in senders:
        t.start()
    time.sleep(0.5)
    beside = [_longest_gap(proxy) for _ in range(3)]
    stop.set()
    for t in senders:
        t.join()
    return {"body_mb": round(len(body) / 1e6, 1), "longest_gap_alone": _ms(alone), "longest_gap_beside": _ms(beside)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.relay_limits", description=__doc__.splitlines()[0])
    p.add_argument("--bomb-mib", type=int, default=1024)
    p.add_argument("--cap", type=float, default=20.0, help="longest wait for the next request to be served")
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args(argv)
    upstream = FaultUpstream()
    home = Path(tempfile.mkdtemp(prefix="llmtap-limits-"))
    started: list[Llmtap] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Llmtap:
        proxy = Llmtap(upstream.url, home / f"llmtap-{len(started)}.log", "--log-level", "warning", *flags, env=env)
        started.append(proxy)
        return proxy

    scenarios: dict[str, Callable[[], dict[str, Any]]] = {
        "bomb": lambda: bomb(start, upstream.url, args.bomb_mib),
        "non_reader": lambda: non_reader(start, args.cap),
        "idle_sockets": lambda: idle_sockets(start),
        "stalled_upload": lambda: stalled_upload(start, args.cap),
        "big_bodies": lambda: big_bodies(start),
    }
    try:
        for name, run in scenarios.items():
            if args.only and name not in args.only:
                continue
            result = run()
            print(json.dumps({"scenario": name, "bounded": BOUNDED, **result}), flush=True)
            while started:
                started.pop().close()
    finally:
        for proxy in started:
            proxy.close()
        upstream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
