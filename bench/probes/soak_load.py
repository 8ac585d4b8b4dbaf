"""The memory soak's load: short streamed chats at a steady rate, a new prompt every request, thousands of tenants.

Every request is a chat with the same system prompt (a shared prefix, as an application sends) and a user message
seen once (``--user-chars`` long, so each request adds that many characters of new prefix blocks to llmtap's
prompt index), a tenant of ``--tenants`` in turn (``x-llmtap-tenant``), a prompt version of a few, and now and then
a model name or a version seen once (values llmtap's label guards must keep off its metrics). Requests start at
``--rate`` per second, spread evenly (an open arrival: a late one does not delay the next), on up to
``--connections`` keep-alive connections; while all of them are busy, arrivals wait for one. In the last
``--burst`` seconds of every ``--period`` the rate is ``--overload-rate``, and one request in ``--long-every``
asks for a long answer (a stream the relay hands over in several segments): the overload the soak pairs with a
stalled telemetry process.

Run ``python -m bench.probes.soak_load --url URL --duration S``; it prints one JSON line of counts at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from urllib.parse import urlsplit

from bench.client import _Exchange, _request_bytes

SYSTEM = "You are the support assistant of a hardware shop. Answer briefly, cite the order number. " * 24
WORDS = ("order", "refund", "delivery", "invoice", "warranty", "screen", "battery", "cable", "late", "broken")
VERSIONS = ("v1", "v2", "v3")


class Plan:
    """What the request ``n`` (sent at ``t`` seconds into the run) asks for; seeded, so two runs send the same."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)

    def overloaded(self, t: float) -> bool:
        """Whether ``t`` seconds into the run falls in an overload phase (the last ``burst`` of each period)."""
        a = self.args
        return bool(a.burst > 0 and t % a.period >= a.period - a.burst)

    def request(self, n: int, t: float) -> tuple[bytes, str]:
        """The request's bytes and its kind (``short``, ``long``, ``odd-model``, ``odd-version``)."""
        a, rng = self.args, self.rng
        words = " ".join(rng.choice(WORDS) for _ in range(a.user_chars // 7))
        kind, model, version = "short", a.model, VERSIONS[n % len(VERSIONS)]
        tokens = a.max_tokens
        if self.overloaded(t) and a.long_every and n % a.long_every == 0:
            kind, tokens = "long", a.long_tokens
        elif n % 97 == 0:
            kind, model = "odd-model", f"{a.model}-{n}"
        elif n % 89 == 0:
            kind, version = "odd-version", f"exp-{n}"
        body = json.dumps(
            {
                "model": model,
                "stream": True,
                "max_tokens": tokens,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Request {n}: {words}"[: a.user_chars]},
                ],
            }
        ).encode()
        _, _, data = _request_bytes(a.url, body, None)
        head, _, rest = data.partition(b"\r\n\r\n")
        extra = f"\r\nx-llmtap-tenant: tenant-{n % a.tenants}\r\nx-llmtap-prompt-version: {version}"
        return head + extra.encode() + b"\r\n\r\n" + rest, kind


class Load:
    """The arrivals, the connections, and what came back."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plan = Plan(args)
        self.free: asyncio.Queue[_Exchange | None] = asyncio.Queue()
        self.counts: Counter[str] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> Counter[str]:
        a = self.args
        for _ in range(a.connections):
            self.free.put_nowait(None)  # a connection opened on first use
        start = a.start_at or time.monotonic()
        n, due = 0, start
        await asyncio.sleep(max(start - time.monotonic(), 0.0))
        while (now := time.monotonic()) < start + a.duration:
            t = now - start
            due += 1.0 / (a.overload_rate if self.plan.overloaded(t) else a.rate)
            if due > now:
                await asyncio.sleep(due - now)
            elif now - due > 1.0:
                self.counts["late_arrivals"] += 1
                due = now  # the client fell behind: no catching up in a burst
            conn = await self.free.get()
            data, kind = self.plan.request(n, t)
            task = asyncio.create_task(self.one(conn, data, kind))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            n += 1
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=120)
        self.counts["sent"] = n
        return self.counts

    async def one(self, conn: _Exchange | None, data: bytes, kind: str) -> None:
        try:
            if conn is None or conn.transport is None:
                parts = urlsplit(self.args.url)
                _, conn = await asyncio.get_running_loop().create_connection(_Exchange, parts.hostname, parts.port)
            await asyncio.wait_for(conn.request(data), 120)
            self.counts[f"status_{conn.status}"] += 1
            self.counts[kind] += 1
        except (TimeoutError, OSError, ConnectionError) as exc:
            self.counts[f"error_{type(exc).__name__}"] += 1
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            conn = None
        finally:
            self.free.put_nowait(conn)


#: The options of the load's shape, as ``argparse`` names them: the memory soak takes them and passes them on.
SHAPE = ("rate", "overload_rate", "period", "burst", "tenants")


def add_shape(p: argparse.ArgumentParser) -> None:
    """The load's shape: its rates, its overload phases and its tenants (``SHAPE``), the same options here and in the
    memory soak (``bench.probes.soak_memory``), which runs this load with them."""
    p.add_argument("--rate", type=float, default=200.0, help="requests per second (200)")
    p.add_argument("--overload-rate", type=float, default=400.0, help="requests per second in overload (400)")
    p.add_argument("--period", type=float, default=300.0, help="seconds from one overload phase to the next (300)")
    p.add_argument(
        "--burst", type=float, default=30.0, help="seconds of overload at the end of each period (30; 0: none)"
    )
    p.add_argument("--tenants", type=int, default=3000, help="tenants in turn (3000)")


def shape_argv(args: argparse.Namespace) -> list[str]:
    """The load's shape in ``args`` (parsed with ``add_shape``) as this probe's command line."""
    argv: list[str] = []
    for name in SHAPE:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.probes.soak_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the proxy's chat completions URL")
    p.add_argument("--duration", type=float, required=True, help="seconds of load")
    add_shape(p)
    p.add_argument("--connections", type=int, default=64, help="keep-alive connections at most (64)")
    p.add_argument("--model", default="llmtap-sim", help="the model asked for (llmtap-sim)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens of a short answer (4)")
    p.add_argument("--long-tokens", type=int, default=600, help="tokens of a long answer, in overload (600)")
    p.add_argument("--long-every", type=int, default=20, help="one request in this many is long, in overload (20)")
    p.add_argument("--user-chars", type=int, default=2100, help="characters of each new user message (2100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-at", type=float, default=0.0, help="when to start, on the monotonic clock (now)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.probes.soak_load``."""
    args = parser().parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    counts = asyncio.run(Load(args).run())
    print(json.dumps(dict(sorted(counts.items()))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
