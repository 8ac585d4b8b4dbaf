"""What ``/metrics`` costs and how close its percentiles read, by default: ``python -m bench.probes.page``.

A fresh ``llmtap serve`` (default settings, ``--record``) in front of the benchmark's upstream, whose TTFT is
spread log-uniformly between ``--ttft`` and ``--ttft-max`` (``bench.upstream``), takes streamed requests of one
model, route and shape. At each checkpoint (14 requests, then more) the page is fetched and measured: bytes,
sample lines, and lines by (model, route, shape): those carrying all three, and all the traffic wrote. At the
end, the p50/p95/p99 TTFT, ITL-per-chunk and E2E that ``histogram_quantile`` reads from the ``gen_ai.*`` and
``llmtap.*`` histograms (summed by ``le``; llmtap's own ``llmtap.analysis.stats.histogram_quantile``, which
agrees with Prometheus' to the last digit in ``bench.probes.buckets``) are set against the exact values of the same
requests, from their records.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench import peers
from llmtap.analysis.stats import histogram_quantile, quantile
from llmtap.store.files import ReadStats, read_records
from tests.support.net import free_port, wait_http
from tests.support.proctree import Service

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "bench-model", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
QUANTILES = (0.5, 0.95, 0.99)
#: (histogram on /metrics, the record field holding the exact value of the same figure)
FIGURES = (
    ("gen_ai_client_operation_time_to_first_chunk_seconds", "ttft"),
    ("llmtap_time_to_first_token_seconds", "ttft"),
    ("gen_ai_client_operation_duration_seconds", "e2e"),
)
KEY_LABELS = ('gen_ai_request_model="', 'llmtap_route="', 'llmtap_request_shape="')


def measure_page(text: str) -> dict[str, int]:
    """Bytes, sample lines, lines carrying model, route and shape, and lines carrying any of them."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    keys = [tuple(line.partition(label)[2].partition('"')[0] for label in KEY_LABELS) for line in lines]
    return {
        "bytes": len(text.encode()),
        "lines": len(lines),
        "lines_model_route_shape": sum(1 for k in keys if all(k)),
        "lines_of_the_traffic": sum(1 for k in keys if any(k)),
    }


def read_quantile(text: str, metric: str, q: float) -> float | None:
    """``histogram_quantile(q, sum by (le) (metric_bucket))`` over one page."""
    by_le: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(metric + "_bucket{"):
            le = line.partition('le="')[2].partition('"')[0]
            bound = float(le.replace("+Inf", "inf"))
            by_le[bound] = by_le.get(bound, 0.0) + float(line.rpartition(" ")[2])
    bounds = sorted(by_le)
    return histogram_quantile(bounds, [by_le[b] for b in bounds], q) if bounds else None


def run(
    requests: int,
    concurrency: int,
    ttft: float,
    ttft_max: float,
    work: Path,
    *,
    repo: Path = REPO,
    args: Sequence[str] = (),
) -> dict[str, object]:
    up, up_port = peers.upstream(work, None, ttft=ttft, gap=0.02, chunks=20, ttft_max=ttft_max)
    port, admin = free_port(), free_port()
    record = work / "records"
    argv = [sys.executable, "-m", "llmtap", "serve", "--upstream", f"http://127.0.0.1:{up_port}"]
    argv += ["--port", str(port), "--admin-port", str(admin), "--record", str(record), *args]
    env = {"PYTHONPATH": str(repo), "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    proxy = Service("llmtap", argv, log=work / "llmtap.log", cpu=None, env=env)
    out: dict[str, object] = {"requests": requests, "ttft": [ttft, ttft_max], "args": list(args), "pages": {}}
    try:
        proxy.ready(lambda: wait_http(f"http://127.0.0.1:{admin}/readyz", 60, alive=lambda: proxy.proc.poll() is None))
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def one(_: int) -> None:
            with httpx.stream("POST", url, json=CHAT, timeout=60) as r:
                r.raise_for_status()
                for _line in r.iter_lines():
                    pass

        def page(n: int) -> str:
            deadline = time.monotonic() + 30
            while True:
                text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=30).text
                done = sum(
                    float(line.rpartition(" ")[2])
                    for line in text.splitlines()
                    if line.startswith("llmtap_proxy_overhead_seconds_count")
                )
                if done >= n or time.monotonic() > deadline:
                    return text
                time.sleep(0.1)

        sent = 0
        text = ""
        with ThreadPoolExecutor(concurrency) as pool:
            for checkpoint in sorted({14, requests}):
                list(pool.map(one, range(checkpoint - sent)))
                sent = checkpoint
                text = page(sent)
                out["pages"][str(sent)] = measure_page(text)  # type: ignore[index]
    finally:
        proxy.stop()
        up.stop()
    records = list(read_records(record, ReadStats()))
    readings = []
    for metric, field in FIGURES:
        exact_values = [float(r[field]) for r in records if r.get(field) is not None]
        for q in QUANTILES:
            read = read_quantile(text, metric, q)
            exact = quantile(exact_values, q)
            if read is not None and exact:
                readings.append({"metric": metric, "q": q, "read": read, "exact": exact, "error": read / exact - 1})
    out["records"] = len(records)
    out["readings"] = readings
    return out


def table(report: dict[str, object]) -> str:
    pages = report["pages"]
    assert isinstance(pages, dict)
    lines = [
        f"llmtap serve, default settings; one model, route and shape; TTFT spread log-uniformly over "
        f"{report['ttft']} s; {report['records']} records; serve arguments {report['args'] or 'none'}.",
        "",
        "| after requests | bytes | sample lines | lines with model, route and shape | lines the traffic wrote |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, m in pages.items():
        cells = (m["bytes"], m["lines"], m["lines_model_route_shape"], m["lines_of_the_traffic"])
        lines.append(f"| {n} | " + " | ".join(f"{c:,}" for c in cells) + " |")
    lines += ["", "| histogram | q | read (s) | exact (s) | error |", "| --- | ---: | ---: | ---: | ---: |"]
    readings = report["readings"]
    assert isinstance(readings, list)
    for r in readings:
        lines.append(f"| {r['metric']} | {r['q']:g} | {r['read']:.4f} | {r['exact']:.4f} | {r['error'] * 100:+.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.probes.page [--requests N] [--concurrency C] [--json PATH]``."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.page", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500, help="requests in all (a first page after 14)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--ttft", type=float, default=0.1)
    p.add_argument("--ttft-max", dest="ttft_max", type=float, default=1.0)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--repo", type=Path, default=REPO, help="the llmtap checkout to run (this one): before and after")
    p.add_argument("--serve-arg", dest="serve_args", action="append", default=[], help="an argument for serve")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmtap-page-") as tmp:
        report = run(
            max(args.requests, 14),
            args.concurrency,
            args.ttft,
            args.ttft_max,
            Path(tmp),
            repo=args.repo,
            args=args.serve_args,
        )
    print(table(report), end="")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
