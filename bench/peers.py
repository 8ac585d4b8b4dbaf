"""Starting what the benchmark measures and measures with: the upstream, the OTLP sink, nginx, LiteLLM,
llmtap, Prometheus and aiperf's offline tokenizer folder.

Each peer is found where ``.ci/install.d/50-bench.sh`` (and ``20-prometheus.sh``) put it; ``missing()``
names what is absent and how to install it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from bench.tlsca import SERVER_NAME, Certs
from tests.support.net import free_port, wait_http
from tests.support.proctree import Service, pin_threads
from tests.support.prometheus import start_prometheus

HERE = Path(__file__).parent
REPO = HERE.parent
#: llmtap's processes import this checkout's ``llmtap`` (``proxy/``), not whichever one the environment installed
#: (an editable install points at its own checkout), and ``bench`` beside it.
LLMTAP_PATH = f"{REPO / 'proxy'}{os.pathsep}{REPO}"
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
    #: llmtap's admin port (``/metrics``), None for other paths.
    admin: int | None = None


def upstream(
    work: Path, cpu: str | None, *, ttft: float, gap: float, chunks: int, ttft_max: float | None = None
) -> tuple[Service, int]:
    """The scripted upstream; returns it and its port."""
    svc, port, _ = upstreams(work, cpu, ttft=ttft, gap=gap, chunks=chunks, ttft_max=ttft_max)
    return svc, port


def upstreams(
    work: Path,
    cpu: str | None,
    *,
    ttft: float,
    gap: float,
    chunks: int,
    ttft_max: float | None = None,
    certs: Certs | None = None,
) -> tuple[Service, int, int | None]:
    """The scripted upstream, listening plain and (with ``certs``) with TLS too: it, its port, its TLS port.

    One process for both, so plain and HTTPS paths of a run share the script and the records.
    """
    argv = [sys.executable, "-m", "bench.upstream", "--ttft", str(ttft), "--gap", str(gap), "--chunks", str(chunks)]
    if ttft_max is not None:
        argv += ["--ttft-max", str(ttft_max)]
    if certs is not None:
        argv += ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    name = "upstream" if ttft_max is None else "upstream-spread"
    svc = Service(name, argv, log=work / f"{name}.log", cpu=cpu, env={"PYTHONPATH": str(REPO)})
    port = svc.ready(lambda: int(svc.read_line()))
    return svc, port, svc.ready(lambda: int(svc.read_line())) if certs is not None else None


def records(port: int) -> list[dict[str, object]]:
    """The upstream's records of finished requests since the last call."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/bench/probes/records", timeout=30) as r:
        data: list[dict[str, object]] = json.load(r)
    return data


def sink(work: Path, cpu: str | None) -> tuple[Service, int, Path]:
    """The OTLP sink; returns it, its port and the file it writes."""
    out = work / "otlp-sink.jsonl"
    argv = [sys.executable, "-m", "bench.sink", "--out", str(out)]
    svc = Service("otlp-sink", argv, log=work / "otlp-sink.log", cpu=cpu, env={"PYTHONPATH": str(REPO)})
    return svc, svc.ready(lambda: int(svc.read_line())), out


#: nginx's side of an HTTPS upstream: verify the run's CA, send and check the name, reuse sessions, and TLS 1.3 as
#: llmtap speaks it (nginx before 1.23.4 offers an upstream TLS 1.2 at most unless told: a cheaper resumption, with
#: no key exchange, than the one TLS 1.3 makes).
NGINX_TLS = """
            proxy_ssl_protocols TLSv1.2 TLSv1.3;
            proxy_ssl_trusted_certificate ${ca};
            proxy_ssl_verify on;
            proxy_ssl_verify_depth 2;
            proxy_ssl_server_name on;
            proxy_ssl_name ${server_name};
            proxy_ssl_session_reuse on;"""


def nginx(work: Path, cpu: str | None, upstream_port: int, *, certs: Certs | None = None) -> Endpoint:
    """nginx-light with ``proxy_buffering off`` in front of the upstream (over TLS with ``certs``)."""
    scheme = "https" if certs is not None else "http"
    d = work / f"nginx-{scheme}"
    d.mkdir(exist_ok=True)
    port = free_port()
    tls = Template(NGINX_TLS).substitute(ca=certs.ca, server_name=SERVER_NAME) if certs is not None else ""
    conf = Template((HERE / "nginx.conf.template").read_text()).substitute(
        dir=d, port=port, upstream_port=upstream_port, upstream_scheme=scheme, upstream_tls=tls
    )
    (d / "nginx.conf").write_text(conf)
    argv = ["nginx", "-c", str(d / "nginx.conf"), "-p", str(d)]
    svc = Service("nginx", argv, log=work / f"nginx-{scheme}.log", cpu=cpu)
    svc.ready(lambda: _wait_port(port, svc))
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
    health = f"http://127.0.0.1:{port}/health/liveliness"
    svc.ready(lambda: wait_http(health, 120, alive=lambda: svc.proc.poll() is None))
    return Endpoint("litellm", f"http://127.0.0.1:{port}/v1/chat/completions", svc, auth=key)


#: The placement of llmtap's whole process tree on one core (``llmtap:one-core``).
ONE_CORE = "one-core"
#: Records written (``llmtap:record``): ``serve --record DIR`` into a folder of the run's, hence the record journal
#: that comes with it (its cost against plain ``llmtap``, which writes none).
RECORD = "record"

#: llmtap-side switches of ``--ablation``: extra environment and extra ``llmtap serve`` arguments.
ABLATIONS: dict[str, tuple[dict[str, str], list[str]]] = {
    # The OpenTelemetry SDK off: relay, tap and summaries only, no spans or metrics built.
    "otel-off": ({"OTEL_SDK_DISABLED": "true"}, []),
    # No span per chunk (the phase spans and the metrics stay).
    "chunk-spans-off": ({"LLMTAP_CHUNK_SPANS": "off"}, []),
    # The telemetry process's workers at SCHED_IDLE (``--telemetry-scheduling idle``) or niced by 5 (``nice``).
    "telemetry-idle": ({"LLMTAP_TELEMETRY_SCHEDULING": "idle"}, []),
    "telemetry-nice": ({"LLMTAP_TELEMETRY_SCHEDULING": "nice"}, []),
    # The telemetry threads never hand the core to a waiting relay (``--telemetry-yield 0``; they look every 500 µs).
    "telemetry-yield-off": ({"LLMTAP_TELEMETRY_YIELD": "0"}, []),
    # Not a switch but a placement: the whole tree, telemetry too, on the relay's one core (a sidecar with a
    # one-core limit), where plain ``llmtap`` moves its telemetry process to the other core.
    ONE_CORE: ({}, []),
    # ``--record`` with a folder of the run's (``llmtap`` adds it: the folder is made per start).
    RECORD: ({}, []),
}


def ablation_names(spec: str) -> list[str]:
    """The switches of an ablation spec (``otel-off+chunk-spans-off``), each checked against ``ABLATIONS``."""
    names = [n for n in spec.split("+") if n]
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise ValueError(f"unknown ablation {', '.join(unknown)} (known: {', '.join(ABLATIONS)})")
    return names


_UPSTREAM_CA_FLAG: bool | None = None


def llmtap_has_upstream_ca(module: str = "llmtap") -> bool:
    """Whether this llmtap has ``serve --upstream-ca`` (asked once, from its ``--help``)."""
    global _UPSTREAM_CA_FLAG
    if _UPSTREAM_CA_FLAG is None:
        done = subprocess.run(
            [sys.executable, "-m", module, "serve", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": LLMTAP_PATH},
        )
        _UPSTREAM_CA_FLAG = "--upstream-ca" in done.stdout
    return _UPSTREAM_CA_FLAG


#: Until ``--upstream-ca`` exists: SSL_CERT_FILE alone does not reach llmtap's HTTPS pool (it builds httpx
#: with trust_env=False, which then trusts certifi's bundle only), so this module, put first on llmtap's
#: PYTHONPATH as ``sitecustomize``, points ``certifi.where()`` at the run's CA in llmtap's processes.
CA_SHIM = """\
# Written by the benchmark (bench/peers.py): trust the run's private CA for HTTPS upstreams.
import os

_ca = os.environ.get("BENCH_UPSTREAM_CA")
if _ca:
    import certifi

    certifi.where = lambda: _ca
"""


def _ca_env(work: Path, certs: Certs, module: str) -> tuple[dict[str, str], list[str]]:
    """How llmtap is told to trust the run's CA: ``--upstream-ca``, else the environment (see ``CA_SHIM``)."""
    if llmtap_has_upstream_ca(module):
        return {}, ["--upstream-ca", str(certs.ca)]
    shim = work / "ca-shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(CA_SHIM)
    env = {
        "SSL_CERT_FILE": str(certs.ca),
        "BENCH_UPSTREAM_CA": str(certs.ca),
        "PYTHONPATH": f"{shim}{os.pathsep}{LLMTAP_PATH}",
    }
    return env, []


def llmtap(
    work: Path,
    cpu: str | None,
    upstream_port: int,
    sink_port: int,
    *,
    name: str = "llmtap",
    workers: int = 1,
    extra_env: dict[str, str] | None = None,
    module: str = "llmtap",
    certs: Certs | None = None,
    ablation: str = "",
    telemetry_cpu: str | None = None,
) -> tuple[Endpoint, int]:
    """``llmtap serve`` with full telemetry: chunk spans on, traces and metrics exported over OTLP/gRPC to the sink.

    With ``certs`` the upstream is ``https://`` (its TLS port) and llmtap trusts the run's CA; ``ablation``
    (``otel-off``, ``otel-off+chunk-spans-off``, ...) applies switches of ``ABLATIONS``. Returns the endpoint and the
    admin port (``/metrics``). ``telemetry_cpu``: the core(s) the telemetry process moves to once it runs
    (the relay stays alone on ``cpu``, as the issue's targets ask); None leaves it where it started.
    """
    port, admin = free_port(), free_port()
    scheme = "https" if certs is not None else "http"
    switches_env: dict[str, str] = {}
    switches_argv: list[str] = []
    for switch in ablation_names(ablation):
        more_env, more_argv = ABLATIONS[switch]
        switches_env.update(more_env)
        switches_argv += more_argv
    if RECORD in ablation_names(ablation):
        records = work / f"records-{name}-{ablation}-{scheme}"
        shutil.rmtree(records, ignore_errors=True)
        switches_argv += ["--record", str(records)]
    ca_env, ca_argv = _ca_env(work, certs, module) if certs is not None else ({}, [])
    env = {
        "PYTHONPATH": LLMTAP_PATH,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_SERVICE_NAME": name,
        "LLMTAP_CHUNK_SPANS": "spans",
        # Spans leave in batches of 512 or after this many ms; short, so a phase's export is inside its window.
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        **ca_env,
        **switches_env,
        **(extra_env or {}),
    }
    argv = [
        sys.executable,
        "-m",
        module,
        "serve",
        "--upstream",
        f"{scheme}://127.0.0.1:{upstream_port}",
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
    argv += ca_argv + switches_argv
    log = work / f"{name}{'-' + ablation if ablation else ''}-{scheme}.log"
    svc = Service(name, argv, log=log, cpu=cpu, env=env)
    svc.ready(lambda: wait_http(f"http://127.0.0.1:{admin}/readyz", 60, alive=lambda: svc.proc.poll() is None))
    if telemetry_cpu is not None:
        cores = {int(c) for c in telemetry_cpu.split(",")}
        for pid in svc.roles()["telemetry"]:
            pin_threads(pid, cores)
    return Endpoint(name, f"http://127.0.0.1:{port}/v1/chat/completions", svc, admin=admin), admin


TAPES_DROPPED = "llmtap_telemetry_tapes_dropped_total"


def scrape_sum(admin_port: int, metric: str = TAPES_DROPPED) -> float | None:
    """The sum over labels of one metric on llmtap's ``/metrics``; None when it is absent (or unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        exc.close()
        return None
    except OSError:
        return None
    return exposition_sum(text, metric)


def exposition_sum(text: str, metric: str) -> float | None:
    """The sum of a metric's samples in a Prometheus text exposition; None when it has none."""
    sample = re.compile(rf"^{re.escape(metric)}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)
    values = [float(m.group(1)) for m in sample.finditer(text)]
    return sum(values) if values else None


def prometheus(work: Path, cpu: str | None, admin_port: int) -> tuple[Service, int]:
    """Debian's Prometheus as a plain process, scraping llmtap's ``/metrics`` every second."""
    job = f"  - job_name: llmtap\n    static_configs: [{{targets: ['127.0.0.1:{admin_port}']}}]\n"
    return start_prometheus(work / "prometheus", job, cpu=cpu, log=work / "prometheus.log")


def tiktoken_cache(work: Path) -> Path:
    """A ``TIKTOKEN_CACHE_DIR`` holding the encodings shipped in ``proxy/llmtap/data`` under tiktoken's cache names."""
    d = work / "tiktoken"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("o200k_base", "cl100k_base"):
        url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
        target = d / hashlib.sha1(url.encode()).hexdigest()
        if not target.exists():
            target.write_bytes((resources.files("llmtap") / "data" / f"{name}.tiktoken").read_bytes())
    return d


def _wait_port(port: int, svc: Service, timeout: float = 60.0) -> None:
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
