"""``llmtap demo``: the offline main job. A simulated server, the proxy in front, two workloads, four numbers.

It starts the simulator (one per workload profile) and the proxy in this process on free ports,
drives each workload through the proxy twice (prompt laid out variable part first, then the
unchanging part first, the course's "fix the support assistant" step) and prints, from the proxy's
own measurements, TTFT, ITL, TPOT, throughput, goodput, the queue/prefill/decode split and the
cached-token share, then the caching verdict of ``llmtap compare`` over the request records it wrote
(``--record``), split by prompt layout. Telemetry goes wherever ``OTEL_*`` points; with no endpoint
set, to local JSON-lines files whose paths are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from llmtap import simulator
from llmtap.analysis.compare import MIN_GAIN_MS, Comparison, Split
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.commands.compare import compare_records
from llmtap.commands.demo_report import ProgressLine, render as render  # render is part of the demo's API
from llmtap.commands.demo_workloads import (  # the workloads are part of the demo's API
    FIXED_FIRST as FIXED_FIRST,
    VARIABLE_FIRST as VARIABLE_FIRST,
    PhaseResult as PhaseResult,
    Workload as Workload,
    default_workloads as default_workloads,
    messages as _messages,
    objective_headers,
    phase_result,
)
from llmtap.config.otel import telemetry_from_env
from llmtap.config.types import Records, Route, Settings, TelemetrySettings
from llmtap.simulator.spans import SpanExporter
from llmtap.simulator.text import Vocabulary
from llmtap.telemetry.emit import reservoir, setup
from llmtap.telemetry.exposition.prometheus import PrometheusReader

if TYPE_CHECKING:
    from uvicorn import Server

__all__ = [
    "FIXED_FIRST",
    "VARIABLE_FIRST",
    "DemoRun",
    "PhaseResult",
    "Progress",
    "Workload",
    "default_workloads",
    "main",
    "render",
    "run",
]

WARMUP = "warmup"
#: Longest wait, after a phase's warm-up, for the simulator's span of it to reach llmtap.
SPAN_SETTLE_S = 5.0


class _Collector:
    """Receives each finished request from the recorder's worker thread."""

    def __init__(self) -> None:
        self.rows: list[tuple[Timeline, Summary]] = []
        self.lock = threading.Lock()

    def __call__(self, tl: Timeline, s: Summary) -> None:
        with self.lock:
            self.rows.append((tl, s))

    def take(self, route: str, layout: str) -> list[tuple[Timeline, Summary]]:
        with self.lock:
            return [(tl, s) for tl, s in self.rows if tl.route == route and tl.prompt_version == layout]


@dataclass(frozen=True, slots=True)
class Progress:
    """Where one phase stands: its requests started and finished, seconds since it began."""

    workload: str
    layout: str
    requests: int
    concurrency: int
    started: int
    done: int
    seconds: float
    #: True once, when the phase is over.
    finished: bool = False


async def _send(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    version: str,
    max_tokens: int,
    objective: dict[str, str],
) -> None:
    """One streamed chat request under prompt ``version`` with its own ``objective`` headers, read to the end."""
    body = {"model": "llmtap-sim", "messages": messages, "max_tokens": max_tokens, "stream": True}
    headers = {"x-llmtap-prompt-version": version, **objective}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        async for _ in r.aiter_raw():
            pass


async def _drive(
    client: httpx.AsyncClient,
    base: str,
    w: Workload,
    layout: str,
    vocab: Vocabulary,
    progress: Callable[[Progress], None],
    offset: int,
    warmed: Callable[[], Awaitable[None]],
) -> float:
    """Send one phase's requests at the workload's concurrency; returns the phase's wall time. ``warmed`` is
    awaited after the warm-up request (the server's span of it reaches llmtap first)."""
    url = f"{base}/{w.route}/v1/chat/completions"
    began = time.perf_counter()
    started = done = 0

    def report(finished: bool = False) -> None:
        seconds = time.perf_counter() - began
        progress(Progress(w.name, layout, w.requests, w.concurrency, started, done, seconds, finished))

    async def one(index: int, version: str, max_tokens: int, objective: dict[str, str]) -> None:
        await _send(client, url, _messages(w, layout, index, vocab), version, max_tokens, objective)

    async def tick() -> None:
        # A long answer takes seconds: the line moves every second, not only when a request ends.
        while True:
            await asyncio.sleep(1.0)
            report()

    report()
    ticker = asyncio.create_task(tick())
    try:
        # One short request first, so the phase measures a warm cache as steady traffic would see it.
        await one(offset + 10_000, WARMUP, 1, {})
        await warmed()
        sem = asyncio.Semaphore(w.concurrency)

        async def limited(i: int) -> None:
            nonlocal started, done
            async with sem:
                started += 1
                report()
                await one(offset + i, layout, w.output_tokens, objective_headers(w, i))
            done += 1
            report()

        start = time.perf_counter()
        await asyncio.gather(*(limited(i) for i in range(w.requests)))
        seconds = time.perf_counter() - start
    finally:
        ticker.cancel()
    report(finished=True)
    return seconds


@dataclass(slots=True)
class DemoRun:
    """Everything one run produced."""

    results: list[PhaseResult] = field(default_factory=list)
    telemetry_files: list[str] = field(default_factory=list)
    #: ``llmtap compare`` of the two layouts, per workload, over the request records.
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    records_file: str = ""


def _file_providers(
    directory: Path, readers: Sequence[MetricReader] = ()
) -> tuple[TracerProvider, MeterProvider, list[IO[str]]]:
    directory.mkdir(parents=True, exist_ok=True)
    traces = (directory / "traces.jsonl").open("w", encoding="utf-8")
    metrics = (directory / "metrics.jsonl").open("w", encoding="utf-8")
    tp = TracerProvider(resource=setup.resource())
    tp.add_span_processor(
        BatchSpanProcessor(ConsoleSpanExporter(out=traces, formatter=lambda s: s.to_json(indent=None) + "\n"))
    )
    reader = PeriodicExportingMetricReader(
        ConsoleMetricExporter(out=metrics, formatter=lambda m: m.to_json(indent=None) + "\n"),
        export_interval_millis=60_000,
    )
    meters = MeterProvider(resource=setup.resource(), metric_readers=[reader, *readers], views=reservoir.views())
    return tp, meters, [traces, metrics]


def _simulators(
    workloads: list[Workload], traces: str
) -> tuple[dict[str, SpanExporter], dict[str, simulator.Background]]:
    """A simulator per workload profile, each exporting its spans to ``traces``, and their span exporters."""
    exporters = {w.profile: SpanExporter(traces, interval=0.2) for w in workloads}
    sims = {
        w.profile: simulator.run_in_thread(simulator.get_profile(w.profile), spans=exporters[w.profile])
        for w in workloads
    }
    return exporters, sims


def _serving(server: Server, sock: socket.socket) -> tuple[Server, asyncio.Task[None]]:
    """``server`` serving on ``sock`` in a task of its own."""
    return server, asyncio.create_task(server.serve(sockets=[sock]))


async def _stop(
    servers: list[tuple[Server, asyncio.Task[None]]], sims: dict[str, simulator.Background], otel: _Telemetry
) -> None:
    """Stop each server in turn and wait for it, then the simulators, then the telemetry (its last export)."""
    for server, task in servers:
        server.should_exit = True
        await task
    for sim in sims.values():
        sim.stop()
    await asyncio.to_thread(otel.shutdown)
    for f in otel.files:
        f.close()


@dataclass(slots=True)
class _Telemetry:
    """Where the demo's telemetry goes: the providers, how to shut them down, the files they write, and the
    reader the live view's Prometheus text comes from (None without ``serve``)."""

    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    shutdown: Callable[[], None]
    prometheus: PrometheusReader | None
    files: list[IO[str]] = field(default_factory=list)


def _telemetry(tel: TelemetrySettings, env: dict[str, str], directory: Path, out: DemoRun, live: bool) -> _Telemetry:
    """The providers ``OTEL_*`` asks for; with no exporter named, JSON-lines files in ``directory`` (their paths
    go into ``out``)."""
    prometheus = PrometheusReader() if live else None
    if tel.traces_exporter == "none" and tel.metrics_exporter == "none" and not tel.sdk_disabled:
        tracer_provider, meter_provider, files = _file_providers(directory, [prometheus] if prometheus else [])
        out.telemetry_files = [str(directory / "traces.jsonl"), str(directory / "metrics.jsonl")]

        def shutdown() -> None:
            tracer_provider.shutdown()
            meter_provider.shutdown()

        return _Telemetry(tracer_provider, meter_provider, shutdown, prometheus, files)
    providers = setup.build(tel, env)
    return _Telemetry(
        providers.tracer_provider,  # type: ignore[arg-type]
        providers.meter_provider,  # type: ignore[arg-type]
        providers.shutdown,
        providers.prometheus if live else None,
    )


def _records_dir(telemetry_dir: Path | None, out: DemoRun) -> tuple[Path, Path]:
    """The run's telemetry folder and its records folder, emptied of an earlier run's records."""
    directory = telemetry_dir or Path(tempfile.gettempdir()) / f"llmtap-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    records = directory / "records"
    if records.is_dir():
        shutil.rmtree(records)  # a folder of an earlier run under the same name: this run's records only
    out.records_file = str(records)
    return directory, records


def _routes(workloads: list[Workload], sims: dict[str, simulator.Background]) -> tuple[Route, ...]:
    """One route per workload, to its profile's simulator."""
    return tuple(
        Route(
            prefix=f"/{w.route}",
            upstream=sims[w.profile].url,
            name=w.route,
            provider="llmtap-sim",
            strip_prefix=True,
            # The simulator's batch size, as a user would pass vLLM's --max-num-seqs: queueing is inferred.
            server_slots=simulator.get_profile(w.profile).max_num_seqs,
            # Each request is judged by its workload's objective (the records carry it, for ``llmtap slo``).
            slo=(w.slo,),
        )
        for w in workloads
    )


async def _started(servers: list[tuple[Server, asyncio.Task[None]]]) -> None:
    """Wait until every server listens; a server that stopped first raises its error here."""
    while not all(server.started for server, _ in servers):
        for _, t in servers:
            if t.done():
                t.result()
        await asyncio.sleep(0.01)


async def _phases(
    out: DemoRun,
    workloads: list[Workload],
    base: str,
    settle: Callable[[str], Callable[[], Awaitable[None]]],
    collector: _Collector,
    progress: Callable[[Progress], None],
) -> None:
    """Drive each workload through the proxy in both layouts, and keep each phase's figures in ``out``."""
    vocab = Vocabulary("o200k_base")
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for n, w in enumerate(workloads):
            for layout in (VARIABLE_FIRST, FIXED_FIRST):
                offset = n * 100_000 + (layout == FIXED_FIRST) * 50_000
                warmed = settle(w.profile)
                seconds = await _drive(client, base, w, layout, vocab, progress, offset, warmed)
                await warmed()  # the phase's last spans joined before the flush writes what still waits
                out.results.append(phase_result(w, layout, collector.take(w.route, layout), seconds))


async def run(
    workloads: list[Workload],
    *,
    progress: Callable[[Progress], None] = lambda _: None,
    env: dict[str, str] | None = None,
    telemetry_dir: Path | None = None,
    serve: Callable[[DemoRun, str, str], Awaitable[None]] | None = None,
    min_gain_ms: float = MIN_GAIN_MS,
) -> DemoRun:
    """Run the demo and return its figures.

    With ``serve``, the proxy, the simulators and an admin listener with the live view stay up after the
    tables: ``serve(figures, view_url, proxy_url)`` is awaited, and everything stops when it returns or is
    cancelled (Ctrl-C).
    """
    import uvicorn

    from llmtap.serve.local import in_process
    from llmtap.serve.server import uvicorn_config
    from llmtap.serve.sockets import bind
    from llmtap.telemetry.admin.server import AdminApp

    env = dict(os.environ if env is None else env)
    out = DemoRun()
    # The admin listener's port first: each simulator exports its spans there, as a vLLM with
    # --otlp-traces-endpoint would, and llmtap joins them to the requests it relayed.
    admin_sock = bind("127.0.0.1", 0, "demo admin listener")
    exporters, sims = _simulators(workloads, f"http://127.0.0.1:{admin_sock.getsockname()[1]}/v1/traces")
    tel: TelemetrySettings = telemetry_from_env(env)
    directory, records = _records_dir(telemetry_dir, out)
    otel = _telemetry(tel, env, directory, out, live=serve is not None)
    routes = _routes(workloads, sims)
    settings = Settings(routes=routes, telemetry=tel, log_level="warning", record=Records(path=str(records)))
    local = in_process(settings, tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    app, recorder = local
    collector = _Collector()
    recorder.listeners.append(collector)
    sock = bind("127.0.0.1", 0, "demo proxy")
    server, task = _serving(uvicorn.Server(uvicorn_config(app, settings)), sock)
    # The admin listener takes the simulators' spans; the live view must see the tables' traffic too, so its
    # listener is subscribed before any request. The page agrees with the tables: the same objectives (the
    # routes'), no warm-ups, and rates over the time requests were in flight, as the tables' rates are.
    admin = AdminApp(local, otel.prometheus, traces=True, busy=True, skip=lambda tl: tl.prompt_version == WARMUP)
    admin_server, admin_task = _serving(uvicorn.Server(uvicorn_config(admin, settings, forwarded=True)), admin_sock)
    try:
        await _started([(server, task), (admin_server, admin_task)])
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        await _phases(out, workloads, base, lambda p: partial(_span_arrived, exporters[p], app), collector, progress)
        if serve is not None:
            _compare(out, workloads, records, min_gain_ms)
            view = f"http://127.0.0.1:{admin_sock.getsockname()[1]}/?window=all"
            await _until_stopped(serve(out, view, base), [server, admin_server])
    finally:
        # Open event streams would hold the admin listener's shutdown: end them first.
        admin.live.close()
        await _stop([(admin_server, admin_task), (server, task)], sims, otel)
    if serve is None:
        _compare(out, workloads, records, min_gain_ms)
    return out


async def _span_arrived(spans: SpanExporter, app: Any) -> None:
    """Wait until the simulator has exported its spans so far (at most a few seconds), then flush llmtap, which
    joins them first: llmtap learns that an upstream traces from its first span (the warm-up's), and a flush
    writes a request still waiting for its span at once, estimated."""
    await asyncio.to_thread(spans.drain, SPAN_SETTLE_S)
    await asyncio.to_thread(app.flush)


async def _until_stopped(keep: Awaitable[None], servers: list[Server]) -> None:
    """Await ``keep`` until it returns or a server is told to stop (uvicorn catches Ctrl-C itself)."""
    waiting = asyncio.ensure_future(keep)
    try:
        while not waiting.done() and not any(server.should_exit for server in servers):
            await asyncio.wait([waiting], timeout=0.1)
    finally:
        waiting.cancel()
    if waiting.done() and not waiting.cancelled():
        waiting.result()


def _compare(out: DemoRun, workloads: list[Workload], records: Path, min_gain_ms: float) -> None:
    split = Split(VARIABLE_FIRST, FIXED_FIRST)
    for w in workloads:
        # The same statistics as ``llmtap compare records --before variable-first --after fixed-first``.
        out.comparisons[w.name] = compare_records(records, split, route=w.route, min_gain_ms=min_gain_ms)


def main(args: Any) -> int:
    """``llmtap demo``."""
    workloads = default_workloads(args.requests, args.concurrency)
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        workloads = [
            replace(
                w,
                slo=replace(
                    w.slo,
                    ttft=args.slo_ttft_ms / 1000 if args.slo_ttft_ms is not None else w.slo.ttft,
                    tpot=args.slo_tpot_ms / 1000 if args.slo_tpot_ms is not None else w.slo.tpot,
                ),
            )
            for w in workloads
        ]
    if args.output_tokens is not None:
        # ``replace``, not ``asdict``: asdict would turn the nested SLO into a plain dict.
        workloads = [replace(w, output_tokens=args.output_tokens) for w in workloads]
    if args.workload:
        workloads = [w for w in workloads if w.route == args.workload]
    progress = None if args.json else ProgressLine(sys.stderr, interactive=sys.stderr.isatty())

    if not args.json:
        names = " and ".join(w.name for w in workloads)
        print(f"llmtap demo: a simulated LLM server, the proxy in front of it, {names} (offline).", file=sys.stderr)
    serving = False

    async def keep_serving(result: DemoRun, view: str, proxy_url: str) -> None:
        nonlocal serving
        serving = True
        if progress is not None:
            progress.close()
        _report(result, workloads, as_json=args.json)
        route = workloads[0].route if workloads else "support"
        print(
            f"\nLive view: {view}\n  (the proxy and the simulated server keep running; Ctrl-C stops them)\n"
            f"  send your own: curl -N {proxy_url}/{route}/v1/chat/completions -H 'content-type: application/json' "
            '-d \'{"model": "llmtap-sim", "stream": true, "max_tokens": 60, '
            '"messages": [{"role": "user", "content": "hello"}]}\'',
            flush=True,
        )
        await asyncio.Event().wait()

    try:
        result = asyncio.run(
            run(
                workloads,
                progress=progress or (lambda _: None),
                serve=keep_serving if args.serve else None,
                min_gain_ms=MIN_GAIN_MS if args.min_gain_ms is None else args.min_gain_ms,
            )
        )
    except KeyboardInterrupt:
        print("\nllmtap demo: stopped.", file=sys.stderr)
        return 0 if serving else 130
    if not args.serve:
        if progress is not None:
            progress.close()
        _report(result, workloads, as_json=args.json)
    return 0


def _report(result: DemoRun, workloads: list[Workload], *, as_json: bool) -> None:
    """Print the tables and verdicts (or the JSON report), and where the records and telemetry went."""
    if as_json:
        report = {
            "results": [asdict(r) for r in result.results],
            "verdicts": {name: c.to_json() for name, c in result.comparisons.items()},
            "records_file": result.records_file,
            "telemetry_files": result.telemetry_files,
        }
        print(json.dumps(report, indent=2))
    else:
        route = workloads[0].route if workloads else "support"
        print(render(result.results, workloads, {name: c.verdict for name, c in result.comparisons.items()}))
        print(
            f"\nRequest records: {result.records_file}\n  compare them yourself: llmtap compare "
            f"{result.records_file} --route {route} --before {VARIABLE_FIRST} --after {FIXED_FIRST} --plot ttft.png"
        )
        if result.telemetry_files:
            print(
                "\nTelemetry (no OTEL_EXPORTER_OTLP_ENDPOINT set) was written to:\n  "
                + "\n  ".join(result.telemetry_files)
            )
        else:
            print("\nTelemetry went to the OTLP endpoint named by OTEL_EXPORTER_OTLP_ENDPOINT.")
