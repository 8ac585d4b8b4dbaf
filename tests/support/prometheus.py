"""Debian's Prometheus as a plain process on a free port, and an instant PromQL query against it: what the tests
that read llmtap's ``/metrics`` as Prometheus reads it and the benchmark's accuracy run both start."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tests.support.net import free_port, wait_http
from tests.support.proctree import Service


def start_prometheus(
    d: Path, jobs: str, *, cpu: str | None, log: Path, flags: Sequence[str] = ()
) -> tuple[Service, int]:
    """Debian's Prometheus on a free port with its files under ``d``, scraping ``jobs`` (YAML scrape configs)
    every second, with any further ``flags`` (``--enable-feature=exemplar-storage``); returned once it is ready."""
    (d / "data").mkdir(parents=True, exist_ok=True)
    conf = d / "prometheus.yml"
    conf.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n{jobs}")
    port = free_port()
    argv = [
        "prometheus",
        f"--config.file={conf}",
        f"--storage.tsdb.path={d / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        *flags,
    ]
    svc = Service("prometheus", argv, log=log, cpu=cpu)
    svc.ready(lambda: wait_http(f"http://127.0.0.1:{port}/-/ready", 60, alive=lambda: svc.proc.poll() is None))
    return svc, port


def promql(port: int, query: str, at: float | None = None) -> float | None:
    """The value of an instant PromQL query with one result (at the epoch time ``at``, else now), or None when it
    has none."""
    params = {"query": query} if at is None else {"query": query, "time": f"{at:.3f}"}
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        data = json.load(r)
    result = data["data"]["result"]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if value != value else value  # NaN: no data in the buckets
