"""What each bounded structure of llmtap's processes weighs when full: built to its bound here, and weighed.

``python -m bench.probes.cache_sizes`` fills each structure the memory soak probes (``bench.probes.soak_probe``) to
its bound
with entries like the soak's (a chat of a 2 KB system prompt and a 2 KB user message, 50 content chunks; 16-byte
prefix hashes; 16-hex-digit span ids), each in a process of its own, and prints per structure its bound, the
entries built, and the memory they hold: the Python heap's growth (``tracemalloc``) and the process's unique
memory's (USS, ``/proc/self/smaps_rollup``: what native code such as protobuf's holds too). Structures whose
entries are whole requests (open streams, requests waiting for their server span) are built to 512 entries and
scaled to the bound, said so in the output. ``--json`` prints the rows as JSON; ``--only NAME`` one row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.probes.soak_load import SYSTEM, WORDS
from bench.probes.soak_memory import smaps
from llmtap.wire.messages import End, Segment
from tests.support.tapes import chat_tape

#: Entries of whole requests built before scaling to the bound.
SAMPLE = 512
_SIZES: dict[str, Callable[[], tuple[int, int, Any]]] = {}


def size(name: str) -> Callable[[Callable[[], tuple[int, int, Any]]], Callable[[], tuple[int, int, Any]]]:
    """Register a builder: it returns (bound, entries built, what holds them)."""

    def register(build: Callable[[], tuple[int, int, Any]]) -> Callable[[], tuple[int, int, Any]]:
        _SIZES[name] = build
        return build

    return register


def _chat(key: int, chunks: int = 50) -> list[tuple[Any, ...]]:
    words = " ".join(WORDS[(key + i) % len(WORDS)] for i in range(300))[:2100]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Request {key}: {words}"}]
    body = json.dumps({"model": "llmtap-sim", "stream": True, "messages": messages}).encode()
    event = b'data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'
    usage = b'data: {"model":"m","choices":[],"usage":{"prompt_tokens":900,"completion_tokens":50}}\n\n'
    reads = [event] * chunks + [usage + b"data: [DONE]\n\n"]
    return chat_tape(key, reads, body=body)[1]


def _settings() -> Any:
    from llmtap.config.types import Route, Settings

    return Settings(routes=(Route(prefix="/", upstream="http://127.0.0.1:8000", name="default"),))


def _finished(key: int) -> tuple[Any, Any]:
    from llmtap.analysis.summary import summarize
    from llmtap.telemetry.intake.replay import Playback
    from llmtap.wire.messages import decode

    settings = _settings()
    m = decode(_chat(key)[-1])
    assert isinstance(m, End) and m.head is not None
    playback = Playback(m.head, settings, {r.name: r for r in settings.routes})
    playback.feed(m.reads)
    tl = playback.finish(m.tail)
    return tl, summarize(tl, settings.slo, drift=False)


@size("prefix_index")
def _prefix() -> tuple[int, int, Any]:
    from llmtap.analysis.fingerprint import PREFIX_BLOCKS, PrefixIndex

    index, n = PrefixIndex(), 0
    while len(index) < PREFIX_BLOCKS:  # a new user message of three blocks a request, as in the soak
        index.add_chain([os.urandom(16) for _ in range(3)], float(n))
        n += 1
    return PREFIX_BLOCKS, len(index), index


@size("token_counts")
def _token_counts() -> tuple[int, int, Any]:
    from llmtap.analysis.fingerprint import PART_COUNTS, TokenCounts

    counts = TokenCounts()
    for n in range(PART_COUNTS):
        counts.count(os.urandom(32) + b"o200k_base", f"part {n}", "o200k_base")
    return PART_COUNTS, len(counts._counts), counts


@size("short_token_counts")
def _short() -> tuple[int, int, Any]:
    from llmtap.analysis import tokens

    for encoding in tokens.ENCODINGS:
        for n in range(tokens.SHORT_KEPT):
            tokens.count(f" w{n:x}"[: tokens.SHORT_CHARS], encoding)
    return tokens.SHORT_KEPT * len(tokens.ENCODINGS), sum(len(v) for v in tokens._short.values()), tokens._short


@size("trace_ids_known")
def _known() -> tuple[int, int, Any]:
    from llmtap.telemetry.fleet.peers import MAX_KNOWN, Ownership

    owned = Ownership(1.0, lambda n: None)
    for _ in range(MAX_KNOWN):
        owned.relayed(os.urandom(16).hex())
    return MAX_KNOWN, len(owned._known), owned


@size("join_recent")
def _recent() -> tuple[int, int, Any]:
    from llmtap.telemetry.fleet.serverspans import MAX_RECENT, Join

    join: Join[Any] = Join(1.0, lambda outcome, n: None)
    for _ in range(MAX_RECENT):
        join.recorded(os.urandom(8).hex(), "http://127.0.0.1:8000")
    return MAX_RECENT, len(join._recent), join


@size("join_held")
def _held() -> tuple[int, int, Any]:
    from llmtap.telemetry.fleet.serverspans import MAX_HELD, Join

    join: Join[Any] = Join(60.0, lambda outcome, n: None)
    items = [_finished(n) for n in range(SAMPLE)]
    for item in items:
        join.hold(os.urandom(8).hex(), "http://127.0.0.1:8000", item, 0.0)
    return MAX_HELD, len(join._held), join


@size("open_streams")
def _open() -> tuple[int, int, Any]:
    from llmtap.telemetry.intake.replay import Playback
    from llmtap.telemetry.intake.streams import MAX_OPEN_STREAMS
    from llmtap.wire.messages import decode

    settings, held = _settings(), []
    big = b'data: {"choices": [{"delta": {"content": "' + b"x" * 33_000 + b'"}}]}\n\n'
    for n in range(SAMPLE):
        m = decode(chat_tape(n, [big, big])[1][0])  # a stream's first segment: its head and 32 KB of reads
        assert isinstance(m, Segment) and m.head is not None
        playback = Playback(m.head, settings, {r.name: r for r in settings.routes})
        playback.feed(m.reads)
        held.append(playback)
    return MAX_OPEN_STREAMS, len(held), held


@size("gone_streams")
def _gone() -> tuple[int, int, Any]:
    from llmtap.telemetry.intake.streams import MAX_GONE, Streams

    streams = Streams(None, None, gone_limit=MAX_GONE)  # type: ignore[arg-type]  # neither is called here
    for n in range(MAX_GONE):
        streams.dropped((0, n), end=True)
    streams._settle()
    return MAX_GONE, streams.gone, streams


@size("live_samples")
def _live() -> tuple[int, int, Any]:
    from llmtap.telemetry.admin.live.window import SAMPLE_BUDGET, LiveWindow

    window = LiveWindow(lambda tl, s: ("default", "llmtap-sim", "v1"), slo=True, traces=True)
    entries = [window.entry(*_finished(n)) for n in range(64)]
    n = 0
    while window._kept < SAMPLE_BUDGET:
        window.take(entries[n % len(entries)])  # type: ignore[arg-type]
        n += 1
    return SAMPLE_BUDGET, window._kept, window


@size("estimator_completions")
def _estimator() -> tuple[int, int, Any]:
    from llmtap.analysis.estimator import MAX_COMPLETIONS, SlotLog

    log = SlotLog()
    for n in range(MAX_COMPLETIONS):
        log.add(n * 0.01, n * 0.01 + 0.5)
        log.decoding(n * 0.01 + 0.1, n * 0.01 + 0.5, count=False)
    return 2 * MAX_COMPLETIONS, len(log._ends) + len(log._decoding), log


@size("sdk_attribute_sets")
def _sdk() -> tuple[int, int, Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from llmtap.telemetry.emit.instruments import DURATION_BUCKETS

    limit = 2000  # the SDK's default cardinality limit per instrument
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    histogram = provider.get_meter("sizes").create_histogram(
        "llmtap.sizes", unit="s", explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS)
    )
    for n in range(limit):
        attrs = {"gen_ai.request.model": f"model-{n}", "llmtap.route": "default", "llmtap.tenant": f"t{n % 20}"}
        histogram.record(0.1, attrs)
    return limit, limit, provider


def measure(name: str) -> dict[str, Any]:
    """Build one structure in this process and weigh it."""
    from llmtap.analysis import tokens

    tokens.get_encoding()  # the tokenizer's table is not the structure's
    for encoding in tokens.ENCODINGS:
        tokens.get_encoding(encoding)
    gc.collect()
    before = smaps(os.getpid())
    tracemalloc.start()
    bound, built, held = _SIZES[name]()
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    after = smaps(os.getpid())
    assert before is not None and after is not None and held is not None
    scale = bound / built if built else 0.0
    return {
        "name": name,
        "bound": bound,
        "built": built,
        "heap_mb": round(heap * scale / 2**20, 2),
        "uss_mb": round(max(after["uss"] - before["uss"], 0) * scale / 2**20, 2),
        "scaled": built < bound,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.probes.cache_sizes``."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.cache_sizes", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=sorted(_SIZES), help="one structure, in this process")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only)))
        return 0
    root = Path(__file__).resolve().parents[2]
    rows = []
    for name in _SIZES:
        done = subprocess.run(
            [sys.executable, "-m", "bench.probes.cache_sizes", "--only", name],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        rows.append(json.loads(done.stdout))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            scaled = f" (from {r['built']}, scaled)" if r["scaled"] else ""
            print(f"{r['name']:<24} {r['bound']:>8,}  heap {r['heap_mb']:>7} MB  USS {r['uss_mb']:>7} MB{scaled}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
