"""What one telemetry core can take, and where it goes: ``python -m bench.probes.telemetry [--before REV]``.

Plays tapes of streamed chat requests (``chunks`` content chunks of a few tokens each, usage at the end,
as the relay hands them over, random trace ids, 64 streams open at once) through a recorder with the SDK's
tracer and meter providers and default telemetry settings, spans exported by the batch processor to an
exporter that encodes OTLP protobuf and drops it (the work a real export does short of the socket), metrics
into the meter provider ``llmtap serve`` builds for ``/metrics`` and an OTLP export (its readers as the
measured tree wires them; no export falls within the run).
Reports the CPU of this process per chunk, in µs, by phase: ``decode`` (the tape played back: bytes
decoded into events and facts, the timeline), ``summary`` (figures, tokens, cache diagnosis), ``spans``
(building them), ``export`` (encoding them, on the exporter's thread), ``metrics`` (recording them),
``records`` (building the record line, which only ``--record`` writes: reported apart, not in the total),
``other`` (the rest of the process's CPU). Also the spans exported per request and the chunks per second
one core sustains.

``--pace S`` hands the tapes over as they come in place, one every ``S`` seconds, the process asleep in between
(``--batch N``: N at a time, every ``N * S`` seconds): the same work then costs more CPU, as a core that idles
between small pieces of work runs them cold.

``--tapes FILE`` plays the messages a relay really sent in place of the made-up tapes: FILE holds the bytes a
telemetry process read from its relays, as ``python -m bench.probes.relay_cpu --capture FILE`` records them. They go
through the recorder's queue and worker thread as in ``llmtap serve`` (``--pace`` and ``--batch`` as above, so a
burst's tapes can be handed over together), with the settings the benchmark gives ``llmtap serve`` (provider
vllm, a span per chunk where a request keeps them); per chunk is per content chunk the timelines counted. The
same tapes then cost what the work costs warm, against what the relay's run measured of the telemetry process.

``--serve`` (with ``--tapes``) gives the recorder the providers and live view ``llmtap serve`` has by default in
place of the exporting ones: no span exporter (no OTLP endpoint), ``/metrics``; what a short request costs the
default telemetry. ``--total`` times no phase (a wrapped function costs a timer read each call, and a phase one
tree skips would skip its timer too): the total alone.

``--before REV`` runs the same measurement, in the same run, against the ``proxy`` package of git
revision ``REV`` (extracted to a temporary folder, run in a child process): before and after side by side.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from llmtap.config.types import Route, Settings
from llmtap.telemetry.recorder import Recorder
from tests.support.tapes import chat_tape, content_event


def _encode(spans: Sequence[ReadableSpan]) -> bytes:
    """A batch as OTLP protobuf, by the encoder the tree's exporters use (the SDK's, before llmtap had one)."""
    try:
        encode_request = _moved("llmtap.telemetry.emit.otlp_spans", "llmtap.telemetry.otlp_spans").encode_request
    except ImportError:
        data: bytes = encode_spans(spans).SerializeToString()
        return data
    encoded: bytes = encode_request(spans)
    return encoded


def _moved(module: str, before: str) -> Any:
    """A module of the tree measured: at its place in the telemetry side's rooms, or where it was before them (a
    ``--before`` revision)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return importlib.import_module(before)


class _Encoding(SpanExporter):
    """Encodes every batch as OTLP protobuf, as the OTLP exporters do before sending, and keeps nothing."""

    def __init__(self) -> None:
        self.spans = 0
        self.cpu_ns = 0  # the exporter thread's CPU in ``export``

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        start = time.thread_time_ns()
        _encode(spans)
        self.spans += len(spans)
        self.cpu_ns += time.thread_time_ns() - start
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release."""


#: Streams open at once in the played-back traffic: each tape starts this share of a stream's length after the one
#: before, so the estimator's replay of admissions sees the overlap of 64 staggered streams, as in a real run.
STREAMS = 64


def tape(key: int, chunks: int, rng: random.Random | None = None, *, received: float | None = None) -> tuple[Any, ...]:
    """The end message of one finished stream of ``chunks`` content chunks (one upstream read each), usage last;
    received ``key`` starts after the first, ``STREAMS`` streams open at once (or at ``received``)."""
    usage = {"model": "m", "choices": [], "usage": {"prompt_tokens": 51, "completion_tokens": 2 * chunks}}
    reads = [content_event(" word word")] * chunks + [b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"]
    prompt = [{"role": "user", "content": "hello " * 50}]
    body = json.dumps({"model": "m", "stream": True, "messages": prompt}).encode()
    rng = rng or random.Random(key)
    if received is None:
        received = 1000.0 + key * (0.1 + 0.02 * chunks) / STREAMS  # chat_tape's first read and gap
    trace_id, span_id = rng.getrandbits(128), rng.getrandbits(64) or 1
    return chat_tape(key, reads, received=received, body=body, trace_id=trace_id, span_id=span_id)[1][-1]


#: Phases, in the order they are reported; ``records`` is not in the default telemetry's total.
PHASES = ("decode", "summary", "spans", "export", "metrics", "other", "records")


class _Phases:
    """Thread CPU per phase, by wrapping the functions each phase runs (the same names before and after)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        ns = self.ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                ns[phase] += time.thread_time_ns() - start

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, inner))

    @classmethod
    def timing(cls) -> _Phases:
        """The phases of the tree's telemetry, each timed by the functions it runs (undo when done)."""
        spans = _moved("llmtap.telemetry.emit.spans", "llmtap.telemetry.spans")
        metrics = _moved("llmtap.telemetry.emit.metrics", "llmtap.telemetry.metrics")
        replay = _moved("llmtap.telemetry.intake.replay", "llmtap.telemetry.replay")
        # The analysis of a finished request: one call since ``llmtap.analysis.finish``, the recorder's before.
        finish = _moved("llmtap.analysis.finish", "llmtap.telemetry.recorder")
        analysis = finish.Analysis if hasattr(finish, "Analysis") else finish.Recorder

        phases = cls()
        phases.wrap(replay.Playback, "__init__", "decode")
        phases.wrap(replay.Playback, "feed", "decode")
        phases.wrap(replay.Playback, "finish", "decode")
        phases.wrap(finish, "summarize", "summary")
        phases.wrap(analysis, "_diagnose", "summary")
        phases.wrap(spans.SpanWriter, "root", "spans")
        phases.wrap(spans.SpanWriter, "write", "spans")
        phases.wrap(metrics.MetricWriter, "record", "metrics")
        return phases

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()


def _meters() -> tuple[MeterProvider, Callable[[], None]]:
    """The meter provider the tree's ``llmtap serve`` builds with ``/metrics`` on and metrics exported over OTLP
    (its readers as it wires them), and how to stop it; an in-memory reader for a tree without that wiring.

    The OTLP endpoint is a closed port an hour's interval away: nothing is sent during the run, and at the end
    the provider is left to the process's exit rather than shut down (its last export would wait on that port).
    """
    from llmtap.config.types import TelemetrySettings

    try:
        build = _moved("llmtap.telemetry.emit.setup", "llmtap.telemetry.setup").build
    except ImportError:
        provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
        return provider, provider.shutdown
    t = TelemetrySettings(
        metrics_exporter="otlp", metrics_endpoint="http://127.0.0.1:9", metric_export_interval_ms=3_600_000
    )
    providers = build(t)
    assert providers.meter_provider is not None
    return providers.meter_provider, lambda: None


def measure(requests: int, chunks: int, *, pace: float = 0.0, batch: int = 1) -> dict[str, Any]:
    """CPU per chunk by phase for ``requests`` tapes of ``chunks`` chunks, default telemetry settings; with
    ``pace``, the tapes come ``batch`` at a time, ``pace`` seconds per tape apart (the process sleeps between)."""
    record_line = _moved("llmtap.telemetry.records.record", "llmtap.telemetry.records").record_line

    exporter = _Encoding()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
    meter_provider, stop_meters = _meters()
    settings = Settings(routes=(Route(prefix="/", upstream="http://upstream:8000", name="default"),))
    recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    rng = random.Random(29)
    messages = [tape(i, chunks, rng) for i in range(requests)]
    recorder.take(0, tape(requests, chunks, rng, received=900.0))  # warm-up: the tokenizer and the first spans
    tracer_provider.force_flush()
    exporter.spans = exporter.cpu_ns = 0
    phases = _Phases.timing()
    ident = recorder.identity

    def line(tl: Any, s: Any) -> None:
        start = time.thread_time_ns()
        record_line(tl, s, None, ident)
        phases.ns["records"] += time.thread_time_ns() - start

    recorder.listeners.append(line)
    cpu, wall = time.process_time_ns(), time.perf_counter()
    for i, message in enumerate(messages, 1):
        recorder.take(0, message)
        if pace and i % batch == 0:
            time.sleep(pace * batch)
    tracer_provider.force_flush()
    cpu, wall = time.process_time_ns() - cpu, time.perf_counter() - wall
    phases.undo()
    recorder.close()
    tracer_provider.shutdown()
    stop_meters()
    total = requests * chunks
    ns = defaultdict(int, phases.ns)  # a phase a compiled caller reaches unwrapped counts in "other"
    ns["export"] = exporter.cpu_ns
    ns["other"] = max(cpu - ns["records"] - sum(ns[p] for p in PHASES[:5]), 0)
    default_cpu = cpu - ns["records"]
    return {
        "requests": requests,
        "chunks_per_request": chunks,
        "spans_per_request": round(exporter.spans / requests, 2),
        "us_per_chunk": {p: round(ns[p] / 1000 / total, 1) for p in PHASES},
        "us_per_chunk_total": round(default_cpu / 1000 / total, 1),
        "chunks_per_s_per_core": round(total / (default_cpu / 1e9)),
        "wall_s": round(wall, 2),
    }


def captured(path: Path) -> list[Any]:
    """The messages in a capture (the bytes a telemetry process read from its relays, frame after frame)."""
    from llmtap.wire.framing import FrameReader

    reader = FrameReader()
    messages = reader.feed(path.read_bytes())
    if reader.pending:
        raise SystemExit(f"{path}: ends inside a message ({reader.pending} bytes of it)")
    return messages


def _served(settings: Settings) -> tuple[Any, Any, Callable[[], None]]:
    """The tracer and meter providers ``llmtap serve``'s telemetry process builds from ``settings`` (by default: no
    span exporter, ``/metrics``), and how to stop them."""
    setup = _moved("llmtap.telemetry.emit.setup", "llmtap.telemetry.setup")
    providers = setup.build(settings.telemetry)
    return providers.tracer_provider, providers.meter_provider, providers.meter_provider.shutdown


def _live_view(recorder: Recorder, settings: Settings) -> None:
    """The admin listener's live view, subscribed to the recorder as ``llmtap serve`` subscribes it."""
    view = _moved("llmtap.telemetry.admin.live.view", "llmtap.telemetry.live")
    view.LiveView(recorder, settings)


def measure_tapes(
    path: Path,
    *,
    pace: float = 0.0,
    batch: int = 1,
    serve: bool = False,
    phases_on: bool = True,
    freeze: bool = False,
) -> dict[str, Any]:
    """CPU per content chunk by phase for the messages captured in ``path``, through the recorder's queue and
    worker; with ``pace``, ``batch`` messages at a time, ``pace`` seconds per message apart. ``serve``: with the
    providers and live view ``llmtap serve`` has under its default settings (no span exporter); ``phases_on``
    False: the total alone (no function wrapped to time it, so a phase skipped does not skip its timer too);
    ``freeze``: the objects made before the measurement frozen out of the cyclic collector's sight, as ``llmtap
    serve``'s telemetry process freezes what its start-up made. The collections within the measurement are counted
    and timed (wall time) by generation either way."""
    from llmtap.analysis import tokens
    from llmtap.config.load import build
    from llmtap.wire.messages import END

    messages = captured(path)
    ends = [i for i, m in enumerate(messages) if m[0] == END]
    if len(ends) < 2:
        raise SystemExit(f"{path}: {len(ends)} finished streams; at least 2 are needed")
    # The settings ``bench.peers.llmtap`` gives ``llmtap serve``; spans and metrics as ``measure`` makes them.
    settings = build(
        {"upstream": "http://127.0.0.1:9", "provider": "vllm"},
        {"LLMTAP_CHUNK_SPANS": "spans", "OTEL_SERVICE_NAME": "llmtap"},
    )
    exporter = _Encoding()
    if serve:
        settings = build({"upstream": "http://127.0.0.1:9", "provider": "vllm"}, {"OTEL_SERVICE_NAME": "llmtap"})
        tracer_provider, meter_provider, stop_meters = _served(settings)
    else:
        tracer_provider = TracerProvider(shutdown_on_exit=False)
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
        meter_provider, stop_meters = _meters()
    recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    if serve:
        _live_view(recorder, settings)
    tokens.get_encoding()
    chunks = [0]
    recorder.listeners.append(lambda tl, s: chunks.__setitem__(0, chunks[0] + len(tl.chunk_times)))
    # Warm-up: the first stream, played and flushed before the measurement (the tokenizer, the first spans).
    for message in messages[: ends[0] + 1]:
        recorder.submit(message)
    recorder.flush(60)
    tracer_provider.force_flush()
    exporter.spans = exporter.cpu_ns = 0
    chunks[0] = 0
    rest = messages[ends[0] + 1 :]
    requests = len(ends) - 1
    if freeze:
        gc.collect()
        gc.freeze()
    collections = _Collections()
    phases = _Phases.timing() if phases_on else _Phases()
    step = batch if pace else len(rest)
    cpu, wall = time.process_time_ns(), time.perf_counter()
    for start in range(0, len(rest), step):
        for message in rest[start : start + step]:
            recorder.submit(message)
        recorder.flush(60)
        if pace:
            time.sleep(pace * step)
    tracer_provider.force_flush()
    cpu, wall = time.process_time_ns() - cpu, time.perf_counter() - wall
    collections.stop()
    phases.undo()
    recorder.close()
    tracer_provider.shutdown()
    stop_meters()
    total = max(chunks[0], 1)
    ns = defaultdict(int, phases.ns)  # a phase a compiled caller reaches unwrapped counts in "other"
    ns["export"] = exporter.cpu_ns
    ns["records"] = 0
    ns["other"] = max(cpu - sum(ns[p] for p in PHASES[:5]), 0)
    return {
        "tapes": str(path),
        "serve": serve,
        "requests": requests,
        "chunks_per_request": round(total / requests, 1),
        "spans_per_request": round(exporter.spans / requests, 2),
        "us_per_chunk": {p: round(ns[p] / 1000 / total, 1) for p in PHASES},
        "us_per_chunk_total": round(cpu / 1000 / total, 1),
        # Short requests (no chunks, e.g. embeddings): what each request costs, by phase.
        "us_per_request": {p: round(ns[p] / 1000 / requests, 1) for p in PHASES},
        "us_per_request_total": round(cpu / 1000 / requests, 1),
        "chunks_per_s_per_core": round(total / (cpu / 1e9)),
        "wall_s": round(wall, 2),
        "frozen": freeze,
        "collections": collections.by_generation(),
    }


class _Collections:
    """The cyclic collector's runs from now until ``stop``: how many of each generation, and their wall time."""

    def __init__(self) -> None:
        self._started = 0.0
        self.runs: dict[int, list[float]] = defaultdict(list)
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.runs[info["generation"]].append(time.perf_counter() - self._started)

    def stop(self) -> None:
        """Count no more."""
        gc.callbacks.remove(self._callback)

    def by_generation(self) -> dict[str, dict[str, float]]:
        """Per generation: how many, and their total wall time in ms."""
        runs = sorted(self.runs.items())
        return {str(g): {"count": len(times), "total_ms": round(sum(times) * 1000, 1)} for g, times in runs}


def _before(rev: str, requests: int, chunks: int, extra: Sequence[str] = ()) -> dict[str, Any]:
    """``measure`` in a child process against revision ``rev``'s package (``proxy/llmtap``), this ``bench``.

    Revisions from the rename to ``llmtap`` on: this bench imports ``llmtap``."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "proxy"], check=True, capture_output=True)
        archive_path = Path(tmp) / "proxy.tar"
        archive_path.write_bytes(archive.stdout)
        with tarfile.open(archive_path) as tar:
            tar.extractall(tmp, filter="data")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tmp) / "proxy"), str(root)])}
        argv = [sys.executable, "-m", "bench.probes.telemetry", "--requests", str(requests), "--chunks", str(chunks)]
        argv += extra
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=tmp)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def table(runs: dict[str, dict[str, Any]]) -> str:
    """The runs side by side as a Markdown table: µs of CPU per chunk (per request for tapes of short requests) by
    phase, spans per request."""
    names = list(runs)
    # Tapes of short requests (no chunks): per request.
    short = all(runs[n]["chunks_per_request"] == 0 and "us_per_request" in runs[n] for n in names)
    per = "request" if short else "chunk"
    lines = [f"| µs of CPU per {per} | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for phase in PHASES:
        label = "records (with --record; not in the total)" if phase == "records" else phase
        lines.append(f"| {label} | " + " | ".join(str(runs[n][f"us_per_{per}"][phase]) for n in names) + " |")
    lines.append("| **total** | " + " | ".join(f"**{runs[n][f'us_per_{per}_total']}**" for n in names) + " |")
    lines.append("| chunks/s per core | " + " | ".join(str(runs[n]["chunks_per_s_per_core"]) for n in names) + " |")
    lines.append("| spans per request | " + " | ".join(str(runs[n]["spans_per_request"]) for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the telemetry side's CPU per chunk by phase (JSON; with ``--before``, a table of both)."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.telemetry", description=__doc__)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--chunks", type=int, default=50)
    p.add_argument("--before", metavar="REV", help="also measure git revision REV's proxy package, side by side")
    p.add_argument(
        "--pace",
        type=float,
        default=0.0,
        metavar="S",
        help="tapes S seconds apart, as they come in place (64 streams of 50 chunks 20 ms apart: 0.0156), the "
        "process asleep between; 0: back to back",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="with --pace: messages taken per wake-up, back to back (tapes; with --tapes, the relay's reports too)",
    )
    p.add_argument(
        "--tapes",
        type=Path,
        metavar="FILE",
        help="play the messages captured in FILE (bench.probes.relay_cpu --capture)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="with --tapes: the providers and live view llmtap serve has by default (no span exporter)",
    )
    p.add_argument("--total", action="store_true", help="with --tapes: the total CPU alone, no phase timed")
    p.add_argument(
        "--freeze",
        action="store_true",
        help="with --tapes: what was made before the measurement frozen out of the collector's sight, as llmtap "
        "serve's telemetry process freezes what its start-up made",
    )
    args = p.parse_args(argv)

    def one() -> dict[str, Any]:
        if args.tapes is not None:
            return measure_tapes(
                args.tapes,
                pace=args.pace,
                batch=args.batch,
                serve=args.serve,
                phases_on=not args.total,
                freeze=args.freeze,
            )
        return measure(args.requests, args.chunks, pace=args.pace, batch=args.batch)

    if args.before is None:
        print(json.dumps(one()))
        return
    extra = ["--pace", str(args.pace), "--batch", str(args.batch)]
    if args.tapes is not None:
        extra += ["--tapes", str(args.tapes.resolve())]
        extra += ["--serve"] if args.serve else []
        extra += ["--total"] if args.total else []
        extra += ["--freeze"] if args.freeze else []
    runs = {f"before ({args.before})": _before(args.before, args.requests, args.chunks, extra)}
    runs["after (this tree)"] = one()
    print(json.dumps(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
