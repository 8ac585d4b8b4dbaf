"""Micro-benchmark of the relay's request step: ``Provider.prepare`` against the full ``inspect``.

``python -m bench.probes.prepare`` prints the median CPU time per call, in µs, for a typical small chat
request (~1 KB) and for a chat request with a 6,200-token prompt (~25 KB), both streamed without
``stream_options`` (so usage is spliced in), and once more with a ``stream_options`` object (the path
that scans for it). ``inspect`` (parse, params, prompt text and regions, then the same splice) and the
re-serialization the splice replaced (``json.loads`` then ``json.dumps``) are measured for comparison.

CPU time of this process, not wall time: a batch of calls is timed together and the median over batches
is reported, so a scheduler hiccup moves one batch, not the figure. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from llmtap.providers import OpenAIChat

CHAT = OpenAIChat()
_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which have not but they "
    "request stream token model latency server cache prompt prefill decode queue usage response client"
).split()


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def small_chat() -> dict[str, Any]:
    """A typical chat request: a system prompt, a short exchange, a few parameters (~1 KB)."""
    rng = random.Random(1)
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": _text(rng, 300)},
            {"role": "user", "content": _text(rng, 250)},
            {"role": "assistant", "content": _text(rng, 200)},
            {"role": "user", "content": _text(rng, 150)},
        ],
        "max_tokens": 512,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": True,
    }


def long_chat() -> dict[str, Any]:
    """A chat request with a 6,200-token prompt (~25 KB at ~4 bytes a token), over a tools list and 12 turns."""
    rng = random.Random(2)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": _text(rng, 120),
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            },
        }
        for i in range(4)
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, 2500)}]
    for turn in range(12):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _text(rng, 1800)})
    return {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "tools": tools, "stream": True}


def _cpu_us(call: Callable[[], object], *, batch: int, batches: int) -> float:
    """Median CPU µs per call over ``batches`` batches of ``batch`` calls."""
    for _ in range(batch):  # warm up
        call()
    samples: list[float] = []
    for _ in range(batches):
        start = time.process_time_ns()
        for _ in range(batch):
            call()
        samples.append((time.process_time_ns() - start) / batch / 1000)
    return statistics.median(samples)


def _reserialize(body: bytes) -> bytes:
    """The rewrite the splice replaced: parse, set the option, serialize the whole request again."""
    obj = json.loads(body)
    obj["stream_options"] = {**(obj.get("stream_options") or {}), "include_usage": True}
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=200, help="timed batches per figure (default 200)")
    args = parser.parse_args(argv)
    bodies = {}
    for name, obj in (("small chat", small_chat()), ("6,200-token chat", long_chat())):
        bodies[name] = json.dumps(obj).encode()
        with_options = {**obj, "stream_options": {"continuous_usage_stats": False}}
        bodies[name + " + stream_options"] = json.dumps(with_options).encode()
    print(f"{'request':<36} {'bytes':>7} {'prepare':>9} {'inspect':>9} {'loads+dumps':>12}   (median CPU µs per call)")
    for name, body in bodies.items():
        batch = max(5, 200_000 // len(body))

        def prepare(body: bytes = body) -> object:
            return CHAT.prepare(body, inject_usage=True)

        def inspect(body: bytes = body) -> object:
            return CHAT.inspect(body, inject_usage=True)

        def rewrite(body: bytes = body) -> object:
            return _reserialize(body)

        figures = [_cpu_us(f, batch=batch, batches=args.batches) for f in (prepare, inspect, rewrite)]
        print(f"{name:<36} {len(body):>7} {figures[0]:>9.1f} {figures[1]:>9.1f} {figures[2]:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
