"""What a sampled request's latency samples cost the histograms, with the SDK's exemplar reservoirs against llmtap's.

``python -m bench.probes.exemplars`` builds the meter provider ``llmtap serve`` builds (``/metrics`` on) twice, with
the views of ``llmtap.telemetry.emit.reservoir`` (bisection) and without them (the SDK's aligned-bucket walk), and
records into each, in alternating rounds, what a short request in a sampled trace records on the duration
histograms: nine samples of a few ms to a few s, each in the request's span context (so each is offered to its
bucket's reservoir), through the public ``Histogram.record``. Prints the CPU a request of each (``process_time``,
median of the rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from llmtap.telemetry import semconv as sc
from llmtap.telemetry.emit import reservoir
from llmtap.telemetry.emit.instruments import create
from llmtap.telemetry.exposition.prometheus import PrometheusReader


def _round(provider: MeterProvider, requests: int, seed: int) -> float:
    """CPU µs a request for ``requests`` sampled requests' nine duration samples."""
    ins = create(provider.get_meter("llmtap-probe"), latest=False)
    hists = [
        ins.operation_duration,
        ins.ttfb,
        ins.ttft,
        ins.upstream_ttft,
        ins.queue,
        ins.prefill,
        ins.decode,
        ins.tpot,
        ins.itl,
    ]
    rng = random.Random(seed)
    attrs = {sc.ROUTE: "default", sc.REQUEST_MODEL: "m"}
    samples = [[rng.lognormvariate(-1.5, 1.2) for _ in hists] for _ in range(requests)]
    contexts = [
        set_span_in_context(NonRecordingSpan(SpanContext(rng.getrandbits(128) or 1, 1, False, TraceFlags(1))))
        for _ in range(requests)
    ]
    start = time.process_time()
    for values, ctx in zip(samples, contexts, strict=True):
        for hist, value in zip(hists, values, strict=True):
            hist.record(value, attrs, context=ctx)
    return 1e6 * (time.process_time() - start) / requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.exemplars", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    got: dict[str, list[float]] = {"walk (SDK)": [], "bisection (llmtap)": []}
    for n in range(args.rounds):
        for name, views in (("walk (SDK)", []), ("bisection (llmtap)", reservoir.views())):
            provider = MeterProvider(metric_readers=[PrometheusReader()], views=views, shutdown_on_exit=False)
            try:
                got[name].append(_round(provider, args.requests, seed=n))
            finally:
                provider.shutdown()
    out: dict[str, Any] = {name: {"us_per_request": statistics.median(v), "rounds": v} for name, v in got.items()}
    out["ratio"] = out["bisection (llmtap)"]["us_per_request"] / out["walk (SDK)"]["us_per_request"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
