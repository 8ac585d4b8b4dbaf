"""Starting what the benchmark measures and measures with: the upstream, the OTLP sink, nginx, LiteLLM,
llmtap, Prometheus and aiperf's offline tokenizer folder.

Each peer is found where ``.ci/install.d/50-bench.sh`` (and ``20-prometheus.sh``) put it; ``missing()``
names what is absent and how to install it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from bench.procs import Service, free_port, wait_http

HERE = Path(__file__).parent
REPO = HERE.parent
TOOLS = Path(os.environ.get("LLMTAP_TOOLS", REPO / ".tools"))
LITELLM = TOOLS / "litellm" / "bin" / "litellm"
AIPERF = TOOLS / "aiperf" / "bin" / "aiperf"
INSTALL = "bash .ci/install.d/50-bench.sh"


def missing() -> dict[str, str]:
    """Each absent peer and the command that installs it."""
    out: dict[str, str] = {}
    if shutil.which("nginx") is None:
        out["nginx"] = INSTALL
    if not LITELLM.exists():
        out["litellm"] = INSTALL
    if not AIPERF.exists():
        out["aiperf"] = INSTALL
    if shutil.which("prometheus") is None:
        out["prometheus"] = "bash .ci/install.d/20-prometheus.sh"
    return out


@dataclass
class Endpoint:
    """A running path: where clients send chat requests, and the process tree to measure (None for direct)."""

    name: str
    url: str
    service: Service | None
    auth: str | None = None


def upstream(
    work: Path, cpu: str | None, *, ttft: float, gap: float, chunks: int, ttft_max: float | None = None
) -> tuple[Service, int]:
    """The scripted upstream; returns it and its port."""
    argv = [sys.executable, "-m", "bench.upstream", "--ttft", str(ttft), "--gap", str(gap), "--chunks", str(chunks)]
    if ttft_max is not None:
        argv += ["--ttft-max", str(ttft_max)]
    name = "upstream" if ttft_max is None else "upstream-spread"
    svc = Service(name, argv, log=work / f"{name}.log", cpu=cpu, env={"PYTHONPATH": str(REPO)})
    return svc, int(svc.read_line())


def records(port: int) -> list[dict[str, object]]:
    """The upstream's records of finished requests since the last call."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/bench/records", timeout=30) as r:
        data: list[dict[str, object]] = json.load(r)
    return data


def sink(work: Path, cpu: str | None) -> tuple[Service, int, Path]:
    """The OTLP sink; returns it, its port and the file it writes."""
    out = work / "otlp-sink.jsonl"
    argv = [sys.executable, "-m", "bench.sink", "--out", str(out)]
    svc = Service("otlp-sink", argv, log=work / "otlp-sink.log", cpu=cpu, env={"PYTHONPATH": str(REPO)})
    return svc, int(svc.read_line()), out


def nginx(work: Path, cpu: str | None, upstream_port: int) -> Endpoint:
    """nginx-light with ``proxy_buffering off`` in front of the upstream."""
    d = work / "nginx"
    d.mkdir(exist_ok=True)
    port = free_port()
    conf = Template((HERE / "nginx.conf.template").read_text()).substitute(
        dir=d, port=port, upstream_port=upstream_port
    )
    (d / "nginx.conf").write_text(conf)
    svc = Service("nginx", ["nginx", "-c", str(d / "nginx.conf"), "-p", str(d)], log=work / "nginx.log", cpu=cpu)
    _wait_port(port, svc)
    return Endpoint("nginx", f"http://127.0.0.1:{port}/v1/chat/completions", svc)


def litellm(work: Path, cpu: str | None, upstream_port: int) -> Endpoint:
    """LiteLLM's proxy (one worker) in front of the upstream, with a random master key and the local cost map."""
    conf = work / "litellm.yaml"
    conf.write_text(Template((HERE / "litellm.yaml").read_text()).substitute(upstream_port=upstream_port))
    port = free_port()
    key = "sk-" + secrets.token_hex(16)
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": key, "LITELLM_LOG": "ERROR"}
    argv = [str(LITELLM), "--config", str(conf), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    svc = Service("litellm", argv, log=work / "litellm.log", cpu=cpu, env=env)
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", 120, alive=lambda: svc.proc.poll() is None)
    return Endpoint("litellm", f"http://127.0.0.1:{port}/v1/chat/completions", svc, auth=key)


def llmtap(
    work: Path,
    cpu: str | None,
    upstream_port: int,
    sink_port: int,
    *,
    name: str = "llmtap",
    workers: int = 1,
    extra_env: dict[str, str] | None = None,
    module: str = "proxy",
) -> tuple[Endpoint, int]:
    """``llmtap serve`` with full telemetry: chunk spans on, traces and metrics exported over OTLP/gRPC to the sink.

    Returns the endpoint and the admin port (``/metrics``).
    """
    port, admin = free_port(), free_port()
    env = {
        "PYTHONPATH": str(REPO),
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_SERVICE_NAME": name,
        "LLMTAP_CHUNK_SPANS": "spans",
        # Spans leave in batches of 512 or after this many ms; short, so a phase's export is inside its window.
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        **(extra_env or {}),
    }
    argv = [
        sys.executable,
        "-m",
        module,
        "serve",
        "--upstream",
        f"http://127.0.0.1:{upstream_port}",
        "--provider",
        "vllm",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--log-level",
        "warning",
    ]
    if workers != 1:
        argv += ["--workers", str(workers)]
    svc = Service(name, argv, log=work / f"{name}.log", cpu=cpu, env=env)
    wait_http(f"http://127.0.0.1:{admin}/readyz", 60, alive=lambda: svc.proc.poll() is None)
    return Endpoint(name, f"http://127.0.0.1:{port}/v1/chat/completions", svc), admin


def prometheus(work: Path, cpu: str | None, admin_port: int) -> tuple[Service, int]:
    """Debian's Prometheus as a plain process, scraping llmtap's ``/metrics`` every second."""
    d = work / "prometheus"
    (d / "data").mkdir(parents=True, exist_ok=True)
    conf = d / "prometheus.yml"
    conf.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: llmtap\n    static_configs: [{{targets: ['127.0.0.1:{admin_port}']}}]\n"
    )
    port = free_port()
    argv = [
        "prometheus",
        f"--config.file={conf}",
        f"--storage.tsdb.path={d / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    svc = Service("prometheus", argv, log=work / "prometheus.log", cpu=cpu)
    wait_http(f"http://127.0.0.1:{port}/-/ready", 60, alive=lambda: svc.proc.poll() is None)
    return svc, port


def promql(port: int, query: str) -> float | None:
    """The value of an instant PromQL query with one result, or None when it has none."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        data = json.load(r)
    result = data["data"]["result"]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if value != value else value  # NaN: no data in the buckets


def tiktoken_cache(work: Path) -> Path:
    """A ``TIKTOKEN_CACHE_DIR`` holding the encodings shipped in ``proxy/data`` under tiktoken's cache names."""
    d = work / "tiktoken"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("o200k_base", "cl100k_base"):
        url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
        target = d / hashlib.sha1(url.encode()).hexdigest()
        if not target.exists():
            target.write_bytes((resources.files("proxy") / "data" / f"{name}.tiktoken").read_bytes())
    return d


def _wait_port(port: int, svc: Service, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.name} exited; see {svc.log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{svc.name} not listening on {port}; see {svc.log_path}")
