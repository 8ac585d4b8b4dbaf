"""What ``llmtap serve`` says when it starts, through the real command: where everything is, uvicorn's lines
once each under their listener's name, and the access log (``--access-log``) written by the telemetry process."""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llmtap.config.load import build
from llmtap.serve.lines import startup_lines
from tests.conftest import PATIENCE, Scripted
from tests.support.net import LoopbackHTTPServer
from tests.support.procs import ROOT, Llmtap, stop, wait_ready

pytestmark = pytest.mark.e2e

CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}


def _messages(log: str, logger: str) -> list[str]:
    """The messages of ``logger``'s lines in ``log``."""
    return re.findall(rf"^\S+ \S+ \w+ {re.escape(logger)}: (.*)$", log, re.MULTILINE)


def test_startup_says_where_everything_is_and_the_access_log_has_each_request(
    scripted: Scripted, tmp_path: Path
) -> None:
    access, records = tmp_path / "access.log", tmp_path / "records"
    proxy = Llmtap(scripted.url, tmp_path / "llmtap.log", "--access-log", str(access), "--record", str(records))
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10) as r:
            assert r.status_code == 200
            body = "".join(r.iter_text())
        assert "[DONE]" in body
        r = httpx.get(proxy.url + "/no/such/path", timeout=10)  # the upstream answers 404: a line too
        deadline = time.monotonic() + PATIENCE
        lines: list[str] = []
        while len(lines) < 2 and time.monotonic() < deadline:  # written after playback, off the relay's path
            lines = access.read_text(encoding="utf-8").splitlines() if access.exists() else []
            time.sleep(0.05)
    finally:
        proxy.close()
    log = proxy.logs()
    said = _messages(log, "llmtap")
    admin = proxy.admin_url
    assert said[:5] == [
        said[0],
        f"admin on {admin}: /metrics, /healthz, /readyz; live view {admin}/",
        f"route / -> {scripted.url} (provider from the API it speaks)",
        f"telemetry: OTLP off: set OTEL_EXPORTER_OTLP_ENDPOINT; Prometheus can scrape {admin}/metrics",
        f"records: {records}/ (a new file past 64 MiB or 60 min, 2 GiB and 168 h kept); journal {records}/.journal/ "
        f"(256 MiB per telemetry process); access log: {access}",
    ], log
    assert re.fullmatch(rf"llmtap \S+: proxy on {re.escape(proxy.url)} \(1 relay process\)", said[0]), said[0]
    # uvicorn's lines: each once, under its listener's name; its lifespan chatter not at all.
    for listener in ("relay", "admin"):
        lines_of = _messages(log, f"uvicorn.{listener}")
        assert [m for m in lines_of if m.startswith("Started server process")] != [], log
        assert len(lines_of) == len(set(lines_of)), log
    assert "Application startup complete" not in log and "INFO:     " not in log, log
    assert len(lines) == 2, lines
    first = lines[0].split(" ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first[0]), lines[0]
    assert first[1:4] == ["POST", "/v1/chat/completions", "200"], lines[0]
    fields = dict(word.split("=", 1) for word in first[4:])
    assert re.fullmatch(r"\d+\.\dms", fields["ttft"]) and re.fullmatch(r"\d+\.\dms", fields["duration"]), lines[0]
    assert float(fields["ttft"][:-2]) <= float(fields["duration"][:-2])
    assert (fields["in"], fields["route"], fields["model"]) == ("12", "default", "scripted"), lines[0]
    assert int(fields["out"]) > 0
    assert lines[1].split(" ")[1:3] == ["GET", "/no/such/path"], lines[1]


def test_startup_names_the_otlp_endpoint_and_protocol() -> None:
    settings = build(
        {"upstream": "https://api.example", "provider": "openai", "upstream_insecure": True},
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
    )
    lines = startup_lines(settings, 8080, 9464)
    assert lines[2] == "route / -> https://api.example (openai, TLS not verified)"
    assert lines[3] == (
        "telemetry: traces to OTLP http/protobuf to http://collector:4318/v1/traces; "
        "metrics to OTLP http/protobuf to http://collector:4318/v1/metrics"
    )
    grpc = build({"upstream": "http://u"}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert startup_lines(grpc, 8080, 9464)[3] == "telemetry: traces and metrics to OTLP grpc to http://collector:4317"
    off = build(
        {"upstream": "http://u"}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "1"}
    )
    assert startup_lines(off, 8080, 9464)[3].startswith("telemetry: OTLP off: OTEL_SDK_DISABLED is set")
    assert (
        startup_lines(off, 8080, 9464)[4]
        == "records: off (--record DIR); access log: off (--access-log PATH, - for stderr)"
    )


def test_startup_says_who_may_use_the_span_receiver_beyond_loopback() -> None:
    loopback = build({"upstream": "http://u"}, env={})
    assert startup_lines(loopback, 8080, 9464)[1].endswith("live view http://127.0.0.1:9464/")
    open_admin = build({"upstream": "http://u", "admin_host": "0.0.0.0"}, env={})
    assert startup_lines(open_admin, 8080, 9464)[1].endswith(
        "; /v1/traces and /events refuse peers beyond loopback (no admin token)"
    )
    token = {"LLMTAP_ADMIN_TOKEN": "a-token-of-sixteen-or-more"}
    guarded = build({"upstream": "http://u", "admin_host": "0.0.0.0"}, env=token)
    assert startup_lines(guarded, 8080, 9464)[1].endswith("; /v1/traces and /events ask the admin token")
    assert "a-token-of-sixteen-or-more" not in repr(guarded)


def test_a_bad_access_log_path_stops_the_start(tmp_path: Path) -> None:
    from tests.commands.test_cli import assert_config_error
    from tests.config.test_options import serve

    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    result = serve(
        "--upstream", "http://127.0.0.1:9", "--port", "0", "--admin-port", "0", "--access-log", str(blocker / "a.log")
    )
    assert_config_error(result, f"access log {str(blocker / 'a.log')!r}: ")


def test_an_access_line_stays_one_line_and_says_what_it_does_not_know() -> None:
    from llmtap.analysis.summary import Summary
    from llmtap.telemetry.records.access_log import PATH_CAP, access_line
    from tests.analysis.test_summary import make

    hostile = make(path="/v1/chat\r\nGET /forged HTTP/1.1 x", status_code=None, error_type="client_gone")
    line = access_line(hostile, Summary())
    assert "\n" not in line and "\r" not in line and " /forged" not in line, line
    assert line.split(" ")[1:] == [
        "POST",
        "/v1/chat%0D%0AGET%20/forged%20HTTP/1.1%20x",
        "-",
        "ttft=-",
        "in=-",
        "out=-",
        "duration=-",
        "route=default",
        "model=gpt-4o",
        "error=client_gone",
    ]
    assert line.startswith("2023-11-14T22:13:20.000Z ")
    long = access_line(make(path="/" + "a" * 1000, status_code=200), Summary(ttft=0.0213, e2e=1.5, input_tokens=3))
    assert long.split(" ")[2] == "/" + "a" * (PATH_CAP - 1) + "..."
    assert long.split(" ")[3:8] == ["200", "ttft=21.3ms", "in=3", "out=-", "duration=1500.0ms"]


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_start_that_lost_its_admin_port_is_not_taken_for_ready(tmp_path: Path) -> None:
    """Another server on the admin port answers ``/readyz`` 200 while the new llmtap fails to bind it and exits: the
    test harness's readiness must see that the answer is not the started process's (a CI run took such a start for
    ready, and its requests were refused)."""
    stray = LoopbackHTTPServer(_Ready)
    port = stray.server_address[1]
    log = (tmp_path / "llmtap.log").open("w+", encoding="utf-8")
    argv = ["serve", "--upstream", "http://127.0.0.1:9", "--port", "0", "--admin-port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmtap", *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log
    )
    try:
        with pytest.raises(AssertionError, match="exited before it was ready"):
            wait_ready(proc, f"http://127.0.0.1:{port}", (tmp_path / "llmtap.log").read_text)
        assert "Address already in use" in (tmp_path / "llmtap.log").read_text()
    finally:
        stop(proc)
        log.close()
        stray.close()


def test_free_ports_come_from_below_the_ephemeral_range_a_part_for_each_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """``free_port``: each pytest-xdist worker hands out its own ports, none the kernel hands out for ``bind(0)`` or an
    outgoing connection, each once in turn, passing over one that is bound."""
    from tests.support import net

    parts = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        parts.append(set(net._own_ports()))
    low = net._ephemeral_low()
    assert parts[0] and parts[1] and not parts[0] & parts[1]
    assert all(net._FIRST_PORT <= port < low for port in parts[0] | parts[1])
    ports = sorted(parts[1])[:64]
    monkeypatch.setattr(net, "_ports", ports)
    monkeypatch.setattr(net, "_next", 0)
    monkeypatch.setattr(net, "_ports_pid", os.getpid())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        given = [net.free_port() for _ in range(10)]
    free = [port for port in ports if port != ports[1]]
    # Anything else bound meanwhile on this machine is passed over too: the ports given are the free ones, in turn.
    assert ports[1] not in given and len(set(given)) == 10 and given == sorted(given)
    assert set(given) <= set(free)
